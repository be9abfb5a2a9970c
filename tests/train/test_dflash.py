"""DFlash drafter: anchors, the batched blocks vs one-block-at-a-time reference, losses, flex vs dense."""

import math
import warnings

import pytest
import torch

from dflash_fixtures import supervised_slots, synthetic_samples, tiny_bundle, tiny_layout
from tapdraft.train.acceptance import acceptance_counts
from tapdraft.train.data import collate
from tapdraft.train.drafters.dflash.anchors import allocate_anchor_counts, sample_anchors
from tapdraft.train.drafters.dflash.config import DFlashConfig
from tapdraft.train.drafters.dflash.model import DFlashDrafter
from tapdraft.train.export import export_drafter


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("bundle")
    bundle = tiny_bundle(root)
    layout = tiny_layout(bundle)
    return bundle, layout, synthetic_samples(bundle, layout, 6)


def test_anchor_sampling_rules():
    T = 30
    lm = torch.zeros(3, T, dtype=torch.bool)
    lm[0, 5:] = True
    lm[1, 20:] = True
    lengths = torch.tensor([30, 25, 30])
    g = torch.Generator().manual_seed(0)
    a, v = sample_anchors(lm, lengths, block_size=4, num_anchors=6, max_total_anchors=100, generator=g)
    assert a.shape == v.shape and a.shape[1] == 6
    for b in range(3):
        pos = a[b][v[b]]
        assert torch.equal(pos, pos.sort().values) and len(set(pos.tolist())) == len(pos)
        assert bool(lm[b, pos].all()) and bool((pos + 1 < lengths[b]).all())
        assert bool((a[b][~v[b]] == 0).all())
    assert int(v[2].sum()) == 0 and int(v[1].sum()) == 4  # positions 20..23 (p + 1 < 25)
    a, v = sample_anchors(lm, lengths, block_size=4, num_anchors=6, max_total_anchors=100, full_blocks_only=True,
                          generator=g)
    assert bool((a[1][v[1]] + 4 <= 25).all()) and int(v[1].sum()) == 2
    # per-batch bound (water-filling) and static count
    a, v = sample_anchors(lm, lengths, block_size=4, num_anchors=20, max_total_anchors=9, generator=g)
    assert int(v.sum()) <= 9 and int(v[1].sum()) == 4
    a, v = sample_anchors(lm, lengths, block_size=4, num_anchors=5, max_total_anchors=9, static=True, generator=g)
    assert a.shape[1] == 3
    assert allocate_anchor_counts(torch.tensor([10, 2, 7]), 8, 12).tolist() == [5, 2, 5]
    # what water-filling leaves of the budget goes one each to the first sequences with room
    assert allocate_anchor_counts(torch.tensor([10, 2, 7]), 8, 11).tolist() == [5, 2, 4]
    assert allocate_anchor_counts(torch.tensor([5, 0, 5, 5]), 8, 2).tolist() == [1, 0, 1, 0]


def test_loss_row_budget_bounds_training_rows_not_evaluation(setup):
    bundle, layout, samples = setup
    batch = collate(samples[:4])
    big = DFlashDrafter.build(DFlashConfig(block_size=4, num_anchors=50), bundle, layout)
    rows = lambda m: int(sum(float(c) for k, (_, c) in m(batch, torch.Generator().manual_seed(0)).metrics.items()
                             if k.startswith("acc@")))
    free = rows(big)
    assert free > 12
    for budget in (3, 7, 12):  # 1, 2 and 4 blocks of 3 loss slots
        cfg = DFlashConfig(block_size=4, num_anchors=50, max_loss_rows=budget)
        assert cfg.train_anchors == budget // 3
        small = DFlashDrafter.build(cfg, bundle, layout)
        small.load_state_dict(big.state_dict())
        r = rows(small)
        assert 0 < r <= budget and r <= cfg.train_anchors * 3
        assert int(small._anchors(batch, torch.Generator().manual_seed(0))[1].sum()) == cfg.train_anchors
        assert torch.equal(small.acceptance(batch).valid, big.acceptance(batch).valid)  # eval keeps every anchor
    with pytest.raises(ValueError, match="max_loss_rows"):
        DFlashConfig(block_size=8, max_loss_rows=6)


def test_anchor_sampling_is_seeded_and_uniform_ish():
    lm = torch.ones(1, 50, dtype=torch.bool)
    L = torch.tensor([50])
    f = lambda s: sample_anchors(lm, L, block_size=2, num_anchors=5, max_total_anchors=10,
                                 generator=torch.Generator().manual_seed(s))[0]
    assert torch.equal(f(1), f(1)) and not torch.equal(f(1), f(2))
    counts = torch.zeros(50)
    for s in range(300):
        counts[f(s)[0]] += 1
    assert counts[:49].min() > 0  # every eligible position gets picked sometimes


def _reference_blocks(model, batch, anchors, valid):
    """Each valid block on its own: context = ctx[:anchor], no mask at all (with a sliding window W: slot s, at
    position a + s, keeps the context keys above a + s - W, written here as its own loop)."""
    ctx = model.context(batch["taps"])
    B = model.config.block_size
    out = {}
    for b in range(anchors.shape[0]):
        for j in range(anchors.shape[1]):
            if not valid[b, j]:
                continue
            a = int(anchors[b, j])
            ids = torch.full((1, B), model.config.mask_token_id, dtype=torch.long)
            ids[0, 0] = batch["input_ids"][b, a]
            x = torch.nn.functional.embedding(ids, model.target.embed_tokens).to(ctx.dtype)
            rope = model.rotary((a + torch.arange(B))[None])
            c = ctx[b : b + 1, :a]
            crope = model.rotary(torch.arange(a)[None])
            W = model.config.sliding_window
            mask = None
            if W is not None:
                mask = torch.ones(1, 1, B, a + B, dtype=torch.bool)
                for s in range(B):
                    for kv in range(a):
                        mask[0, 0, s, kv] = a + s - kv < W
            for layer in model.layers:
                x = layer(x, rope, mask=mask, context=c, context_rope=crope)
            out[(b, j)] = model.norm(x)[0]
    return out


@pytest.mark.parametrize("attention,window", [("dense", None), ("flex", None), ("dense", 5), ("flex", 6)])
def test_batched_blocks_equal_one_block_at_a_time(setup, attention, window):
    bundle, layout, samples = setup
    torch.manual_seed(0)
    cfg = DFlashConfig(num_layers=2, block_size=4, attention=attention, flex_block_size=16, num_anchors=5,
                       sliding_window=window)
    model = DFlashDrafter.build(cfg, bundle, layout).double()
    batch = collate(samples[:3])
    batch["taps"] = batch["taps"].double()
    anchors, valid = model._anchors(batch, torch.Generator().manual_seed(0))
    with torch.no_grad():
        h = model.block_hidden(batch["input_ids"], model.context(batch["taps"]), anchors)
        ref = _reference_blocks(model, batch, anchors, valid)
    assert ref
    for (b, j), r in ref.items():
        assert torch.allclose(h[b, j], r, atol=1e-10), (b, j)


def test_context_after_anchor_is_invisible(setup):
    bundle, layout, samples = setup
    model = DFlashDrafter.build(DFlashConfig(block_size=4), bundle, layout)
    batch = collate(samples[:1])
    anchors = torch.tensor([[10]])
    with torch.no_grad():
        ctx = model.context(batch["taps"])
        h1 = model.block_hidden(batch["input_ids"], ctx, anchors)
        ctx2 = ctx.clone()
        ctx2[:, 10:] += 5.0
        h2 = model.block_hidden(batch["input_ids"], ctx2, anchors)
        ctx2[:, 9] += 5.0
        h3 = model.block_hidden(batch["input_ids"], ctx2, anchors)
    assert torch.allclose(h1, h2) and not torch.allclose(h1, h3)


def test_a_sliding_window_hides_the_context_behind_each_slot(setup):
    """One layer, window 6, anchor 12: slot s sees context 7 + s .. 11. A change at 7 reaches slot 0 alone, a
    change at 6 or earlier no slot; without the window every slot sees both."""
    bundle, layout, samples = setup
    torch.manual_seed(0)
    batch = collate(samples[:1])
    anchors = torch.tensor([[12]])
    for window, moved in ((6, [0]), (None, [0, 1, 2, 3])):
        model = DFlashDrafter.build(DFlashConfig(num_layers=1, block_size=4, sliding_window=window), bundle, layout)
        with torch.no_grad():
            ctx = model.context(batch["taps"])
            h = model.block_hidden(batch["input_ids"], ctx, anchors)[0, 0]
            at7, before7 = ctx.clone(), ctx.clone()
            at7[:, 7] += 5.0
            before7[:, :7] += 5.0
            h7 = model.block_hidden(batch["input_ids"], at7, anchors)[0, 0]
            h6 = model.block_hidden(batch["input_ids"], before7, anchors)[0, 0]
        assert [s for s in range(4) if not torch.allclose(h[s], h7[s])] == moved
        assert [s for s in range(4) if not torch.allclose(h[s], h6[s])] == ([] if window else [0, 1, 2, 3])


def test_a_window_is_dflashs_and_holds_a_whole_block():
    from tapdraft.train.drafters.dflash2.config import DFlash2Config
    from tapdraft.train.drafters.dspark.config import DSparkConfig
    from tapdraft.train.drafters.lilicorr.config import LiLiCorrConfig

    assert DFlashConfig(block_size=4, sliding_window=4).sliding_window == 4
    with pytest.raises(ValueError, match="sliding_window must be >= block_size"):
        DFlashConfig(block_size=8, sliding_window=7)
    for cls in (DFlash2Config, DSparkConfig, LiLiCorrConfig):
        with pytest.raises(ValueError, match="sliding_window is DFlash's only"):
            cls(block_size=4, sliding_window=8)


@pytest.mark.parametrize("kd", ["none", "topk", "exact"])
def test_forward_backward_all_kd_modes(tmp_path, kd):
    bundle = tiny_bundle(tmp_path)
    layout = tiny_layout(bundle, tap_ids=(1, 3), final_hidden=(kd == "exact"))
    samples = synthetic_samples(bundle, layout, 4)
    model = DFlashDrafter.build(DFlashConfig(block_size=4, kd=kd, chunk_rows=16), bundle, layout)
    out = model(collate(samples), torch.Generator().manual_seed(0))
    assert ("kd" in out.terms) == (kd != "none")
    for s, c, _ in out.terms.values():
        assert torch.isfinite(s) and float(c) > 0
    sum(s for s, _, _ in out.terms.values()).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert model.target.lm_head.grad is None and not model.target.lm_head.requires_grad


def test_no_anchor_batch_still_reaches_every_parameter(setup):
    bundle, layout, samples = setup
    model = DFlashDrafter.build(DFlashConfig(block_size=4), bundle, layout)
    batch = collate(samples[:2])
    batch["loss_mask"][:] = False
    out = model(batch, torch.Generator().manual_seed(0))
    assert float(out.terms["ce"][1]) == 0.0
    out.terms["ce"][0].backward()
    assert all(p.grad is not None for p in model.parameters())


def test_loss_targets_and_weights_match_definition(setup):
    bundle, layout, samples = setup
    model = DFlashDrafter.build(DFlashConfig(block_size=4, gamma=2.0), bundle, layout).double()
    batch = collate(samples[:2])
    batch["taps"] = batch["taps"].double()
    g = torch.Generator().manual_seed(3)
    out = model(batch, g)
    anchors, valid = model._anchors(batch, torch.Generator().manual_seed(3))
    with torch.no_grad():
        h = model.block_hidden(batch["input_ids"], model.context(batch["taps"]), anchors)
    num = den = 0.0
    for b, j, k, p in supervised_slots(batch, anchors, valid, 4):
        z = h[b, j, k] @ model.target.lm_head.double().T
        ce = -torch.log_softmax(z, -1)[batch["input_ids"][b, p]]
        wk = torch.exp(torch.tensor(-(k - 1) / 2.0, dtype=torch.float64))
        num, den = num + float(wk * ce), den + float(wk)
    s, c, _ = out.terms["ce"]
    assert abs(float(s.detach()) / float(c) - num / den) < 1e-6 and abs(float(c) - den) < 1e-5


@pytest.mark.parametrize("weighting", ["reach", "dpace"])
def test_adaptive_slot_weights_match_their_definition_from_the_rows_own_probabilities(setup, weighting):
    """reach: slot k weighs prod_{i<k} of slot i's mean label probability over the batch; dpace: each row weighs the
    suffix sum of its block's smoothed prefix products (both detached, checked in float64 by hand)."""
    bundle, layout, samples = setup
    model = DFlashDrafter.build(DFlashConfig(block_size=4, slot_weighting=weighting, dpace_alpha=0.3),
                                bundle, layout).double()
    batch = collate(samples[:2])
    batch["taps"] = batch["taps"].double()
    out = model(batch, torch.Generator().manual_seed(3))
    anchors, valid = model._anchors(batch, torch.Generator().manual_seed(3))
    with torch.no_grad():
        h = model.block_hidden(batch["input_ids"], model.context(batch["taps"]), anchors)
    rows = {}  # (b, j) -> {k: (ce, q)}
    for b, j, k, p in supervised_slots(batch, anchors, valid, 4):
        z = h[b, j, k] @ model.target.lm_head.double().T
        ce = float(-torch.log_softmax(z, -1)[batch["input_ids"][b, p]])
        rows.setdefault((b, j), {})[k] = (ce, math.exp(-ce))
    if weighting == "reach":
        mean_q = {k: sum(r[k][1] for r in rows.values() if k in r) / sum(k in r for r in rows.values()) for k in (1, 2)}
        wk = {1: 1.0, 2: mean_q[1], 3: mean_q[1] * mean_q[2]}
        pairs = [(wk[k], ce) for r in rows.values() for k, (ce, _) in r.items()]
    else:
        pairs = []
        for r in rows.values():
            prefix, acc = {}, 1.0
            for k in sorted(r):
                acc *= 0.7 * r[k][1] + 0.3
                prefix[k] = acc
            pairs += [(sum(prefix[j] for j in prefix if j >= k), r[k][0]) for k in r]
    num, den = sum(w * ce for w, ce in pairs), sum(w for w, _ in pairs)
    s, c, _ = out.terms["ce"]
    assert abs(float(s.detach()) / float(c) - num / den) < 1e-6 and abs(float(c) - den) < 1e-6


def test_acceptance_counts():
    correct = torch.tensor([[[1, 1, 0], [1, 0, 1], [0, 1, 1]]], dtype=torch.bool)
    valid = torch.tensor([[[1, 1, 1], [1, 1, 1], [1, 1, 0]]], dtype=torch.bool)
    acc = acceptance_counts(correct, valid)
    assert acc.accepted.tolist() == [2, 1, 0]
    assert acc.reached.tolist() == [3, 2, 1]
    assert acc.correct.tolist() == [2, 2, 1] and acc.valid.tolist() == [3, 3, 2]


def test_config_validation_and_resolve(setup):
    bundle, layout, _ = setup
    with pytest.raises(ValueError):
        DFlashConfig(block_size=1)
    with pytest.raises(ValueError):
        DFlashConfig(attention="sparse")
    with pytest.raises(ValueError, match="did not store"):
        DFlashConfig(target_layer_ids=(0, 2)).resolve(bundle, layout)
    r = DFlashConfig(num_layers=2).resolve(bundle, layout)
    assert r.target_layer_ids == (1,) and r.num_heads == 4 and r.mask_token_id == 0
    with pytest.raises(ValueError, match="top-k"):
        DFlashDrafter.build(DFlashConfig(kd="topk"), bundle, tiny_layout(bundle, top_k=0))
    with pytest.raises(ValueError, match="final_hidden"):
        DFlashDrafter.build(DFlashConfig(kd="exact"), bundle, tiny_layout(bundle, tap_ids=(1, 2)))


def test_replay_rounds_walks_a_reply_like_a_live_decoder():
    from tapdraft.train.acceptance import replay_rounds

    # one reply at positions 2..9 (8 tokens); K = 3 drafts per round; anchors at every reply position
    lm = torch.zeros(1, 12, dtype=torch.bool)
    lm[0, 2:10] = True
    anchors = torch.arange(2, 10)[None]
    T = anchors.shape[1]
    valid = torch.zeros(1, T, 3, dtype=torch.bool)
    for n, p in enumerate(range(2, 10)):
        for k in range(3):
            valid[0, n, k] = p + k + 1 <= 9  # slot k predicts p + k + 1, supervised up to 9
    correct = torch.ones(1, T, 3, dtype=torch.bool)
    correct[0, 0, 1] = False  # at anchor 2: slot 1 right, slot 2 wrong -> emit 2, next anchor 4
    correct[0, 2, 0] = False  # at anchor 4: slot 0 wrong -> emit 1, next anchor 5
    # anchor 5: all 3 right and the block is full -> emit 4, next anchor 9: no valid slot -> reply ends
    tokens, rounds = replay_rounds(lm, anchors, correct, valid)
    assert (tokens, rounds) == (2 + 1 + 4, 3)
    # a reply whose last round is cut by its end: anchor 8 has one valid slot, right -> emit 1 and stop
    correct2 = torch.ones(1, T, 3, dtype=torch.bool)
    correct2[0, 0, 0] = False  # anchor 2 -> emit 1, next 3
    correct2[0, 1, 2] = False  # anchor 3: 2 right -> emit 3, next 6
    correct2[0, 4, 1] = False  # anchor 6: 1 right -> emit 2, next 8; anchor 8: 1 valid, right -> emit 1
    assert replay_rounds(lm, anchors, correct2, valid) == (1 + 3 + 2 + 1, 4)
    # a full block whose last draft is the reply's last token: no bonus after it
    correct3 = torch.ones(1, T, 3, dtype=torch.bool)
    correct3[0, 0, 0] = correct3[0, 1, 1] = False  # anchor 2 -> emit 1, next 3; anchor 3 -> emit 2, next 5
    correct3[0, 3, 0] = False  # anchor 5 -> emit 1, next 6; anchor 6: drafts 7, 8, 9 all right -> emit 3, end
    assert replay_rounds(lm, anchors, correct3, valid) == (1 + 2 + 1 + 3, 4)


def test_mask_slots_use_a_dedicated_id_recorded_in_the_export(setup, tmp_path):
    """The mask id is the first embedding row past the tokenizer's ids (what adding <|MASK|> gives), never pad."""
    import dataclasses as dc
    import json as js

    from tapdraft.train.drafters.dflash.config import default_mask_id

    bundle, layout, _ = setup
    V = bundle.vocab_size
    tok = {"model": {"type": "WordLevel", "vocab": {f"w{i}": i for i in range(V - 8)}},
           "added_tokens": [{"id": V - 8, "content": "<|im_end|>"}, {"id": V - 7, "content": "<|pad|>"}]}
    with_tok = dc.replace(bundle, tokenizer_files={"tokenizer.json": js.dumps(tok).encode()})
    assert default_mask_id(with_tok, layout) == V - 6
    model = DFlashDrafter.build(DFlashConfig(num_layers=1, block_size=4), with_tok, layout)
    assert model.config.mask_token_id == V - 6 != bundle.config["pad_token_id"]
    export_drafter(model, tmp_path / "exp", {})
    cfg = js.loads((tmp_path / "exp" / "config.json").read_text())
    assert cfg["dflash_config"]["mask_token_id"] == V - 6 and cfg["dflash_config"]["mask_token"] == "<|MASK|>"
    ids = torch.full((1, 4), V - 6)
    assert torch.equal(model.target.embed_tokens[ids], bundle.embed_tokens[ids].float())  # the target's own row
    # a table the tokenizer fills has no spare row: the pad id, which no reply holds, so nothing to warn about
    full = dc.replace(bundle, tokenizer_files={"tokenizer.json": js.dumps(
        {"model": {"vocab": {f"w{i}": i for i in range(V)}}}).encode()})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert default_mask_id(full, layout) == bundle.config["pad_token_id"]
    # an explicit id always wins and is recorded as given
    assert DFlashConfig(mask_token_id=5).resolve(with_tok, layout).mask_token_id == 5


@pytest.mark.parametrize("family", ["dflash", "dflash2"])
def test_eval_measures_every_eligible_anchor_in_bounded_chunks(setup, family):
    """Offline acceptance walks every eligible anchor of every sequence (not the training cap), and chunking the
    anchors to bound memory changes nothing."""
    from tapdraft.train.drafters.dflash2.config import DFlash2Config
    from tapdraft.train.drafters.dflash2.model import DFlash2Drafter

    bundle, layout, samples = setup
    batch = collate(samples)
    cls, cfg = (DFlashDrafter, DFlashConfig) if family == "dflash" else (DFlash2Drafter, DFlash2Config)
    extra = {} if family == "dflash" else {"chunk_rows": 0, "selector_candidates": 5, "selector_rank": 8,
                                           "conv_group_size": 8}
    torch.manual_seed(0)
    small = cls.build(cfg(num_layers=1, block_size=4, num_anchors=3, max_total_anchors=5, **extra), bundle, layout)
    torch.manual_seed(0)
    big = cls.build(cfg(num_layers=1, block_size=4, num_anchors=10_000, max_total_anchors=10_000, **extra), bundle,
                    layout)
    L = batch["lengths"][:, None]
    pos = torch.arange(batch["input_ids"].shape[1])[None]
    eligible = int((batch["loss_mask"] & (pos + 1 < L)).sum())
    assert eligible > 3 * batch["input_ids"].shape[0]  # far more than the per-sequence training cap
    a_small, a_big = small.eval().acceptance(batch), big.eval().acceptance(batch)
    assert a_small.blocks == a_big.blocks == eligible
    assert len(small.anchor_chunks(small.eval_anchors(batch)[0])) > 1
    for f in ("accepted", "reached", "correct", "valid"):
        assert torch.equal(getattr(a_small, f), getattr(a_big, f)), f
    assert (a_small.round_tokens, a_small.rounds) == (a_big.round_tokens, a_big.rounds)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sampled_acceptance_is_the_overlap_of_the_live_proposal_with_the_exact_target_row(tmp_path, temperature):
    """Offline sampled acceptance at slot k = sum_v min(p, q): q what ``propose`` samples from at that anchor,
    p the target's exact row a + k - 1 at the same temperature; a float64 loop over every anchor gives the same sums."""
    from tapdraft.shards.head import teacher_logits

    bundle = tiny_bundle(tmp_path, scaling=1.3)
    layout = tiny_layout(bundle, tap_ids=(1, 3))  # the last layer (3) tapped: the exact teacher exists
    s = synthetic_samples(bundle, layout, 1, min_len=20, max_len=20, seed=4)[0]
    torch.manual_seed(0)
    model = DFlashDrafter.build(DFlashConfig(num_layers=1, block_size=4, target_layer_ids=(1,), max_total_anchors=5),
                                bundle, layout).eval()
    got_s, got_c = model.sampled_acceptance(collate([s]), temperature)
    ids, lm, taps = s["input_ids"].long(), s["loss_mask"], s["taps"].float()
    sums, counts = torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    for a in range(len(ids) - 1):
        if not lm[a]:
            continue
        _, q = model.propose(ids[: a + 1], taps[:a], temperature=temperature, generator=torch.Generator())
        for k in range(1, 4):
            if a + k >= len(ids) or not lm[a + k]:
                continue
            z = teacher_logits(taps[a + k - 1, 1][None], model.target.norm_weight, model.target.lm_head,
                               model.head_spec)[0]
            p = torch.softmax(z.double() / temperature, -1)
            sums[k - 1] += torch.minimum(p, q[k - 1].double()).sum()
            counts[k - 1] += 1
    assert torch.equal(got_c, counts) and counts.sum() > 20
    torch.testing.assert_close(got_s, sums, rtol=1e-5, atol=1e-5)


def test_mask_never_falls_back_to_an_all_zero_embedding_row(setup):
    """HF zero-initialises the pad row (nn.Embedding padding_idx) and it never gets a gradient. A mask slot fed that
    row has RMSNorm(0) = 0 as its first layer's input: no query, key or value, uniform attention, identical slots.
    With no spare row the fallback must be a nonzero row, and then a 1-layer draft's mask slots differ."""
    import dataclasses as dc
    import json as js

    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tapdraft.train.drafters.dflash.config import default_mask_id

    hf = Qwen3ForCausalLM(Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, pad_token_id=0))
    assert float(hf.model.embed_tokens.weight.detach()[0].abs().max()) == 0.0  # the fact the fallback must respect

    bundle, layout, samples = setup
    V = bundle.vocab_size
    emb = bundle.embed_tokens.clone()
    emb[bundle.config["pad_token_id"]] = 0.0
    tok = {"model": {"vocab": {f"w{i}": i for i in range(V)}},
           "added_tokens": [{"id": 0, "content": "<|pad|>"}, {"id": 1, "content": "<|im_start|>"}]}
    no_bos = {**bundle.config, "bos_token_id": None}  # with a bos token (nonzero row) the mask would use it silently
    full = dc.replace(bundle, embed_tokens=emb, tokenizer_files={"tokenizer.json": js.dumps(tok).encode()},
                      config=no_bos)
    with pytest.warns(UserWarning, match=r"mask slots use id 1, a token replies may hold.*costs acceptance on the "
                      r"share of supervised tokens that are id 1\. Set drafter.mask_token_id"):
        mask = default_mask_id(full, layout)
    assert mask != bundle.config["pad_token_id"] and float(emb[mask].abs().max()) > 0
    assert mask == 1  # the lowest id with a nonzero row
    model = DFlashDrafter.build(DFlashConfig(num_layers=1, block_size=4), full, layout).eval()
    b = collate(samples[:1])
    with torch.no_grad():
        h = model.block_hidden(b["input_ids"], model.context(b["taps"]), torch.tensor([[10]]))[0, 0, 1:]
    assert float((h[1:] - h[0]).abs().max()) > 1e-4  # mask slots are told apart by position
    # an explicit all-zero row is allowed (a recorded run keeps loading) but said out loud
    with pytest.warns(UserWarning, match="all-zero embedding"):
        DFlashConfig(mask_token_id=0).resolve(full, layout)


def test_a_full_vocabulary_uses_its_unk_token_silently_when_pad_is_a_zero_row(setup):
    """The demo's case: every row is a tokenizer id and pad's row is zero, but <|unk|> is reserved (no reply holds
    it): the mask uses it without a warning the user could not act on."""
    import dataclasses as dc
    import json as js

    from tapdraft.train.drafters.dflash.config import default_mask_id

    bundle, layout, _ = setup
    V = bundle.vocab_size
    emb = bundle.embed_tokens.clone()
    emb[bundle.config["pad_token_id"]] = 0.0
    tok = {"model": {"vocab": {f"w{i}": i for i in range(V)}},
           "added_tokens": [{"id": 0, "content": "<|pad|>"}, {"id": 7, "content": "<|unk|>"}]}
    files = {"tokenizer.json": js.dumps(tok).encode(),
             "tokenizer_config.json": js.dumps({"pad_token": "<|pad|>", "unk_token": "<|unk|>"}).encode()}
    full = dc.replace(bundle, embed_tokens=emb, tokenizer_files=files)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert default_mask_id(full, layout) == 7


def test_the_tap_rule_fallback_warns_once_however_often_the_config_is_resolved(tmp_path):
    """Training resolves the config in several places (build, the dataset check); the fallback is said once."""
    from tapdraft.shards.taps import default_tap_ids

    bundle = tiny_bundle(tmp_path, layers=4)
    layout = tiny_layout(bundle, tap_ids=(0, 1))
    assert not set(default_tap_ids(4, 1)) <= {0, 1}  # the rule wants taps this dataset lacks
    cfg = DFlashConfig(block_size=4, num_layers=1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        first = cfg.resolve(bundle, layout)  # two call sites, as build and the dataset check are
        second = cfg.resolve(bundle, layout)
    taps = [w for w in seen if "tap rule" in str(w.message)]
    assert len(taps) == 1, [str(w.message) for w in taps]
    assert first.target_layer_ids == second.target_layer_ids == (0, 1)


def test_context_taps_spread_the_tap_rule_independently_of_the_draft_depth(tmp_path):
    """A one-layer draft reads the middle layer by the references' rule; ``context_taps: 3`` spreads three over the
    target (SmolLM2's 30 layers: EAGLE-3's 1 / 14 / 27); explicit ids win; fewer than one tap is refused."""
    from tapdraft.shards.taps import default_tap_ids

    bundle = tiny_bundle(tmp_path, layers=30)
    layout = tiny_layout(bundle, tap_ids=tuple(sorted({*default_tap_ids(30, 5), 15, 29})))
    assert DFlashConfig(num_layers=1).resolve(bundle, layout).target_layer_ids == (15,)
    assert DFlashConfig(num_layers=1, context_taps=3).resolve(bundle, layout).target_layer_ids == (1, 14, 27)
    assert DFlashConfig(num_layers=1, context_taps=3, target_layer_ids=(8,)).resolve(
        bundle, layout).target_layer_ids == (8,)
    with pytest.raises(ValueError, match="context_taps must be >= 1"):
        DFlashConfig(context_taps=0)
