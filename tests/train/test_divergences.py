"""KL, TV, their lumped-tail top-k forms and the LK loss against float64 references on random inputs."""

import math

import pytest
import torch

from tapdraft.train.drafters.common.divergences import (
    acceptance,
    kl_tv_full,
    kl_tv_topk,
    lk_loss,
    mean_acceptance,
    parse_lk_lambda,
    tv_full,
)


def _ref_kl_tv(p, q):
    """Plain float64 definitions over explicit probability vectors [N, M]."""
    kl = [
        sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(pr.tolist(), qr.tolist()) if pi > 0)
        for pr, qr in zip(p, q)
    ]
    tv = [0.5 * sum(abs(pi - qi) for pi, qi in zip(pr.tolist(), qr.tolist())) for pr, qr in zip(p, q)]
    return torch.tensor(kl, dtype=torch.float64), torch.tensor(tv, dtype=torch.float64)


def _random(N=7, V=50, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    p_logits = torch.randn(N, V, generator=g, dtype=torch.float64) * scale
    q_logits = torch.randn(N, V, generator=g, dtype=torch.float64) * scale
    return p_logits, q_logits


def _lump(prob, ids):
    """Probabilities on the k ids plus one tail bin: [N, k + 1]."""
    head = prob.gather(-1, ids)
    return torch.cat([head, (1.0 - head.sum(-1, keepdim=True)).clamp(min=0)], dim=-1)


def test_full_matches_float64_reference():
    p_logits, q_logits = _random()
    kl, tv = kl_tv_full(p_logits, q_logits)
    rkl, rtv = _ref_kl_tv(p_logits.softmax(-1), q_logits.softmax(-1))
    torch.testing.assert_close(kl, rkl, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(tv, rtv, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(acceptance(tv), torch.minimum(p_logits.softmax(-1), q_logits.softmax(-1)).sum(-1))


def test_tv_alone_matches_float64_reference_and_its_gradient():
    p_logits, q_logits = _random(seed=4)
    _, rtv = _ref_kl_tv(p_logits.softmax(-1), q_logits.softmax(-1))
    torch.testing.assert_close(tv_full(p_logits, q_logits), rtv, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(tv_full(p_logits.float(), q_logits.float()).double(), rtv, rtol=1e-4, atol=1e-5)
    a, b = q_logits.clone().requires_grad_(True), q_logits.clone().requires_grad_(True)
    tv_full(p_logits, a).sum().backward()
    kl_tv_full(p_logits, b)[1].sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)


def test_full_float32_close_to_float64():
    p_logits, q_logits = _random(seed=1)
    kl32, tv32 = kl_tv_full(p_logits.float(), q_logits.float())
    kl64, tv64 = kl_tv_full(p_logits, q_logits)
    torch.testing.assert_close(kl32.double(), kl64, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(tv32.double(), tv64, rtol=1e-4, atol=1e-5)
    # bf16 inputs are upcast, never computed in bf16
    kl16, _ = kl_tv_full(p_logits.bfloat16(), q_logits.bfloat16())
    assert kl16.dtype == torch.float32


@pytest.mark.parametrize("k", [1, 5, 20])
def test_topk_matches_lumped_reference_and_bounds_exact(k):
    p_logits, q_logits = _random(N=9, V=40, seed=k)
    p, q = p_logits.softmax(-1), q_logits.softmax(-1)
    ids = p.topk(k, dim=-1).indices
    lps = p.log().gather(-1, ids)
    kl, tv = kl_tv_topk(ids.to(torch.int32), lps, q_logits)
    rkl, rtv = _ref_kl_tv(_lump(p, ids), _lump(q, ids))
    torch.testing.assert_close(kl, rkl, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(tv, rtv, rtol=1e-9, atol=1e-12)
    ekl, etv = kl_tv_full(p_logits, q_logits)
    # data-processing inequality: lumping can only lose divergence
    assert bool((tv <= etv + 1e-12).all()) and bool((kl <= ekl + 1e-12).all())
    assert bool((tv < etv - 1e-6).any()), "random inputs should show a strict gap somewhere"


def test_topk_with_whole_vocab_equals_exact():
    p_logits, q_logits = _random(N=4, V=12, seed=3)
    p = p_logits.softmax(-1)
    ids = p.topk(12, dim=-1).indices
    kl, tv = kl_tv_topk(ids, p.log().gather(-1, ids), q_logits)
    ekl, etv = kl_tv_full(p_logits, q_logits)
    assert torch.isfinite(kl).all()
    torch.testing.assert_close(kl, ekl, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(tv, etv, rtol=1e-9, atol=1e-9)


def test_gradients_match_finite_differences():
    p_logits, q_logits = _random(N=3, V=8, seed=4)
    ids = p_logits.softmax(-1).topk(3, dim=-1).indices
    lps = p_logits.log_softmax(-1).gather(-1, ids)
    q = q_logits.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: kl_tv_full(p_logits, x), (q,))
    assert torch.autograd.gradcheck(lambda x: kl_tv_topk(ids, lps, x), (q,))


def test_lk_fixed_lambda_against_reference():
    p_logits, q_logits = _random(N=10, V=20, seed=7)
    valid = torch.tensor([1, 1, 0, 1, 0, 1, 1, 1, 0, 1], dtype=torch.bool)
    q = q_logits.clone().requires_grad_(True)
    kl, tv = kl_tv_full(p_logits, q)
    for lam in (0.0, 0.3, 0.5, 1.0):
        res = lk_loss(kl, tv, valid, lam)
        rkl, rtv = _ref_kl_tv(p_logits.softmax(-1), q_logits.softmax(-1))
        want = (lam * rkl + (1 - lam) * rtv)[valid].sum()
        torch.testing.assert_close(res.loss_sum.detach(), want, rtol=1e-10, atol=1e-12)
        assert int(res.count) == 7 and res.lam == lam
    # invalid rows get no gradient
    lk_loss(kl, tv, valid, 0.5).loss_sum.backward()
    assert bool((q.grad[~valid] == 0).all()) and bool((q.grad[valid] != 0).any())


def test_lk_adaptive_lambda_against_reference():
    p_logits, q_logits = _random(N=8, V=16, seed=8, scale=1.0)
    valid = torch.tensor([1, 0, 1, 1, 1, 0, 1, 1], dtype=torch.bool)
    q = q_logits.clone().requires_grad_(True)
    kl, tv = kl_tv_full(p_logits, q)
    res = lk_loss(kl, tv, valid, "adaptive")
    p, qq = p_logits.softmax(-1), q_logits.softmax(-1)
    alpha = torch.minimum(p, qq).sum(-1)[valid].mean()
    lam = math.exp(-3.0 * float(alpha))
    rkl, rtv = _ref_kl_tv(p, qq)
    want = (lam * rkl + (1 - lam) * rtv)[valid].sum()
    torch.testing.assert_close(res.loss_sum.detach(), want, rtol=1e-10, atol=1e-12)
    assert abs(res.lam - lam) < 1e-12
    # lambda is detached: the gradient equals that of the fixed mixture with the same lambda
    res.loss_sum.backward()
    g_adaptive = q.grad.clone()
    q.grad = None
    kl2, tv2 = kl_tv_full(p_logits, q)
    lk_loss(kl2, tv2, valid, lam).loss_sum.backward()
    torch.testing.assert_close(g_adaptive, q.grad)
    # a better draft gets a smaller lambda (more weight on TV)
    kl3, tv3 = kl_tv_full(p_logits, p_logits + 0.01)
    assert lk_loss(kl3, tv3, valid, "adaptive").lam < res.lam
    assert float(mean_acceptance(tv, torch.zeros_like(valid))) == 0.0


def test_lk_lambda_parsing():
    assert parse_lk_lambda("adaptive") == "adaptive"
    assert parse_lk_lambda("0.25") == 0.25
    for bad in (1.5, -0.1, "often", float("nan")):
        with pytest.raises(ValueError, match="lk_lambda"):
            parse_lk_lambda(bad)


def test_a_zero_teacher_probability_contributes_nothing():
    """Masked vocabulary (teacher logit or stored log-prob -inf): KL and its gradient stay finite and exact."""
    from tapdraft.train.drafters.common.divergences import kl_grad_full, kl_grad_topk

    p_logits, q_logits = _random(N=5, V=40, seed=7)
    p_logits[:, ::3] = float("-inf")  # a third of the vocabulary is impossible for the teacher
    q_logits = q_logits.requires_grad_(True)
    kl, tv = kl_tv_full(p_logits, q_logits)
    rkl, rtv = _ref_kl_tv(p_logits.softmax(-1), q_logits.detach().softmax(-1))
    torch.testing.assert_close(kl.detach(), rkl, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(tv.detach(), rtv, rtol=1e-10, atol=1e-12)
    kl.sum().backward()
    assert torch.isfinite(q_logits.grad).all()
    torch.testing.assert_close(q_logits.grad, q_logits.detach().softmax(-1) - p_logits.softmax(-1))
    lq = q_logits.detach().log_softmax(-1)
    kl_f, grad_f = kl_grad_full(p_logits.clone(), lq, lq.exp())
    torch.testing.assert_close(kl_f, rkl)
    torch.testing.assert_close(grad_f, q_logits.grad)
    # stored top-k where some of the k log-probs are -inf (the teacher had fewer than k possible ids)
    ids = torch.stack([torch.randperm(40, generator=torch.Generator().manual_seed(i))[:8] for i in range(5)])
    p = p_logits.softmax(-1)
    lps = p.gather(-1, ids).log()
    assert torch.isinf(lps).any()
    kl_k, tv_k = kl_tv_topk(ids, lps, q_logits.detach())
    rkl_k, rtv_k = _ref_kl_tv(_lump(p, ids), _lump(q_logits.detach().softmax(-1), ids))
    torch.testing.assert_close(kl_k, rkl_k, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(tv_k, rtv_k, rtol=1e-9, atol=1e-12)
    kl_g, grad_g = kl_grad_topk(ids, lps, lq, lq.exp())
    torch.testing.assert_close(kl_g, rkl_k, rtol=1e-9, atol=1e-12)
    assert torch.isfinite(grad_g).all()
