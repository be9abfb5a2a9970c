"""Teacher rows for distillation: only the rows a loss reads, never [batch, seq, vocab] logits.

Two sources, both read per row:

- exact: the target's pre-norm last-layer state at the row (``final_hidden``, or the taps entry of
  the last layer when it was tapped) through the bundle's head (``shards.head.teacher_logits``:
  final norm -> lm_head -> logits scaling, as the bundle's head spec says). This is the target's
  own distribution for that row, exactly; the projection happens inside the loss's row chunks.
- top-k: the stored top-k ids and log-probabilities (under the full softmax) of the row, with the
  tail as one extra bin (``train.drafters.common.divergences.kl_tv_topk``, exact lumped-tail form).

Row convention: the teacher row that predicts the token at position t + 1 is row t. A DFlash slot
k of anchor a predicts the token at a + k, so its teacher row is a + k - 1.

Shapes: Bs batch, T positions, R gathered rows, H hidden, V vocab, k stored top-k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tapdraft.shards.head import HeadSpec, teacher_logits
from tapdraft.shards.schema import Layout
from tapdraft.shards.taps import DEFAULT_TAPS_CODEC, TAPS_CODECS


@dataclass
class ExactTeacher:
    """Per-row teacher from pre-norm hidden states, through the bundle's head."""

    hidden_RH: torch.Tensor
    norm_weight: torch.Tensor
    lm_head: torch.Tensor
    head: HeadSpec
    norm_bias: torch.Tensor | None = None
    lm_head_bias: torch.Tensor | None = None

    def chunk_logits(self, start: int, end: int) -> torch.Tensor:
        """float32 [end - start, V] teacher logits of rows start..end (projected now, not stored)."""
        return teacher_logits(self.hidden_RH[start:end], self.norm_weight, self.lm_head, self.head,
                              norm_bias_H=self.norm_bias, lm_head_bias_V=self.lm_head_bias)

    def logits(self) -> torch.Tensor:
        """float32 [R, V] teacher logits of every row (for losses that hold dense logits anyway)."""
        return self.chunk_logits(0, self.hidden_RH.shape[0])


@dataclass
class TopKTeacher:
    """Per-row stored teacher: ids [R, k] and log-probs [R, k] under the full softmax."""

    ids_Rk: torch.Tensor
    logprobs_Rk: torch.Tensor


def exact_last_tap(layout: Layout) -> int | None:
    """Index of the last-layer tap when it can serve as the exact last hidden state, else None.

    The exact teacher and MTP's h^0 promise the target's own distribution: a last layer stored
    through a lossy taps codec (fp8) would silently break that promise, so it does not count.
    """
    if not TAPS_CODECS[getattr(layout, "taps_codec", DEFAULT_TAPS_CODEC)].lossless:
        return None
    return getattr(layout, "last_layer_tap", None)


def last_hidden_source(layout: Layout) -> str | None:
    """Where the exact last hidden state comes from: 'final_hidden', 'tap' (lossless), or None."""
    if getattr(layout, "has_final_hidden", False):
        return "final_hidden"
    return "tap" if exact_last_tap(layout) is not None else None


def require_last_hidden(layout: Layout, what: str) -> None:
    """ValueError (saying what to do) when ``what`` needs the exact last hidden state and the dataset lacks it."""
    if last_hidden_source(layout) is not None:
        return
    last = layout.num_layers - 1
    if getattr(layout, "last_layer_tap", None) is not None:
        raise ValueError(
            f"{what} needs the target's last hidden state losslessly, but this dataset stores it only as a tap "
            f"through the lossy {layout.taps_codec!r} taps codec; capture again with final_hidden (stored in bf16 "
            "whatever the taps codec) or with the bf16 codec"
        )
    raise ValueError(
        f"{what} needs the target's last hidden state, but this dataset has neither final_hidden nor a tap of the "
        f"last layer ({last}; taps are {list(layout.tap_ids)}); capture again with final_hidden or the last layer "
        "tapped"
    )


def last_hidden(batch: dict[str, Any], last_tap: int | None) -> torch.Tensor:
    """[Bs, T, H] pre-norm last-layer states: ``final_hidden`` if stored, else the last-layer tap.

    ``last_tap`` comes from :func:`exact_last_tap` (None under a lossy codec)."""
    if "final_hidden" in batch:
        return batch["final_hidden"]
    if last_tap is None:
        raise ValueError(
            "the exact teacher needs the target's last-layer state: capture with final_hidden or with the "
            "last decoder layer among the taps, or use kd='topk' / kd='none'"
        )
    return batch["taps"][:, :, last_tap]


def gather_exact(
    batch: dict[str, Any], b_R: torch.Tensor, row_R: torch.Tensor, *, last_tap: int | None, bundle_norm: torch.Tensor,
    lm_head: torch.Tensor, head: HeadSpec, norm_bias: torch.Tensor | None = None,
    lm_head_bias: torch.Tensor | None = None,
) -> ExactTeacher:
    """The exact teacher for rows (b_R[i], row_R[i]): gathers only those [R, H] states."""
    h = last_hidden(batch, last_tap)[b_R, row_R]
    return ExactTeacher(h, bundle_norm, lm_head, head, norm_bias, lm_head_bias)


def gather_topk(batch: dict[str, Any], b_R: torch.Tensor, row_R: torch.Tensor) -> tuple[TopKTeacher, torch.Tensor]:
    """Stored top-k for rows (b_R, row_R) and a bool [R] saying which rows were stored."""
    if "topk_ids" not in batch:
        raise ValueError("kd='topk' needs a dataset captured with top-k teacher rows (top_k > 0)")
    return (
        TopKTeacher(batch["topk_ids"][b_R, row_R], batch["topk_logprobs"][b_R, row_R]),
        batch["topk_valid"][b_R, row_R],
    )
