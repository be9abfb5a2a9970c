"""DSpark: its loss against a float64 reference, its drafts against a float64 re-implementation of vLLM's walk run
on the export alone, its alignment, export layout and refusals, and `tapdraft train --recipe dspark_demo`."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from tapdraft.cli import app
from tapdraft.shards.head import teacher_logits
from tests.train.dflash_fixtures import (away_from_init, synthetic_samples, tiny_bundle, tiny_layout,
                                         write_synthetic_dataset)
from tapdraft.train.data import collate
from tapdraft.train.drafters.base import combine_terms, get_family
from tapdraft.train.drafters.common.export_files import load_export
from tapdraft.train.drafters.dspark.config import DSparkConfig
from tapdraft.train.drafters.dspark.model import DSparkDrafter
from tapdraft.train.export import export_drafter

B, RANK = 4, 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    bundle = tiny_bundle(tmp_path_factory.mktemp("dspark"))
    layout = tiny_layout(bundle, final_hidden=True)
    batch = collate(synthetic_samples(bundle, layout, 3, seed=1))
    return bundle, layout, batch


def drafter(bundle, layout, **kw) -> DSparkDrafter:
    base = dict(num_layers=1, block_size=B, gamma=3.0, num_anchors=6, markov_rank=RANK, confidence_head=True,
                chunk_rows=5, target_layer_ids=(1, 3))
    base.update(kw)
    torch.manual_seed(0)
    return DSparkDrafter.build(DSparkConfig(**base), bundle, layout)


@torch.no_grad()
def reference_terms(m: DSparkDrafter, batch, anchors, vblk) -> dict[str, tuple[float, float]]:
    """The DSpark loss written out slot by slot in float64 (ModelOpt's hf_dspark.py ``_compute_dspark_loss``):
    slot k of anchor a predicts ids[a + k + 1] from lm_head(h_k) + W2 W1[ids[a + k]], weight exp(-k / gamma);
    teacher row a + k; L1 = sum |p - q|; confidence BCE towards 1 - L1 / 2."""
    ids, lm, L, fh = batch["input_ids"], batch["loss_mask"], batch["lengths"], batch["final_hidden"].double()
    h = m.block_hidden(ids, m.context(batch["taps"]), anchors).double()
    W1, W2 = m.markov_head.markov_w1.weight.double(), m.markov_head.markov_w2.weight.double()
    cw, cb = m.confidence_head.proj.weight.double()[0], m.confidence_head.proj.bias.double()[0]
    lm_head = m.target.lm_head.double()
    sums = {"ce": [0.0, 0.0], "l1": [0.0, 0.0], "confidence": [0.0, 0.0]}
    for b in range(ids.shape[0]):
        for n in range(anchors.shape[1]):
            a = int(anchors[b, n])
            for k in range(B):
                t = a + k + 1
                if not (bool(vblk[b, n]) and t < int(L[b]) and bool(lm[b, t])):
                    continue
                w = math.exp(-k / m.config.gamma)
                prev = int(ids[b, a + k])
                z = h[b, n, k] @ lm_head.T + W2 @ W1[prev]
                q = torch.softmax(z, -1)
                row = teacher_logits(fh[b, a + k][None], m.target.norm_weight.double(), lm_head, m.head_spec)
                p = torch.softmax(row[0].double(), -1)
                l1 = float((p - q).abs().sum())
                c = float(torch.cat([h[b, n, k], W1[prev]]) @ cw + cb)
                y = 1.0 - l1 / 2
                bce = -(y * math.log(1 / (1 + math.exp(-c))) + (1 - y) * math.log(1 - 1 / (1 + math.exp(-c))))
                for name, v in (("ce", -float(torch.log(q[int(ids[b, t])]))), ("l1", l1), ("confidence", bce)):
                    sums[name][0] += w * v
                    sums[name][1] += w
    return {k: (s, c) for k, (s, c) in sums.items()}


def test_loss_equals_a_float64_reference(setup):
    bundle, layout, batch = setup
    m = away_from_init(drafter(bundle, layout, kd="exact"), 0.05).double()
    out = m(batch, torch.Generator().manual_seed(5))
    anchors, vblk = m._anchors(batch, torch.Generator().manual_seed(5))
    ref = reference_terms(m, batch, anchors, vblk)
    assert ref["ce"][1] > 0
    for name in ("ce", "l1", "confidence"):
        s, c, _ = out.terms[name]
        # the slot weights are stored in float32 (as for DFlash); everything else is float64 here
        assert float(c) == pytest.approx(ref[name][1], rel=1e-7)
        assert float(s.detach()) == pytest.approx(ref[name][0], rel=1e-7), name
    weights = {n: w for n, (_, _, w) in out.terms.items()}
    assert weights == {"ce": 0.1, "l1": 0.9, "confidence": 1.0}
    loss, values = combine_terms(out.terms)
    loss.backward()
    assert m.markov_head.markov_w1.weight.grad.abs().sum() > 0 and m.confidence_head.proj.weight.grad.abs().sum() > 0


def test_topk_teacher_reads_the_same_rows_as_the_exact_one(setup):
    """With every id stored (k = V, no tail bin) the stored teacher is the exact one: the L1 terms agree only if
    both read row a + k for slot k."""
    bundle, layout, batch = setup
    exact = drafter(bundle, layout, kd="exact")
    topk = drafter(bundle, layout, kd="topk")
    topk.load_state_dict(exact.state_dict())
    lp = torch.log_softmax(teacher_logits(batch["final_hidden"].float(), exact.target.norm_weight, exact.target.lm_head,
                                          exact.head_spec), -1)  # [Bs, T, V]
    full = dict(batch, topk_ids=lp.argsort(-1, descending=True), topk_logprobs=lp.sort(-1, descending=True).values,
                topk_valid=torch.ones(lp.shape[:2], dtype=torch.bool))
    oe = exact(full, torch.Generator().manual_seed(2))
    ot = topk(full, torch.Generator().manual_seed(2))
    assert torch.equal(oe.terms["ce"][0], ot.terms["ce"][0])
    torch.testing.assert_close(ot.terms["l1"][0], oe.terms["l1"][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ot.terms["confidence"][0], oe.terms["confidence"][0], rtol=1e-5, atol=1e-5)


def vllm_walk(weights, base_KV: torch.Tensor, anchor: int) -> list[int]:
    """vLLM 0.32's greedy DSpark drafting (vllm/v1/worker/gpu/spec_decode/dspark/speculator.py,
    ``DSparkSpeculator._sample_sequential``), re-implemented in float64 on the export's tensors:
    prev = the anchor; per slot i, logits = base[i] + markov_w2(markov_w1[prev]) (logit_scale 1), argmax, fed back."""
    W1 = weights["markov_head.markov_w1.weight"].double()
    W2 = weights["markov_head.markov_w2.weight"].double()
    prev, out = anchor, []
    for i in range(base_KV.shape[0]):
        tok = int((base_KV[i].double() + W2 @ W1[prev]).argmax())
        out.append(tok)
        prev = tok
    return out


def test_drafts_equal_vllms_walk_on_the_export(setup, tmp_path):
    bundle, layout, batch = setup
    m = away_from_init(drafter(bundle, layout), 0.05)
    with torch.no_grad():  # a Markov bias strong enough to change drafts
        m.markov_head.markov_w2.weight.mul_(40.0)
    export_drafter(m, tmp_path, {})
    _, weights = load_export(tmp_path)
    changed = 0
    for P in (5, 9, 14, 20):
        ids, taps = batch["input_ids"][0, : P + 1], batch["taps"][0, :P]
        tokens, q = m.propose(ids, taps)
        assert q is None and tokens.shape == (B,)
        b, anchors = m._live_block(ids, taps)
        base = m.logits(m.block_hidden(b["input_ids"], m.context(b["taps"]), anchors)[0, 0])
        assert tokens.tolist() == vllm_walk(weights, base, int(ids[P]))
        changed += tokens.tolist() != base.argmax(-1).tolist()
    assert changed  # the walk is not the backbone's argmax


def test_sampled_drafts_carry_the_distribution_of_their_own_prefix(setup):
    bundle, layout, batch = setup
    m = away_from_init(drafter(bundle, layout), 0.05)
    ids, taps = batch["input_ids"][1, :12], batch["taps"][1, :11]
    tokens, q = m.propose(ids, taps, temperature=0.7, generator=torch.Generator().manual_seed(3))
    b, anchors = m._live_block(ids, taps)
    h = m.block_hidden(b["input_ids"], m.context(b["taps"]), anchors)[0, 0]
    prev = torch.cat([ids[-1:], tokens[:-1]])
    want = torch.softmax(m.slot_logits(h, prev, 0.7).double(), -1)
    torch.testing.assert_close(q.double(), want, rtol=1e-5, atol=1e-6)


def test_teacher_forced_drafts_are_the_walk_while_it_follows_the_reply(setup):
    """Replay counts slot k only after slots < k matched the reply, where the walk's predecessor IS the reply's
    token: so teacher-forced slot k equals the walk's slot k on every block whose slots < k were right."""
    bundle, layout, batch = setup
    m = away_from_init(drafter(bundle, layout), 0.05)
    anchors, vblk = m.eval_anchors(batch)
    tf = m.draft_slots(batch, m.context(batch["taps"]), anchors)
    labels, valid, _ = m._targets(batch, anchors, vblk)
    checked = 0
    for b in range(anchors.shape[0]):
        for n in range(anchors.shape[1]):
            if not bool(vblk[b, n]):
                continue
            P = int(anchors[b, n])
            walked, _ = m.propose(batch["input_ids"][b, : P + 1], batch["taps"][b, :P])
            for k in range(B):
                assert int(walked[k]) == int(tf[b, n, k])
                checked += 1
                if not (bool(valid[b, n, k]) and int(labels[b, n, k]) == int(tf[b, n, k])):
                    break
    assert checked > 0


def test_sampled_acceptance_of_slot_0_written_out(setup):
    """sum_v min(p, q) at slot k: p the target's exact row a + k, q the corrected slot distribution given the
    reply's token at a + k; written out for slot 0 of every valid block."""
    bundle, layout, batch = setup
    m = away_from_init(drafter(bundle, layout), 0.05)
    T = 0.8
    sums, counts = m.sampled_acceptance(batch, temperature=T)
    anchors, vblk = m.eval_anchors(batch)
    _, valid, _ = m._targets(batch, anchors, vblk)
    assert counts.tolist() == valid.sum((0, 1)).double().tolist()
    with torch.no_grad():
        h = m.block_hidden(batch["input_ids"], m.context(batch["taps"]), anchors)
        want = 0.0
        for b, n in zip(*torch.nonzero(valid[:, :, 0], as_tuple=True)):
            a = int(anchors[b, n])
            p = torch.softmax(m.target.logits(batch["final_hidden"][b, a][None].float())[0].double() / T, -1)
            q = torch.softmax(m.slot_logits(h[b, n, 0][None], batch["input_ids"][b, a][None], T)[0].double(), -1)
            want += float(torch.minimum(p, q).sum())
    assert float(sums[0]) == pytest.approx(want, rel=1e-5)


def test_slot_alignment_and_weights(setup):
    bundle, layout, batch = setup
    m = drafter(bundle, layout)
    anchors = torch.tensor([[3, 7]] * batch["input_ids"].shape[0])
    labels, valid, tpos = m._targets(batch, anchors, torch.ones_like(anchors, dtype=torch.bool))
    assert tpos[0, 0].tolist() == [4, 5, 6, 7]  # slot 0 predicts anchor + 1
    assert labels[0, 1].tolist() == batch["input_ids"][0, 8:12].tolist()
    assert m.predecessors(batch["input_ids"], tpos)[0, 0].tolist() == batch["input_ids"][0, 3:7].tolist()
    torch.testing.assert_close(m.weights_k, torch.exp(-torch.arange(B) / 3.0))


def test_export_is_vllms_qwen3_dspark_layout(setup, tmp_path):
    bundle, layout, _ = setup
    m = drafter(bundle, layout)
    export_drafter(m, tmp_path / "native", {})
    cfg, weights = load_export(tmp_path / "native")
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and "auto_map" not in cfg
    assert cfg["block_size"] == B and cfg["tapdraft"]["serve_with"]["vllm"] == {"method": "dspark",
                                                                               "num_speculative_tokens": B}
    assert (cfg["markov_rank"], cfg["markov_head_type"], cfg["sample_from_anchor"], cfg["dspark_bonus_anchor"]) == \
        (RANK, "vanilla", True, False)
    assert cfg["enable_confidence_head"] and cfg["confidence_head_with_markov"] and cfg["use_aux_hidden_state"]
    V, H = m.vocab_size, m.hidden_size
    assert weights["markov_head.markov_w1.weight"].shape == (V, RANK)
    assert weights["markov_head.markov_w2.weight"].shape == (V, RANK)
    assert weights["confidence_head.proj.weight"].shape == (1, H + RANK)
    assert weights["confidence_head.proj.bias"].shape == (1,)
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in weights)
    omni = export_drafter(m, tmp_path / "omni", {}, layout="qwen3_omni")
    cfg2, w2 = load_export(omni)
    assert cfg2["architectures"] == ["Qwen3OmniDSparkModel"] and sorted(w2) == sorted(weights)
    with pytest.raises(ValueError, match="qwen3_omni"):
        export_drafter(m, tmp_path / "bad", {}, layout="speculators")


@pytest.mark.parametrize("kw, msg", [
    (dict(kd="none"), "kd must be 'topk' or 'exact'"),
    (dict(markov_head_type="gated"), "vanilla Markov head only"),
    (dict(markov_head_type="rnn"), "vanilla Markov head only"),
    (dict(markov_rank=0), "markov_rank"),
    (dict(draft_vocab=16, kd="exact"), "draft_vocab is DFlash-only"),
    (dict(tv_weight=-1.0), "tv_weight"),
])
def test_config_refusals(kw, msg):
    with pytest.raises(ValueError, match=msg):
        DSparkConfig(**kw)


@pytest.mark.parametrize("head, msg", [
    (dict(final_logit_softcap=30.0), "no lm_head bias or soft cap"),
    (dict(logits_scaling=2.0), "set confidence_head false"),
])
def test_targets_vllms_dspark_cannot_serve_as_trained_are_refused(setup, head, msg):
    import dataclasses

    bundle, layout, _ = setup
    other = dataclasses.replace(bundle, head=dataclasses.replace(bundle.head, **head))
    with pytest.raises(ValueError, match=msg):
        DSparkDrafter.build(DSparkConfig(num_layers=1, block_size=B, markov_rank=RANK, confidence_head=True,
                                         target_layer_ids=(1, 3)), other, layout)


def test_family_is_registered():
    assert get_family("dspark") == (DSparkConfig, DSparkDrafter)


@pytest.mark.parametrize("recipe, block", [("dspark", 16), ("dspark_demo", 8)])
def test_train_recipe_trains_exports_and_evaluates(tmp_path, recipe, block):
    bundle = tiny_bundle(tmp_path / "ds")
    layout = tiny_layout(bundle)
    samples = synthetic_samples(bundle, layout, 8, min_len=16, max_len=24)
    ds = write_synthetic_dataset(tmp_path / "ds", bundle, layout, {"train": samples[:6], "validation": samples[6:]},
                                 regenerated=False)
    run = str(tmp_path / "run")
    r = CliRunner().invoke(app, ["train", "--data", ds, "--recipe", recipe, "--out", run, "--set",
                                 "max_steps=3", "--set", "max_tokens=160", "--set", "progress=false", "--set",
                                 "drafter.markov_rank=8", "--set", "drafter.num_layers=1"])
    assert r.exit_code == 0, r.output
    assert r.output.startswith("trained dspark to step 3 of 3")
    r = CliRunner().invoke(app, ["eval", "--draft", run, "--data", ds])
    assert r.exit_code == 0, r.output
    assert "tau = " in r.output
    r = CliRunner().invoke(app, ["export", "--draft", run, "--out", str(tmp_path / "exp"), "--layout", "qwen3_omni"])
    assert r.exit_code == 0, r.output
    cfg = json.loads((tmp_path / "exp" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3OmniDSparkModel"] and cfg["block_size"] == block
