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

Everything is computed per row in at least float32 (float64 inputs stay float64). The values are
differentiable (autograd); ``kl_grad_full`` / ``kl_grad_topk`` return the KL with its analytic
gradient w.r.t. the draft logits for the fused chunked loss in ``train.drafters.common.losses``. Memory is bounded
by the callers' row chunks (``train.drafters.common.chunks.map_row_chunks``), never [rows, V] whole.

The one home of KL / TV in the project.

Shapes: N rows, V vocab, k stored teacher top-k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

ADAPTIVE = "adaptive"
"""The ``lk_lambda`` value that selects the adaptive mixture."""
DEFAULT_ETA = 3.0
"""Adaptive lambda = exp(-eta * mean acceptance)."""


def _work(x: torch.Tensor) -> torch.Tensor:
    """Upcast to at least float32 for the softmax arithmetic; float64 stays float64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _zero_where_p_is(p: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    """log p with 0 where p == 0: a zero teacher probability (a masked id, log p = -inf) contributes
    0 * (anything) = 0 to KL, never 0 * -inf = NaN (the convention 0 log 0 = 0)."""
    return torch.where(p > 0, lp, torch.zeros_like(lp))


def kl_tv_full(p_logits: torch.Tensor, q_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact per-row KL(p || q) and TV(p, q) from full logits [N, V] -> ([N], [N]).

    p is the teacher (no gradient is needed through it, but none is blocked either); q the draft.
    """
    if p_logits.shape != q_logits.shape:
        raise ValueError(f"teacher logits {tuple(p_logits.shape)} and draft logits {tuple(q_logits.shape)} differ")
    lp = F.log_softmax(_work(p_logits), dim=-1)
    lq = F.log_softmax(_work(q_logits), dim=-1)
    p, q = lp.exp(), lq.exp()
    kl = (p * (_zero_where_p_is(p, lp) - lq)).sum(-1)
    tv = 0.5 * (p - q).abs().sum(-1)
    return kl, tv


def tv_full(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """TV(p, q) alone from full logits [N, V] -> [N]: what DSpark's L1 and every sampled acceptance (1 - TV) need,
    without ``kl_tv_full``'s KL passes (one softmax kernel each side instead of log_softmax + exp, no log p
    masking, no KL product): a third fewer passes over the [N, V] rows."""
    if p_logits.shape != q_logits.shape:
        raise ValueError(f"teacher logits {tuple(p_logits.shape)} and draft logits {tuple(q_logits.shape)} differ")
    p = F.softmax(_work(p_logits), dim=-1)
    q = F.softmax(_work(q_logits), dim=-1)
    if torch.is_grad_enabled() and q.requires_grad:
        return 0.5 * (p - q).abs().sum(-1)
    return 0.5 * p.sub_(q).abs_().sum(-1)  # no graph: reuse p's buffer


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
    lp_k = _zero_where_p_is(p_k, lp_k)
    p_tail = (1.0 - p_k.sum(-1)).clamp(min=0.0)
    q_k, q_tail = lq_k.exp(), lq_tail.exp()
    # k == V leaves no tail bin: its p_tail is rounding noise and must not meet log(0)
    has_tail = torch.isfinite(lq_tail)
    p_tail = torch.where(has_tail, p_tail, torch.zeros_like(p_tail))
    lq_tail = torch.where(has_tail, lq_tail, torch.zeros_like(lq_tail))
    kl = (p_k * (lp_k - lq_k)).sum(-1) + torch.xlogy(p_tail, p_tail) - p_tail * lq_tail
    tv = 0.5 * ((p_k - q_k).abs().sum(-1) + (p_tail - q_tail).abs())
    return kl, tv


def kl_grad_full(p_logits: torch.Tensor, lq: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(p || q) per row and its gradient w.r.t. the draft logits, q - p, from teacher logits and the draft's
    log q and q [c, V] (in place: few [c, V] temporaries; the fused loss path computes gradients itself)."""
    lp = torch.log_softmax(p_logits.to(lq.dtype), -1)
    del p_logits
    p = lp.exp()
    kl = lp.masked_fill_(p == 0, 0.0).sub_(lq).mul_(p).sum(-1)
    del lp
    return kl, p.neg_().add_(q)


def kl_grad_topk(
    ids: torch.Tensor, lps: torch.Tensor, lq: torch.Tensor, q: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lumped-tail KL over (top-k ids + one tail bin) and its gradient w.r.t. the draft logits.

    KL = sum_k p_k (log p_k - log q_k) + p_t (log p_t - log q_t); d/dz_v = q_v - ptilde_v with
    ptilde = p_k on the stored ids and p_t * q_v / q_t on the tail (the tail's mass spread as q does).
    """
    ids = ids.long()
    lq_k = lq.gather(-1, ids)
    lq_t = torch.logsumexp(lq.scatter(-1, ids, float("-inf")), -1)
    lp_k = lps.to(lq.dtype)
    p_k = lp_k.exp()
    lp_k = _zero_where_p_is(p_k, lp_k)
    p_t = (1.0 - p_k.sum(-1)).clamp(min=0.0)
    has_tail = torch.isfinite(lq_t)
    p_t = torch.where(has_tail, p_t, torch.zeros_like(p_t))
    lq_t = torch.where(has_tail, lq_t, torch.zeros_like(lq_t))
    kl = (p_k * (lp_k - lq_k)).sum(-1) + torch.xlogy(p_t, p_t) - p_t * lq_t
    grad = q * (1.0 - p_t * torch.exp(-lq_t))[:, None]  # q - p_t * q / q_t on every id ...
    grad.scatter_(-1, ids, q.gather(-1, ids) - p_k)  # ... and q_k - p_k on the stored ids
    return kl, grad


def acceptance(tv: torch.Tensor) -> torch.Tensor:
    """Per-row expected acceptance alpha = sum_v min(p_v, q_v) = 1 - TV."""
    return 1.0 - tv


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
