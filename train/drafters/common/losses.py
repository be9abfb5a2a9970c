"""Draft losses over gathered rows: chunked lm_head + cross-entropy, and optional distillation.

The drafter hands over only the rows that carry a loss (R rows of hidden size H), and this module
projects them through the frozen lm_head in chunks of ``chunk_rows``, computing each chunk's
gradient w.r.t. its rows analytically in the forward (softmax - onehot for CE, q - p for KL), so
neither the forward nor the backward ever holds the [R, V] logits whole (at V = 152k, 16k rows of
float32 logits would be 10 GB; a 2048-row chunk is 1.2 GB, freed before the next) and, unlike an
activation checkpoint per chunk, nothing is computed twice. The lumped-tail KL and its gradient
are ``train.drafters.common.divergences.kl_grad_topk`` / ``kl_grad_full`` (tests check them against ``kl_tv_topk``).

Per row i (label y_i, weight w_i):
    ce_i = -log softmax(shards.head.project(h_i))[y_i]     (lm_head, then the bundle's logits scaling)
    kd_i = KL(p_teacher,i || q_draft,i)       (exact per-row teacher, or stored top-k + tail bin)
The callers turn these into LossOutput terms (sum_i w_i * ce_i, sum_i w_i, weight); the one
normalisation rule lives in ``train.drafters.base.combine_terms``.

DFlash's slot weights: slot k >= 1 of a block weighs exp(-(k - 1) / gamma) (gamma 7 for B = 16,
4 for B = 8): early slots matter most because acceptance stops at the first miss. D-PACE weights
(``dpace_weights``) instead follow the draft's own acceptance, detached: with s_k = (1 - alpha) q_k + alpha
(q_k the draft's probability of slot k's label) and P_k = s_1 ... s_k, slot k weighs sum_{j >= k} P_j, the
expected number of accepted slots that a miss at k would cost. Reach weights (``reach_weights``) are one
weight a slot for the whole micro-batch: slot k weighs prod_{i < k} a_i, a_i the mean over the batch's valid
slot-i rows of the draft's probability of the label (detached), i.e. how often drafting reaches slot k. An
untrained draft trains slot 1 alone and each later slot joins as the ones before it start to be accepted;
measured on the 8k-BPE target (docs/LOG.md, 2026-12-03), any fixed share of the loss on slots the draft
cannot reach yet (gamma decay, D-PACE's per-row weights) held slot 1's acceptance to a third of what it
reaches alone.
"""

from __future__ import annotations

import torch

from tapdraft.shards.head import HeadSpec, project, project_backward, row_spans, softcap_jacobian
from tapdraft.train.drafters.common.divergences import kl_grad_full, kl_grad_topk
from tapdraft.train.drafters.common.teacher import ExactTeacher, TopKTeacher


def slot_weights(block_size: int, gamma: float) -> torch.Tensor:
    """float32 [B - 1]: the weight of slots k = 1..B-1, exp(-(k - 1) / gamma)."""
    k = torch.arange(1, block_size, dtype=torch.float64)
    return torch.exp(-(k - 1) / gamma).float()


def dpace_weights(q_BNK: torch.Tensor, valid_BNK: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE slot weights [Bs, N, K] (no gradient): w_k = sum_{j >= k, valid} prod_{i <= j, valid} s_i with
    s_i = (1 - alpha) q_i + alpha. ``q_BNK``: the draft's probability of each slot's label; an invalid slot is
    a no-op in the products and adds nothing to the sums (its weight is 0)."""
    with torch.no_grad():
        v = valid_BNK.to(q_BNK.dtype)
        s = torch.where(valid_BNK, (1.0 - alpha) * q_BNK + alpha, torch.ones_like(q_BNK))
        prefix = torch.cumprod(s, dim=-1) * v
        return prefix.flip(-1).cumsum(-1).flip(-1) * v


def reach_weights(q_BNK: torch.Tensor, valid_BNK: torch.Tensor) -> torch.Tensor:
    """Reach slot weights [K] (no gradient): w_1 = 1, w_k = prod_{i < k} a_i with a_i the mean of ``q_BNK`` over the
    valid slot-i entries (1 where slot i has none, so an empty slot neither helps nor blocks the ones after it)."""
    with torch.no_grad():
        v = valid_BNK.to(q_BNK.dtype)
        n = v.sum(dim=(0, 1))
        a = torch.where(n > 0, (q_BNK * v).sum(dim=(0, 1)) / n.clamp(min=1), torch.ones_like(n))
        return torch.cat([a.new_ones(1), torch.cumprod(a, 0)[:-1]])


class _FusedRowLosses(torch.autograd.Function):
    """Chunked lm_head + CE (+ KD) whose gradient w.r.t. the rows is computed in the forward.

    Per chunk of c rows: z = lm_head(h) / s; dCE/dz = softmax(z) - onehot(y); dKL/dz = q - p.
    Only [R, H] gradients are kept (g_ce, g_kd), never [c, V] activations, so the backward is two
    scaled adds: no recompute (an activation checkpoint would run the chunk twice). In-place ops
    keep about four [c, V] float32 temporaries alive at the peak.
    """

    @staticmethod
    def forward(ctx, h, lm_head, labels, head, chunk, teacher, want_grad, bias, ce_grad):
        R = h.shape[0]
        dev = h.device
        wd = torch.promote_types(torch.promote_types(h.dtype, lm_head.dtype), torch.float32)
        ce = torch.empty(R, device=dev, dtype=wd)
        correct = torch.empty(R, device=dev, dtype=wd)
        kd = torch.empty(R, device=dev, dtype=wd) if teacher is not None else None
        g_ce = torch.empty_like(h) if want_grad and ce_grad else None
        g_kd = torch.empty_like(h) if want_grad and teacher is not None else None
        for s, e in row_spans(R, chunk):
            y = labels[s:e]
            lq = project(h[s:e], lm_head, head, bias)
            jac = softcap_jacobian(lq, head) if want_grad else None  # soft-capped heads only
            correct[s:e] = (lq.argmax(-1) == y).to(wd)
            lq = torch.log_softmax(lq, -1)  # one fused kernel (~3x the separate logsumexp, sub and exp passes)
            ce[s:e] = -lq.gather(-1, y[:, None])[:, 0]
            q = lq.exp() if teacher is not None else lq.exp_()  # without KD, q replaces log q in place
            if teacher is not None:
                if isinstance(teacher, TopKTeacher):
                    k_s, dk = kl_grad_topk(teacher.ids_Rk[s:e], teacher.logprobs_Rk[s:e], lq, q)
                else:
                    k_s, dk = kl_grad_full(teacher.chunk_logits(s, e), lq, q)
                kd[s:e] = k_s
                if want_grad:
                    g_kd[s:e] = project_backward(dk, lm_head, head, jac).to(h.dtype)
                del dk
            del lq
            if g_ce is not None:
                q[torch.arange(e - s, device=dev), y] -= 1.0  # dCE/dz, in place of q
                g_ce[s:e] = project_backward(q, lm_head, head, jac).to(h.dtype)
            del q
        ctx.save_for_backward(*(t for t in (g_ce, g_kd) if t is not None))
        ctx.has_ce, ctx.has_kd = g_ce is not None, g_kd is not None
        ctx.mark_non_differentiable(correct)
        if kd is None:
            return ce, correct
        return ce, correct, kd

    @staticmethod
    def backward(ctx, grad_ce, grad_correct, grad_kd=None):
        saved = list(ctx.saved_tensors)
        grad_h = None
        if ctx.has_ce:
            grad_h = grad_ce.to(saved[0].dtype)[:, None] * saved.pop(0)
        if ctx.has_kd and grad_kd is not None:
            g = grad_kd.to(saved[0].dtype)[:, None] * saved[0]
            grad_h = g if grad_h is None else grad_h + g
        return grad_h, None, None, None, None, None, None, None, None


def row_losses(
    h_RH: torch.Tensor,
    labels_R: torch.Tensor,
    lm_head_VH: torch.Tensor,
    *,
    head: HeadSpec = HeadSpec(),
    lm_head_bias: torch.Tensor | None = None,
    chunk_rows: int = 2048,
    teacher: ExactTeacher | TopKTeacher | None = None,
    ce_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-row (ce [R], correct [R] float 0/1 (argmax == label), kd [R] or None), chunked.

    ``teacher``: None, :class:`TopKTeacher` (lumped tail), or anything with ``chunk_logits(s, e)``
    returning the teacher's [e - s, V] logits for rows s..e (:class:`ExactTeacher` projects them
    from the gathered hidden rows). ``head``: the bundle's head spec (bias, scaling, soft cap), with
    ``lm_head_bias`` when it declares one. The lm_head is frozen (no gradient flows to it).
    ``ce_grad=False`` (a loss that weighs CE by 0, e.g. DFlash's ``ce_weight: 0``): the CE values are still
    returned (logged) but carry no gradient, which saves the CE gradient's [c, V] x [V, H] matmul per chunk
    (three head matmuls a row with KD instead of four).
    """
    if teacher is not None and not isinstance(teacher, TopKTeacher) and not hasattr(teacher, "chunk_logits"):
        raise TypeError(f"unknown teacher type {type(teacher).__name__}")
    want_grad = torch.is_grad_enabled() and h_RH.requires_grad
    out = _FusedRowLosses.apply(h_RH, lm_head_VH.detach(), labels_R.long(), head, int(chunk_rows),
                                teacher, want_grad, None if lm_head_bias is None else lm_head_bias.detach(),
                                bool(ce_grad))
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


class _FusedTrainedHead(torch.autograd.Function):
    """Chunked draft logits z = x W^T through a head that may train, with the weighted loss's gradients
    w.r.t. the rows AND the head computed in the forward (EAGLE-3's own lm_head).

    Per chunk: dL/dz = w * (softmax(z) - onehot(y)) (CE) or w * (q - p) (KL); g_x += dz W, g_W += dz^T x. The
    loss leaves as one scalar sum_i w_i l_i, so the backward is a scale of the two saved gradients.
    """

    @staticmethod
    def forward(ctx, x, W, y, w, teacher, chunk, grad_x, grad_W):
        n = x.shape[0]
        dev = x.device
        wd = torch.promote_types(torch.promote_types(x.dtype, W.dtype), torch.float32)
        per_row = torch.empty(n, device=dev, dtype=wd)
        tv = torch.empty(n, device=dev, dtype=wd) if teacher is not None else None
        pred = torch.empty(n, device=dev, dtype=torch.long)
        g_x = torch.empty_like(x) if grad_x else None
        g_W = torch.zeros(W.shape, device=dev, dtype=wd) if grad_W else None
        for s, e in row_spans(n, chunk):
            xc = x[s:e].to(W.dtype)
            lq = torch.matmul(xc, W.T).to(wd)
            pred[s:e] = lq.argmax(-1)
            lq = torch.log_softmax(lq, -1)
            if teacher is None:
                yc = y[s:e]
                per_row[s:e] = -lq.gather(-1, yc[:, None])[:, 0]
                q = lq.exp_()
                del lq
                q[torch.arange(e - s, device=dev), yc] -= 1.0
                dz = q
            else:
                q = lq.exp()
                if isinstance(teacher, TopKTeacher):
                    ids, lps = teacher.ids_Rk[s:e], teacher.logprobs_Rk[s:e]
                    per_row[s:e], dz = kl_grad_topk(ids, lps, lq, q)
                    tv[s:e] = _lumped_tv(ids.long(), lps.to(wd), q)
                else:
                    per_row[s:e], dz = kl_grad_full(teacher.chunk_logits(s, e), lq, q)
                    tv[s:e] = 0.5 * dz.abs().sum(-1)  # dz = q - p: TV for one more pass, no softmax
                del lq, q
            if grad_x or grad_W:
                dz = dz.mul_(w[s:e].to(wd)[:, None]).to(W.dtype)
                if grad_x:
                    g_x[s:e] = torch.matmul(dz, W).to(x.dtype)
                if grad_W:
                    g_W.add_(torch.matmul(dz.T, xc).to(wd))
            del dz
        loss = (w.to(wd) * per_row).sum()
        ctx.save_for_backward(*(t for t in (g_x, g_W) if t is not None))
        ctx.grads = (grad_x, grad_W)
        ctx.W_dtype = W.dtype
        ctx.mark_non_differentiable(per_row, pred, *(() if tv is None else (tv,)))
        return loss, per_row, pred, tv

    @staticmethod
    def backward(ctx, grad_loss, grad_rows, grad_pred, grad_tv):
        saved = list(ctx.saved_tensors)
        grad_x = grad_loss.to(saved[0].dtype) * saved.pop(0) if ctx.grads[0] else None
        grad_W = (grad_loss.to(saved[0].dtype) * saved[0]).to(ctx.W_dtype) if ctx.grads[1] else None
        return grad_x, grad_W, None, None, None, None, None, None


def _lumped_tv(ids_ck: torch.Tensor, lps_ck: torch.Tensor, q_cV: torch.Tensor) -> torch.Tensor:
    """TV over the k stored ids + one tail bin (``divergences.kl_tv_topk``'s), from the draft's q [c, V]."""
    p_k = lps_ck.exp()
    q_k = q_cV.gather(-1, ids_ck)
    p_t = (1.0 - p_k.sum(-1)).clamp(min=0.0)
    q_t = (1.0 - q_k.sum(-1)).clamp(min=0.0)
    return 0.5 * ((p_k - q_k).abs().sum(-1) + (p_t - q_t).abs())


def trained_head_losses(
    x_nH: torch.Tensor,
    W_NH: torch.Tensor,
    w_n: torch.Tensor,
    *,
    labels_n: torch.Tensor | None = None,
    teacher: ExactTeacher | TopKTeacher | None = None,
    chunk_rows: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Loss of rows through a head that may train (z = x W^T over its N outputs), without [n, N] whole and
    without recompute: (sum_i w_i l_i (differentiable w.r.t. x and W), l [n], argmax z [n], TV [n] or None).

    ``labels_n`` (head ids): l = CE; or ``teacher`` (logits over the same N outputs, e.g. the target restricted
    to a draft vocabulary): l = KL(p || q), with TV(p, q) from the same chunk's q - p (lumped over top-k + tail
    for a :class:`TopKTeacher`). ``w_n``: per-row weights, not differentiated (0 drops a row). Gradients w.r.t.
    x and W are computed in the forward when they need one; the backward scales them by the loss's upstream
    gradient, which is why the loss leaves as one weighted sum rather than per row.
    """
    if (labels_n is None) == (teacher is None):
        raise ValueError("trained_head_losses needs exactly one of labels_n (CE) and teacher (KL)")
    grad = torch.is_grad_enabled()
    grad_x, grad_W = grad and x_nH.requires_grad, grad and W_NH.requires_grad
    y = labels_n.long() if labels_n is not None else None
    loss, rows, pred, tv = _FusedTrainedHead.apply(x_nH, W_NH, y, w_n.detach(), teacher, int(chunk_rows),
                                                   grad_x, grad_W)
    return loss, rows, pred, tv
