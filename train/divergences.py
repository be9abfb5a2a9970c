"""Divergences between the frozen target's next-token distribution p and a draft's q, and the LK loss.

Speculative decoding accepts a drafted token with probability min(1, p/q); summed over the vocab the
expected acceptance of one row is

    alpha = sum_v min(p_v, q_v) = 1 - TV(p, q),        TV(p, q) = 1/2 sum_v |p_v - q_v|.

The LK objective optimises that directly, mixed with KL for its better-conditioned gradient far
from the optimum:

    LK = lambda * KL(p || q) + (1 - lambda) * TV(p, q)

with ``lambda`` fixed (default 0.5) or adaptive, ``lambda = exp(-eta * mean alpha)`` (eta = 3),
``mean alpha`` detached and taken over the valid rows of the whole data-parallel group: while the
draft is poor (alpha small) KL dominates; as it improves the loss shifts to TV, i.e. acceptance.

Two teacher forms, both exact for what they see:
- full: the teacher's logits over the whole vocabulary (from the per-row projection of the stored
  final hidden state). ``kl_tv_full``.
- lumped tail: the teacher's stored top-k log-probabilities (under the FULL softmax, so the tail
  mass ``1 - sum exp`` is exact) plus the tail as one extra bin; the student's distribution is
  lumped onto the same k ids + one tail bin. ``kl_tv_topk``. Lumping is a deterministic map of both
  distributions, so by the data-processing inequality both the lumped KL and the lumped TV are lower
  bounds of the exact ones (tested). Renormalising the top-k instead would be biased and is not offered.

Everything is computed per row in at least float32 (float64 inputs stay float64). ``map_row_chunks``
bounds memory: the caller's per-chunk function builds the [chunk, V] logits inside an activation
checkpoint, so neither the forward nor the backward ever holds [rows, V] whole.

Shapes: N rows, V vocab, k stored teacher top-k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

ADAPTIVE = "adaptive"
"""The ``lk_lambda`` value that selects the adaptive mixture."""
DEFAULT_ETA = 3.0
"""Adaptive lambda = exp(-eta * mean acceptance)."""


def _work(x: torch.Tensor) -> torch.Tensor:
    """Upcast to at least float32 for the softmax arithmetic; float64 stays float64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def kl_tv_full(p_logits: torch.Tensor, q_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact per-row KL(p || q) and TV(p, q) from full logits [N, V] -> ([N], [N]).

    p is the teacher (no gradient is needed through it, but none is blocked either); q the draft.
    """
    if p_logits.shape != q_logits.shape:
        raise ValueError(f"teacher logits {tuple(p_logits.shape)} and draft logits {tuple(q_logits.shape)} differ")
    lp = F.log_softmax(_work(p_logits), dim=-1)
    lq = F.log_softmax(_work(q_logits), dim=-1)
    p, q = lp.exp(), lq.exp()
    kl = (p * (lp - lq)).sum(-1)
    tv = 0.5 * (p - q).abs().sum(-1)
    return kl, tv


def kl_tv_topk(
    topk_ids: torch.Tensor, topk_logprobs: torch.Tensor, q_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lumped-tail KL(p || q) and TV(p, q) from the teacher's stored top-k -> ([N], [N]).

    ``topk_ids`` int [N, k] (distinct per row) and ``topk_logprobs`` [N, k] are the teacher's top-k
    under its full softmax; ``q_logits`` [N, V] the draft's full logits. Bins: the k ids, plus one
    tail bin holding everything else, with p_tail = 1 - sum_k p (clamped at 0 against rounding) and
    q_tail from a log-sum-exp over the draft's logits with the k ids removed (stable, no 1 - x).
    """
    N, k = topk_ids.shape
    if topk_logprobs.shape != (N, k) or q_logits.shape[0] != N:
        raise ValueError(
            f"top-k ids {tuple(topk_ids.shape)}, log-probs {tuple(topk_logprobs.shape)} and draft "
            f"logits {tuple(q_logits.shape)} must agree on rows and k"
        )
    z = _work(q_logits)
    ids = topk_ids.long()
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    lq_k = z.gather(-1, ids) - lse  # [N, k]
    lq_tail = torch.logsumexp(z.scatter(-1, ids, float("-inf")), dim=-1) - lse.squeeze(-1)  # [N]
    lp_k = topk_logprobs.to(z.dtype)
    p_k = lp_k.exp()
    p_tail = (1.0 - p_k.sum(-1)).clamp(min=0.0)
    q_k, q_tail = lq_k.exp(), lq_tail.exp()
    # k == V leaves no tail bin: its p_tail is rounding noise and must not meet log(0)
    has_tail = torch.isfinite(lq_tail)
    p_tail = torch.where(has_tail, p_tail, torch.zeros_like(p_tail))
    lq_tail = torch.where(has_tail, lq_tail, torch.zeros_like(lq_tail))
    kl = (p_k * (lp_k - lq_k)).sum(-1) + torch.xlogy(p_tail, p_tail) - p_tail * lq_tail
    tv = 0.5 * ((p_k - q_k).abs().sum(-1) + (p_tail - q_tail).abs())
    return kl, tv


def acceptance(tv: torch.Tensor) -> torch.Tensor:
    """Per-row expected acceptance alpha = sum_v min(p_v, q_v) = 1 - TV."""
    return 1.0 - tv


def map_row_chunks(
    fn: Callable[..., tuple[torch.Tensor, ...]],
    rows: Sequence[torch.Tensor],
    chunk_rows: int,
) -> tuple[torch.Tensor, ...]:
    """Apply ``fn`` to row chunks of ``rows`` and concatenate its per-row outputs.

    ``fn(*chunk)`` returns a tuple of [c, ...] tensors (for example per-row KL and TV after building
    [c, V] logits from [c, H] hidden states). Under autograd each chunk runs inside an activation
    checkpoint, so only one chunk's [c, V] logits exist at a time, in the backward pass as well.
    ``chunk_rows <= 0`` runs everything as one chunk.
    """
    n = int(rows[0].shape[0])
    if any(int(r.shape[0]) != n for r in rows):
        raise ValueError(f"row tensors disagree on the row count: {[tuple(r.shape) for r in rows]}")
    step = n if chunk_rows <= 0 else int(chunk_rows)
    if n == 0 or step >= n:
        return tuple(fn(*rows))
    needs_grad = torch.is_grad_enabled() and any(r.requires_grad for r in rows)
    outs: list[tuple[torch.Tensor, ...]] = []
    for s in range(0, n, step):
        chunk = [r[s : s + step] for r in rows]
        if needs_grad:
            outs.append(tuple(checkpoint(fn, *chunk, use_reentrant=False)))
        else:
            outs.append(tuple(fn(*chunk)))
    return tuple(torch.cat(parts, dim=0) for parts in zip(*outs))


def parse_lk_lambda(value: float | str) -> float | str:
    """Validate an ``lk_lambda`` setting: a number in [0, 1] or the string 'adaptive'."""
    if isinstance(value, str):
        if value.strip().lower() == ADAPTIVE:
            return ADAPTIVE
        try:
            value = float(value)
        except ValueError:
            raise ValueError(f"lk_lambda must be a number in [0, 1] or 'adaptive', got {value!r}") from None
    lam = float(value)
    if not (0.0 <= lam <= 1.0) or math.isnan(lam):
        raise ValueError(f"lk_lambda must be in [0, 1] (or 'adaptive'), got {lam}")
    return lam


def mean_acceptance(tv: torch.Tensor, valid: torch.Tensor, *, group=None) -> torch.Tensor:
    """Detached mean of alpha = 1 - TV over the valid rows, summed over the data-parallel group.

    Returns a float64 scalar; 0 when no rank has a valid row. The all-reduce runs only when
    torch.distributed is initialised, and then on every rank (all ranks call it every step).
    """
    v = valid.to(torch.float64)
    stats = torch.stack([((1.0 - tv.detach().to(torch.float64)) * v).sum(), v.sum()])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(stats, group=group)
    return torch.where(stats[1] > 0, stats[0] / stats[1].clamp(min=1.0), torch.zeros_like(stats[0]))


@dataclass
class LKResult:
    """One LK loss term, un-normalised: the loop divides ``loss_sum`` by the group-wide ``count``."""

    loss_sum: torch.Tensor
    """sum over valid rows of lambda*KL + (1-lambda)*TV (carries the gradient)."""
    count: torch.Tensor
    """number of valid rows on this rank."""
    lam: float
    """the lambda used (fixed, or this step's adaptive value)."""
    kl_sum: torch.Tensor
    """detached sums over valid rows, for metrics."""
    tv_sum: torch.Tensor


def lk_loss(
    kl: torch.Tensor,
    tv: torch.Tensor,
    valid: torch.Tensor,
    lk_lambda: float | str = 0.5,
    *,
    eta: float = DEFAULT_ETA,
    group=None,
) -> LKResult:
    """LK = lambda*KL + (1-lambda)*TV summed over the rows where ``valid`` is True.

    ``lk_lambda``: a number in [0, 1], or 'adaptive' for lambda = exp(-eta * mean alpha) with the
    mean detached and taken over the valid rows of the data-parallel group (``mean_acceptance``).
    Invalid rows contribute nothing to the value or the gradient; callers should still pass only
    the rows they mean to train (garbage rows cost compute, and an inf there would poison backward).
    """
    lam_setting = parse_lk_lambda(lk_lambda)
    valid = valid.bool()
    if lam_setting == ADAPTIVE:
        lam = float(torch.exp(-eta * mean_acceptance(tv, valid, group=group)))
    else:
        lam = float(lam_setting)
    zero = torch.zeros((), dtype=kl.dtype, device=kl.device)
    per_row = lam * kl + (1.0 - lam) * tv
    loss_sum = torch.where(valid, per_row, zero).sum()
    return LKResult(
        loss_sum=loss_sum,
        count=valid.sum(),
        lam=lam,
        kl_sum=torch.where(valid, kl.detach(), zero).sum(),
        tv_sum=torch.where(valid, tv.detach(), zero).sum(),
    )
