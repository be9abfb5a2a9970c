"""A reduced draft vocabulary: the subset rule, the reduced loss against a float64 reference, drafting only subset
tokens (offline == live proposal), the run lifecycle (fit, checkpoint, resume check, eval, export in EAGLE-3's
d2t / t2d convention loaded by the shipped modeling file), and live decoding == replay with it on."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModel

from dflash_fixtures import (away_from_init, supervised_slots, synthetic_samples, tiny_bundle, tiny_dataset,
                             tiny_layout)
from tapdraft.shards.head import final_norm
from tapdraft.shards.reader import open_dataset
from tapdraft.train.checkpoints import CKPT_DIR, STATE_FILE, latest_checkpoint
from tapdraft.train.config import load_run_config
from tapdraft.train.data import collate
from tapdraft.train.drafters.common.draft_vocab import DraftVocab, choose, draft_index, required_ids, token_counts
from tapdraft.train.drafters.common.export_files import load_export
from tapdraft.train.drafters.dflash.config import DFlashConfig
from tapdraft.train.drafters.dflash.model import DFlashDrafter
from tapdraft.train.drafters.dflash2.config import DFlash2Config
from tapdraft.train.export import export_run
from tapdraft.train.loop import train


def test_subset_rule_counts_ties_forced_and_fill():
    counts = torch.tensor([0, 5, 3, 3, 0, 9, 3, 0])
    # most counted first, equal counts by the smaller id: 5 (9), 1 (5), then 2 and 3 of the three 3s
    assert choose(counts, 4).tolist() == [1, 2, 3, 5]
    # a forced id takes its place whatever its count
    assert choose(counts, 4, forced=[7]).tolist() == [1, 2, 5, 7]
    # fewer seen than asked: unseen ids fill the rest in id order
    assert choose(counts, 7).tolist() == [0, 1, 2, 3, 4, 5, 6]
    with pytest.raises(ValueError, match="cannot hold"):
        choose(counts, 1, forced=[0, 7])
    with pytest.raises(ValueError, match=r"draft_vocab must be in \[1, 8\]"):
        choose(counts, 9)
    assert required_ids({"eos_token_id": [7, 2, 99]}, 8) == [2, 7] and required_ids({}, 8) == []


def test_d2t_t2d_follow_eagle3s_convention():
    v = DraftVocab(torch.tensor([1, 2, 5, 9]), 12)
    assert v.d2t.tolist() == [1, 1, 3, 6]  # target id of draft id i = i + d2t[i]
    assert (torch.arange(4) + v.d2t).tolist() == [1, 2, 5, 9]
    assert v.t2d.nonzero().flatten().tolist() == [1, 2, 5, 9] and v.t2d.dtype == torch.bool
    assert torch.equal(DraftVocab.from_d2t(v.d2t, 12).ids, v.ids)
    assert draft_index(v.t2d, torch.tensor([[9, 0], [5, 1]])).tolist() == [[3, -1], [2, 0]]
    assert v.coverage(torch.tensor([0, 1, 1, 0, 0, 1, 0, 0, 0, 1, 6, 0])) == 0.4
    with pytest.raises(ValueError, match="ascending"):
        DraftVocab(torch.tensor([3, 2]), 12)


def test_token_counts_are_the_supervised_labels_of_the_split(tmp_path):
    mem = tiny_dataset(tmp_path / "ds", n=6)
    ds = open_dataset(mem.path)
    want = torch.zeros(64, dtype=torch.long)
    for s in mem.samples:
        want += torch.bincount(s["input_ids"].long()[s["loss_mask"]], minlength=64)
    assert torch.equal(token_counts(ds, "train", 64), want) and int(want.sum()) > 0


def _reduced_model(tmp_path, kd="exact", n=24):
    bundle = tiny_bundle(tmp_path)
    layout = tiny_layout(bundle, tap_ids=(1, 3), final_hidden=True)
    samples = synthetic_samples(bundle, layout, 4)
    cfg = DFlashConfig(block_size=4, gamma=2.0, kd=kd, chunk_rows=7, draft_vocab=n, target_layer_ids=(1,))
    model = DFlashDrafter.build(cfg, bundle, layout)
    counts = sum(torch.bincount(s["input_ids"].long()[s["loss_mask"]], minlength=64) for s in samples)
    vocab = DraftVocab(choose(counts, n, [2]), 64)
    model.set_draft_vocab(vocab)
    return model, bundle, samples, vocab


def test_reduced_loss_matches_a_float64_reference(tmp_path):
    """CE over the subset's lm_head rows on rows whose label is in the subset; KD = KL(p_S || q_S) with the exact
    teacher restricted to the subset and renormalised; rows outside carry no loss but count as misses."""
    model, bundle, samples, vocab = _reduced_model(tmp_path)
    model = model.double()
    batch = collate(samples[:3])
    batch["taps"], batch["final_hidden"] = batch["taps"].double(), batch["final_hidden"].double()
    out = model(batch, torch.Generator().manual_seed(3))
    anchors, vblk = model._anchors(batch, torch.Generator().manual_seed(3))
    W = model.target.lm_head.double()[vocab.ids]
    ids = vocab.ids.tolist()
    h = model.block_hidden(batch["input_ids"], model.context(batch["taps"]), anchors)
    ce_num = kd_num = den = 0.0
    rows = outside = 0
    for b, j, k, p in supervised_slots(batch, anchors, vblk, 4):
        rows += 1
        y = int(batch["input_ids"][b, p])
        if y not in ids:
            outside += 1
            continue
        lq = torch.log_softmax(h[b, j, k] @ W.T, -1)
        t = final_norm(batch["final_hidden"][b, p - 1], model.target.norm_weight.double(), model.head_spec)
        lp = torch.log_softmax(t @ W.T, -1)  # the full teacher restricted to S, renormalised
        wk = float(torch.exp(torch.tensor(-(k - 1) / 2.0, dtype=torch.float64)).float())  # float32 weights
        ce_num = ce_num + wk * -lq[ids.index(y)]
        kd_num = kd_num + wk * (lp.exp() * (lp - lq)).sum()
        den += wk
    assert outside > 0 and rows > outside  # the subset bites, and rows remain
    for name, ref in (("ce", ce_num), ("kd", kd_num)):
        s, c, _ = out.terms[name]
        assert abs(float(c) - den) < 1e-9 and abs(float(s.detach()) - float(ref)) < 1e-8 * max(1.0, float(ref))
    # acceptance metrics count every supervised slot, the unreachable ones as misses
    assert sum(float(out.metrics[f"acc@{k}"][1]) for k in (1, 2, 3)) == rows
    # and the fused loss's analytic gradient equals autograd through the float64 reference
    params = [p for p in model.parameters() if p.requires_grad]
    fused = torch.autograd.grad(out.terms["ce"][0] + out.terms["kd"][0], params)
    ref = torch.autograd.grad(ce_num + kd_num, params, allow_unused=True)
    for g, r in zip(fused, ref):
        assert torch.allclose(g, torch.zeros_like(g) if r is None else r, rtol=1e-7, atol=1e-10)


def test_drafts_are_subset_tokens_and_live_proposals_equal_offline_blocks(tmp_path):
    model, bundle, samples, vocab = _reduced_model(tmp_path, kd="none", n=12)
    model = away_from_init(model, 0.3, seed=2)
    z = model.logits(torch.randn(5, 32))
    assert z.shape == (5, 64) and bool(torch.isinf(z[:, ~vocab.t2d]).all())
    assert bool(torch.isfinite(z[:, vocab.ids]).all())
    s = samples[0]
    batch = collate([s])
    for anchor in (3, 9, 15):
        with torch.no_grad():
            offline = model.draft_slots(batch, model.context(batch["taps"]), torch.tensor([[anchor]]))[0, 0]
        live, _ = model.propose(s["input_ids"][: anchor + 1].long(), s["taps"][:anchor])
        assert torch.equal(live, offline) and bool(vocab.t2d[live].all())
        tok, q = model.propose(s["input_ids"][: anchor + 1].long(), s["taps"][:anchor], temperature=1.0,
                               generator=torch.Generator().manual_seed(0))
        assert bool(vocab.t2d[tok].all()) and float(q[:, ~vocab.t2d].sum()) == 0.0


def test_refused_where_the_mechanism_does_not_reach(tmp_path):
    with pytest.raises(ValueError, match="kd 'none' or 'exact'"):
        DFlashConfig(draft_vocab=8, kd="topk")
    with pytest.raises(ValueError, match="DFlash-only"):
        DFlash2Config(draft_vocab=8)
    with pytest.raises(ValueError, match="draft_vocab trains with loss_type: ce"):
        load_run_config("mtp_lk", overrides=["drafter.draft_vocab=8"])
    assert load_run_config("mtp", overrides=["drafter.draft_vocab=8"]).drafter.draft_vocab == 8
    bundle = tiny_bundle(tmp_path)
    with pytest.raises(ValueError, match="exceeds the target vocabulary"):
        DFlashDrafter.build(DFlashConfig(draft_vocab=65), bundle, tiny_layout(bundle))
    model = DFlashDrafter.build(DFlashConfig(draft_vocab=8, block_size=4), bundle, tiny_layout(bundle))
    with pytest.raises(RuntimeError, match="never set"):
        model.logits(torch.zeros(1, 32))


def _run(n, steps, **kw):
    sets = [f"max_steps={steps}", "block_size=4", f"draft_vocab={n}", "progress=false", "num_anchors=8",
            "ckpt_every=2", "log_every=1", "target_layer_ids=[1]"]
    return load_run_config("dflash", overrides=sets + [f"{k}={v}" for k, v in kw.items()])


def test_run_fits_checkpoints_checks_on_resume_evaluates_and_exports(tmp_path):
    mem = tiny_dataset(tmp_path / "ds", n=12)
    summary = train(_run(20, 4), mem.path, tmp_path / "run", stop_at=2)
    assert summary["draft_vocab"]["size"] == 20 and 0 < summary["draft_vocab"]["coverage"] < 1
    state = torch.load(latest_checkpoint(tmp_path / "run") / STATE_FILE, weights_only=False)
    counts = token_counts(open_dataset(mem.path), "train", 64)
    want = DraftVocab(choose(counts, 20, [2]), 64)
    assert torch.equal(state["draft"]["d2t"], want.d2t) and torch.equal(state["draft"]["t2d"], want.t2d)
    # a checkpoint whose subset is not the one the split gives is refused on resume
    other = DraftVocab(torch.tensor(sorted(set(want.ids.tolist()[1:]) | {int((~want.t2d).nonzero()[0])})), 64)
    bad = dict(state, draft={**state["draft"], "d2t": other.d2t, "t2d": other.t2d})
    ck = tmp_path / "bad" / CKPT_DIR / "step-0000002"
    ck.mkdir(parents=True)
    (tmp_path / "bad" / "config.json").write_text((tmp_path / "run" / "config.json").read_text())
    torch.save(bad, ck / STATE_FILE)
    with pytest.raises(ValueError, match="draft vocabulary is not the one"):
        train(_run(20, 4), mem.path, tmp_path / "bad")
    # the real resume continues on the same subset to the end
    summary = train(_run(20, 4), mem.path, tmp_path / "run")
    assert summary["resumed_from_step"] == 2 and summary["draft_vocab"]["size"] == 20
    from tapdraft.train.evaluate import evaluate

    res = evaluate(tmp_path / "run", mem.path, plot=False)
    assert 1.0 <= res["tau"] <= 4
    # export: EAGLE-3's keys, int64 d2t and bool t2d, the subset's frozen lm_head rows (which vLLM projects on), loaded
    # by the shipped modeling file with the same logits; the rows come from a dataset of the same target
    with pytest.raises(ValueError, match="pass --data DATASET"):
        export_run(tmp_path / "run", tmp_path / "export")
    export_run(tmp_path / "run", tmp_path / "export", data=mem.path)
    cfg, weights = load_export(tmp_path / "export")
    assert cfg["draft_vocab_size"] == 20 and cfg["vocab_size"] == 64
    assert weights["d2t"].dtype == torch.int64 and torch.equal(weights["d2t"], want.d2t)
    assert weights["t2d"].dtype == torch.bool and torch.equal(weights["t2d"], want.t2d)
    ids = torch.arange(20) + want.d2t
    assert torch.equal(weights["lm_head.weight"], mem.bundle.lm_head.float()[ids])
    auto, info = AutoModel.from_pretrained(tmp_path / "export", trust_remote_code=True, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert torch.equal(auto.d2t, want.d2t) and torch.equal(auto.t2d, want.t2d)
    bundle = mem.bundle
    h = torch.randn(6, 32)
    from tapdraft.train.run import load_trained

    model = load_trained(tmp_path / "run", mem.path, split="train").model
    engine = auto.compute_logits(h, bundle.lm_head.float())
    assert torch.equal(torch.isinf(engine), torch.isinf(model.logits(h)))
    fin = ~torch.isinf(engine)
    assert torch.allclose(engine[fin], model.logits(h)[fin], atol=1e-5)


@pytest.mark.slow
@pytest.mark.integration
def test_live_decoding_equals_replay_with_a_draft_vocabulary(tmp_path, monkeypatch):
    """The demo chain with a draft vocabulary that leaves out tokens the replies use: live speculative greedy still
    equals the target's greedy output, and the offline replay of decoding rounds predicts live tau."""
    from tapdraft.demo.data import prepare_demo
    import tapdraft.speculate.run as speculate_run
    from tapdraft.speculate.run import SpeculateConfig, format_result, run_speculate
    from tapdraft.train.evaluate import evaluate

    torch.set_num_threads(1)
    p = prepare_demo(tmp_path / "demo", quick=True, progress=False)
    run = load_run_config("dflash_demo", overrides=["max_steps=40", "log_every=10", "ckpt_every=40", "draft_vocab=6"])
    summary = train(run, str(p.dataset), tmp_path / "run")
    assert summary["draft_vocab"]["coverage"] < 1.0  # some reply tokens can never be drafted
    off = evaluate(tmp_path / "run", str(p.dataset), plot=False)
    assert off["tau_replayed"] is not None
    live = run_speculate(SpeculateConfig(target=str(p.target), draft=str(tmp_path / "run"), data=str(p.dataset),
                                         conversations=str(p.train_manifest), max_samples=5, max_new_tokens=32),
                         progress=False)
    assert live["matches_greedy"] == "5/5"
    assert abs(live["tau"] - live["offline_tau_replayed"]) <= 0.02 * live["tau"], live
    three = Path(p.train_manifest).with_name("three.jsonl")  # fewer than --max-samples: the progress total is 3
    three.write_text("".join(Path(p.train_manifest).read_text().splitlines(keepends=True)[:3]))
    totals = []
    real = speculate_run.Progress
    monkeypatch.setattr(speculate_run, "Progress", lambda name, total, **kw: totals.append(total) or real(name, total,
                                                                                                      **kw))
    short = run_speculate(SpeculateConfig(target=str(p.target), draft=str(tmp_path / "run"), data=str(p.dataset),
                                          conversations=str(three), max_samples=32, max_new_tokens=16), progress=False)
    assert totals == [3] and short["samples"] == 3 and short["config"]["device"] == "cpu"  # auto: no CUDA here
    assert "replayed offline over the same 3 conversations" in format_result(short)
    assert json.loads((tmp_path / "run" / "config.json").read_text())["drafter"]["draft_vocab"] == 6
