"""Draft losses vs float64 references written from the definitions; chunked == unchunked."""

import math

import pytest
import torch

from tapdraft.shards.head import HeadSpec
from tapdraft.train.acceptance import tau_from_alpha
from tapdraft.train.drafters.base import combine_terms
from tapdraft.train.drafters.common.losses import dpace_weights, row_losses, slot_weights, weighted_terms
from tapdraft.train.drafters.common.teacher import ExactTeacher, TopKTeacher


def reference_loss_f64(
    h_RH: torch.Tensor, labels_R: torch.Tensor, w_R: torch.Tensor, lm_head_VH: torch.Tensor, scaling: float = 1.0
) -> float:
    """Float64 sum(w * CE) / sum(w), written from the definition (for tests and sanity checks)."""
    z = (h_RH.double() @ lm_head_VH.double().T) / scaling
    logp = z - torch.logsumexp(z, dim=-1, keepdim=True)
    ce = -logp.gather(-1, labels_R.long()[:, None])[:, 0]
    w = w_R.double()
    return float((w * ce).sum() / w.sum()) if float(w.sum()) > 0 else math.nan


def _rand(R=37, H=16, V=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(R, H, generator=g, dtype=torch.float64)
    W = torch.randn(V, H, generator=g, dtype=torch.float64) / 3
    y = torch.randint(0, V, (R,), generator=g)
    w = torch.rand(R, generator=g, dtype=torch.float64)
    return h, W, y, w


def test_slot_weights():
    w = slot_weights(16, 7.0)
    assert w.shape == (15,)
    assert torch.allclose(w.double(), torch.tensor([math.exp(-(k - 1) / 7) for k in range(1, 16)], dtype=torch.float64))


def _dpace_reference(q, valid, alpha):
    """D-PACE in float64 loops: slot k weighs the sum over later valid slots j of the product of smoothed q up to j."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for idx in torch.cartesian_prod(*[torch.arange(n) for n in q.shape[:-1]]):
        qs, vs = q[tuple(idx)].double(), valid[tuple(idx)]
        K = qs.shape[0]
        prefix = [math.prod(((1 - alpha) * float(qs[i]) + alpha) for i in range(j + 1) if vs[i]) for j in range(K)]
        for k in range(K):
            if vs[k]:
                out[tuple(idx)][k] = sum(prefix[j] for j in range(k, K) if vs[j])
    return out


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_dpace_weights_match_float64_reference(alpha):
    g = torch.Generator().manual_seed(3)
    q = torch.rand(2, 3, 7, generator=g)
    valid = torch.rand(2, 3, 7, generator=g) > 0.3
    w = dpace_weights(q, valid, alpha)
    torch.testing.assert_close(w.double(), _dpace_reference(q, valid, alpha), rtol=1e-5, atol=1e-6)
    assert not w.requires_grad and bool((w[~valid] == 0).all())
    if alpha == 1.0:  # every factor 1: a valid slot weighs the count of valid slots from it on
        torch.testing.assert_close(w[0, 0], (valid[0, 0].flip(0).cumsum(0).flip(0) * valid[0, 0]).float())


def test_ce_matches_float64_reference():
    h, W, y, w = _rand()
    for scaling in (1.0, 2.5):
        ce, correct, kd = row_losses(h, y, W, head=HeadSpec(logits_scaling=scaling), chunk_rows=8)
        assert kd is None
        got = float((w * ce).sum() / w.sum())
        assert abs(got - reference_loss_f64(h, y, w, W, scaling)) < 1e-10
        assert torch.equal(correct.bool(), ((h @ W.T).argmax(-1) == y))


def _lumped_kl_ref(ids, lps, z):
    """KL over k ids + one tail bin, loops in float64 from the definition."""
    out = []
    for i in range(z.shape[0]):
        q = torch.softmax(z[i].double(), -1)
        p_k = lps[i].double().exp()
        p_t = 1 - p_k.sum()
        q_k = q[ids[i]]
        q_t = 1 - q_k.sum()
        kl = (p_k * (p_k.log() - q_k.log())).sum() + p_t * (p_t.log() - q_t.log())
        out.append(kl)
    return torch.stack(out)


def test_topk_kd_matches_float64_reference():
    h, W, y, w = _rand(seed=1)
    g = torch.Generator().manual_seed(2)
    t_logits = torch.randn(h.shape[0], W.shape[0], generator=g, dtype=torch.float64) * 2
    lp = torch.log_softmax(t_logits, -1)
    top = lp.topk(6, -1)
    teacher = TopKTeacher(top.indices, top.values)
    ce, _, kd = row_losses(h, y, W, chunk_rows=5, teacher=teacher)
    ref = _lumped_kl_ref(top.indices, top.values, h @ W.T)
    assert torch.allclose(kd, ref, atol=1e-10)


def test_exact_kd_matches_float64_reference():
    h, W, y, w = _rand(seed=3)
    g = torch.Generator().manual_seed(4)
    th = torch.randn(h.shape[0], h.shape[1], generator=g, dtype=torch.float64) * 3
    nw = 1 + 0.1 * torch.randn(h.shape[1], generator=g, dtype=torch.float64)
    scaling = 1.7
    teacher = ExactTeacher(th, nw, W, HeadSpec(eps=1e-6, logits_scaling=scaling))
    _, _, kd = row_losses(h, y, W, head=HeadSpec(logits_scaling=scaling), chunk_rows=7, teacher=teacher)
    tn = th / torch.sqrt(th.pow(2).mean(-1, keepdim=True) + 1e-6) * nw
    p = torch.log_softmax(tn @ W.T / scaling, -1)
    q = torch.log_softmax(h @ W.T / scaling, -1)
    ref = (p.exp() * (p - q)).sum(-1)
    assert torch.allclose(kd, ref, atol=1e-10)


def test_chunked_equals_unchunked_values_and_grads():
    h, W, y, w = _rand(R=50, seed=5)
    lps = torch.log_softmax(torch.randn(50, W.shape[0], dtype=torch.float64), -1).topk(4, -1)
    res = []
    for chunk in (0, 7, 1000):
        hh = h.clone().requires_grad_(True)
        ce, _, kd = row_losses(hh, y, W, chunk_rows=chunk, teacher=TopKTeacher(lps.indices, lps.values))
        ((w * ce).sum() + (w * kd).sum()).backward()
        res.append((ce.detach(), kd.detach(), hh.grad))
    for r in res[1:]:
        for a, b in zip(res[0], r):
            assert torch.allclose(a, b, atol=1e-12)


def test_ce_grad_off_gives_the_kd_gradient_alone():
    """ce_grad=False (ce_weight 0) skips the CE gradient: the rows' gradient is the KD term's alone, vs float64
    autograd through dense logits; CE values are still returned."""
    h, W, y, w = _rand(R=30, seed=6)
    lps = torch.log_softmax(torch.randn(30, W.shape[0], dtype=torch.float64), -1).topk(4, -1)
    teacher = TopKTeacher(lps.indices, lps.values)
    hh = h.clone().requires_grad_(True)
    ce, _, kd = row_losses(hh, y, W, chunk_rows=7, teacher=teacher, ce_grad=False)
    (0.0 * (w * ce).sum() + (w * kd).sum()).backward()
    ref_h = h.clone().requires_grad_(True)
    ref_kd = _lumped_kl_ref(lps.indices, lps.values, ref_h @ W.T)
    (w * ref_kd).sum().backward()
    assert torch.allclose(hh.grad, ref_h.grad, atol=1e-10)
    ce_on, _, _ = row_losses(h, y, W, chunk_rows=7, teacher=teacher)
    assert torch.allclose(ce, ce_on, atol=1e-12)


@pytest.mark.parametrize("kind", ["ce", "exact", "topk"])
def test_trained_head_fused_matches_float64_autograd(kind):
    """The trained-head fused loss (EAGLE-3's kl / ce) vs float64 autograd through dense logits: the weighted sum,
    per-row values, TV, argmax, and the gradients w.r.t. the rows AND the head, across chunkings."""
    from tapdraft.train.drafters.common.divergences import kl_tv_full, kl_tv_topk
    from tapdraft.train.drafters.common.losses import trained_head_losses

    h, W, y, w = _rand(R=23, seed=8)
    w = (w > 0.3).double()  # 0/1 like EAGLE-3's carries (a CE label outside the draft vocabulary weighs 0)
    g = torch.Generator().manual_seed(9)
    th = torch.randn(h.shape[0], h.shape[1], generator=g, dtype=torch.float64) * 3
    nw = 1 + 0.1 * torch.randn(h.shape[1], generator=g, dtype=torch.float64)
    Wt = torch.randn_like(W)  # the target's head differs from the draft's (which trains)
    p_logits = (th / torch.sqrt(th.pow(2).mean(-1, keepdim=True) + 1e-6) * nw) @ Wt.T
    top = torch.log_softmax(p_logits, -1).topk(5, -1)

    def reference():
        x, Wr = h.clone().requires_grad_(True), W.clone().requires_grad_(True)
        z = x @ Wr.T
        if kind == "ce":
            rows, tv = torch.nn.functional.cross_entropy(z, y, reduction="none"), None
        elif kind == "exact":
            rows, tv = kl_tv_full(p_logits, z)
        else:
            rows, tv = kl_tv_topk(top.indices, top.values, z)
        (w * rows).sum().backward()
        return (w * rows).sum().detach(), rows.detach(), tv, z.argmax(-1), x.grad, Wr.grad

    ref = reference()
    teacher = {"ce": None, "exact": ExactTeacher(th, nw, Wt, HeadSpec(eps=1e-6)),
               "topk": TopKTeacher(top.indices, top.values)}[kind]
    for chunk in (0, 4, 100):
        x, Wg = h.clone().requires_grad_(True), W.clone().requires_grad_(True)
        loss, rows, pred, tv = trained_head_losses(x, Wg, w, labels_n=y if kind == "ce" else None, teacher=teacher,
                                                   chunk_rows=chunk)
        (2.5 * loss).backward()
        assert torch.allclose(loss.detach(), ref[0], atol=1e-10)
        assert torch.allclose(rows, ref[1], atol=1e-10)
        assert (tv is None) == (ref[2] is None)
        if tv is not None:
            assert torch.allclose(tv, ref[2].detach(), atol=1e-10)
        assert torch.equal(pred, ref[3])
        assert torch.allclose(x.grad, 2.5 * ref[4], atol=1e-10)
        assert torch.allclose(Wg.grad, 2.5 * ref[5], atol=1e-10)


def test_trained_head_frozen_head_and_no_grad():
    """A frozen head gets no gradient (and none is computed); under no_grad nothing is."""
    from tapdraft.train.drafters.common.losses import trained_head_losses

    h, W, y, w = _rand(R=9, seed=10)
    x = h.clone().requires_grad_(True)
    loss, _, _, tv = trained_head_losses(x, W, w, labels_n=y, chunk_rows=4)
    loss.backward()
    assert tv is None and x.grad is not None and W.grad is None
    with torch.no_grad():
        loss, _, _, _ = trained_head_losses(h, W.clone().requires_grad_(True), w, labels_n=y, chunk_rows=4)
    assert not loss.requires_grad
    with pytest.raises(ValueError, match="exactly one"):
        trained_head_losses(h, W, w, chunk_rows=4)


def test_combine_terms_normalises_each_term_by_its_own_count():
    ce_sum = torch.tensor(6.0, requires_grad=True)
    kd_sum = torch.tensor(2.0, requires_grad=True)
    terms = {"ce": (ce_sum, torch.tensor(3.0), 1.0), "kd": (kd_sum, torch.tensor(4.0), 0.5)}
    loss, vals = combine_terms(terms)
    assert abs(float(loss.detach()) - (6 / 3 + 0.5 * 2 / 4)) < 1e-6
    assert vals == {"ce": 2.0, "kd": 0.5}
    loss.backward()
    assert abs(float(ce_sum.grad) - 1 / 3) < 1e-7 and abs(float(kd_sum.grad) - 0.5 / 4) < 1e-7
    # an empty term contributes zero and no NaN
    loss, vals = combine_terms({"ce": (torch.zeros((), requires_grad=True), torch.zeros(()), 1.0)})
    assert float(loss) == 0.0 and vals["ce"] == 0.0


def test_weighted_terms_and_tau():
    ce = torch.tensor([1.0, 2.0])
    w = torch.tensor([1.0, 0.5])
    t = weighted_terms(ce, w, None, None, ce_weight=1.0, kd_weight=1.0)
    assert float(t["ce"][0]) == 2.0 and float(t["ce"][1]) == 1.5
    assert tau_from_alpha([1.0, 1.0, 0.0]) == 3.0
    assert abs(tau_from_alpha([0.5, 0.5]) - 1.75) < 1e-12


def test_fused_gradients_match_float64_autograd_reference():
    """The analytic in-forward gradients vs autograd through the explicit float64 formulas."""
    h, W, y, w = _rand(R=23, seed=7)
    g = torch.Generator().manual_seed(8)
    top = torch.log_softmax(torch.randn(23, W.shape[0], generator=g, dtype=torch.float64) * 2, -1).topk(5, -1)
    th = torch.randn(23, h.shape[1], generator=g, dtype=torch.float64)
    nw = torch.ones(h.shape[1], dtype=torch.float64)
    scaling = 1.3
    for kind in ("none", "topk", "exact"):
        teacher = {"none": None, "topk": TopKTeacher(top.indices, top.values),
                   "exact": ExactTeacher(th, nw, W, HeadSpec(eps=1e-6, logits_scaling=scaling))}[kind]
        hh = h.clone().requires_grad_(True)
        ce, _, kd = row_losses(hh, y, W, head=HeadSpec(logits_scaling=scaling), chunk_rows=6, teacher=teacher)
        loss = (w * ce).sum() + (0.0 if kd is None else (0.7 * w * kd).sum())
        loss.backward()
        hr = h.clone().requires_grad_(True)
        z = hr @ W.T / scaling
        lq = torch.log_softmax(z, -1)
        ref = (w * -lq.gather(-1, y[:, None])[:, 0]).sum()
        if kind == "topk":
            q = lq.exp()
            p_k = top.values.exp()
            q_k = q.gather(-1, top.indices)
            p_t, q_t = 1 - p_k.sum(-1), 1 - q_k.sum(-1)
            kl = (p_k * (p_k.log() - q_k.log())).sum(-1) + p_t * (p_t.log() - q_t.log())
            ref = ref + (0.7 * w * kl).sum()
        elif kind == "exact":
            tn = th / torch.sqrt(th.pow(2).mean(-1, keepdim=True) + 1e-6)
            lp = torch.log_softmax(tn @ W.T / scaling, -1)
            ref = ref + (0.7 * w * (lp.exp() * (lp - lq)).sum(-1)).sum()
        ref.backward()
        assert abs(float(loss) - float(ref)) < 1e-9, kind
        assert torch.allclose(hh.grad, hr.grad, atol=1e-10), kind


def test_topk_kd_agrees_with_divergences_module():
    from tapdraft.train.drafters.common.divergences import kl_tv_topk

    h, W, y, w = _rand(R=9, seed=11)
    top = torch.log_softmax(torch.randn(9, W.shape[0], dtype=torch.float64), -1).topk(3, -1)
    _, _, kd = row_losses(h, y, W, teacher=TopKTeacher(top.indices, top.values))
    assert torch.allclose(kd, kl_tv_topk(top.indices, top.values, h @ W.T)[0], atol=1e-12)


def test_ce_kd_and_gradients_through_a_soft_capped_biased_head_match_autograd():
    """The fused loss computes dL/dh itself: through the soft cap's tanh and past the lm_head bias."""
    h, W, y, w = _rand(R=23, H=12, V=40, seed=3)
    g = torch.Generator().manual_seed(4)
    b = torch.randn(40, generator=g, dtype=torch.float64)
    th = torch.randn(23, 12, generator=g, dtype=torch.float64)
    spec = HeadSpec(logits_scaling=1.5, final_logit_softcap=0.7, lm_head_bias=True)

    def z_of(x):  # the definition: softcap(scale(x W^T + b))
        return 0.7 * torch.tanh((x @ W.T + b) / 1.5 / 0.7)

    teacher = ExactTeacher(th, torch.ones(12, dtype=torch.float64), W, HeadSpec(eps=1e-6, **{
        k: getattr(spec, k) for k in ("logits_scaling", "final_logit_softcap", "lm_head_bias")}), lm_head_bias=b)
    x = h.clone().requires_grad_(True)
    ce, _, kd = row_losses(x, y, W, head=spec, lm_head_bias=b, chunk_rows=5, teacher=teacher)
    ((w * ce).sum() + (w * kd).sum()).backward()
    ref_x = h.clone().requires_grad_(True)
    logq = torch.log_softmax(z_of(ref_x), -1)
    tn = th * torch.rsqrt(th.pow(2).mean(-1, keepdim=True) + 1e-6)
    logp = torch.log_softmax(z_of(tn), -1)
    ref_ce = -logq.gather(1, y[:, None])[:, 0]
    ref_kd = (logp.exp() * (logp - logq)).sum(-1)
    ((w * ref_ce).sum() + (w * ref_kd).sum()).backward()
    torch.testing.assert_close(ce, ref_ce.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(kd, ref_kd.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-9, atol=1e-10)


def test_bf16_head_stays_close_to_the_float64_loss_and_gradient():
    """The frozen head in bf16 (``head_dtype: bf16``, auto on a CPU with bf16 instructions and a real-size head):
    rows rounded to bf16 at the matmul, logits back in bf16, softmax and losses in fp32. The weights are bf16
    exactly, as a real checkpoint's; the float64 reference uses the same weights and unrounded rows."""
    g = torch.Generator().manual_seed(3)
    R, H, V = 96, 256, 4096
    W = (torch.randn(V, H, generator=g) * 3 / H**0.5).bfloat16()
    h = torch.randn(R, H, generator=g)
    y = torch.randint(0, V, (R,), generator=g)
    th = torch.randn(R, H, generator=g)
    for teacher in (None, ExactTeacher(th, torch.ones(H), W, HeadSpec())):
        x = h.clone().requires_grad_(True)
        ce, _, kd = row_losses(x, y, W, chunk_rows=40, teacher=teacher)
        loss = ce.mean() if kd is None else kd.mean()
        loss.backward()
        x64 = h.double().requires_grad_(True)
        t64 = None if teacher is None else ExactTeacher(th.double(), torch.ones(H, dtype=torch.float64), W.double(),
                                                         HeadSpec())
        ce64, _, kd64 = row_losses(x64, y, W.double(), chunk_rows=40, teacher=t64)
        ref = ce64.mean() if kd64 is None else kd64.mean()
        ref.backward()
        assert abs(float(loss.detach()) - float(ref.detach())) / float(ref.detach()) < 5e-4
        cos = torch.nn.functional.cosine_similarity(x.grad.double().flatten(), x64.grad.flatten(), dim=0)
        assert cos > 0.999
        assert float((x.grad.double() - x64.grad).norm() / x64.grad.norm()) < 0.03
