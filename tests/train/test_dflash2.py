"""DFlash2: identity-initialised block convolutions, the selector as a no-op at init, its loss term, refusals."""

import dataclasses

import pytest
import torch

from tests.train.dflash_fixtures import synthetic_samples, tiny_bundle, tiny_layout
from tapdraft.train.config import load_run_config
from tapdraft.train.data import collate
from tapdraft.train.drafters.base import combine_terms
from tapdraft.train.drafters.dflash.config import DFlashConfig
from tapdraft.train.drafters.dflash.model import DFlashDrafter
from tapdraft.train.drafters.dflash2.config import DFlash2Config
from tapdraft.train.drafters.dflash2.model import DFlash2Drafter, SublayerConv


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    bundle = tiny_bundle(tmp_path_factory.mktemp("d2"))
    layout = tiny_layout(bundle)
    batch = collate(synthetic_samples(bundle, layout, 3, seed=1))
    return bundle, layout, batch


def _pair(bundle, layout, **kw):
    base = dict(num_layers=2, block_size=4, gamma=4.0, num_anchors=6, chunk_rows=0)
    base.update(kw)
    torch.manual_seed(0)
    d1 = DFlashDrafter.build(DFlashConfig(**base), bundle, layout)
    torch.manual_seed(0)
    cfg2 = DFlash2Config(**base, selector_candidates=5, selector_rank=8, conv_group_size=8)
    d2 = DFlash2Drafter.build(cfg2, bundle, layout)
    return d1, d2


def test_fresh_dflash2_equals_dflash_with_the_same_weights(setup):
    bundle, layout, batch = setup
    d1, d2 = _pair(bundle, layout)
    missing, unexpected = d2.load_state_dict(d1.state_dict(), strict=False)
    assert not unexpected and missing and all("conv" in m or m.startswith("candidate_selector.") for m in missing)
    anchors, _ = d1._anchors(batch, torch.Generator().manual_seed(3))
    ctx = d1.context(batch["taps"])
    h1 = d1.block_hidden(batch["input_ids"], ctx, anchors)
    h2 = d2.block_hidden(batch["input_ids"], d2.context(batch["taps"]), anchors)
    torch.testing.assert_close(d2.logits(h2), d1.logits(h1), rtol=0, atol=0)
    # and the backbone CE term matches DFlash's (same anchors from the same generator)
    o1 = d1(batch, torch.Generator().manual_seed(5))
    o2 = d2(batch, torch.Generator().manual_seed(5))
    torch.testing.assert_close(o2.terms["ce"][0], o1.terms["ce"][0], rtol=1e-6, atol=1e-6)
    assert o2.terms["ce"][1] == o1.terms["ce"][1]


def test_selector_starts_as_a_noop(setup):
    bundle, layout, batch = setup
    _, d2 = _pair(bundle, layout)
    anchors, _ = d2._anchors(batch, None, take_all=True)
    drafted = d2.draft_blocks(batch, anchors)
    h = d2.block_hidden(batch["input_ids"], d2.context(batch["taps"]), anchors)
    assert torch.equal(drafted[:, :, 1:], d2.logits(h[:, :, 1:]).argmax(-1))
    out = d2(batch, torch.Generator().manual_seed(0))
    assert float(out.metrics["selector_path_acc"][0]) == float(out.metrics["backbone_argmax_acc"][0])
    acc1 = DFlashDrafter.acceptance(d2, batch)  # backbone argmax path
    acc2 = d2.acceptance(batch)  # selector walk
    assert torch.equal(acc1.accepted, acc2.accepted) and torch.equal(acc1.reached, acc2.reached)


def test_loss_terms_and_gradients(setup):
    bundle, layout, batch = setup
    _, d2 = _pair(bundle, layout, kd="topk")
    out = d2(batch, torch.Generator().manual_seed(0))
    assert set(out.terms) == {"ce", "kd", "selector"}
    s, c, w = out.terms["selector"]
    # drop: only rows whose gold is a candidate count, each by its slot's position decay (< 1 past slot 1)
    assert w == 1.0 and 0 < float(c) < int(out.metrics["selector_candidate_recall"][0])
    assert float(c) < float(out.terms["ce"][1])
    loss, values = combine_terms(out.terms)
    loss.backward()
    assert d2.candidate_selector.successor_codebook.grad.abs().sum() > 0  # B = 0 at init, so only B moves first
    assert d2.layers[0].mlp_conv.kernel_projection.weight.grad.abs().sum() > 0
    assert d2.layers[0].attention_conv.base_kernel.grad.abs().sum() > 0
    d2.zero_grad()
    _, d_ins = _pair(bundle, layout)
    d_ins = DFlash2Drafter.build(dataclasses.replace(d_ins.config, selector_gold_miss="insert"), bundle, layout)
    o = d_ins(batch, torch.Generator().manual_seed(0))
    # insert: every row counts, with the backbone CE's slot weights
    torch.testing.assert_close(o.terms["selector"][1].float(), o.terms["ce"][1].float())


def _ref_conv(x, y, conv):
    """Float64 per-position loops: the taps of both sides come from the sublayer input x,
    coef[side, o, c] = base_kernel[side, o, c] + (P x_t)[side, o, c // group];
    out_t = sum_o coef * v_{t-o} within a block
    (v = x before the sublayer, y after it)."""
    Bs, L, H = x.shape
    K, gs, G = conv.kernel_size, conv.group_size, conv.groups
    P, base = conv.kernel_projection.weight.double(), conv.base_kernel.double()
    out = [torch.zeros_like(x), torch.zeros_like(x)]
    for n in range(Bs):
        for t in range(L):
            d = (P @ x[n, t]).view(2, K, G)
            for side, v in enumerate((x, y)):
                for c in range(H):
                    for o in range(K):
                        if t % conv.block_size >= o:
                            out[side][n, t, c] += (base[side, o, c] + d[side, o, c // gs]) * v[n, t - o, c]
    return out


@pytest.mark.parametrize("kernel", [2, 3])
def test_sublayer_conv_reference_and_never_crosses_blocks(kernel):
    torch.manual_seed(0)
    conv = SublayerConv(8, block_size=3, group_size=4, kernel_size=kernel).double()
    assert tuple(conv.base_kernel.shape) == (2, kernel, 8) and tuple(conv.kernel_projection.weight.shape) == (
        2 * kernel * 2, 8)
    x, y = torch.randn(2, 9, 8, dtype=torch.float64), torch.randn(2, 9, 8, dtype=torch.float64)
    x_out, dyn = conv.before(x)
    torch.testing.assert_close(x_out, x, rtol=0, atol=0)  # identity at init, both sides
    torch.testing.assert_close(conv.after(y, dyn), y, rtol=0, atol=0)
    with torch.no_grad():
        conv.kernel_projection.weight.normal_()
        conv.base_kernel.normal_()
    x_out, dyn = conv.before(x)
    ref_x, ref_y = _ref_conv(x, y, conv)
    torch.testing.assert_close(x_out, ref_x)
    torch.testing.assert_close(conv.after(y, dyn), ref_y)
    x2 = x.clone()
    x2[:, 3:6] += 1.0  # change block 1 only
    d = (conv.before(x2)[0] - conv.before(x)[0]).abs().sum(-1)
    assert bool((d[:, :3] == 0).all()) and bool((d[:, 6:] == 0).all()) and bool((d[:, 3:6] > 0).all())
    with pytest.raises(ValueError, match="divide"):
        SublayerConv(10, block_size=3, group_size=4)


@pytest.mark.parametrize("kd", ["none", "exact", "topk"])
def test_chunked_dense_loss_equals_one_chunk_values_and_gradients(setup, kd):
    """The loss's [rows, V] logits are built one checkpointed chunk at a time; chunking changes nothing."""
    bundle, layout, batch = setup
    models = []
    for chunk, budget in ((0, 1 << 20), (7, 1024)):
        torch.manual_seed(0)
        cfg = DFlash2Config(num_layers=1, block_size=4, num_anchors=6, kd=kd, chunk_rows=chunk,
                            logits_budget_mib=budget, selector_candidates=5, selector_rank=8, conv_group_size=8)
        m = DFlash2Drafter.build(cfg, bundle, layout)
        with torch.no_grad():
            for p in m.candidate_selector.parameters():
                p.add_(0.1)  # selector terms non-trivial
        models.append(m)
    one, chunked = models
    assert one.logits_chunk_rows() > 200 and chunked.logits_chunk_rows() == 7
    outs = [m(batch, torch.Generator().manual_seed(5)) for m in models]
    for name in outs[0].terms:
        torch.testing.assert_close(outs[1].terms[name][0], outs[0].terms[name][0], rtol=1e-5, atol=1e-6)
        assert int(outs[1].terms[name][1]) == int(outs[0].terms[name][1])
    for name in outs[0].metrics:
        assert float(outs[1].metrics[name][0]) == float(outs[0].metrics[name][0]), name
    for m, o in zip(models, outs):
        combine_terms(o.terms)[0].backward()
    for (n, p1), p2 in zip(one.named_parameters(), chunked.parameters()):
        torch.testing.assert_close(p2.grad, p1.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_chunk_rows_follow_the_vocabulary_and_config_is_validated():
    from types import SimpleNamespace

    cfg = DFlash2Config()
    fake = SimpleNamespace(config=cfg, vocab_size=151_936)
    assert DFlash2Drafter.logits_chunk_rows(fake) == 441  # 1 GiB / (4 copies x 4 bytes x 151,936)
    with pytest.raises(ValueError, match="logits_budget_mib"):
        DFlash2Config(logits_budget_mib=0)
    with pytest.raises(ValueError, match="selector_gold_miss"):
        DFlash2Config(selector_gold_miss="skip")
    cfg = load_run_config("dflash2", overrides=["max_steps=3"])
    assert isinstance(cfg.drafter, DFlash2Config) and cfg.drafter.selector_candidates == 16
    assert cfg.drafter.selector_rank == 256 and cfg.drafter.selector_gold_miss == "drop"


def test_exact_kd_equals_dflash_fused_path(setup):
    bundle, layout, batch = setup
    d1, d2 = _pair(bundle, layout, kd="exact")
    d2.load_state_dict(d1.state_dict(), strict=False)
    o1 = d1(batch, torch.Generator().manual_seed(5))
    o2 = d2(batch, torch.Generator().manual_seed(5))
    assert float(o1.terms["kd"][0].detach()) > 0
    torch.testing.assert_close(o2.terms["kd"][0], o1.terms["kd"][0], rtol=1e-5, atol=1e-6)
