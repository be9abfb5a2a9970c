"""MTP heads: alignment, losses against float64 references, teacher forms, refusals, eval chain, export."""

import json
import math

import pytest
import torch

from tapdraft.shards.bundle import TargetBundle
from tapdraft.shards.schema import Layout, teacher_rows
from tapdraft.train.data import collate
from tapdraft.train.drafters.base import combine_terms
from tapdraft.train.drafters.common.chain import IGNORE, depth_labels, doc_end_from_lengths, next_token_labels
from tapdraft.train.drafters.mtp.config import MTPConfig
from tapdraft.train.drafters.mtp.model import MTPDrafter, load_exported
from tapdraft.train.export import export_drafter

V, H, L = 40, 16, 4


def tiny_bundle(seed=0, scaling=1.0):
    g = torch.Generator().manual_seed(seed)
    cfg = {"model_type": "qwen3", "hidden_size": H, "num_hidden_layers": L, "vocab_size": V, "num_attention_heads": 2,
           "num_key_value_heads": 1, "head_dim": 8, "intermediate_size": 24, "rope_theta": 10000.0,
           "rms_norm_eps": 1e-6, "logits_scaling": scaling, "bos_token_id": None, "eos_token_id": 1, "pad_token_id": 0}
    return TargetBundle(config=cfg, audio={}, chat_template=None, embed_tokens=torch.randn(V, H, generator=g),
                        norm_weight=1 + 0.1 * torch.randn(H, generator=g), lm_head=torch.randn(V, H, generator=g) * 0.5)


def tiny_layout(**kw):
    base = dict(hidden_size=H, num_layers=L, tap_ids=(1, L - 1), top_k=V, audio_token_id=V - 1)
    base.update(kw)
    return Layout(**base)


def sample(T, seed, layout, bundle, audio_at=()):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, V - 1, (T,), generator=g).int()
    is_audio = torch.zeros(T, dtype=torch.bool)
    for a in audio_at:
        is_audio[a] = True
        ids[a] = layout.audio_token_id
    loss_mask = torch.rand(T, generator=g) < 0.8
    loss_mask[is_audio] = False
    loss_mask[0] = False
    taps = torch.randn(T, layout.n_taps, H, generator=g).bfloat16()
    s = {"sample_id": f"s{seed}", "source": "test", "audio_seconds": 0.0, "input_ids": ids, "is_audio": is_audio,
         "loss_mask": loss_mask, "taps": taps}
    if layout.has_audio_embeds:
        s["audio_embeds"] = torch.randn(int(is_audio.sum()), H, generator=g).bfloat16()
    if layout.top_k:
        rows = teacher_rows(loss_mask)
        last = taps[:, layout.last_layer_tap].float()
        h = last * torch.rsqrt(last.pow(2).mean(-1, keepdim=True) + 1e-6) * bundle.norm_weight
        lp = torch.log_softmax(h @ bundle.lm_head.T / float(bundle.config["logits_scaling"]), -1)[rows.long()]
        top = lp.topk(layout.top_k, dim=-1)
        s.update(topk_rows=rows, topk_ids=top.indices.int(), topk_logprobs=top.values.float())
    return s


def batch_of(layout, bundle, lengths=(9, 6), audio_at=((), ())):
    return collate([sample(T, i, layout, bundle, a) for i, (T, a) in enumerate(zip(lengths, audio_at))])


def test_alignment_fixture_packed():
    labels = torch.tensor([10, 11, 12, 20, 21])
    doc_end = torch.tensor([3, 3, 3, 5, 5])  # two packed sequences of lengths 3 and 2
    assert depth_labels(labels, doc_end, 1).tolist() == [11, 12, IGNORE, 21, IGNORE]
    assert depth_labels(labels, doc_end, 2).tolist() == [12, IGNORE, IGNORE, IGNORE, IGNORE]


def test_padded_targets_are_token_t_plus_k_plus_1():
    ids = torch.tensor([[5, 6, 7, 8, 9, 0], [3, 4, 5, 0, 0, 0]])
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [0, 1, 1, 0, 0, 0]], dtype=torch.bool)
    doc_end = doc_end_from_lengths(torch.tensor([5, 3]), 6)
    labels = next_token_labels(ids, mask, doc_end)
    assert labels.tolist() == [[6, 7, IGNORE, 9, IGNORE, IGNORE], [4, 5, IGNORE, IGNORE, IGNORE, IGNORE]]
    assert depth_labels(labels, doc_end, 1).tolist() == [[7, IGNORE, 9, IGNORE, IGNORE, IGNORE], [5] + [IGNORE] * 5]
    assert depth_labels(labels, doc_end, 3).tolist() == [[9] + [IGNORE] * 5, [IGNORE] * 6]


@torch.no_grad()
def _reference_ce(drafter, batch, subset=None):
    """Float64, per (b, t) loops from the definition; reuses only the head modules' weights. ``subset``: the draft
    vocabulary's target ids (a row whose label is outside carries no loss; the softmax runs over the subset)."""
    d = drafter
    rows = torch.arange(V) if subset is None else subset
    ids, lengths, mask = batch["input_ids"], batch["lengths"], batch["loss_mask"]
    last = batch["taps"][:, :, d.last_tap].double()
    emb_t = d.target.embed_tokens.double()
    eps = d.eps

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()

    total, counts = {}, {}
    for b in range(ids.shape[0]):
        n = int(lengths[b])
        h = rms(last[b, :n], d.target.norm_weight)
        for k in range(1, d.config.num_depths + 1):
            head = d.head(k)
            e = torch.zeros(n, H, dtype=torch.float64)
            e[: n - k] = emb_t[ids[b, k:n]]
            x = torch.cat([rms(e, head.enorm.weight), rms(h, head.hnorm.weight)], -1) @ head.eh_proj.weight.double().T
            pos = torch.arange(n)[None]
            h = super(type(head), head).forward(x[None], d.rope(pos), is_causal=True)[0]  # the plain decoder layer
            ce = 0.0
            c = 0
            for t in range(n):
                y = int(ids[b, t + k + 1]) if t + k + 1 < n else -1
                if t + k + 1 < n and bool(mask[b, t + k + 1]) and y in rows.tolist():
                    z = rms(h[t], head.shared_head.norm.weight) @ d.target.lm_head.double()[rows].T / d.logits_scaling
                    ce += (torch.logsumexp(z, 0) - z[rows.tolist().index(y)]).item()
                    c += 1
            total[k] = total.get(k, 0.0) + ce
            counts[k] = counts.get(k, 0) + c
    return total, counts


@pytest.mark.parametrize("repeated", [False, True])
def test_ce_loss_matches_float64_reference(repeated):
    torch.manual_seed(0)
    bundle, layout = tiny_bundle(scaling=2.0), tiny_layout()
    d = MTPDrafter.build(MTPConfig(num_depths=2, use_repeated_layer=repeated, chunk_rows=5), bundle, layout).double()
    d.target.to_dtype(torch.float64)
    assert len(d.model.layers) == (1 if repeated else 2)
    batch = batch_of(layout, bundle)
    batch["taps"] = batch["taps"].double()
    out = d(batch)
    ref, cnt = _reference_ce(d, batch)
    for k in (1, 2):
        s, c, w = out.terms[f"loss@{k}"]
        assert int(c) == cnt[k] > 0 and w == 0.5
        assert abs(s.item() - ref[k]) < 1e-6 * max(1.0, ref[k])  # layers.RMSNorm normalises in float32
    loss, _ = combine_terms(out.terms)
    loss.backward()
    assert all(p.grad is not None for p in d.parameters())
    assert not any(n.startswith(("embed", "lm_head", "norm_weight")) for n in d.state_dict())


def test_draft_vocabulary_loss_acceptance_and_export(tmp_path):
    """With ``draft_vocab`` the head scores only the subset's frozen rows: CE over them (a label outside carries no
    loss) equals the float64 reference, drafts are subset tokens (-inf elsewhere), a label outside is a miss, and the
    export carries the subset's rows and ``d2t`` for the tapdraft-vllm layout (other loaders are refused)."""
    from tapdraft.train.drafters.common.draft_vocab import DraftVocab
    from tapdraft.train.drafters.mtp.export import convert

    torch.manual_seed(8)
    bundle, layout = tiny_bundle(scaling=2.0), tiny_layout(top_k=0)
    subset = torch.tensor([1, 2, 3, 5, 8, 13, 21, 30, 34, 37])
    d = MTPDrafter.build(MTPConfig(num_depths=2, draft_vocab=10, chunk_rows=5), bundle, layout).double()
    d.target.to_dtype(torch.float64)
    d.set_draft_vocab(DraftVocab(subset, V))
    batch = batch_of(layout, bundle, lengths=(14, 11))
    batch["taps"] = batch["taps"].double()
    out = d(batch)
    ref, cnt = _reference_ce(d, batch, subset)
    full, _ = _reference_ce(d, batch)
    for k in (1, 2):
        s, c, _ = out.terms[f"loss@{k}"]
        assert int(c) == cnt[k] > 0 and abs(s.item() - ref[k]) < 1e-6 * max(1.0, ref[k])
        assert ref[k] != full[k]  # the subset's softmax, not the whole head's
    run = d.run_depths(batch)
    z = d.logits(1, run["h"][0][0])
    assert z.shape[-1] == V and torch.isinf(z[:, [i for i in range(V) if i not in subset.tolist()]]).all()
    acc = d.acceptance(batch)
    outside = (run["labels"][0] != IGNORE) & ~d.t2d[run["labels"][0].clamp(min=0)]
    assert bool(outside.any()) and int(acc.accepted[0]) <= int(acc.reached[0]) - int(outside.sum())
    one = MTPDrafter.build(MTPConfig(num_depths=1, draft_vocab=10), bundle, layout)  # vLLM's layout: one depth
    one.set_draft_vocab(DraftVocab(subset, V))
    export_drafter(one, tmp_path, {"source": "test"})
    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / "model.safetensors"))
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 10
    assert torch.equal(weights["d2t"] + torch.arange(10), subset)
    torch.testing.assert_close(weights["lm_head.weight"].double(), bundle.lm_head.double()[subset])
    vllm_w, vllm_cfg = convert(weights, cfg, "tapdraft-vllm")
    assert vllm_cfg["draft_vocab_size"] == 10 and "lm_head.weight" in vllm_w and "d2t" in vllm_w
    with pytest.raises(ValueError, match="draft vocabulary"):
        convert(weights, cfg, "nemo-salm")


def test_rerun_chain_is_what_incremental_drafting_computes():
    """``chain: rerun``: depth k >= 2 of the chain anchored at row t equals a per-anchor incremental draft, as vLLM's
    proposer runs it: depth 1 over rows 0..t (its keys cached), then the one layer rerun at positions t + 1, t + 2,
    ... on its own output and the drafted (here: the dataset's) tokens, attending the cache plus its own new keys."""
    torch.manual_seed(9)
    bundle, layout = tiny_bundle(), tiny_layout(top_k=0)
    d = MTPDrafter.build(MTPConfig(num_depths=3, use_repeated_layer=True, chain="rerun"), bundle, layout).double()
    d.target.to_dtype(torch.float64)
    batch = batch_of(layout, bundle, lengths=(10, 7))
    batch["taps"] = batch["taps"].double()
    run = d.run_depths(batch)
    head = d.head(1)
    emb = d.target.embed_tokens.double()[batch["input_ids"].long()]
    last = batch["taps"][:, :, d.last_tap]
    h0 = last * torch.rsqrt(last.pow(2).mean(-1, keepdim=True) + d.eps) * d.target.norm_weight.double()
    for b, n in enumerate(batch["lengths"].tolist()):
        for t in range(n - 3):
            rows = torch.arange(t + 1)
            h, kv = head.step(emb[b, 1 : t + 2][None], h0[b, : t + 1][None], d.rope(rows[None]), return_kv=True)
            torch.testing.assert_close(h[0, t], run["h"][0][b, t], rtol=1e-9, atol=1e-9)
            r = h[:, t : t + 1]
            for k in (2, 3):
                pos = torch.tensor([[t + k - 1]])
                r, new = head.step(emb[b, t + k : t + k + 1][None], r, d.rope(pos), cache=kv,
                                   mask=torch.ones(1, 1, 1, kv[0].shape[2] + 1, dtype=torch.bool), return_kv=True)
                kv = (torch.cat([kv[0], new[0]], 2), torch.cat([kv[1], new[1]], 2))
                torch.testing.assert_close(r[0, 0], run["h"][k - 1][b, t], rtol=1e-9, atol=1e-9)
    seq = MTPDrafter.build(MTPConfig(num_depths=3, use_repeated_layer=True), bundle, layout).double()
    seq.load_state_dict(d.state_dict())
    seq.target.to_dtype(torch.float64)
    assert not torch.allclose(seq.run_depths(batch)["h"][1], run["h"][1])  # the sequence chain is another model
    with pytest.raises(ValueError, match="use_repeated_layer: true"):
        MTPConfig(num_depths=2, chain="rerun")


def test_ce_gradients_match_dense_autograd_float64():
    """The fused CE's parameter gradients equal float64 autograd through dense logits + cross_entropy."""
    torch.manual_seed(0)
    bundle, layout = tiny_bundle(scaling=2.0), tiny_layout()
    d = MTPDrafter.build(MTPConfig(num_depths=2, chunk_rows=5), bundle, layout).double()
    d.target.to_dtype(torch.float64)
    batch = batch_of(layout, bundle)
    batch["taps"] = batch["taps"].double()
    loss, _ = combine_terms(d(batch).terms)
    loss.backward()
    fused = {n: p.grad.clone() for n, p in d.named_parameters()}
    d.zero_grad()
    run = d.run_depths(batch)
    terms = {}
    for k in (1, 2):
        lab = run["labels"][k - 1]
        rows = (lab != IGNORE).nonzero(as_tuple=True)
        ce = torch.nn.functional.cross_entropy(d.logits(k, run["h"][k - 1][rows]), lab[rows], reduction="sum")
        terms[k] = (ce, torch.tensor(float(rows[0].numel())), 0.5)
    ref, _ = combine_terms(terms)
    ref.backward()
    assert torch.allclose(loss.detach(), ref.detach(), atol=1e-10)
    for n, p in d.named_parameters():
        assert torch.allclose(fused[n], p.grad, atol=1e-10), n


def _teacher_p(d, batch, b, row):
    last = batch["taps"][b, row, d.last_tap].float()
    h = last * torch.rsqrt(last.pow(2).mean() + d.eps) * d.target.norm_weight
    return torch.softmax((h @ d.target.lm_head.T).double() / d.logits_scaling, -1)


@pytest.mark.parametrize("lam", [0.5, 0.2, "adaptive"])
def test_lk_loss_matches_float64_reference(lam):
    torch.manual_seed(1)
    bundle, layout = tiny_bundle(), tiny_layout()
    d = MTPDrafter.build(MTPConfig(num_depths=2, loss_type="lk", lk_lambda=lam, chunk_rows=4), bundle, layout)
    assert d.teacher_kind == "exact"
    batch = batch_of(layout, bundle)
    out = d(batch)
    run = d.run_depths(batch)
    for k in (1, 2):
        rows_kl, rows_tv = [], []
        lab = run["labels"][k - 1]
        for b, t in (lab != IGNORE).nonzero().tolist():
            p = _teacher_p(d, batch, b, t + k)
            q = torch.softmax(d.logits(k, run["h"][k - 1][b, t][None]).double()[0], -1)
            rows_kl.append((p * (p.log() - q.log())).sum().item())
            rows_tv.append(0.5 * (p - q).abs().sum().item())
        kl, tv = torch.tensor(rows_kl, dtype=torch.float64), torch.tensor(rows_tv, dtype=torch.float64)
        w = math.exp(-3.0 * float((1 - tv).mean())) if lam == "adaptive" else lam
        want = float((w * kl + (1 - w) * tv).sum())
        s, c, _ = out.terms[f"loss@{k}"]
        assert int(c) == len(rows_kl)
        assert abs(s.item() - want) < 1e-4 * max(1.0, want)
        acc_sum, acc_n = out.metrics[f"sampled_acceptance@{k}"]
        assert abs(float(acc_sum) / float(acc_n) - float((1 - tv).mean())) < 1e-4


def test_topk_teacher_with_full_vocab_equals_exact_and_lower_bound_with_small_k():
    torch.manual_seed(2)
    bundle = tiny_bundle()
    exact = MTPDrafter.build(MTPConfig(loss_type="lk", teacher="exact"), bundle, tiny_layout())
    topk = MTPDrafter.build(MTPConfig(loss_type="lk", teacher="topk"), bundle, tiny_layout())
    topk.load_state_dict(exact.state_dict())
    batch = batch_of(tiny_layout(), bundle)
    a, b = exact(batch).terms["loss@1"][0], topk(batch).terms["loss@1"][0]
    assert abs(a.item() - b.item()) < 1e-4 * max(1.0, a.item())
    # a small stored k lumps more: per-row KL and TV can only shrink (data-processing inequality)
    lay4 = tiny_layout(top_k=4)
    t4 = MTPDrafter.build(MTPConfig(loss_type="lk", teacher="topk"), bundle, lay4)
    t4.load_state_dict(exact.state_dict())
    b4 = batch_of(lay4, bundle)
    e4 = exact(b4)
    o4 = t4(b4)
    assert o4.terms["loss@1"][0].item() < e4.terms["loss@1"][0].item()
    assert float(o4.metrics["kl@1"][0]) < float(e4.metrics["kl@1"][0])
    # MTP always has the last hidden state, so 'auto' picks the exact teacher
    assert MTPDrafter.build(MTPConfig(loss_type="lk"), bundle, lay4).teacher_kind == "exact"


def test_audio_rows_masked_without_embeds_and_used_with_them():
    torch.manual_seed(3)
    bundle = tiny_bundle()
    lay = tiny_layout(top_k=0)
    d = MTPDrafter.build(MTPConfig(num_depths=1), bundle, lay)
    batch = batch_of(lay, bundle, lengths=(10, 7), audio_at=((2, 3, 4), ()))
    batch["loss_mask"][0, :] = True
    out = d(batch)
    masked, seen = out.metrics["rows_audio_masked"]
    # rows t = 1, 2, 3 read audio inputs at t + 1 = 2, 3, 4 and have supervised targets at t + 2
    assert int(masked) == 3 and int(seen) == int(out.terms["loss@1"][1]) + 3
    lay_e = tiny_layout(top_k=0, has_audio_embeds=True)
    d_e = MTPDrafter.build(MTPConfig(num_depths=1), bundle, lay_e)
    b_e = batch_of(lay_e, bundle, lengths=(10, 7), audio_at=((2, 3, 4), ()))
    b_e["loss_mask"][0, :] = True
    out_e = d_e(b_e)
    assert int(out_e.metrics["rows_audio_masked"][0]) == 0
    assert int(out_e.terms["loss@1"][1]) == int(out.terms["loss@1"][1]) + 3
    # the stored audio embedding is what enters at those rows
    emb, unknown = d_e.input_embeds(b_e)
    assert not unknown.any() and torch.equal(emb[0, 2], b_e["audio_embeds"][0, 2].float())


def test_config_refusals():
    with pytest.raises(ValueError, match="head_only"):
        MTPConfig(loss_type="lk", training_mode="full")
    with pytest.raises(ValueError, match="head_only"):
        MTPConfig(training_mode="full")
    with pytest.raises(ValueError, match="lk_lambda"):
        MTPConfig(loss_type="lk", lk_lambda=2.0)
    with pytest.raises(ValueError, match="num_depths"):
        MTPConfig(num_depths=0)
    with pytest.raises(ValueError, match="loss_type: ce"):
        MTPConfig(loss_type="lk", draft_vocab=8)
    assert MTPConfig(lk_lambda="adaptive").lk_lambda == "adaptive"
    with pytest.raises(ValueError, match="last layer"):
        MTPDrafter.build(MTPConfig(), tiny_bundle(), tiny_layout(tap_ids=(1,)))
    with pytest.raises(ValueError, match="top_k"):
        MTPDrafter.build(MTPConfig(loss_type="lk", teacher="topk"), tiny_bundle(), tiny_layout(top_k=0))


def test_acceptance_chains_depths():
    torch.manual_seed(4)
    bundle, layout = tiny_bundle(), tiny_layout(top_k=0)
    d = MTPDrafter.build(MTPConfig(num_depths=3), bundle, layout)
    batch = batch_of(layout, bundle, lengths=(12, 9))
    batch["loss_mask"][:] = True
    acc = d.acceptance(batch)
    run = d.run_depths(batch)
    preds = []
    for k in (1, 2, 3):
        z = torch.stack([d.logits(k, run["h"][k - 1][b]) for b in range(2)])
        preds.append(z.argmax(-1))
    for k in range(3):
        ok = torch.ones(2, 12, dtype=torch.bool)
        for j in range(k):
            ok &= (run["labels"][j] != IGNORE) & (preds[j] == run["labels"][j])
        v = run["labels"][k] != IGNORE
        assert int(acc.reached[k]) == int((ok & v).sum())
        assert int(acc.accepted[k]) == int((ok & v & (preds[k] == run["labels"][k])).sum())
    assert (acc.accepted <= acc.reached).all() and acc.blocks == int(acc.valid[0])


def test_export_roundtrip_reproduces_logits(tmp_path):
    torch.manual_seed(5)
    bundle, layout = tiny_bundle(), tiny_layout(top_k=0)
    d = MTPDrafter.build(MTPConfig(num_depths=2), bundle, layout)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(0.01 * torch.randn_like(p))
    export_drafter(d, tmp_path, {"source": "test"})
    import json

    from safetensors.torch import load_file

    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["mtp_concat_order"] == "embedding_first" and cfg["num_nextn_predict_layers"] == 2
    assert cfg["first_mtp_layer_index"] == L and cfg["tapdraft"]["source"] == "test"
    names = set(load_file(str(tmp_path / "model.safetensors")))
    for want in (f"model.layers.{L}.eh_proj.weight", f"model.layers.{L}.enorm.weight", f"model.layers.{L}.hnorm.weight",
                 f"model.layers.{L + 1}.shared_head.norm.weight", f"model.layers.{L}.self_attn.q_proj.weight",
                 f"model.layers.{L}.mlp.gate_proj.weight", f"model.layers.{L}.input_layernorm.weight"):
        assert want in names, want
    assert not any("embed" in n or "lm_head" in n for n in names)
    # eh_proj's first H input columns act on the embedding: zeroing them must remove the embedding's effect
    back = load_exported(tmp_path, bundle, layout)
    batch = batch_of(layout, bundle)
    r1, r2 = d.run_depths(batch), back.run_depths(batch)
    for k in (1, 2):
        torch.testing.assert_close(d.logits(k, r1["h"][k - 1]), back.logits(k, r2["h"][k - 1]), rtol=0, atol=0)
    with torch.no_grad():
        back.head(1).eh_proj.weight[:, :H] = 0
    b2 = dict(batch)
    b2["input_ids"] = torch.randint(2, V - 1, batch["input_ids"].shape)
    h_a = back.run_depths(batch)["h"][0]
    h_b = back.run_depths(b2)["h"][0]
    torch.testing.assert_close(h_a, h_b)


def test_batch_without_supervised_rows_still_reaches_every_parameter():
    torch.manual_seed(6)
    bundle, layout = tiny_bundle(), tiny_layout(top_k=0)
    d = MTPDrafter.build(MTPConfig(num_depths=2), bundle, layout)
    batch = batch_of(layout, bundle)
    batch["loss_mask"][:] = False
    out = d(batch)
    assert all(int(c) == 0 for _, c, _ in out.terms.values())
    loss, _ = combine_terms(out.terms)
    loss.backward()
    assert all(p.grad is not None for p in d.parameters())


def test_sampled_acceptance_is_one_minus_tv_of_exact_rows():
    torch.manual_seed(7)
    bundle, layout = tiny_bundle(), tiny_layout()
    d = MTPDrafter.build(MTPConfig(num_depths=2, loss_type="lk", lk_lambda=0.0), bundle, layout)
    batch = batch_of(layout, bundle)
    s, c = d.sampled_acceptance(batch)
    out = d(batch)  # lambda 0: the LK term is the sum of TV over the same rows
    for k in (1, 2):
        tv_sum, n = out.terms[f"loss@{k}"][0].item(), int(out.terms[f"loss@{k}"][1])
        assert int(c[k - 1]) == n and abs(float(s[k - 1]) - (n - tv_sum)) < 1e-4
