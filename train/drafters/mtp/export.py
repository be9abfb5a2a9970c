"""MTP export layouts: the trained heads rewritten for the loaders that serve them, selected by ``--layout``.

A checkpoint keeps DeepSeek-V3 names (``model.layers.{L + i}.{enorm, hnorm, eh_proj, shared_head.norm,
self_attn.*, mlp.*, ...}``, ``train.drafters.mtp.model``). :func:`convert` turns (weights, export config) into one of:

``deepseek``  the checkpoint's own names, as DeepSeek-V3-style MTP loaders read them (vLLM
    ``deepseek_mtp.py``: ``model.layers.{L + i}.{enorm, hnorm, eh_proj, shared_head.norm}`` + block).
    Written for every head; engines load it only with a DeepSeek-style block, which a Qwen3 head is not
    (its attention has QK-norm and GQA, not MLA), so it is tapdraft's and converters' layout.

``vllm-qwen3-next``  vLLM's Qwen3-Next MTP (``vllm/model_executor/models/qwen3_next_mtp.py``,
    ``Qwen3NextMultiTokenPredictor``): ``mtp.fc`` (2H -> H on concat[embedding, hidden], embedding
    first, as ours), ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, ``mtp.norm`` and
    ``mtp.layers.{i}`` holding a ``Qwen3NextDecoderLayer(layer_type="full_attention")``; its loader
    renames ``mtp.`` to ``model.`` and loads by name. Facts a Qwen3 head needs to match exactly:
    every RMSNorm there is ``GemmaRMSNorm`` (scales by 1 + w), so norms are exported as w - 1; the
    attention's output gate is off (``attn_output_gate: false``) and RoPE covers the whole head
    (``partial_rotary_factor: 1.0``); the MLP is dense (``num_experts: 0``); step k reads step
    k-1's NORMED output (``self.norm`` runs inside forward), so heads with several depths must be
    trained with ``recursion: post_norm``; ``num_nextn_predict_layers`` counts physical layers and
    vLLM cycles them (``spec_step_idx % num_mtp_layers``).

``nemo-salm``  a NeMo speechlm2 SALM checkpoint's MTP part: every LLM weight carries ``llm.``
    (NeMo ``speechlm2/vllm/salm`` MTP loader: ``llm.mtp.layers.0.*`` -> ``mtp.layers.0.*``), and
    NeMo Automodel's ``MTPModule`` (``components/models/common/mtp/mtp.py``) stores one flat
    sublayer per depth (layer pattern ``*``) with the fusion modules on it (``enorm``, ``hnorm``,
    ``eh_proj``) and ``final_layernorm`` (applied inside the sublayer, so the next depth reads the
    normed output: ``recursion: post_norm`` for several depths); the block keeps the LLM's HF decoder
    names (Qwen3: plain RMSNorm). ``use_repeated_layer`` keeps one physical depth, as Automodel's
    ``build_mtp_config_from_hf(use_repeated_layer=True)`` expects (the export retains physical
    depths only). The root ``mtp`` block carries the SALM recipe's fields (enabled, training_mode,
    loss_type, lk_lambda) plus num_layers / layer_pattern / use_repeated_layer.

``tapdraft-vllm``  the checkpoint's own names (as ``deepseek``) under a Qwen3 block's config
    (``model_type: qwen3``, ``architectures: [TapdraftMTPForCausalLM]``), served by vLLM's MTP path through the
    project's plugin (``engines/vllm_plugin/tapdraft_vllm/mtp.py``, which computes exactly this head over any dense
    target vLLM serves: the target's final-normed last hidden state is h^0). One depth, or several trained with
    ``chain: rerun`` (one layer rerun on its own output over its own cache: what vLLM's proposer does past the
    first draft; a ``sequence`` chain is refused), served with as many drafts a round; ``tapdraft.audio_embeds`` says
    whether the head reads the target's merged audio embeddings (the plugin then declares multimodal
    embeddings) or the placeholder id's embedding (vLLM's text-only draft inputs). A head with a draft vocabulary
    carries its N frozen lm_head rows (``lm_head.weight``) and ``d2t``; the plugin scores those rows only. Served as
    ``{"method": "mtp", "model": DIR, "num_speculative_tokens": D}``.

Logits: every engine applies the target's lm_head alone, so a target's ``logits_scaling`` is folded
into the head's output norm (exactly, for one depth; several depths with post-norm recursion would feed
the scaled norm onward, so that combination is refused).
"""

from __future__ import annotations

from typing import Any

import torch

from tapdraft.train.drafters.mtp import LAYOUTS

BLOCK_PARAMS = ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "self_attn.q_norm", "self_attn.k_norm", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj",
                "mlp.down_proj")
"""The Qwen3 decoder block's parameters (``.weight`` each), named as HF and vLLM name them."""
NORMS = ("input_layernorm", "self_attn.q_norm", "self_attn.k_norm", "post_attention_layernorm")


def _physical(config: dict[str, Any]) -> list[int]:
    first = int(config["first_mtp_layer_index"])
    return [first + i for i in range(int(config["num_nextn_predict_layers"]))]


def _check(config: dict[str, Any], layout: str) -> float:
    """Refuse what the layout cannot express; returns the logits divisor to fold into the output norm."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown MTP layout {layout!r}; known: {list(LAYOUTS)}")
    steps = int(config.get("num_speculative_steps", config["num_nextn_predict_layers"]))
    scale = float(config.get("logits_scaling") or 1.0)
    rerun = config.get("mtp_chain", "sequence") == "rerun"
    if layout == "tapdraft-vllm" and steps > 1 and not rerun:
        raise ValueError(f"this head chains {steps} depths over whole sequences (chain: sequence); vLLM drafts past "
                         "the first token by rerunning one layer over its own cache: train drafter.chain: rerun (or "
                         "num_depths: 1) for --layout tapdraft-vllm")
    if layout not in ("deepseek", "tapdraft-vllm") and steps > 1 and config.get("mtp_recursion",
                                                                               "pre_norm") != "post_norm":
        raise ValueError(
            f"layout {layout!r} feeds each step the previous step's normed output, but this head chains "
            f"{steps} depths on the pre-norm state (DeepSeek-V3); train it with drafter.recursion: post_norm, or "
            "export one depth, or use --layout deepseek"
        )
    head = config.get("target_head") or {}
    if layout == "tapdraft-vllm" and (float(head.get("embed_scale", 1.0)) != 1.0 or head.get("final_logit_softcap")):
        raise ValueError("the target scales its input embeddings or soft-caps its logits; vLLM's MTP path shares the "
                         "raw embedding table and applies the lm_head alone: use --layout deepseek")
    if layout == "vllm-qwen3-next" and int(config["num_nextn_predict_layers"]) > 1:
        raise ValueError("vLLM's Qwen3-Next MTP shares one fc, pre-fc norms and output norm across its layers; "
                         f"this head has {config['num_nextn_predict_layers']} physical depths with their own: train "
                         "use_repeated_layer: true (or one depth) for --layout vllm-qwen3-next")
    if config.get("draft_vocab_size") and layout not in ("deepseek", "tapdraft-vllm"):
        raise ValueError(f"this head drafts from a {config['draft_vocab_size']}-token draft vocabulary; {layout!r} "
                         "loaders score the target's whole lm_head: use --layout tapdraft-vllm, or train without "
                         "draft_vocab")
    if layout != "deepseek" and (config.get("target_head") or {}).get("lm_head_bias"):
        raise ValueError(f"the target's lm_head has a bias: {layout!r} loaders apply the lm_head alone and the logits "
                         "scaling cannot be folded past a bias; use --layout deepseek")
    if layout != "deepseek" and steps > 1 and scale != 1.0 and not rerun:
        raise ValueError(f"the target scales logits by 1/{scale}: folding that into the output norm would also scale "
                         f"what the next depth reads; export a one-depth head for {layout!r}")
    return scale


def convert(state: dict[str, torch.Tensor], config: dict[str, Any], layout: str
            ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(weights, export config) in tapdraft's names -> the same head in ``layout``'s names and config."""
    scale = _check(config, layout)
    if layout == "deepseek":
        return dict(state), {**config, "mtp_layout": layout}
    if layout == "tapdraft-vllm":  # the checkpoint's names; only the output norm takes the logits divisor
        out = dict(state)
        for li in _physical(config):
            key = f"model.layers.{li}.shared_head.norm.weight"
            out[key] = state[key].float() / scale
        return out, _config(config, layout)
    out: dict[str, torch.Tensor] = {}
    layers = _physical(config)
    gemma = layout == "vllm-qwen3-next"

    def norm(w: torch.Tensor, divide: float = 1.0) -> torch.Tensor:  # GemmaRMSNorm scales by 1 + w
        w = w.float() / divide
        return w - 1.0 if gemma else w

    for i, li in enumerate(layers):
        src = f"model.layers.{li}."
        dst = f"mtp.layers.{i}." if gemma else f"llm.mtp.layers.{i}."
        for name in BLOCK_PARAMS:
            w = state[src + name + ".weight"]
            out[dst + name + ".weight"] = norm(w) if name in NORMS else w
        if gemma:
            if i == 0:  # Qwen3-Next has ONE fusion and ONE output norm shared by every step
                out["mtp.fc.weight"] = state[src + "eh_proj.weight"]
                out["mtp.pre_fc_norm_embedding.weight"] = norm(state[src + "enorm.weight"])
                out["mtp.pre_fc_norm_hidden.weight"] = norm(state[src + "hnorm.weight"])
                out["mtp.norm.weight"] = norm(state[src + "shared_head.norm.weight"], scale)
        else:
            out[dst + "enorm.weight"] = state[src + "enorm.weight"]
            out[dst + "hnorm.weight"] = state[src + "hnorm.weight"]
            out[dst + "eh_proj.weight"] = state[src + "eh_proj.weight"]
            out[dst + "final_layernorm.weight"] = norm(state[src + "shared_head.norm.weight"], scale)
    return out, _config(config, layout)


def _config(config: dict[str, Any], layout: str) -> dict[str, Any]:
    arch = {k: config[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                   "intermediate_size", "rms_norm_eps", "rope_theta", "vocab_size")}
    n_phys = int(config["num_nextn_predict_layers"])
    steps = int(config.get("num_speculative_steps", n_phys))
    keep = {"tapdraft": config.get("tapdraft", {}), "mtp_layout": layout, "num_speculative_steps": steps,
            "logits": "target lm_head(output) only: the target's logits_scaling is folded into the output norm"}
    if layout == "tapdraft-vllm":
        tapdraft = {**keep["tapdraft"], "serve_with": {"vllm": {"method": "mtp", "num_speculative_tokens": steps}},
                    "block_size": {"vllm": steps + 1}, "vllm_plugin": "tapdraft-vllm (engines/vllm_plugin)"}
        return {
            "architectures": ["TapdraftMTPForCausalLM"], "model_type": "qwen3", **arch,
            "num_hidden_layers": int(config["first_mtp_layer_index"]),
            "first_mtp_layer_index": int(config["first_mtp_layer_index"]), "num_nextn_predict_layers": n_phys,
            "hidden_act": "silu", "attention_bias": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": arch["rope_theta"]},
            "tie_word_embeddings": False, "mtp_recursion": config.get("mtp_recursion", "pre_norm"),
            "mtp_chain": config.get("mtp_chain", "sequence"),
            "max_position_embeddings": int(config.get("max_position_embeddings") or 32768), **keep,
            "tapdraft": tapdraft,
            **{k: config[k] for k in ("draft_vocab_size", "draft_vocab") if k in config},
        }
    if layout == "vllm-qwen3-next":
        return {
            "architectures": ["Qwen3NextMTP"], "model_type": "qwen3_next", **arch,
            "num_hidden_layers": int(config["first_mtp_layer_index"]), "num_nextn_predict_layers": n_phys,
            "hidden_act": "silu", "attention_bias": False, "attn_output_gate": False,
            "partial_rotary_factor": 1.0,
            "rope_parameters": {"rope_type": "default", "rope_theta": arch["rope_theta"], "partial_rotary_factor": 1.0},
            "num_experts": 0, "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False,
            "max_position_embeddings": int(config.get("max_position_embeddings") or 32768), **keep,
        }
    mtp = config.get("mtp_config", {})
    return {
        "llm": {"model_type": "qwen3", **arch, "num_hidden_layers": int(config["first_mtp_layer_index"]),
                "num_nextn_predict_layers": n_phys},
        "mtp": {"enabled": True, "num_layers": n_phys, "layer_pattern": "*",
                "use_repeated_layer": bool(mtp.get("use_repeated_layer", False)),
                "training_mode": mtp.get("training_mode", "head_only"), "loss_type": mtp.get("loss_type", "ce"),
                "lk_lambda": mtp.get("lk_lambda", 0.5)},
        **keep,
    }
