"""A DFlash2 export in the public reference layout (NVIDIA-NeMo/Automodel,
nemo_automodel/components/speculative/dflash/draft_qwen3_dflash2.py on top of draft_qwen3.py): the exact key
list, shapes and config fields its ``Qwen3DFlash2DraftModel`` builds and reads, written out here from that
source, and a float64 re-implementation of its documented forward and selector walk, run on nothing but the
export and the target's embedding and lm_head, equals tapdraft's drafts, logits and sampling distributions."""

import json

import pytest
import torch
import torch.nn.functional as F

from tests.train.dflash_fixtures import away_from_init, synthetic_samples, tiny_bundle, tiny_layout
from tapdraft.train.drafters.common.export_files import load_export
from tapdraft.train.drafters.dflash2.config import DFlash2Config
from tapdraft.train.drafters.dflash2.model import DFlash2Drafter
from tapdraft.train.export import export_drafter

B, LAYERS = 4, 2


def reference_keys(layers: int) -> list[str]:
    """Every tensor ``Qwen3DFlash2DraftModel.state_dict()`` holds (DFlash's Qwen3 stack with fc / hidden_norm /
    norm, no embedding or lm_head; per layer the two convolutions; the candidate selector; RoPE's inv_freq is a
    non-persistent buffer)."""
    per_layer = [
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "self_attn.q_norm.weight", "self_attn.k_norm.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
        "input_layernorm.weight", "post_attention_layernorm.weight",
        "attention_conv.base_kernel", "attention_conv.kernel_projection.weight",
        "mlp_conv.base_kernel", "mlp_conv.kernel_projection.weight",
    ]
    keys = [f"layers.{i}.{k}" for i in range(layers) for k in per_layer]
    keys += ["fc.weight", "hidden_norm.weight", "norm.weight", "candidate_selector.predecessor_codebook",
             "candidate_selector.successor_codebook", "candidate_selector.hidden_projection.weight"]
    return sorted(keys)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("d2ref")
    bundle = tiny_bundle(root, scaling=1.7)  # a target that scales its logits: the fold must hold for the selector
    layout = tiny_layout(bundle, tap_ids=(1, 2, 3))
    torch.manual_seed(0)
    cfg = DFlash2Config(num_layers=LAYERS, block_size=B, target_layer_ids=(1, 2), chunk_rows=0,
                        selector_candidates=5, selector_rank=8, conv_group_size=8)
    model = away_from_init(DFlash2Drafter.build(cfg, bundle, layout), 0.3)
    export_drafter(model, root / "export", {})
    sample = synthetic_samples(bundle, layout, 1, min_len=30, max_len=30, seed=3)[0]
    return model, bundle, root / "export", sample


def test_export_has_exactly_the_reference_keys_and_config(exported):
    from transformers import Qwen3Config

    model, bundle, export, _ = exported
    cfg, weights = load_export(export)
    assert sorted(weights) == reference_keys(LAYERS)  # zero missing, zero unexpected
    H, V = bundle.hidden_size, bundle.vocab_size
    dc = cfg["dflash_config"]
    K, gs, r = dc["conv_kernel_size"], dc["conv_group_size"], dc["selector_rank"]
    assert (K, gs, r, dc["selector_top_k"]) == (2, 8, 8, 5)
    assert "projector_type" not in dc  # the reference refuses any projector on DFlash2
    assert dc["target_layer_ids"] == [1, 2] and dc["mask_token_id"] == model.config.mask_token_id
    # the name engines key on (vLLM's registry and V2-runner switch, exllamav3); Automodel's class loads by class
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["tapdraft"]["serve_with"]["vllm"] == {"method": "dflash", "num_speculative_tokens": B - 1}
    assert cfg["block_size"] == B and "auto_map" not in cfg
    for i in range(LAYERS):
        for conv in ("attention_conv", "mlp_conv"):
            assert tuple(weights[f"layers.{i}.{conv}.base_kernel"].shape) == (2, K, H)
            assert tuple(weights[f"layers.{i}.{conv}.kernel_projection.weight"].shape) == (2 * K * (H // gs), H)
    assert tuple(weights["candidate_selector.predecessor_codebook"].shape) == (V, r)
    assert tuple(weights["candidate_selector.successor_codebook"].shape) == (V, r)
    assert tuple(weights["candidate_selector.hidden_projection.weight"].shape) == (r, H)
    assert tuple(weights["fc.weight"].shape) == (H, 2 * H)
    # the reference builds its config as a Qwen3Config and reads these attributes from it
    qc = Qwen3Config.from_dict(cfg)
    assert (qc.hidden_size, qc.num_hidden_layers, qc.vocab_size, qc.block_size) == (H, LAYERS, V, B)
    assert qc.dflash_config["selector_top_k"] == 5 and qc.head_dim == cfg["head_dim"]


def _rms(x, w, eps):
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def _rope(x, pos, theta):
    """Rotate-half RoPE of x [n, heads, d] at positions pos [n]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.cat([pos[:, None].double() * inv] * 2, -1)[:, None]
    rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * ang.cos() + rot * ang.sin()


def _conv(v, dyn, base, gs):
    """out_t = sum_o (base[o] + dyn_t[o, group]) * v_{t-o}, zero before the block's start; v [B, H], dyn [B, K, G]."""
    out = torch.zeros_like(v)
    for t in range(v.shape[0]):
        for o in range(base.shape[0]):
            if t >= o:
                out[t] += (base[o] + dyn[t, o].repeat_interleave(gs)) * v[t - o]
    return out


def reference_forward(cfg, W, target_hidden, noise, positions):
    """The reference draft's forward for one block, float64: target_hidden [C, n*H] (context rows before the
    anchor), noise [B, H] (embedded anchor + mask tokens), positions [C + B]. Returns the final-normed hidden
    states [B, H] the engine feeds to the target's lm_head and to the selector."""
    W = {k: v.double() for k, v in W.items()}
    dc = cfg["dflash_config"]
    K, gs, eps = dc.get("conv_kernel_size", 2), dc.get("conv_group_size", 16), cfg["rms_norm_eps"]
    nh, nkv, hd, theta = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["rope_theta"]
    ctx = _rms(target_hidden.double() @ W["fc.weight"].T, W["hidden_norm.weight"], eps)
    x, C, Bq = noise.double(), ctx.shape[0], noise.shape[0]
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."

        def around(sub, h, conv):
            G = h.shape[-1] // gs
            dyn = (h @ W[p + conv + ".kernel_projection.weight"].T).view(Bq, 2, K, G)
            base = W[p + conv + ".base_kernel"]
            return _conv(sub(_conv(h, dyn[:, 0], base[0], gs)), dyn[:, 1], base[1], gs)

        def attention(h):
            q = _rms((h @ W[p + "self_attn.q_proj.weight"].T).view(Bq, nh, hd), W[p + "self_attn.q_norm.weight"], eps)
            kv_in = torch.cat([ctx, h])
            k = _rms((kv_in @ W[p + "self_attn.k_proj.weight"].T).view(C + Bq, nkv, hd),
                     W[p + "self_attn.k_norm.weight"], eps)
            v = (kv_in @ W[p + "self_attn.v_proj.weight"].T).view(C + Bq, nkv, hd)
            q, k = _rope(q, positions[C:], theta), _rope(k, positions, theta)
            k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
            att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / hd ** 0.5, -1)  # the whole block, non-causal
            return torch.einsum("hqk,khd->qhd", att, v).reshape(Bq, nh * hd) @ W[p + "self_attn.o_proj.weight"].T

        def mlp(h):
            return (F.silu(h @ W[p + "mlp.gate_proj.weight"].T) * (h @ W[p + "mlp.up_proj.weight"].T)) \
                @ W[p + "mlp.down_proj.weight"].T

        x = x + around(attention, _rms(x, W[p + "input_layernorm.weight"], eps), "attention_conv")
        x = x + around(mlp, _rms(x, W[p + "post_attention_layernorm.weight"], eps), "mlp_conv")
    return _rms(x, W["norm.weight"], eps)


def reference_walk(cfg, W, h, logits, anchor, temperature):
    """The reference selector's walk over the draft slots: h [D, H], logits [D, V] (lm_head only), from the anchor.
    Greedy tokens, or at temperature t the per-slot softmax(S / t) over the top-k candidates along the greedy path."""
    A, Bc = W["candidate_selector.predecessor_codebook"].double(), W["candidate_selector.successor_codebook"].double()
    gate_h = h @ W["candidate_selector.hidden_projection.weight"].double().T
    unary, cand = logits.topk(cfg["dflash_config"]["selector_top_k"], dim=-1)
    prev, tokens, probs = anchor, [], []
    for k in range(h.shape[0]):
        S = unary[k] + (Bc[cand[k]] * (A[prev] * gate_h[k])).sum(-1)
        probs.append(torch.zeros(logits.shape[-1], dtype=torch.float64).scatter(0, cand[k],
                                                                                torch.softmax(S / temperature, -1)))
        prev = int(cand[k, int(S.argmax())])
        tokens.append(prev)
    return tokens, torch.stack(probs)


def test_reference_forward_on_the_export_equals_tapdraft(exported):
    model, bundle, export, sample = exported
    cfg, W = load_export(export)
    lm_head = bundle.lm_head.double()
    taps = sample["taps"].float()
    for P in (6, 17, 25):
        ids = sample["input_ids"][: P + 1].long()
        block = torch.full((B,), cfg["dflash_config"]["mask_token_id"])
        block[0] = ids[P]
        h = reference_forward(cfg, W, taps[:P][:, list(model.tap_index)].reshape(P, -1),
                              bundle.embed_tokens[block].double(), torch.cat([torch.arange(P), torch.arange(P, P + B)]))
        ref_logits = h[1:] @ lm_head.T  # the engine applies the target's lm_head only
        with torch.no_grad():
            b, anchors = model._live_block(ids, taps[:P])
            ours_h = model.block_hidden(b["input_ids"], model.context(b["taps"]), anchors)[0, 0, 1:]
            ours = model.logits(ours_h)
        torch.testing.assert_close(ref_logits, ours.double(), rtol=1e-4, atol=1e-5)
        tokens, _ = reference_walk(cfg, W, h[1:], ref_logits, int(ids[P]), 1.0)
        assert tokens == model.propose(ids, taps[:P])[0].tolist()
        for T in (0.6, 1.0):  # sampling: along the greedy path the selector's distributions are tapdraft's q
            greedy = torch.tensor([int(ids[P])] + tokens)
            _, ref_q = reference_walk(cfg, W, h[1:], ref_logits, int(ids[P]), T)
            with torch.no_grad():
                q = torch.stack([torch.softmax(model.slot_logits(ours_h[k: k + 1], greedy[k: k + 1], T)[0], -1)
                                 for k in range(B - 1)])
            torch.testing.assert_close(ref_q, q.double(), rtol=1e-4, atol=1e-6)


def test_fresh_export_is_the_reference_identity_start(exported, tmp_path):
    """Fresh, the reference's convolutions pass their input through (base kernel (1, 0), zero projection) and its
    selector's successor codebook is zero: a fresh tapdraft DFlash2 exports exactly that start."""
    model, bundle, _, _ = exported
    fresh = DFlash2Drafter.build(model.config, bundle, tiny_layout(bundle, tap_ids=(1, 2, 3)))
    export_drafter(fresh, tmp_path, {})
    cfg, W = load_export(tmp_path)
    for i in range(LAYERS):
        for conv in ("attention_conv", "mlp_conv"):
            base = W[f"layers.{i}.{conv}.base_kernel"]
            assert bool((base[:, 0] == 1).all()) and bool((base[:, 1:] == 0).all())
            assert bool((W[f"layers.{i}.{conv}.kernel_projection.weight"] == 0).all())
    assert bool((W["candidate_selector.successor_codebook"] == 0).all())
    assert abs(float(W["candidate_selector.predecessor_codebook"].std()) - 0.02) < 0.005
    assert json.loads((tmp_path / "config.json").read_text())["logits_scaling_compensated_in"] == [
        "candidate_selector.hidden_projection.weight"]
