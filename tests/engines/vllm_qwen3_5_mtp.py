"""vLLM 0.32's Qwen3.5 MTP (``qwen3_5_mtp.py``) re-implemented in float64 from its source, with its loader's naming.

vLLM's CPU venv cannot import ``qwen3_5.py`` (it imports ``qwen3_vl.py``, which imports transformers' Qwen2-VL
image processor, which needs torchvision; PyPI has no torchvision for torch 2.13.0+cpu), so the export is
checked against this instead. What it follows, file by file:

- ``Qwen3_5MTP.load_weights``: checkpoint names not starting with ``mtp.`` and naming neither ``embed_tokens``
  nor ``lm_head`` are skipped; ``mtp.`` becomes ``model.``; ``language_model.`` is dropped from embedding names;
  then the stacked parameters (``packed_modules_mapping``): ``q_proj``/``k_proj``/``v_proj`` -> ``qkv_proj``,
  ``gate_proj``/``up_proj`` -> ``gate_up_proj``. Every parameter of the module must be loaded.
- ``Qwen3_5MultiTokenPredictor.forward``: e = pre_fc_norm_embedding(embed(ids)), h = pre_fc_norm_hidden(hidden),
  fc(cat[e, h]) -> ``layers[spec_step_idx % n]`` (residual None) -> ``norm(hidden, residual)``.
- ``Qwen3NextDecoderLayer.forward`` (``Qwen3_5DecoderLayer``, full attention, dense ``Qwen3NextMLP``),
  ``Qwen3NextAttention._project_qkv_gate`` (non-fused path: ``q_gate`` viewed per head and chunked in two,
  query first; QK-norm per head; RoPE; ``attn * sigmoid(gate)``; ``o_proj``), ``attn_output_gate`` default
  True, ``get_rope`` with ``partial_rotary_factor`` (NeoX rotation of the first ``rotary_dim`` dims).
- ``GemmaRMSNorm`` (``Qwen3_5RMSNorm``): x / sqrt(mean(x^2) + eps) * (1 + w); with a residual, of x + residual.
- the target's hidden states handed to the MTP are its model output after the final norm.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

STACKED = {".q_proj": (".qkv_proj", 0), ".k_proj": (".qkv_proj", 1), ".v_proj": (".qkv_proj", 2),
           ".mlp.gate_proj": (".mlp.gate_up_proj", 0), ".mlp.up_proj": (".mlp.gate_up_proj", 1)}


def expected_params(cfg: dict) -> dict[str, tuple[int, ...]]:
    """The parameters ``Qwen3_5MTP.__init__`` creates (one MTP layer per ``mtp_num_hidden_layers``), by name."""
    H, V, I = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    nh, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    gate = 2 if cfg.get("attn_output_gate", True) else 1
    out = {"model.embed_tokens.weight": (V, H), "model.fc.weight": (H, 2 * H), "model.norm.weight": (H,),
           "model.pre_fc_norm_hidden.weight": (H,), "model.pre_fc_norm_embedding.weight": (H,)}
    if not cfg.get("tie_word_embeddings"):
        out["lm_head.weight"] = (V, H)
    for i in range(int(cfg.get("mtp_num_hidden_layers", 1))):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                    p + "self_attn.qkv_proj.weight": (nh * hd * gate + 2 * kv * hd, H),
                    p + "self_attn.o_proj.weight": (H, nh * hd), p + "self_attn.q_norm.weight": (hd,),
                    p + "self_attn.k_norm.weight": (hd,), p + "mlp.gate_up_proj.weight": (2 * I, H),
                    p + "mlp.down_proj.weight": (H, I)})
    return out


def load(checkpoint: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, vLLM's MTP parameters in float64) from a checkpoint directory, as vLLM's loader maps them.
    Raises AssertionError when a parameter is left unloaded or a shape differs."""
    from safetensors.torch import load_file

    root = Path(checkpoint)
    cfg = json.loads((root / "config.json").read_text())
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for f in sorted(root.glob("*.safetensors")):
        for name, w in load_file(str(f)).items():
            if not name.startswith("mtp.") and not any(k in name for k in ("embed_tokens", "lm_head")):
                continue
            name = name.replace("mtp.", "model.") if name.startswith("mtp.") else name.replace("language_model.", "")
            for src, (dst, shard) in STACKED.items():
                if src in name:
                    parts.setdefault(name.replace(src, dst), {})[shard] = w.double()
                    break
            else:
                parts.setdefault(name, {})[0] = w.double()
    params = {n: torch.cat([p[i] for i in sorted(p)], 0) for n, p in parts.items()}
    want = expected_params(cfg)
    unloaded, unknown = sorted(set(want) - set(params)), sorted(set(params) - set(want))
    assert not unloaded and not unknown, f"unloaded {unloaded}, unknown {unknown}"
    bad = {n: (tuple(params[n].shape), s) for n, s in want.items() if tuple(params[n].shape) != s}
    assert not bad, f"shape mismatches {bad}"
    if cfg.get("tie_word_embeddings"):
        params["lm_head.weight"] = params["model.embed_tokens.weight"]
    return cfg, params


def gemma_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def _rope(x: torch.Tensor, pos: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
    """NeoX rotation of the first ``rotary_dim`` dims of x [T, heads, hd]; the rest passes through."""
    inv = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    f = pos.double()[:, None] * inv[None]
    cos, sin = f.cos()[:, None], f.sin()[:, None]
    r, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    x1, x2 = r[..., : rotary_dim // 2], r[..., rotary_dim // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], -1)


def forward(cfg: dict, P: dict[str, torch.Tensor], ids_T: torch.Tensor, hidden_TH: torch.Tensor,
            pos_T: torch.Tensor, step: int = 0) -> torch.Tensor:
    """Qwen3_5MultiTokenPredictor.forward over T causal positions -> its output [T, H] (after ``norm``)."""
    eps = cfg["rms_norm_eps"]
    nh, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    rope = cfg.get("rope_parameters") or {}
    rotary_dim = int(hd * float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))))
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    e = gemma_norm(P["model.embed_tokens.weight"][ids_T], P["model.pre_fc_norm_embedding.weight"], eps)
    h = gemma_norm(hidden_TH.double(), P["model.pre_fc_norm_hidden.weight"], eps)
    x = torch.cat([e, h], -1) @ P["model.fc.weight"].T
    L = f"model.layers.{step % int(cfg.get('mtp_num_hidden_layers', 1))}."
    residual = x
    a = gemma_norm(x, P[L + "input_layernorm.weight"], eps)
    qkv = a @ P[L + "self_attn.qkv_proj.weight"].T
    T = x.shape[0]
    q_gate, k, v = qkv.split([nh * hd * 2, kv * hd, kv * hd], -1)
    q, gate = torch.chunk(q_gate.view(T, nh, 2 * hd), 2, -1)
    gate = gate.reshape(T, nh * hd)
    q = _rope(gemma_norm(q, P[L + "self_attn.q_norm.weight"], eps), pos_T, rotary_dim, theta)
    k = _rope(gemma_norm(k.view(T, kv, hd), P[L + "self_attn.k_norm.weight"], eps), pos_T, rotary_dim, theta)
    v = v.view(T, kv, hd)
    k, v = k.repeat_interleave(nh // kv, 1), v.repeat_interleave(nh // kv, 1)
    s = torch.einsum("thd,shd->hts", q, k) * hd ** -0.5
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    o = torch.einsum("hts,shd->thd", s.softmax(-1), v).reshape(T, nh * hd)
    o = (o * torch.sigmoid(gate)) @ P[L + "self_attn.o_proj.weight"].T
    x = o + residual  # post_attention_layernorm(hidden, residual): fused add, then norm
    residual = x
    m = gemma_norm(x, P[L + "post_attention_layernorm.weight"], eps)
    g, u = (m @ P[L + "mlp.gate_up_proj.weight"].T).chunk(2, -1)
    x = (torch.nn.functional.silu(g) * u) @ P[L + "mlp.down_proj.weight"].T
    return gemma_norm(x + residual, P["model.norm.weight"], eps)


def drafts(cfg: dict, P: dict[str, torch.Tensor], seq_T: torch.Tensor, hidden_TH: torch.Tensor) -> torch.Tensor:
    """One greedy MTP draft per row t < T - 1: the token the module predicts at t + 2 from x_{t+1} and h_t."""
    T = seq_T.shape[0]
    out = forward(cfg, P, seq_T[1:], hidden_TH[: T - 1], torch.arange(T - 1))
    return (out @ P["lm_head.weight"].T).argmax(-1)
