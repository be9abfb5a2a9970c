"""LiLiCorr: its lattice loss and penalty against a float64 reference, the top-k penalty's bound, its drafts against
vLLM's scorer and walk re-implemented in float64 on the export alone, the export's tensors and shapes, refusals, and
`tapdraft train --recipe lilicorr` (lilicorr_topk, lilicorr_conv)."""

import dataclasses
import json
import math

import pytest
import torch
from typer.testing import CliRunner

from tapdraft.cli import app
from tapdraft.shards.head import teacher_logits
from tests.train.dflash_fixtures import (away_from_init, synthetic_samples, tiny_bundle, tiny_layout,
                                         write_synthetic_dataset)
from tests.train.lilicorr_reference import vllm_greedy_walk, vllm_scores
from tapdraft.train.data import collate
from tapdraft.train.drafters.base import combine_terms, get_family
from tapdraft.train.drafters.common.export_files import load_export
from tapdraft.train.drafters.lilicorr.config import LiLiCorrConfig
from tapdraft.train.drafters.lilicorr.model import LiLiCorrDrafter, topk_bound
from tapdraft.train.export import export_drafter

B, K = 5, 16


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    bundle = tiny_bundle(tmp_path_factory.mktemp("lilicorr"))
    layout = tiny_layout(bundle, final_hidden=True)
    batch = collate(synthetic_samples(bundle, layout, 3, seed=1))
    return bundle, layout, batch


def drafter(bundle, layout, **kw) -> LiLiCorrDrafter:
    base = dict(num_layers=1, block_size=B, gamma=3.0, num_anchors=8, candidate_topk=K, lattice_heads=2,
                lattice_hidden=16, factor_dim=8, chunk_rows=5, target_layer_ids=(1, 3), logit_scale=4.0)
    base.update(kw)
    torch.manual_seed(0)
    return LiLiCorrDrafter.build(LiLiCorrConfig(**base), bundle, layout)


def with_exact_topk(m, batch, k: int):
    """``batch`` with top-k teacher rows made from the exact ones (k ids per row; every row stored)."""
    lp = torch.log_softmax(teacher_logits(batch["final_hidden"].float(), m.target.norm_weight, m.target.lm_head,
                                          m.head_spec), -1)
    v, i = lp.sort(-1, descending=True)
    return dict(batch, topk_ids=i[..., :k], topk_logprobs=v[..., :k],
                topk_valid=torch.ones(lp.shape[:2], dtype=torch.bool)), lp


def lattice_ref(m, weights, dcfg, ids, ctx, h_BH, anchor):
    """Candidates [S, k] and vLLM's scores [S, k, k] in float64 for one block (draft hidden h_BH, rows 0..B-1)."""
    lp = torch.log_softmax(h_BH[1:].double() @ m.target.lm_head.double().T, -1)
    logp, cand = lp.topk(dcfg["lilicorr_candidate_topk"], -1)
    tok = m.target.embed_tokens.double()[cand]
    ok = anchor >= 1
    scores = vllm_scores(weights, dcfg, m.eps, tok, logp, h_BH[1:], ctx[max(anchor - 1, 0)] * float(ok), ok)
    return cand, scores


@torch.no_grad()
def reference_terms(m, batch, anchors, vblk, p_of) -> dict[str, tuple[float, float]]:
    """The lattice CE and the penalty written out slot by slot in float64: slot s of anchor a (DFlash slot s + 1)
    predicts ids[a + s + 1]; its row is the scores given the index of ids[a + s] in slot s - 1's candidates (slot
    0: the start row); CE over the k candidates where gold is among them; penalty 1 - sum_j min(p_j, q_j), p from
    ``p_of(b, row, cand)``; weights exp(-s / gamma)."""
    weights = {f"lilicorr.{k}": v for k, v in m.lilicorr.state_dict().items()}
    dcfg = m.export_config()["dflash_config"]
    ids, lm, L = batch["input_ids"], batch["loss_mask"], batch["lengths"]
    ctx = m.context(batch["taps"]).double()
    h = m.block_hidden(ids, m.context(batch["taps"]), anchors).double()
    sums = {"lattice": [0.0, 0.0], "penalty": [0.0, 0.0]}
    for b in range(ids.shape[0]):
        for n in range(anchors.shape[1]):
            if not bool(vblk[b, n]):
                continue
            a = int(anchors[b, n])
            cand, scores = lattice_ref(m, weights, dcfg, ids, ctx[b], h[b, n], a)
            prev_idx, prev_ok = 0, True
            for s in range(B - 1):
                t = a + s + 1
                gold = int(ids[b, t]) if t < ids.shape[1] else -1
                hits = (cand[s] == gold).nonzero()
                if t < int(L[b]) and bool(lm[b, t]) and prev_ok:
                    w = math.exp(-s / m.config.gamma)
                    row = scores[s, prev_idx]
                    q = torch.softmax(row, -1)
                    if len(hits):
                        sums["lattice"][0] += w * -float(torch.log(q[int(hits[0])]))
                        sums["lattice"][1] += w
                    p = p_of(b, a + s, cand[s])
                    sums["penalty"][0] += w * (1.0 - float(torch.minimum(p, q).sum()))
                    sums["penalty"][1] += w
                prev_ok, prev_idx = bool(len(hits)), (int(hits[0]) if len(hits) else 0)
    return {k: (s, c) for k, (s, c) in sums.items()}


CONV = dict(conv_kernel_size=2, conv_group_size=8)  # lilicorr_conv: DFlash2's convolutions in the backbone


@pytest.mark.parametrize("variant", [{}, CONV], ids=["lilicorr", "lilicorr_conv"])
def test_loss_equals_a_float64_reference(setup, variant):
    bundle, layout, batch = setup
    m = away_from_init(drafter(bundle, layout, **variant), 0.3).double()  # far enough that every lattice bias matters
    out = m(batch, torch.Generator().manual_seed(5))
    anchors, vblk = m._anchors(batch, torch.Generator().manual_seed(5))
    fh = batch["final_hidden"].double()

    def p_exact(b, row, cand):
        z = teacher_logits(fh[b, row][None], m.target.norm_weight.double(), m.target.lm_head.double(), m.head_spec)
        return torch.softmax(z[0].double(), -1)[cand]

    ref = reference_terms(m, batch, anchors, vblk, p_exact)
    assert ref["lattice"][1] > 0 and ref["penalty"][1] > ref["lattice"][1]
    for name in ("lattice", "penalty"):
        s, c, _ = out.terms[name]
        assert float(c) == pytest.approx(ref[name][1], rel=1e-7), name  # slot weights are float32, as DFlash's
        assert float(s.detach()) == pytest.approx(ref[name][0], rel=1e-7), name
    assert {n: w for n, (_, _, w) in out.terms.items()} == {"ce": 1.0, "lattice": 1.0, "penalty": 1.0}
    loss, _ = combine_terms(out.terms)
    loss.backward()
    for name in ("pass_hidden_proj.weight", "in_head.weight", "anchor_out_head.weight", "relative_slot_bias"):
        assert m.lilicorr.get_parameter(name).grad.abs().sum() > 0, name
    assert m.fc.weight.grad.abs().sum() > 0


def test_topk_bound_is_never_below_the_exact_probability(setup):
    """For every candidate outside the stored top-k, min(smallest stored p, tail) >= its exact p; inside, it is
    the stored p. So the top-k penalty never exceeds the exact one, row by row and in total."""
    bundle, layout, batch = setup
    m = away_from_init(drafter(bundle, layout), 0.05)
    for kt in (1, 3, 12):
        stored, lp = with_exact_topk(m, batch, kt)
        V = lp.shape[-1]
        rows = lp.reshape(-1, V)
        cand = torch.stack([torch.randperm(V, generator=torch.Generator().manual_seed(i))[:K]
                            for i in range(rows.shape[0])])
        bound = topk_bound(stored["topk_ids"].reshape(rows.shape[0], kt),
                           stored["topk_logprobs"].reshape(rows.shape[0], kt), cand)
        exact = rows.double().exp().gather(-1, cand)
        assert bool((bound >= exact).all()), kt
        inside = (cand[:, :, None] == stored["topk_ids"].reshape(rows.shape[0], 1, kt)).any(-1)
        assert inside.any() and (~inside).any()
        torch.testing.assert_close(bound[inside], exact[inside], rtol=1e-12, atol=0)
        ex = m(stored, torch.Generator().manual_seed(2))
        tk = drafter(bundle, layout, penalty="topk_bound")
        tk.load_state_dict(m.state_dict())
        bo = tk(stored, torch.Generator().manual_seed(2))
        assert float(bo.terms["penalty"][1]) == float(ex.terms["penalty"][1])
        assert float(bo.terms["penalty"][0].detach()) <= float(ex.terms["penalty"][0].detach()) + 1e-6
    full, _ = with_exact_topk(m, batch, 64)  # every id stored: the bound path is the exact teacher
    tk = drafter(bundle, layout, penalty="topk_bound")
    tk.load_state_dict(m.state_dict())
    torch.testing.assert_close(tk(full, torch.Generator().manual_seed(2)).terms["penalty"][0],
                               m(full, torch.Generator().manual_seed(2)).terms["penalty"][0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", [{}, CONV], ids=["lilicorr", "lilicorr_conv"])
def test_drafts_equal_vllms_scorer_and_walk_on_the_export(setup, tmp_path, variant):
    bundle, layout, batch = setup
    m = away_from_init(drafter(bundle, layout, **variant), 0.2)
    export_drafter(m, tmp_path, {})
    cfg, weights = load_export(tmp_path)
    dcfg = cfg["dflash_config"]
    changed = 0
    for b, P in ((0, 5), (0, 9), (1, 14), (2, 20), (1, 7), (2, 11)):
        ids, taps = batch["input_ids"][b, : P + 1], batch["taps"][b, :P]
        tokens, q = m.propose(ids, taps)
        assert q is None and tokens.shape == (B - 1,)
        bb, anchors = m._live_block(ids, taps)
        ctx = m.context(bb["taps"])
        h = m.block_hidden(bb["input_ids"], ctx, anchors)[0, 0]
        cand, scores = lattice_ref(m, weights, dcfg, ids, ctx[0].double(), h.double(), P)
        mine = m.lattice(bb["input_ids"], ctx, anchors, h[None, None])[1][0, 0]
        torch.testing.assert_close(mine.double(), scores, rtol=1e-4, atol=1e-4)
        assert tokens.tolist() == vllm_greedy_walk(scores, cand)
        changed += tokens.tolist() != cand[:, 0].tolist()
    assert changed  # the walk is not the backbone's argmax


def test_sampled_drafts_carry_their_lattice_distribution(setup):
    bundle, layout, batch = setup
    m = away_from_init(drafter(bundle, layout), 0.2)
    ids, taps = batch["input_ids"][1, :12], batch["taps"][1, :11]
    tokens, q = m.propose(ids, taps, temperature=0.7, generator=torch.Generator().manual_seed(3))
    assert q.shape == (B - 1, m.vocab_size)
    torch.testing.assert_close(q.sum(-1).double(), torch.ones(B - 1, dtype=torch.float64))
    bb, anchors = m._live_block(ids, taps)
    ctx = m.context(bb["taps"])
    h = m.block_hidden(bb["input_ids"], ctx, anchors)
    cand, scores = m.lattice(bb["input_ids"], ctx, anchors, h)
    prev = 0
    for s in range(B - 1):
        want = torch.softmax(scores[0, 0, s, prev].double() / 0.7, -1)
        torch.testing.assert_close(q[s].double()[cand[0, 0, s]], want, rtol=1e-5, atol=1e-6)
        assert int(tokens[s]) in cand[0, 0, s].tolist() and float(q[s].sum()) == pytest.approx(1.0, abs=1e-5)
        prev = cand[0, 0, s].tolist().index(int(tokens[s]))


def test_teacher_forced_drafts_are_the_walk_while_it_follows_the_reply(setup):
    bundle, layout, batch = setup
    m = away_from_init(drafter(bundle, layout), 0.2)
    anchors, vblk = m.eval_anchors(batch)
    tf = m.draft_slots(batch, m.context(batch["taps"]), anchors)
    labels, valid, _ = m._targets(batch, anchors, vblk)
    checked = 0
    for b in range(anchors.shape[0]):
        for n in range(0, anchors.shape[1], 3):
            if not bool(vblk[b, n]):
                continue
            P = int(anchors[b, n])
            walked, _ = m.propose(batch["input_ids"][b, : P + 1], batch["taps"][b, :P])
            for k in range(B - 1):
                assert int(walked[k]) == int(tf[b, n, k])
                checked += 1
                if not (bool(valid[b, n, k]) and int(labels[b, n, k]) == int(tf[b, n, k])):
                    break
    assert checked > 0


def test_sampled_acceptance_of_slot_0_written_out(setup):
    """sum_j min(p_j, q_j) at slot 0 (p: the target's exact row a at temperature T, q: softmax(start / T) over the
    candidates), written out in float64 for every valid block; counts are the valid slots."""
    bundle, layout, batch = setup
    m = away_from_init(drafter(bundle, layout), 0.3)
    T = 0.8
    sums, counts = m.sampled_acceptance(batch, temperature=T)
    anchors, vblk = m.eval_anchors(batch)
    _, valid, _ = m._targets(batch, anchors, vblk)
    assert counts.tolist() == valid.sum((0, 1)).double().tolist()
    weights = {f"lilicorr.{k}": v for k, v in m.lilicorr.state_dict().items()}
    dcfg = m.export_config()["dflash_config"]
    want = 0.0
    with torch.no_grad():
        ctx = m.context(batch["taps"])
        h = m.block_hidden(batch["input_ids"], ctx, anchors)
        for b, n in zip(*torch.nonzero(valid[:, :, 0], as_tuple=True)):
            a = int(anchors[b, n])
            cand, scores = lattice_ref(m, weights, dcfg, None, ctx[b].double(), h[b, n].double(), a)
            z = teacher_logits(batch["final_hidden"][b, a][None].double(), m.target.norm_weight.double(),
                               m.target.lm_head.double(), m.head_spec)[0]
            p = torch.softmax(z / T, -1)[cand[0]]
            want += float(torch.minimum(p, torch.softmax(scores[0, 0] / T, -1)).sum())
    assert float(sums[0]) == pytest.approx(want, rel=1e-4)


def test_export_is_vllms_lilicorr_layout(setup, tmp_path):
    """Every lilicorr tensor vLLM 0.32's LiLiCorrHead declares, with its shape (lilicorr.py), and nothing else."""
    bundle, layout, _ = setup
    m = drafter(bundle, layout, lattice_layers=2)
    export_drafter(m, tmp_path, {})
    cfg, weights = load_export(tmp_path)
    assert cfg["architectures"] == ["LiLiCorrDraftModel"] and "auto_map" not in cfg
    assert cfg["tapdraft"]["serve_with"]["vllm"] == {"method": "dflash", "num_speculative_tokens": B - 1}
    d = cfg["dflash_config"]
    assert (d["block_size"], d["lilicorr_enabled"], d["lilicorr_candidate_topk"], d["lilicorr_num_layers"]) == \
        (B, True, K, 2)
    Hm, H, f, nh, S = m.hidden_size, 16, 8, 2, B - 1
    mid = int(H * d["lilicorr_mlp_ratio"])
    want = {"token_proj.weight": (H, Hm), "token_proj.bias": (H,), "pass_hidden_proj.weight": (H, Hm),
            "pass_hidden_proj.bias": (H,), "feature_norm.weight": (5,), "feature_norm.bias": (5,),
            "feature_mlp.up_proj.weight": (H, 5), "feature_mlp.up_proj.bias": (H,),
            "feature_mlp.down_proj.weight": (H, H), "feature_mlp.down_proj.bias": (H,),
            "slot_embedding": (1, 1, S, 1, H), "rank_embedding": (1, 1, 1, K, H),
            "relative_slot_bias": (nh, 2 * B - 1), "same_slot_bias": (nh,), "context_proj.weight": (H, Hm),
            "context_proj.bias": (H,), "output_norm.weight": (H,), "anchor_norm.weight": (H,),
            "factor_input_proj.weight": (H, 3 * H), "factor_input_proj.bias": (H,)}
    for name in ("out_head", "in_head", "anchor_out_head"):
        want.update({f"{name}.weight": (f, H), f"{name}.bias": (f,)})
    for i in range(2):
        p = f"layers.{i}"
        want.update({f"{p}.attn_norm.weight": (H,), f"{p}.attn.in_proj_weight": (3 * H, H),
                     f"{p}.attn.in_proj_bias": (3 * H,), f"{p}.attn.out_proj.weight": (H, H),
                     f"{p}.attn.out_proj.bias": (H,), f"{p}.mlp_norm.weight": (H,), f"{p}.mlp.up_proj.weight": (mid, H),
                     f"{p}.mlp.up_proj.bias": (mid,), f"{p}.mlp.down_proj.weight": (H, mid),
                     f"{p}.mlp.down_proj.bias": (H,)})
    have = {k.removeprefix("lilicorr."): tuple(v.shape) for k, v in weights.items() if k.startswith("lilicorr.")}
    assert have == want
    assert "fc.weight" in weights and not any(k.startswith(("embed_tokens", "lm_head")) for k in weights)
    same = drafter(bundle, layout, lattice_hidden=None)
    export_drafter(same, tmp_path / "same", {})
    cfg2, w2 = load_export(tmp_path / "same")
    assert cfg2["dflash_config"]["lilicorr_hidden_size"] == Hm and "lilicorr.token_proj.weight" not in w2


def test_conv_variant_is_dflash2s_backbone_under_the_lattice(setup, tmp_path):
    """lilicorr_conv starts as the identity of LiLiCorr (the same loss from the same weights) and exports DFlash2's
    convolution tensors, names and shapes those of a DFlash2 export, with the geometry vLLM's LiLiCorr reads."""
    from tapdraft.train.drafters.dflash2.config import DFlash2Config
    from tapdraft.train.drafters.dflash2.model import DFlash2Drafter

    bundle, layout, batch = setup
    plain, conv = drafter(bundle, layout), drafter(bundle, layout, **CONV)
    missing, unexpected = conv.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and missing and all("_conv." in k for k in missing)
    a, b = plain(batch, torch.Generator().manual_seed(1)), conv(batch, torch.Generator().manual_seed(1))
    for name in ("ce", "lattice", "penalty"):
        torch.testing.assert_close(b.terms[name][0], a.terms[name][0], rtol=1e-6, atol=1e-6)
    export_drafter(conv, tmp_path / "conv", {})
    cfg, weights = load_export(tmp_path / "conv")
    assert (cfg["dflash_config"]["conv_kernel_size"], cfg["dflash_config"]["conv_group_size"]) == (2, 8)
    torch.manual_seed(0)
    d2 = DFlash2Drafter.build(DFlash2Config(num_layers=1, block_size=B, conv_kernel_size=2, conv_group_size=8,
                                            target_layer_ids=(1, 3)), bundle, layout)
    export_drafter(d2, tmp_path / "d2", {})
    _, w2 = load_export(tmp_path / "d2")
    convs = {k: tuple(v.shape) for k, v in weights.items() if "_conv." in k}
    assert convs and convs == {k: tuple(v.shape) for k, v in w2.items() if "_conv." in k}
    assert {k for k in weights if not k.startswith("lilicorr.")} == {k for k in w2 if not k.startswith("candidate_")}
    _, plain_w = load_export(export_drafter(plain, tmp_path / "plain", {}))
    assert not any("_conv." in k for k in plain_w)


@pytest.mark.parametrize("kw, msg", [
    (dict(conv_kernel_size=2), "both 0"),
    (dict(conv_group_size=16), "both 0"),
    (dict(candidate_topk=6), "power of two"),
    (dict(candidate_topk=32), "power of two"),
    (dict(block_size=2), "block_size >= 3"),
    (dict(penalty="none"), "penalty must be"),
    (dict(draft_vocab=16), "full target vocabulary"),
    (dict(penalty_weight=-1.0), "penalty_weight"),
])
def test_config_refusals(kw, msg):
    with pytest.raises(ValueError, match=msg):
        LiLiCorrConfig(**kw)


@pytest.mark.parametrize("head", [dict(final_logit_softcap=30.0), dict(logits_scaling=2.0)])
def test_targets_vllms_lilicorr_cannot_serve_as_trained_are_refused(setup, head):
    bundle, layout, _ = setup
    other = dataclasses.replace(bundle, head=dataclasses.replace(bundle.head, **head))
    with pytest.raises(ValueError, match="no bias, soft cap or scaling"):
        drafter(other, layout)


def test_penalty_sources_need_their_fields(setup):
    bundle, _, _ = setup
    with pytest.raises(ValueError, match="penalty='topk_bound' needs"):
        drafter(bundle, tiny_layout(bundle, top_k=0, final_hidden=True), penalty="topk_bound")
    with pytest.raises(ValueError, match="penalty='exact'"):
        drafter(bundle, tiny_layout(bundle, tap_ids=(0, 1), final_hidden=False), target_layer_ids=(0, 1))


def test_family_is_registered():
    assert get_family("lilicorr") == (LiLiCorrConfig, LiLiCorrDrafter)


@pytest.mark.parametrize("recipe", ["lilicorr", "lilicorr_topk", "lilicorr_conv"])
def test_train_recipe_trains_exports_and_evaluates(tmp_path, recipe):
    bundle = tiny_bundle(tmp_path / "ds")
    layout = tiny_layout(bundle, final_hidden=recipe != "lilicorr_topk")
    samples = synthetic_samples(bundle, layout, 8, min_len=16, max_len=24)
    ds = write_synthetic_dataset(tmp_path / "ds", bundle, layout, {"train": samples[:6], "validation": samples[6:]},
                                 regenerated=False)
    run = str(tmp_path / "run")
    r = CliRunner().invoke(app, ["train", "--data", ds, "--recipe", recipe, "--out", run, "--set",
                                 "max_steps=3", "--set", "max_tokens=160", "--set", "progress=false", "--set",
                                 "drafter.lattice_hidden=16", "--set", "drafter.factor_dim=8"])
    assert r.exit_code == 0, r.output
    assert r.output.startswith("trained lilicorr to step 3 of 3")
    r = CliRunner().invoke(app, ["eval", "--draft", run, "--data", ds])
    assert r.exit_code == 0, r.output
    assert "tau = " in r.output
    r = CliRunner().invoke(app, ["export", "--draft", run, "--out", str(tmp_path / "exp")])
    assert r.exit_code == 0, r.output
    cfg = json.loads((tmp_path / "exp" / "config.json").read_text())
    assert cfg["architectures"] == ["LiLiCorrDraftModel"] and cfg["dflash_config"]["block_size"] == 16
