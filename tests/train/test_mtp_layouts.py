"""MTP exports in the layouts real loaders read: the exact key lists and config fields, written out from each
loader's source, and the exported weights run through a float64 reference of that loader's forward.

Key lists (literal, not derived from the product):
- vLLM ``vllm/model_executor/models/qwen3_next_mtp.py`` (``Qwen3NextMultiTokenPredictor``): ``fc``,
  ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``, ``norm`` and ``layers.{i}`` (a full-attention
  ``Qwen3NextDecoderLayer``: input_layernorm, self_attn.{q,k,v,o}_proj, q_norm, k_norm,
  post_attention_layernorm, dense mlp.{gate,up,down}_proj), all under ``mtp.``; every norm a GemmaRMSNorm (1 + w).
- NeMo speechlm2 SALM checkpoints: ``llm.`` + NeMo Automodel's ``MTPModule`` flat ``mtp.layers.{i}`` with the fusion
  (``enorm``, ``hnorm``, ``eh_proj``) and ``final_layernorm`` on the depth's sublayer
  (``nemo_automodel/components/models/common/mtp/mtp.py``), root ``mtp`` config block.
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.train.dflash_fixtures import away_from_init
from tests.train.test_mtp import L, batch_of, tiny_bundle, tiny_layout
from tapdraft.train.drafters.mtp.config import MTPConfig
from tapdraft.train.drafters.mtp.model import MTPDrafter
from tapdraft.train.export import export_drafter

BLOCK = ["input_layernorm.weight", "mlp.down_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
         "post_attention_layernorm.weight", "self_attn.k_norm.weight", "self_attn.k_proj.weight",
         "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.q_proj.weight", "self_attn.v_proj.weight"]
VLLM_QWEN3_NEXT_KEYS = sorted(["mtp.fc.weight", "mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight",
                               "mtp.pre_fc_norm_hidden.weight"] + [f"mtp.layers.0.{b}" for b in BLOCK])
NEMO_SALM_KEYS = sorted(f"llm.mtp.layers.{i}.{b}" for i in range(2)
                        for b in BLOCK + ["eh_proj.weight", "enorm.weight", "final_layernorm.weight", "hnorm.weight"])


def _head(cfg, scaling=1.0, seed=3):
    torch.manual_seed(seed)
    bundle, layout = tiny_bundle(scaling=scaling), tiny_layout(top_k=0)
    return away_from_init(MTPDrafter.build(cfg, bundle, layout), 0.2, seed), bundle, layout


def _export(d, tmp_path, layout):
    export_drafter(d, tmp_path, {}, layout=layout)
    return json.loads((tmp_path / "config.json").read_text()), load_file(str(tmp_path / "model.safetensors"))


# ------------------------------------------------------------------ float64 reference of vLLM's Qwen3-Next MTP


def _gemma_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def _rope(x, pos, theta):  # x [T, heads, D], rotate-half layout, full rotary dim (partial_rotary_factor 1)
    D = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    f = pos[:, None].double() * inv
    cos, sin = torch.cat([f, f], -1).cos()[:, None], torch.cat([f, f], -1).sin()[:, None]
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _layer(x, w, p, cfg):  # Qwen3NextDecoderLayer(full_attention), attn_output_gate off, dense MLP, causal
    eps, nh, nkv, hd = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    T = x.shape[0]
    h = _gemma_norm(x, w[p + "input_layernorm.weight"], eps)
    q = (h @ w[p + "self_attn.q_proj.weight"].T).view(T, nh, hd)
    k = (h @ w[p + "self_attn.k_proj.weight"].T).view(T, nkv, hd)
    v = (h @ w[p + "self_attn.v_proj.weight"].T).view(T, nkv, hd)
    q, k = _gemma_norm(q, w[p + "self_attn.q_norm.weight"], eps), _gemma_norm(k, w[p + "self_attn.k_norm.weight"], eps)
    pos = torch.arange(T)
    q, k = _rope(q, pos, cfg["rope_theta"]), _rope(k, pos, cfg["rope_theta"])
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    s = torch.einsum("thd,shd->hts", q, k) / hd**0.5
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    a = torch.einsum("hts,shd->thd", s.softmax(-1), v).reshape(T, nh * hd) @ w[p + "self_attn.o_proj.weight"].T
    x = x + a
    h = _gemma_norm(x, w[p + "post_attention_layernorm.weight"], eps)
    m = torch.nn.functional.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)
    return x + m @ w[p + "mlp.down_proj.weight"].T


def _vllm_qwen3_next_logits(w, cfg, bundle, ids, h0, steps):
    """Step k's logits at every position: fc(cat[norm_e(emb(x_{t+k})), norm_h(h)]) -> layer -> norm; the normed
    output is the next step's hidden (spec_step_idx % num_mtp_layers picks the layer); logits = lm_head only."""
    w = {k: v.double() for k, v in w.items()}
    eps, out, h = cfg["rms_norm_eps"], [], h0.double()
    emb = bundle.embed_tokens.double()
    for k in range(1, steps + 1):
        e = emb[torch.cat([ids[k:], ids.new_zeros(k)])]
        x = torch.cat([_gemma_norm(e, w["mtp.pre_fc_norm_embedding.weight"], eps),
                       _gemma_norm(h, w["mtp.pre_fc_norm_hidden.weight"], eps)], -1) @ w["mtp.fc.weight"].T
        x = _layer(x, w, f"mtp.layers.{(k - 1) % cfg['num_nextn_predict_layers']}.", cfg)
        h = _gemma_norm(x, w["mtp.norm.weight"], eps)
        out.append(h @ bundle.lm_head.double().T)
    return out


@pytest.mark.parametrize("scaling,cfg", [(1.7, MTPConfig(num_depths=1)),
                                         (1.0, MTPConfig(num_depths=3, use_repeated_layer=True,
                                                         recursion="post_norm"))])
def test_vllm_qwen3_next_layout_loads_with_exact_keys_and_logits(tmp_path, scaling, cfg):
    d, bundle, layout = _head(cfg, scaling)
    conf, w = _export(d, tmp_path, "vllm-qwen3-next")
    assert sorted(w) == VLLM_QWEN3_NEXT_KEYS  # zero missing, zero unexpected
    assert conf["architectures"] == ["Qwen3NextMTP"] and conf["model_type"] == "qwen3_next"
    assert conf["num_nextn_predict_layers"] == 1 and conf["num_speculative_steps"] == cfg.num_depths
    assert conf["num_hidden_layers"] == L and conf["attn_output_gate"] is False and conf["num_experts"] == 0
    assert conf["partial_rotary_factor"] == 1.0 and conf["rope_parameters"]["partial_rotary_factor"] == 1.0
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                "rms_norm_eps", "rope_theta", "vocab_size", "max_position_embeddings"):
        assert key in conf
    batch = batch_of(layout, bundle, lengths=(9,))
    with torch.no_grad():
        h = d.run_depths(batch)["h"]
        ours = [d.logits(k + 1, h[k][0]).double() for k in range(cfg.num_depths)]
        from tapdraft.shards.head import final_norm

        h0 = final_norm(d.last_hidden(batch)[0].float(), d.target.norm_weight.float(), d.head_spec)
    ref = _vllm_qwen3_next_logits(w, conf, bundle, batch["input_ids"][0].long(), h0, cfg.num_depths)
    for k in range(cfg.num_depths):
        T = 9 - (k + 1)  # positions whose input x_{t+k} exists
        torch.testing.assert_close(ref[k][:T], ours[k][:T], rtol=1e-4, atol=1e-4)
        # sampling agrees, not only argmax: the engine's softmax(logits / T) is tapdraft's
        torch.testing.assert_close(torch.softmax(ref[k][:T] / 0.7, -1), torch.softmax(ours[k][:T] / 0.7, -1),
                                   rtol=1e-4, atol=1e-5)


def test_nemo_salm_layout_has_exact_keys_and_root_mtp_block(tmp_path):
    d, _, _ = _head(MTPConfig(num_depths=2, recursion="post_norm", loss_type="lk", lk_lambda=0.3))
    conf, w = _export(d, tmp_path, "nemo-salm")
    assert sorted(w) == NEMO_SALM_KEYS
    assert conf["mtp"] == {"enabled": True, "num_layers": 2, "layer_pattern": "*", "use_repeated_layer": False,
                           "training_mode": "head_only", "loss_type": "lk", "lk_lambda": 0.3}
    L0 = f"model.layers.{L}."
    torch.testing.assert_close(w["llm.mtp.layers.0.eh_proj.weight"], d.state_dict()[L0 + "eh_proj.weight"].float())
    torch.testing.assert_close(w["llm.mtp.layers.1.final_layernorm.weight"],
                               d.state_dict()[f"model.layers.{L + 1}.shared_head.norm.weight"].float())
    rep, _, _ = _head(MTPConfig(num_depths=3, use_repeated_layer=True, recursion="post_norm"))
    conf_r, w_r = _export(rep, tmp_path / "rep", "nemo-salm")
    assert conf_r["mtp"]["num_layers"] == 1 and conf_r["mtp"]["use_repeated_layer"] is True
    assert {k.split(".")[3] for k in w_r} == {"0"}


def test_repeated_layer_never_claims_more_layers_than_it_exports(tmp_path):
    d, _, _ = _head(MTPConfig(num_depths=2, use_repeated_layer=True))
    conf, w = _export(d, tmp_path, None)
    assert conf["num_nextn_predict_layers"] == 1 and conf["num_speculative_steps"] == 2
    assert {k.split(".")[2] for k in w} == {str(L)}


def test_layouts_refuse_what_they_cannot_express(tmp_path):
    chained, _, _ = _head(MTPConfig(num_depths=2, use_repeated_layer=True))  # DeepSeek recursion
    with pytest.raises(ValueError, match="recursion: post_norm"):
        _export(chained, tmp_path, "vllm-qwen3-next")
    two, _, _ = _head(MTPConfig(num_depths=2, recursion="post_norm"))
    with pytest.raises(ValueError, match="use_repeated_layer"):
        _export(two, tmp_path, "vllm-qwen3-next")
    with pytest.raises(ValueError, match="unknown MTP layout"):
        _export(two, tmp_path, "sglang")


# ------------------------------------------------------------------ tapdraft-vllm: the plugin's TapdraftMTPForCausalLM


def test_tapdraft_vllm_layout_keeps_the_names_and_folds_the_logits_scaling(tmp_path):
    """The checkpoint's own names under a Qwen3 block's config naming the plugin's class; the target's lm_head
    alone on the exported output norm gives tapdraft's logits (the scaling folded in); the head's audio input and
    how vLLM serves it are stated."""
    scaling = 1.7
    d, bundle, layout = _head(MTPConfig(num_depths=1, loss_type="lk"), scaling)
    cfg, w = _export(d, tmp_path, "tapdraft-vllm")
    native = d.trainable_state_dict()
    assert sorted(w) == sorted(native) == sorted(f"model.layers.{L}.{b}" for b in
                                                 BLOCK + ["eh_proj.weight", "enorm.weight", "hnorm.weight",
                                                          "shared_head.norm.weight"])
    assert cfg["architectures"] == ["TapdraftMTPForCausalLM"] and cfg["model_type"] == "qwen3"
    assert (cfg["first_mtp_layer_index"], cfg["num_hidden_layers"], cfg["num_nextn_predict_layers"]) == (L, L, 1)
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": bundle.config["rope_theta"]}
    assert cfg["tapdraft"]["serve_with"] == {"vllm": {"method": "mtp", "num_speculative_tokens": 1}}
    assert cfg["tapdraft"]["block_size"] == {"vllm": 2}
    assert cfg["tapdraft"]["audio_embeds"] is False
    norm = f"model.layers.{L}.shared_head.norm.weight"
    for k in native:
        if k != norm:
            assert torch.equal(w[k], native[k].float()), k
    h = torch.randn(5, bundle.config["hidden_size"], dtype=torch.float64)
    ours = d.double().logits(1, h.double())
    x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + bundle.config["rms_norm_eps"]) * w[norm].double()
    assert torch.allclose(x @ bundle.lm_head.double().T, ours, atol=1e-9)


def test_tapdraft_vllm_layout_refuses_what_vllm_would_serve_differently(tmp_path):
    two, _, _ = _head(MTPConfig(num_depths=2, recursion="post_norm"))
    with pytest.raises(ValueError, match="chain: rerun"):
        _export(two, tmp_path, "tapdraft-vllm")
    rerun, _, _ = _head(MTPConfig(num_depths=2, use_repeated_layer=True, chain="rerun"))
    cfg, _ = _export(rerun, tmp_path / "rerun", "tapdraft-vllm")  # what vLLM's proposer computes: served with 2
    assert cfg["mtp_chain"] == "rerun" and cfg["tapdraft"]["serve_with"]["vllm"]["num_speculative_tokens"] == 2
