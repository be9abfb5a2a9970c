"""EAGLE-3: the training-time-test mask, losses and chains against a float64 re-implementation of vLLM's EAGLE-3
module math (on the exported weights' names), proposals, refusals, export layout, resume and DDP."""

import json
import math
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from tests.train.test_mtp import V, H, L, batch_of, tiny_bundle, tiny_layout
from tapdraft.train.drafters.base import combine_terms
from tapdraft.train.drafters.common.chain import IGNORE
from tapdraft.train.drafters.common.divergences import kl_tv_full, kl_tv_topk
from tapdraft.train.drafters.common.draft_vocab import DraftVocab
from tapdraft.train.drafters.common.export_files import load_export
from tapdraft.train.drafters.common.mask import eagle3_dense_mask
from tapdraft.train.drafters.common.teacher import last_hidden
from tapdraft.train.drafters.eagle3.config import Eagle3Config
from tapdraft.train.drafters.eagle3.model import Eagle3Drafter
from tapdraft.train.export import export_drafter

TAPS = (0, 1, 2, L - 1)


def layout(**kw):
    return tiny_layout(tap_ids=TAPS, **kw)


def drafter(bundle=None, lay=None, **cfg):
    torch.manual_seed(cfg.pop("seed", 0))
    d = Eagle3Drafter.build(Eagle3Config(**{"num_steps": 3, "chunk_rows": 5, **cfg}), bundle or tiny_bundle(),
                            lay or layout())
    with torch.no_grad():  # norms away from 1 and a head away from the target's, so every weight matters
        for name, p in d.named_parameters():
            p.add_((0.05 if "norm" in name else 0.01) * torch.randn_like(p))
    return d


# -- the mask ---------------------------------------------------------------------------------------
def test_mask_is_causal_on_step_zero_and_the_own_chain_after():
    rows = torch.tensor([4, 0, 2])
    T = 6
    for step in range(3):
        m = eagle3_dense_mask(rows, T, step)[0, 0]
        assert m.shape == (3, T + step * 3)
        for q, r in enumerate(rows.tolist()):
            for kv in range(T + step * 3):
                want = kv <= r if kv < T else (kv - T) % 3 == q
                assert bool(m[q, kv]) == want, (step, q, kv)
    full = eagle3_dense_mask(torch.arange(T), T, 0)[0, 0]
    assert torch.equal(full, torch.ones(T, T, dtype=torch.bool).tril())


def test_flex_forward_matches_dense_cpu():
    bundle, lay = tiny_bundle(), layout()
    batch = batch_of(lay, bundle, lengths=(20, 13))
    dense, flex = drafter(bundle, lay), drafter(bundle, lay, attention="flex", flex_block_size=16)
    with torch.no_grad():
        a, b = dense.run_steps(batch), flex.run_steps(batch)
    for x, y in zip(a["h"], b["h"]):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-5)


# -- a float64 re-implementation of vLLM's EAGLE-3 math, on the exported weights' names ---------------
def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):  # x [heads, D] at one position; neox (rotate-half) layout
    D = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = pos * inv
    cos, sin = torch.cat([ang.cos(), ang.cos()]), torch.cat([ang.sin(), ang.sin()])
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class VllmEagle3:
    """vLLM's Eagle3Qwen3ForCausalLM / Eagle3LlamaForCausalLM forward (qwen3_eagle3.py, llama_eagle3.py) in float64:
    fused q/k/v over cat[input_layernorm(embeds), hidden_norm(hidden)], residual = hidden, fused add-norms,
    final norm returning (normed, pre-norm), logits = lm_head(normed) placed at arange(N) + d2t."""

    def __init__(self, weights, cfg, embed):
        self.w = {k: v.double() if v.is_floating_point() else v for k, v in weights.items()}
        self.c, self.embed = cfg, embed.double()
        self.eps, self.theta = cfg["rms_norm_eps"], cfg["rope_parameters"]["rope_theta"]
        self.n, self.kv, self.D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        self.keys: list[tuple[torch.Tensor, torch.Tensor]] = []

    def W(self, name):
        return self.w["midlayer." + name]

    def layer(self, token, hidden, pos, visible):
        """One position: ``visible`` are the cached (k, v) it attends besides its own. Returns (prenorm, kv)."""
        e = _rms(self.embed[token], self.W("input_layernorm.weight"), self.eps)
        x = torch.cat([e, _rms(hidden, self.W("hidden_norm.weight"), self.eps)])
        qkv = torch.cat([self.W(f"self_attn.{p}_proj.weight") for p in "qkv"]) @ x
        q, k, v = qkv.split([self.n * self.D, self.kv * self.D, self.kv * self.D])
        q, k, v = q.view(self.n, self.D), k.view(self.kv, self.D), v.view(self.kv, self.D)
        if self.c["architectures"] == ["Qwen3ForCausalLM"]:
            q = _rms(q, self.W("self_attn.q_norm.weight"), self.eps)
            k = _rms(k, self.W("self_attn.k_norm.weight"), self.eps)
        q, k = _rope(q, pos, self.theta), _rope(k, pos, self.theta)
        K = torch.stack([kk for kk, _ in visible] + [k])  # [S, kv, D]
        Vv = torch.stack([vv for _, vv in visible] + [v])
        rep = self.n // self.kv
        att = torch.einsum("hd,shd->hs", q, K.repeat_interleave(rep, 1)) / math.sqrt(self.D)
        o = torch.einsum("hs,shd->hd", att.softmax(-1), Vv.repeat_interleave(rep, 1)).reshape(-1)
        residual = hidden + self.W("self_attn.o_proj.weight") @ o
        h = _rms(residual, self.W("post_attention_layernorm.weight"), self.eps)
        gate, up = self.W("mlp.gate_proj.weight") @ h, self.W("mlp.up_proj.weight") @ h
        return residual + self.W("mlp.down_proj.weight") @ (torch.nn.functional.silu(gate) * up), (k, v)

    def logits(self, prenorm):
        z = self.w["lm_head.weight"] @ _rms(prenorm, self.w["norm.weight"], self.eps)
        if "d2t" not in self.w:
            return z
        out = torch.full((self.c["vocab_size"],), float("-inf"), dtype=torch.float64)
        out[torch.arange(z.shape[0]) + self.w["d2t"]] = z  # vLLM: target id = draft id + d2t[draft id]
        return out

    def chain(self, ids, aux, t, steps):
        """Step outputs (pre-norm) of the chain anchored at row t: step 0 over rows 0..t (the target-fed pass
        vLLM runs over the verified tokens, aux = the concatenated aux hidden states), then steps 1.. on its own
        outputs with the tokens ``ids`` holds there."""
        f = aux.double() @ self.w["fc.weight"].T
        cache, r = [], None
        for s in range(t + 1):
            r, kv = self.layer(int(ids[s + 1]), f[s], s, cache)
            cache.append(kv)
        outs = [r]
        for j in range(1, steps):
            r, kv = self.layer(int(ids[t + j + 1]), r, t + j, cache)
            cache.append(kv)
            outs.append(r)
        return outs


def _reference(d, batch, tmp_path):
    export_drafter(d, tmp_path, {})
    cfg, weights = load_export(tmp_path)
    return VllmEagle3(weights, cfg, d.target.embed_tokens), cfg, weights


def _aux(d, batch, b):
    taps = batch["taps"][b][:, d.tap_index]
    return taps.reshape(taps.shape[0], -1)


@pytest.mark.parametrize("qk_norm", [True, False])
def test_steps_match_vllms_math_on_the_exported_weights(tmp_path, qk_norm):
    bundle, lay = tiny_bundle(scaling=2.0), layout()
    d = drafter(bundle, lay, qk_norm=qk_norm)
    batch = batch_of(lay, bundle)
    ref, _, _ = _reference(d, batch, tmp_path)
    run = d.run_steps(batch)
    for b in range(2):
        n = int(batch["lengths"][b])
        for t in range(n - 4):
            want = ref.chain(batch["input_ids"][b], _aux(d, batch, b), t, 3)
            for j in range(3):
                torch.testing.assert_close(run["h"][j][b, t].double(), want[j], rtol=0, atol=2e-5)
                torch.testing.assert_close(d.logits(run["h"][j][b, t][None])[0].double(), ref.logits(want[j]),
                                           rtol=0, atol=5e-5)


def test_ce_and_kl_terms_match_float64_references(tmp_path):
    bundle, lay = tiny_bundle(), layout()
    batch = batch_of(lay, bundle, lengths=(12, 9))
    for loss_type in ("ce", "kl"):
        d = drafter(bundle, lay, loss_type=loss_type, step_decay=0.5)
        ref, _, _ = _reference(d, batch, tmp_path / loss_type)
        out = d(batch)
        for j in range(3):
            total, count = 0.0, 0
            for b in range(2):
                n = int(batch["lengths"][b])
                for t in range(n - j - 2):
                    if not bool(batch["loss_mask"][b, t + j + 2]):
                        continue
                    z = ref.logits(ref.chain(batch["input_ids"][b], _aux(d, batch, b), t, j + 1)[j])
                    lq = torch.log_softmax(z, -1)
                    if loss_type == "ce":
                        total -= float(lq[int(batch["input_ids"][b, t + j + 2])])
                    else:
                        last = batch["taps"][b, t + j + 1, TAPS.index(L - 1)].double()
                        lp = torch.log_softmax(_rms(last, bundle.norm_weight.double(), 1e-6) @ bundle.lm_head.double().T, -1)
                        total += float((lp.exp() * (lp - lq)).sum())
                    count += 1
            s, c, w = out.terms[f"loss@{j + 1}"]
            assert int(c) == count > 0 and w == 0.5**j
            assert abs(float(s.detach()) - total) < 1e-4 * max(1.0, total), (loss_type, j)
        loss, _ = combine_terms(out.terms)
        loss.backward()
        assert all(p.grad is not None for p in d.parameters())
        assert d.lm_head.weight.grad.abs().sum() > 0  # the draft's own head trains


@pytest.mark.parametrize("teacher,draft_vocab", [("exact", None), ("exact", 12), ("topk", None)])
def test_fused_kl_gradients_equal_dense_autograd_float64(teacher, draft_vocab):
    """kl's fused path (analytic gradients for the rows and the head, the teacher over the draft vocabulary's rows
    only) equals float64 autograd through dense logits, values and every gradient."""
    bundle, lay = tiny_bundle(), layout()
    batch = batch_of(lay, bundle)
    batch["taps"] = batch["taps"].double()
    lps = batch["topk_logprobs"].double()  # top_k = V here: renormalised in float64 so that no rounding tail is left
    batch["topk_logprobs"] = lps - torch.logsumexp(lps, -1, keepdim=True)
    d = drafter(bundle, lay, loss_type="kl", teacher=teacher, draft_vocab=draft_vocab).double()
    d.target.to_dtype(torch.float64)
    if draft_vocab:
        d.set_draft_vocab(DraftVocab(torch.tensor([1, 2, 3, 5, 8, 13, 17, 21, 25, 30, 34, 38]), V))
    loss, _ = combine_terms(d(batch).terms)
    loss.backward()
    fused = {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}
    d.zero_grad()
    run = d.run_steps(batch)
    last = last_hidden(batch, d.last_tap) if teacher == "exact" else None
    terms = {}
    for j, (h, lab) in enumerate(zip(run["h"], run["labels"])):
        rows = (lab != IGNORE).nonzero(as_tuple=True)
        trow = (rows[0], rows[1] + j + 1)
        z = d.norm(h[rows]) @ d.lm_head.weight.T  # dense float64 logits, autograd all the way
        if teacher == "exact":
            p = d.teacher(last[trow])
            kl, _ = kl_tv_full(p if draft_vocab is None else p[:, d.draft_ids()], z)
        else:
            kl, _ = kl_tv_topk(batch["topk_ids"][trow], batch["topk_logprobs"][trow], z)
        terms[f"loss@{j + 1}"] = (kl.sum(), torch.tensor(float(kl.numel())), d.config.step_decay**j)
    ref, _ = combine_terms(terms)
    ref.backward()
    assert torch.allclose(loss.detach(), ref.detach(), atol=1e-10)
    assert set(fused) == {n for n, p in d.named_parameters() if p.grad is not None}
    for n, p in d.named_parameters():
        if p.grad is not None:
            assert torch.allclose(fused[n], p.grad, atol=1e-10), (n, float((fused[n] - p.grad).abs().max()))


def test_loss_row_budget_samples_whole_chains():
    """max_loss_rows: at most max_loss_rows // num_steps positions, the same at every step, so every step's rows
    are a subset of the all-rows ones and the total stays within the budget; None or a budget that fits: all rows."""
    bundle, lay = tiny_bundle(), layout()
    batch = batch_of(lay, bundle, lengths=(12, 9))
    full = drafter(bundle, lay)
    whole = full(batch)
    roomy = drafter(bundle, lay, max_loss_rows=10_000)(batch)
    for j in range(3):
        assert float(roomy.terms[f"loss@{j + 1}"][0]) == pytest.approx(float(whole.terms[f"loss@{j + 1}"][0]))
    d = drafter(bundle, lay, max_loss_rows=9)
    labels = d._loss_positions(d.run_steps(batch)["labels"], torch.Generator().manual_seed(0))
    all_labels = d.run_steps(batch)["labels"]
    kept = torch.stack([t != IGNORE for t in labels]).any(0)
    assert int(kept.sum()) == 3 and sum(int((t != IGNORE).sum()) for t in labels) <= 9
    for t, a in zip(labels, all_labels):
        assert torch.equal(t[kept], a[kept]) and bool((t[~kept] == IGNORE).all())
    out = d(batch, torch.Generator().manual_seed(0))
    assert sum(int(out.terms[f"loss@{j + 1}"][1]) for j in range(3)) <= 9
    with pytest.raises(ValueError, match="max_loss_rows"):
        Eagle3Config(num_steps=3, max_loss_rows=2)


def test_lk_and_topk_teacher():
    bundle, lay = tiny_bundle(), layout()
    batch = batch_of(lay, bundle)
    exact = drafter(bundle, lay, loss_type="kl", teacher="exact")
    topk = drafter(bundle, lay, loss_type="kl", teacher="topk")  # top_k = V: the stored rows are the whole softmax
    a, b = exact(batch), topk(batch)
    for j in range(3):
        assert float(a.terms[f"loss@{j + 1}"][0]) == pytest.approx(float(b.terms[f"loss@{j + 1}"][0]), rel=1e-4)
    lk = drafter(bundle, lay, loss_type="lk", lk_lambda=0.0)  # pure TV: the loss is 1 - acceptance per row
    out = lk(batch)
    for j in range(3):
        s, n, _ = out.terms[f"loss@{j + 1}"]
        acc, m = out.metrics[f"sampled_acceptance@{j + 1}"]
        assert float(s) == pytest.approx(float(n) - float(acc), rel=1e-5) and int(n) == int(m)


def test_draft_vocabulary_uses_vllms_d2t_convention(tmp_path):
    bundle, lay = tiny_bundle(), layout(top_k=0)
    d = drafter(bundle, lay, draft_vocab=12, loss_type="ce")
    ids = torch.tensor([1, 2, 3, 5, 8, 13, 17, 21, 25, 30, 34, 38])
    d.set_draft_vocab(DraftVocab(ids, V))
    assert torch.equal(d.lm_head.weight, d.target.lm_head[ids])  # the head starts on the target's rows of the subset
    batch = batch_of(lay, bundle)
    ref, cfg, weights = _reference(d, batch, tmp_path)
    assert cfg["draft_vocab_size"] == 12 and weights["d2t"].dtype == torch.int64
    assert torch.equal(torch.arange(12) + weights["d2t"], ids) and weights["lm_head.weight"].shape == (12, H)
    run = d.run_steps(batch)
    want = ref.chain(batch["input_ids"][0], _aux(d, batch, 0), 2, 3)
    for j in range(3):
        z = d.logits(run["h"][j][0, 2][None])[0]
        assert torch.isinf(z[~d.t2d]).all() and int(z.argmax()) in ids.tolist()
        torch.testing.assert_close(z.double(), ref.logits(want[j]), rtol=0, atol=5e-5)
    out = d(batch)  # a label outside the subset carries no loss
    y = [batch["input_ids"][b, t + 2] for b, t in (batch["loss_mask"][:, 2:] & (torch.arange(
        batch["input_ids"].shape[1] - 2) < batch["lengths"][:, None] - 2)).nonzero().tolist()]
    assert int(out.terms["loss@1"][1]) == sum(int(v) in ids.tolist() for v in y)


# -- chains, proposals, eval ----------------------------------------------------------------------------
def test_live_proposals_are_the_offline_chain(tmp_path):
    bundle, lay = tiny_bundle(), layout()
    d = drafter(bundle, lay)
    batch = batch_of(lay, bundle, lengths=(14, 9))
    ids, taps = batch["input_ids"][0], batch["taps"][0]
    for P in (3, 7):
        drafts, q = d.propose(ids[: P + 1], taps[:P])
        assert q is None and drafts.shape == (3,)
        fed = torch.cat([ids[: P + 1], drafts])  # the chain with its own drafts as the tokens
        b = dict(batch, input_ids=fed[None], taps=torch.cat([taps[:P], torch.zeros(4, *taps.shape[1:])])[None].to(taps),
                 loss_mask=torch.ones(1, P + 4, dtype=torch.bool), is_audio=torch.zeros(1, P + 4, dtype=torch.bool),
                 lengths=torch.tensor([P + 4]))
        run = d.run_steps(b)
        offline = [int(d.logits(run["h"][j][0, P - 1][None]).argmax()) for j in range(3)]
        assert drafts.tolist() == offline
        torch.manual_seed(0)
        sampled, q = d.propose(ids[: P + 1], taps[:P], temperature=1.0, generator=torch.Generator().manual_seed(1))
        assert q.shape == (3, V) and torch.allclose(q.sum(-1), torch.ones(3))


def test_fewer_drafts_are_the_chains_first_steps():
    """``propose(drafts=N)``: the chain's first N drafts (what vLLM drafts at num_speculative_tokens=N), and their
    distributions when sampling; beyond the trained steps or below one is refused."""
    bundle, lay = tiny_bundle(), layout()
    d = drafter(bundle, lay)
    batch = batch_of(lay, bundle, lengths=(14, 9))
    ids, taps = batch["input_ids"][0], batch["taps"][0]
    full, _ = d.propose(ids[:8], taps[:7])
    _, q_full = d.propose(ids[:8], taps[:7], temperature=1.0, generator=torch.Generator().manual_seed(1))
    for n in (1, 2):
        assert d.propose(ids[:8], taps[:7], drafts=n)[0].tolist() == full[:n].tolist()
        _, q = d.propose(ids[:8], taps[:7], temperature=1.0, generator=torch.Generator().manual_seed(1), drafts=n)
        torch.testing.assert_close(q, q_full[:n])
    for bad in (0, 4):
        with pytest.raises(ValueError, match="1..3"):
            d.propose(ids[:8], taps[:7], drafts=bad)


def test_acceptance_chains_steps_and_replays_rounds():
    bundle, lay = tiny_bundle(), layout()
    d = drafter(bundle, lay)
    batch = batch_of(lay, bundle)
    acc = d.acceptance(batch)
    run = d.run_steps(batch)
    ok = None
    for j in range(3):
        lab = run["labels"][j]
        pred = d.logits(run["h"][j].reshape(-1, H)).argmax(-1).view(lab.shape)
        hit = (pred == lab) & (lab != IGNORE)
        ok = hit if ok is None else ok & hit
        assert int(acc.accepted[j]) == int(ok.sum())
    assert acc.rounds > 0 and acc.round_tokens >= acc.rounds
    s, c = d.sampled_acceptance(batch, 1.0)
    assert s.shape == (3,) and (s <= c).all() and (s > 0).all()


# -- refusals and the tap rule ----------------------------------------------------------------------
def test_taps_default_refusals_and_fallback():
    bundle = tiny_bundle()
    d = drafter(bundle, layout())
    assert d.config.target_layer_ids == (0, 2, 3)  # shards.taps.eagle3_tap_ids(4)
    with pytest.warns(UserWarning, match="fusing"):
        d = drafter(bundle, tiny_layout(tap_ids=(1, L - 1)))
    assert d.config.target_layer_ids == (1,)
    with pytest.raises(ValueError, match="did not store"):
        drafter(bundle, layout(), target_layer_ids=(0, 5))
    with pytest.raises(ValueError, match="draft vocabulary restricts"):
        Eagle3Drafter.build(Eagle3Config(draft_vocab=8, teacher="topk"), bundle, layout())
    with pytest.raises(ValueError, match="teacher rows"):
        Eagle3Drafter.build(Eagle3Config(), bundle, tiny_layout(tap_ids=(0, 1), top_k=0))
    with pytest.raises(ValueError, match="num_steps"):
        Eagle3Config(num_steps=0)
    with pytest.raises(ValueError, match="not below"):
        Eagle3Drafter.build(Eagle3Config(draft_vocab=V), bundle, layout())


def test_export_is_vllms_eagle3_layout(tmp_path):
    d = drafter(tiny_bundle(), layout())
    export_drafter(d, tmp_path, {"source": "test"})
    cfg, w = load_export(tmp_path)
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["num_hidden_layers"] == 1
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True,
                                   "norm_before_fc": False}
    assert cfg["draft_vocab_size"] == cfg["vocab_size"] == V and cfg["target_hidden_size"] == H
    assert w["fc.weight"].shape == (H, 3 * H) and w["lm_head.weight"].shape == (V, H)
    assert w["midlayer.self_attn.q_proj.weight"].shape == (2 * 8, 2 * H)  # q/k/v read [embedding ; hidden]
    assert w["midlayer.self_attn.o_proj.weight"].shape == (H, 2 * 8)
    names = set(w)
    assert {"norm.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
            "midlayer.post_attention_layernorm.weight", "midlayer.self_attn.q_norm.weight"} <= names
    assert not any(n.startswith("embed") or "target" in n for n in names) and "d2t" not in names
    assert json.loads((tmp_path / "config.json").read_text())["tapdraft"]["family"] == "eagle3"


# -- the loop: exact resume and two DDP ranks --------------------------------------------------------
FAST = ["max_tokens=160", "max_batch_size=4", "warmup_steps=2", "progress=false", "log_every=1", "lr=3e-3",
        "num_steps=2", "ckpt_every=100"]


@pytest.fixture(scope="module")
def mem(tmp_path_factory):
    from tests.train.dflash_fixtures import tiny_dataset

    return tiny_dataset(tmp_path_factory.mktemp("e3"), n=12, min_len=16, max_len=28, tap_ids=(0, 1, 2, 3), top_k=4)


def _losses(run_dir):
    return [json.loads(line)["loss"] for line in open(run_dir / "metrics.jsonl")]


def test_resume_continues_exactly(tmp_path, mem):
    from tapdraft.train.config import load_run_config
    from tapdraft.train.loop import train

    run = load_run_config("eagle3_demo", overrides=FAST + ["max_steps=5", "draft_vocab=24"])
    train(run, mem.path, tmp_path / "full")
    train(run, mem.path, tmp_path / "cut", stop_at=2)
    assert train(run, mem.path, tmp_path / "cut")["resumed_from_step"] == 2
    assert _losses(tmp_path / "cut") == pytest.approx(_losses(tmp_path / "full"), rel=1e-6, abs=1e-7)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_worker(rank, world, port, root, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from tapdraft.train.config import load_run_config
    from tapdraft.train.loop import train

    train(load_run_config("eagle3_demo", overrides=FAST + ["max_steps=3", "device=cpu", "loss_type=lk",
                                                           "lk_lambda=adaptive"]), root, out)


@pytest.mark.slow
def test_loop_under_two_gloo_ranks(tmp_path, mem):
    from tapdraft.train.checkpoints import latest_checkpoint, load_checkpoint

    mp.spawn(_ddp_worker, args=(2, _free_port(), str(mem.path), str(tmp_path / "run")), nprocs=2, join=True)
    lines = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in lines] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in lines)
    assert len(load_checkpoint(latest_checkpoint(tmp_path / "run")).data_states) == 2
