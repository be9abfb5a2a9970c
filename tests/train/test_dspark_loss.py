"""DSpark's fused row loss against autograd through the unfused one, in float64: the two weighted sums, the per-row CE
and TV, argmax agreement, and the gradients w.r.t. the rows, their Markov embeddings and markov_w2, for both teacher
forms, across chunkings, with rows that carry no weight and the k = V edge (no tail bin)."""

import pytest
import torch
import torch.nn.functional as F

from tapdraft.shards.head import HeadSpec
from tapdraft.train.drafters.common.divergences import kl_tv_topk, tv_full
from tapdraft.train.drafters.common.teacher import ExactTeacher, TopKTeacher
from tapdraft.train.drafters.dspark.loss import dspark_row_losses

R, H, r, V = 7, 6, 3, 11


def _case(k: int | None, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    d = torch.float64
    h = torch.randn(R, H, generator=g, dtype=d, requires_grad=True)
    emb = torch.randn(R, r, generator=g, dtype=d, requires_grad=True)
    w2 = torch.randn(V, r, generator=g, dtype=d, requires_grad=True)
    lm_head = torch.randn(V, H, generator=g, dtype=d)
    y = torch.randint(0, V, (R,), generator=g)
    w = torch.rand(R, generator=g, dtype=d)
    u = torch.rand(R, generator=g, dtype=d)
    w[2], u[4] = 0.0, 0.0  # rows outside a term
    head = HeadSpec(logits_scaling=1.3)
    if k is None:
        teacher = ExactTeacher(torch.randn(R, H, generator=g, dtype=d), torch.ones(H, dtype=d), lm_head, head)
        p_logits = teacher.chunk_logits(0, R)
        ref_tv = lambda z: tv_full(p_logits, z)  # noqa: E731
    else:
        lp = torch.log_softmax(2 * torch.randn(R, V, generator=g, dtype=d), -1)
        order = lp.argsort(-1, descending=True)[:, :k]
        teacher = TopKTeacher(order, lp.gather(-1, order))
        ref_tv = lambda z: kl_tv_topk(teacher.ids_Rk, teacher.logprobs_Rk, z)[1]  # noqa: E731
    return h, emb, w2, lm_head, y, w, u, head, teacher, ref_tv


@pytest.mark.parametrize("k", [None, 4, V], ids=["exact", "topk4", "topk_all"])
@pytest.mark.parametrize("chunk", [1, 3, 0])
@pytest.mark.parametrize("predicted", [True, False], ids=["predicted_mix", "other_mix"])
def test_fused_losses_and_gradients_equal_autograd_in_float64(k, chunk, predicted, monkeypatch):
    """The loss mixes the sums as combine_terms does (weight over row count): the gradient saved in the forward is
    scaled, and no chunk is projected again. Another mix (ranks whose counts differ in proportion) recomputes."""
    import tapdraft.train.drafters.dspark.loss as fused_loss
    h, emb, w2, lm_head, y, w, u, head, teacher, ref_tv = _case(k)
    weights = (0.1, 0.9)
    a, b = 3.0 * weights[0] / float(w.sum()), 3.0 * weights[1] / float(u.sum())  # 3: the world size's factor
    if not predicted:
        a *= 1.5
    projections = []
    real_project = fused_loss.add_projection_
    monkeypatch.setattr(fused_loss, "add_projection_",
                        lambda *x, **kw: projections.append(1) or real_project(*x, **kw))
    ce_sum, l1_sum, ce, tv, correct = dspark_row_losses(h, emb, w2, lm_head, y, w, u, teacher, head=head,
                                                        chunk_rows=chunk, weights=weights)
    chunks = len(projections)
    (a * ce_sum + b * l1_sum).backward()
    assert len(projections) == chunks * (1 if predicted else 2)
    fused = [t.grad.clone() for t in (h, emb, w2)]
    for t in (h, emb, w2):
        t.grad = None
    z = h @ lm_head.T / head.logits_scaling + emb @ w2.T
    ref_ce, ref_tv_R = F.cross_entropy(z, y, reduction="none"), ref_tv(z)
    ref_ce_sum, ref_l1_sum = (w * ref_ce).sum(), (u * 2 * ref_tv_R).sum()
    (a * ref_ce_sum + b * ref_l1_sum).backward()
    torch.testing.assert_close(ce, ref_ce.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(tv, ref_tv_R.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ce_sum, ref_ce_sum, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(l1_sum, ref_l1_sum, rtol=1e-12, atol=1e-12)
    assert torch.equal(correct, z.argmax(-1) == y)
    for got, t in zip(fused, (h, emb, w2)):
        torch.testing.assert_close(got, t.grad, rtol=1e-10, atol=1e-12)


def test_without_gradients_nothing_is_kept_and_values_stay():
    h, emb, w2, lm_head, y, w, u, head, teacher, _ = _case(4, seed=1)
    with torch.no_grad():
        out = dspark_row_losses(h, emb, w2, lm_head, y, w, u, teacher, head=head, chunk_rows=2)
    again = dspark_row_losses(h, emb, w2, lm_head, y, w, u, teacher, head=head, chunk_rows=0)
    assert not out[0].requires_grad and again[0].requires_grad
    for x, z in zip(out, again):
        torch.testing.assert_close(x, z.detach() if z.dtype != torch.bool else z, rtol=1e-12, atol=1e-12)


def test_a_head_vllm_cannot_serve_is_refused():
    h, emb, w2, lm_head, y, w, u, _, teacher, _ = _case(None)
    with pytest.raises(ValueError, match="no lm_head bias or soft cap"):
        dspark_row_losses(h, emb, w2, lm_head, y, w, u, teacher, head=HeadSpec(final_logit_softcap=30.0))


def test_under_bf16_autocast_the_logits_stay_float32():
    """At the peers' precision (a bf16 head, CPU bf16 autocast over fp32 weights) the corrected logits are the bf16
    head's and the autocast Markov bias's sum in float32, so the CE and TV are the float32 ones of that sum."""
    g = torch.Generator().manual_seed(1)
    h, emb = torch.randn(R, H, generator=g), torch.randn(R, r, generator=g)
    w2, lm_head = torch.randn(V, r, generator=g), torch.randn(V, H, generator=g).to(torch.bfloat16)
    y, w, u = torch.randint(0, V, (R,), generator=g), torch.rand(R, generator=g), torch.rand(R, generator=g)
    lp = torch.log_softmax(2 * torch.randn(R, V, generator=g), -1)
    teacher = TopKTeacher(lp.argsort(-1, descending=True)[:, :4], lp.sort(-1, descending=True).values[:, :4])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, _, ce, tv, _ = dspark_row_losses(h, emb, w2, lm_head, y, w, u, teacher)
        bias = emb @ w2.T  # bf16 under autocast
    z = (h.to(torch.bfloat16) @ lm_head.T).float() + bias.float()
    assert ce.dtype == torch.float32
    torch.testing.assert_close(ce, F.cross_entropy(z, y, reduction="none"), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(tv, kl_tv_topk(teacher.ids_Rk, teacher.logprobs_Rk, z)[1], rtol=1e-6, atol=1e-6)
