"""Draft losses over gathered rows: chunked lm_head + cross-entropy, and optional distillation.

The drafter hands over only the rows that carry a loss (R rows of hidden size H), and this module
projects them through the frozen lm_head in chunks of ``chunk_rows``, computing each chunk's
gradient w.r.t. its rows analytically in the forward (softmax - onehot for CE, q - p for KL), so
neither the forward nor the backward ever holds the [R, V] logits whole (at V = 152k, 16k rows of
float32 logits would be 10 GB; a 2048-row chunk is 1.2 GB, freed before the next) and, unlike an
activation checkpoint per chunk, nothing is computed twice. The lumped-tail KL and its gradient
follow ``train.divergences.kl_tv_topk`` (tests check the two agree).

Per row i (label y_i, weight w_i):
    ce_i = -log softmax(lm_head(h_i) / scaling)[y_i]
    kd_i = KL(p_teacher,i || q_draft,i)       (exact per-row teacher, or stored top-k + tail bin)
The callers turn these into LossOutput terms (sum_i w_i * ce_i, sum_i w_i, weight); the one
normalisation rule lives in ``train.drafter.combine_terms``.

DFlash's slot weights: slot k >= 1 of a block weighs exp(-(k - 1) / gamma) (gamma 7 for B = 16,
4 for B = 8): early slots matter most because acceptance stops at the first miss.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from train.teacher import ExactTeacher, TopKTeacher


def slot_weights(block_size: int, gamma: float) -> torch.Tensor:
    """float32 [B - 1]: the weight of slots k = 1..B-1, exp(-(k - 1) / gamma)."""
    k = torch.arange(1, block_size, dtype=torch.float64)
    return torch.exp(-(k - 1) / gamma).float()


def _logits(h: torch.Tensor, lm_head: torch.Tensor, scaling: float) -> torch.Tensor:
    z = F.linear(h.to(lm_head.dtype), lm_head)
    return z.to(torch.promote_types(z.dtype, torch.float32)) / float(scaling)


def _kd_dense(p_logits: torch.Tensor, lq: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(p || q) per row and its gradient w.r.t. the draft logits, q - p (in place: few [c, V] temporaries)."""
    lp = torch.log_softmax(p_logits.to(lq.dtype), -1)
    del p_logits
    p = lp.exp()
    kl = lp.sub_(lq).mul_(p).sum(-1)
    del lp
    return kl, p.neg_().add_(q)


def _kd_topk(ids: torch.Tensor, lps: torch.Tensor, lq: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Lumped-tail KL over (top-k ids + one tail bin) and its gradient w.r.t. the draft logits.

    KL = sum_k p_k (log p_k - log q_k) + p_t (log p_t - log q_t); d/dz_v = q_v - ptilde_v with
    ptilde = p_k on the stored ids and p_t * q_v / q_t on the tail (the tail's mass spread as q does).
    """
    ids = ids.long()
    lq_k = lq.gather(-1, ids)
    lq_t = torch.logsumexp(lq.scatter(-1, ids, float("-inf")), -1)
    lp_k = lps.to(lq.dtype)
    p_k = lp_k.exp()
    p_t = (1.0 - p_k.sum(-1)).clamp(min=0.0)
    has_tail = torch.isfinite(lq_t)
    p_t = torch.where(has_tail, p_t, torch.zeros_like(p_t))
    lq_t = torch.where(has_tail, lq_t, torch.zeros_like(lq_t))
    kl = (p_k * (lp_k - lq_k)).sum(-1) + torch.xlogy(p_t, p_t) - p_t * lq_t
    grad = q * (1.0 - p_t * torch.exp(-lq_t))[:, None]  # q - p_t * q / q_t on every id ...
    grad.scatter_(-1, ids, q.gather(-1, ids) - p_k)  # ... and q_k - p_k on the stored ids
    return kl, grad


class _FusedRowLosses(torch.autograd.Function):
    """Chunked lm_head + CE (+ KD) whose gradient w.r.t. the rows is computed in the forward.

    Per chunk of c rows: z = lm_head(h) / s; dCE/dz = softmax(z) - onehot(y); dKL/dz = q - p.
    Only [R, H] gradients are kept (g_ce, g_kd), never [c, V] activations, so the backward is two
    scaled adds: no recompute (an activation checkpoint would run the chunk twice). In-place ops
    keep about four [c, V] float32 temporaries alive at the peak.
    """

    @staticmethod
    def forward(ctx, h, lm_head, labels, scaling, chunk, teacher, want_grad):
        R = h.shape[0]
        dev = h.device
        wd = torch.promote_types(torch.promote_types(h.dtype, lm_head.dtype), torch.float32)
        ce = torch.empty(R, device=dev, dtype=wd)
        correct = torch.empty(R, device=dev, dtype=wd)
        kd = torch.empty(R, device=dev, dtype=wd) if teacher is not None else None
        g_ce = torch.empty_like(h) if want_grad else None
        g_kd = torch.empty_like(h) if want_grad and teacher is not None else None
        step = R if chunk <= 0 else chunk
        for s in range(0, R, max(step, 1)):
            e = min(s + step, R)
            y = labels[s:e]
            lq = _logits(h[s:e], lm_head, scaling)
            correct[s:e] = (lq.argmax(-1) == y).to(wd)
            lq.sub_(torch.logsumexp(lq, -1, keepdim=True))  # log q, in place of the logits
            q = lq.exp()
            ce[s:e] = -lq.gather(-1, y[:, None])[:, 0]
            if teacher is not None:
                if isinstance(teacher, TopKTeacher):
                    k_s, dk = _kd_topk(teacher.ids_Rk[s:e], teacher.logprobs_Rk[s:e], lq, q)
                else:
                    k_s, dk = _kd_dense(teacher.chunk_logits(s, e), lq, q)
                kd[s:e] = k_s
                if want_grad:
                    g_kd[s:e] = (F.linear(dk.to(lm_head.dtype), lm_head.T) / scaling).to(h.dtype)
                del dk
            del lq
            if want_grad:
                q[torch.arange(e - s, device=dev), y] -= 1.0  # dCE/dz, in place of q
                g_ce[s:e] = (F.linear(q.to(lm_head.dtype), lm_head.T) / scaling).to(h.dtype)
            del q
        ctx.save_for_backward(*(t for t in (g_ce, g_kd) if t is not None))
        ctx.has_kd = teacher is not None
        ctx.mark_non_differentiable(correct)
        if kd is None:
            return ce, correct
        return ce, correct, kd

    @staticmethod
    def backward(ctx, grad_ce, grad_correct, grad_kd=None):
        saved = ctx.saved_tensors
        grad_h = None
        if saved:
            grad_h = grad_ce.to(saved[0].dtype)[:, None] * saved[0]
            if ctx.has_kd and grad_kd is not None:
                grad_h = grad_h + grad_kd.to(saved[1].dtype)[:, None] * saved[1]
        return grad_h, None, None, None, None, None, None


def row_losses(
    h_RH: torch.Tensor,
    labels_R: torch.Tensor,
    lm_head_VH: torch.Tensor,
    *,
    scaling: float = 1.0,
    chunk_rows: int = 2048,
    teacher: ExactTeacher | TopKTeacher | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-row (ce [R], correct [R] float 0/1 (argmax == label), kd [R] or None), chunked.

    ``teacher``: None, :class:`TopKTeacher` (lumped tail), or anything with ``chunk_logits(s, e)``
    returning the teacher's [e - s, V] logits for rows s..e (:class:`ExactTeacher` projects them
    from the gathered hidden rows). The lm_head is frozen (no gradient flows to it).
    """
    if teacher is not None and not isinstance(teacher, TopKTeacher) and not hasattr(teacher, "chunk_logits"):
        raise TypeError(f"unknown teacher type {type(teacher).__name__}")
    want_grad = torch.is_grad_enabled() and h_RH.requires_grad
    out = _FusedRowLosses.apply(h_RH, lm_head_VH.detach(), labels_R.long(), float(scaling), int(chunk_rows),
                                teacher, want_grad)
    return out[0], out[1], (out[2] if len(out) > 2 else None)


def weighted_terms(
    ce_R: torch.Tensor, w_R: torch.Tensor, kd_R: torch.Tensor | None, kd_w_R: torch.Tensor | None,
    *, ce_weight: float, kd_weight: float,
) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """LossOutput terms: ce = (sum w*ce, sum w, ce_weight); kd likewise over the rows with a teacher."""
    terms = {"ce": ((w_R * ce_R).sum(), w_R.sum().detach(), ce_weight)}
    if kd_R is not None:
        assert kd_w_R is not None
        terms["kd"] = ((kd_w_R * kd_R).sum(), kd_w_R.sum().detach(), kd_weight)
    return terms


def reference_loss_f64(
    h_RH: torch.Tensor, labels_R: torch.Tensor, w_R: torch.Tensor, lm_head_VH: torch.Tensor, scaling: float = 1.0
) -> float:
    """Float64 sum(w * CE) / sum(w), written from the definition (for tests and sanity checks)."""
    z = (h_RH.double() @ lm_head_VH.double().T) / scaling
    logp = z - torch.logsumexp(z, dim=-1, keepdim=True)
    ce = -logp.gather(-1, labels_R.long()[:, None])[:, 0]
    w = w_R.double()
    return float((w * ce).sum() / w.sum()) if float(w.sum()) > 0 else math.nan
