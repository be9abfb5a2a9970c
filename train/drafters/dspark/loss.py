"""DSpark's training loss over its loss rows, fused: the Markov-corrected logits, CE and the L1 distance to the
teacher, with their gradients computed chunk by chunk in the forward (as ``common.losses`` does for DFlash's CE/KD
and EAGLE-3's head), so neither pass holds [R, V] logits whole and nothing is computed twice.

Per row i (hidden h_i, predecessor embedding e_i = markov_w1[prev_i], label y_i, teacher p_i):

    z_i   = project(h_i) + markov_w2 e_i                 the corrected logits (``DSparkDrafter.corrected_logits``)
    q_i   = softmax(z_i)
    ce_i  = -log q_i(y_i)                                dce/dz = q - onehot(y)
    l1_i  = 2 TV(p_i, q_i) = sum_v |p_v - q_v|           dl1/dz = q * (s - <q, s>),  s_v = sign(q_v - p_v)

With a top-k teacher both distributions are lumped onto the k stored ids plus one tail bin (``divergences
.kl_tv_topk``): s_v is the sign of the stored id's bin or, for every other id, the tail bin's. The two losses leave
as weighted sums, sum_i w_i ce_i and sum_i u_i l1_i (weights not differentiated); the loss mixes them with their
terms' weights over their row counts, a mix the forward predicts, so it builds that mix's gradient w.r.t. h, e and
markov_w2 once a chunk and the backward only scales it (``_FusedDSparkRows``). The frozen head has no bias or soft cap here
(``DSparkDrafter.check_dataset`` refuses both: vLLM adds the Markov bias to lm_head(h) alone).

Shapes: R rows, H hidden, r Markov rank, V vocab, k stored teacher top-k.
"""

from __future__ import annotations

import torch

from tapdraft.shards.head import HeadSpec, add_projection_, project_backward, row_spans
from tapdraft.train.drafters.common.teacher import ExactTeacher, TopKTeacher


def _l1_and_grad(q: torch.Tensor, teacher: ExactTeacher | TopKTeacher, s: int, e: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """TV [c] and d(2 TV)/dz [c, V] of chunk rows s..e from the draft's q [c, V]."""
    if isinstance(teacher, TopKTeacher):
        ids = teacher.ids_Rk[s:e].long()
        p_k = teacher.logprobs_Rk[s:e].to(q.dtype).exp()
        q_k = q.gather(-1, ids)
        q_t = q.scatter(-1, ids, 0.0).sum(-1)  # summed, not 1 - sum q_k: no cancellation
        p_t = (1.0 - p_k.sum(-1)).clamp(min=0.0) if ids.shape[1] < q.shape[1] else torch.zeros_like(q_t)
        tv = 0.5 * ((p_k - q_k).abs().sum(-1) + (p_t - q_t).abs())
        sign = torch.sign(q_t - p_t)[:, None].expand_as(q).clone()
        sign.scatter_(-1, ids, torch.sign(q_k - p_k))
    else:
        p = torch.softmax(teacher.chunk_logits(s, e).to(q.dtype), -1)
        sign = torch.sign(q - p)
        tv = 0.5 * (q - p).abs_().sum(-1)
        del p
    mean = (q * sign).sum(-1, keepdim=True)
    return tv, sign.sub_(mean).mul_(q)


def _chunks(h, emb, w2, lm_head, head, labels, w, u, teacher, chunk, mix):
    """Per-row CE, TV and argmax agreement, and with ``mix`` = (a, b) the gradients of a sum_i w_i ce_i +
    b sum_i u_i l1_i w.r.t. (h, emb, w2), from one combined dz a chunk."""
    R = h.shape[0]
    dev = h.device
    wd = torch.promote_types(torch.promote_types(h.dtype, w2.dtype), torch.float32)
    ce = torch.empty(R, device=dev, dtype=wd)
    tv = torch.empty(R, device=dev, dtype=wd)
    correct = torch.empty(R, device=dev, dtype=torch.bool)
    grads = None
    if mix is not None:
        grads = (torch.empty_like(h), torch.empty_like(emb), torch.zeros(w2.shape, device=dev, dtype=wd))
        a_R, b_R = float(mix[0]) * w.to(wd), float(mix[1]) * u.to(wd)
    w2w = w2.to(wd)
    for s, e in row_spans(R, chunk):
        y, ec = labels[s:e], emb[s:e].to(wd)
        # the Markov bias (bf16 under autocast, as before) in the work dtype, then the head's logits added into it
        z = add_projection_(torch.matmul(ec, w2w.T).to(wd), h[s:e], lm_head, head)
        correct[s:e] = z.argmax(-1) == y
        lq = torch.log_softmax(z, -1)
        del z
        ce[s:e] = -lq.gather(-1, y[:, None])[:, 0]
        q = lq.exp_()
        tv[s:e], dz = _l1_and_grad(q, teacher, s, e)
        if grads is not None:
            q[torch.arange(e - s, device=dev), y] -= 1.0  # dce/dz, in place of q
            dz = dz.mul_(b_R[s:e, None]).add_(q.mul_(a_R[s:e, None]))
            grads[0][s:e] = project_backward(dz, lm_head, head).to(h.dtype)
            grads[1][s:e] = torch.matmul(dz, w2w).to(emb.dtype)
            grads[2].add_(torch.matmul(dz.T, ec))
        del q, dz
    return ce, tv, correct, grads


class _FusedDSparkRows(torch.autograd.Function):
    """The two weighted sums, with the gradient of their predicted mix computed in the forward.

    The loss takes each sum over its own row count times its term's weight (``combine_terms``), so the forward
    predicts the mix (a, b) = (ce_weight / sum w, tv_weight / sum u) and builds that mix's dz once a chunk: one
    lm_head and two Markov matmuls for the gradient, none recomputed. The backward receives the real mix: when it is
    the predicted one up to scale (one process; ranks whose counts keep the same proportion), the saved gradients are
    scaled; otherwise every chunk is recomputed with the real mix, so the gradient is exact either way.
    """

    @staticmethod
    def forward(ctx, h, emb, w2, lm_head, head, labels, w, u, teacher, chunk, mix):
        ce, tv, correct, grads = _chunks(h, emb, w2, lm_head, head, labels, w, u, teacher, chunk, mix)
        ctx.mix, ctx.args, ctx.w2_dtype = mix, (head, teacher, chunk), w2.dtype
        if mix is not None:
            ctx.save_for_backward(h, emb, w2, lm_head, labels, w, u, *grads)
        ctx.mark_non_differentiable(ce, tv, correct)
        wd = ce.dtype
        return (w.to(wd) * ce).sum(), (u.to(wd) * 2.0 * tv).sum(), ce, tv, correct

    @staticmethod
    def backward(ctx, g_ce, g_l1, *_):
        if ctx.mix is None:
            return (None,) * 11
        h, emb, w2, lm_head, labels, w, u, g_h, g_e, g_w2 = ctx.saved_tensors
        a, b = ctx.mix
        real = (float(g_ce), float(g_l1))
        ref, got = (a, real[0]) if abs(a) >= abs(b) else (b, real[1])
        scale = got / ref if ref else 0.0
        if abs(real[0] - scale * a) <= 1e-6 * abs(real[0]) + 1e-30 and \
                abs(real[1] - scale * b) <= 1e-6 * abs(real[1]) + 1e-30:
            grads = (g_h * scale, g_e * scale, g_w2 * scale)
        else:  # another mix than predicted: recompute the chunks with it
            head, teacher, chunk = ctx.args
            grads = _chunks(h, emb, w2, lm_head, head, labels, w, u, teacher, chunk, real)[3]
        return grads[0], grads[1], grads[2].to(ctx.w2_dtype), None, None, None, None, None, None, None, None


def dspark_row_losses(
    h_RH: torch.Tensor,
    emb_Rr: torch.Tensor,
    markov_w2_Vr: torch.Tensor,
    lm_head_VH: torch.Tensor,
    labels_R: torch.Tensor,
    w_R: torch.Tensor,
    u_R: torch.Tensor,
    teacher: ExactTeacher | TopKTeacher,
    *,
    head: HeadSpec = HeadSpec(),
    chunk_rows: int = 2048,
    weights: tuple[float, float] = (1.0, 1.0),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum_i w_i ce_i, sum_i u_i l1_i, ce [R], TV [R], correct [R] bool: argmax z == label), chunked; the two sums
    are differentiable w.r.t. ``h_RH``, ``emb_Rr`` (the rows' markov_w1 embeddings) and ``markov_w2_Vr``; the
    per-row values carry no gradient (TV feeds the confidence head's target, detached). ``weights``: the CE and L1
    terms' weights, from which the gradient's mix is predicted (any other mix is still exact, at a recompute)."""
    if head.lm_head_bias or head.final_logit_softcap is not None:
        raise ValueError("DSpark's fused loss takes a head with no lm_head bias or soft cap (as vLLM serves it)")
    mix = None
    if torch.is_grad_enabled() and (h_RH.requires_grad or emb_Rr.requires_grad or markov_w2_Vr.requires_grad):
        counts = (float(w_R.sum()), float(u_R.sum()))  # combine_terms: an empty term is divided by 1
        mix = tuple(wt / (c if c > 1e-12 else 1.0) for wt, c in zip(weights, counts))
    return _FusedDSparkRows.apply(h_RH, emb_Rr, markov_w2_Vr, lm_head_VH.detach(), head, labels_R.long(),
                                  w_R.detach(), u_R.detach(), teacher, int(chunk_rows), mix)
