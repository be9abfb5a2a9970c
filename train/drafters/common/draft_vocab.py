"""A reduced draft vocabulary: the N target tokens a drafter may propose, chosen from the training data.

At Qwen3's V = 151,936 the draft's vocabulary loss (lm_head matmul forward and backward on every loss
row) is most of a DFlash training step. A drafter with ``draft_vocab = N`` computes its logits only
over N rows of the frozen lm_head, the target tokens seen most often where the training split is
supervised, and maps its choices back to target ids for verification, as EAGLE-3 does. Off by
default: a token outside the subset can never be proposed, so acceptance can only drop.

The rule (the one home of it; training, resume, eval, live decoding and export read it from here):

    counts[v]  = occurrences of target id v at supervised positions (loss_mask) of the training split
    forced     = the ids the drafter must be able to emit: the target's eos_token_id(s)
    subset     = forced + the N - |forced| other ids with the most counts, ties broken by the smaller
                 id (deterministic; ids never seen fill the rest in id order when fewer than N were seen)
    draft id i = the i-th subset id in ascending target-id order

On disk, EAGLE-3's convention (SafeAILab/EAGLE, eagle/traineagle3/cnets.py ``scandata``: top-N of a
Counter over supervised tokens, ``used_tokens.sort()``, ``d2t[i] = used_tokens[i] - i``, ``t2d[v] = v in
used_tokens``; vLLM's vllm/model_executor/models/llama_eagle3.py ``compute_logits``: target id =
``arange(draft_vocab_size) + draft_id_to_target_id`` loaded from ``d2t``, logits -inf elsewhere):

    d2t  int64 [N]   offset table: target id of draft id i = i + d2t[i]
    t2d  bool  [V]   whether target id v is in the subset

The drafter keeps both as persistent buffers, so they travel in every checkpoint and export; a resume
recomputes the subset from its training split and refuses a checkpoint that holds another.

Shapes: V target vocabulary, N draft vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:  # the annotation only: drafters import no reader
    from tapdraft.shards.reader import Dataset


@dataclass(frozen=True)
class DraftVocab:
    """A draft vocabulary: ascending target ids [N] of a V-token target."""

    ids: torch.Tensor
    """int64 [N] target ids, strictly ascending (draft id i is ids[i])."""
    vocab_size: int
    """V: the target's vocabulary size."""

    def __post_init__(self) -> None:
        ids = self.ids
        if ids.ndim != 1 or ids.numel() == 0 or ids.dtype != torch.long:
            raise ValueError(f"a draft vocabulary is a non-empty int64 [N] tensor, got {ids.dtype} {tuple(ids.shape)}")
        if int(ids[0]) < 0 or int(ids[-1]) >= self.vocab_size or not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError(f"draft vocabulary ids must be strictly ascending target ids in [0, {self.vocab_size})")

    @property
    def size(self) -> int:
        return int(self.ids.numel())

    @property
    def d2t(self) -> torch.Tensor:
        """int64 [N]: target id of draft id i = i + d2t[i] (EAGLE-3's offset table)."""
        return self.ids - torch.arange(self.size, device=self.ids.device)

    @property
    def t2d(self) -> torch.Tensor:
        """bool [V]: target id v is in the draft vocabulary."""
        mask = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.ids.device)
        mask[self.ids] = True
        return mask

    @classmethod
    def from_d2t(cls, d2t: torch.Tensor, vocab_size: int) -> "DraftVocab":
        d2t = d2t.long()
        return cls(d2t + torch.arange(d2t.numel(), device=d2t.device), vocab_size)

    def coverage(self, counts_V: torch.Tensor) -> float:
        """Fraction of the counted supervised tokens that lie in the subset (1.0 when nothing was counted)."""
        total = int(counts_V.sum())
        return 1.0 if total == 0 else int(counts_V[self.ids.to(counts_V.device)].sum()) / total


class DraftVocabMixin:
    """The draft vocabulary half of a drafter (DFlash, DFlash2, EAGLE-3, MTP): installs the subset into the drafter's
    persistent ``d2t`` / ``t2d`` buffers and reads it back. It reads ``config.draft_vocab`` and ``vocab_size``; the
    frozen-head methods (``frozen_draft_head``, ``to_target_logits``) also read ``target`` (a ``FrozenHead``)."""

    def register_draft_vocab(self) -> None:
        """EAGLE-3's buffers, filled by ``set_draft_vocab`` (or a checkpoint); -1 = unset. No-op without a subset."""
        if self.config.draft_vocab is not None:
            self.register_buffer("d2t", torch.full((self.config.draft_vocab,), -1, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(self.vocab_size, dtype=torch.bool))

    def set_draft_vocab(self, vocab: DraftVocab) -> None:
        """Install the draft vocabulary (:func:`setup` fits it on the training split)."""
        if self.config.draft_vocab != vocab.size or vocab.vocab_size != self.vocab_size:
            raise ValueError(f"a {vocab.size}-token draft vocabulary of a {vocab.vocab_size}-token target does not fit "
                             f"draft_vocab={self.config.draft_vocab} over {self.vocab_size} tokens")
        self.d2t.copy_(vocab.d2t)
        self.t2d.copy_(vocab.t2d)

    def draft_ids(self) -> torch.Tensor | None:
        """Target ids [N] of the draft vocabulary (None: the full vocabulary)."""
        if self.config.draft_vocab is None:
            return None
        ids = self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)
        if int(ids[0]) < 0:
            raise RuntimeError("the draft vocabulary was never set: train.drafters.common.draft_vocab.setup (or "
                               "loading a checkpoint) fills it before the drafter runs")
        return ids

    def frozen_draft_head(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The frozen target lm_head rows (and bias) a drafter that projects on the target's head scores: the
        subset's, or all of them."""
        ids = self.draft_ids()
        if ids is None:
            return self.target.lm_head, self.target.lm_head_bias
        bias = None if self.target.lm_head_bias is None else self.target.lm_head_bias.index_select(0, ids)
        return self.target.lm_head.index_select(0, ids), bias

    def to_target_logits(self, z: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary [..., N] -> over the target's [..., V], -inf at every id outside the
        subset (never proposed); unchanged without a subset."""
        ids = self.draft_ids()
        if ids is None:
            return z
        out = z.new_full((*z.shape[:-1], self.vocab_size), float("-inf"))
        out[..., ids] = z
        return out


def subset_head_rows(weights: dict[str, torch.Tensor], config: dict[str, Any],
                     lm_head: Callable[[], torch.Tensor]) -> dict[str, torch.Tensor]:
    """An export's own ``lm_head.weight`` [N, H] when its draft projects on N frozen rows of the target's head (a
    ``draft_vocab_size`` in its config; ``weights`` hold ``d2t``): engines that share the target's head with such a
    draft would score the wrong rows (vLLM keeps the first N logits), so the export carries the subset's rows and
    its loader projects on them. {} without a subset."""
    n = config.get("draft_vocab_size")
    if n is None:
        return {}
    ids = torch.arange(int(n)) + weights["d2t"].long().cpu()
    return {"lm_head.weight": lm_head().detach().float().index_select(0, ids).contiguous()}


def draft_index(t2d_V: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    """Draft ids of ``target_ids`` (any shape), -1 where a target id is outside the subset."""
    rank = t2d_V.long().cumsum(0) - 1  # draft id of every in-subset target id (ascending order)
    ids = target_ids.long()
    return torch.where(t2d_V[ids], rank[ids], torch.full_like(ids, -1))


def required_ids(bundle_config: dict[str, Any], vocab_size: int) -> list[int]:
    """Target ids every draft vocabulary must hold: the end-of-turn id(s) (``eos_token_id``), so a drafted
    reply can end. Ids outside the vocabulary are ignored (a config naming them is already inconsistent)."""
    eos = bundle_config.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    return sorted({int(i) for i in ids if 0 <= int(i) < vocab_size})


def choose(counts_V: torch.Tensor, n: int, forced: list[int] | tuple[int, ...] = ()) -> torch.Tensor:
    """The subset rule: ``forced`` plus the most counted other ids (ties: smaller id first), ascending int64 [n]."""
    V = int(counts_V.numel())
    if not 0 < n <= V:
        raise ValueError(f"draft_vocab must be in [1, {V}] (the target's vocabulary), got {n}")
    forced = sorted(set(int(i) for i in forced))
    if len(forced) > n:
        raise ValueError(f"draft_vocab {n} cannot hold the {len(forced)} ids a draft must emit ({forced}); raise it")
    key = counts_V.long().clone()
    key[forced] = -1  # taken already; sorted last below, never picked twice
    # stable sort of -count keeps ascending id order among equal counts
    order = torch.sort(-key, stable=True).indices
    rest = order[: n - len(forced)]
    return torch.sort(torch.cat([torch.tensor(forced, dtype=torch.long), rest.long()])).values


def token_counts(data: Dataset, split: str, vocab_size: int) -> torch.Tensor:
    """int64 [V]: how often each target id occurs at a supervised position of ``split`` (every sample, file order).

    ``data``: an opened ``shards.reader`` dataset. One pass over the split (it decodes whole samples: the
    reader has no column projection), done once per training start.
    """
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for sample in data.stream(split, seed=0, shuffle=False):
        ids = torch.as_tensor(sample["input_ids"]).long()
        mask = torch.as_tensor(sample["loss_mask"]).bool()
        counts += torch.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    return counts


def fit(data: Dataset, split: str, n: int, bundle_config: dict[str, Any], vocab_size: int) -> tuple[DraftVocab, float]:
    """The draft vocabulary of size ``n`` for a training split, and the fraction of its supervised tokens it covers."""
    counts = token_counts(data, split, vocab_size)
    vocab = DraftVocab(choose(counts, n, required_ids(bundle_config, vocab_size)), vocab_size)
    return vocab, vocab.coverage(counts)


def setup(model: Any, src: Any, saved_draft: dict[str, torch.Tensor] | None) -> dict[str, Any] | None:
    """Fit a drafter's draft vocabulary on its training split before the first step (no-op when it has none).

    On resume (``saved_draft``: the checkpoint's draft state) the subset is recomputed and must equal the
    checkpoint's (``d2t``): the training split
    changed otherwise, and the run would continue on another vocabulary. Returns {size, coverage} or None.
    """
    n = getattr(model.config, "draft_vocab", None)
    if n is None:
        return None
    V = int(model.vocab_size)
    vocab, cover = fit(src.data, src.split, n, src.bundle.config, V)
    if saved_draft is not None:
        saved = saved_draft.get("d2t")
        if saved is None or not torch.equal(saved.cpu().long() + torch.arange(saved.numel()), vocab.ids):
            raise ValueError(
                f"the checkpoint's draft vocabulary is not the one split {src.split!r} of {src.where} gives now "
                "(its supervised tokens changed since the run started); resume on the dataset the run was "
                "trained on, or start a new --out directory")
    model.set_draft_vocab(vocab)
    return {"size": vocab.size, "coverage": round(cover, 6)}
