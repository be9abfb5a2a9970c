"""DFlash draft model for ``transformers.AutoModel`` (``trust_remote_code=True``), shipped in every tapdraft
DFlash export beside ``config.json`` and ``model.safetensors``.

Self-contained: it imports torch and transformers only (never tapdraft), so an export directory is a
complete model repository. It computes exactly what tapdraft's trainer computes (``train/drafters/dflash/model.py``):

    context  = RMSNorm_hidden(fc(concat of the target's hidden states at dflash_config.target_layer_ids))
    block    = the target's input embeddings of [anchor token, mask, mask, ...]      (noise_embedding)
    layers   = pre-norm Qwen3 layers; each attends, NON-causally, over [its own projection of the context,
               then the block] (context rows are keys/values only), QK-norm before RoPE, SwiGLU
    output   = RMSNorm_final(block)                                  -> logits = target lm_head(output)

Sliding window (``dflash_config.use_swa`` with ``swa_window_size`` W, as vLLM reads them): a block slot at position p
sees only keys above p - W (its whole block when W >= the block size). Keys are taken to hold consecutive positions
ending with the block, as in a fresh call (context 0..P-1, block P..) and in the reference decoding loop's cache.

Draft vocabulary (``draft_vocab_size`` in the config, EAGLE-3's convention): the export then holds
``d2t`` (int64 [N]; draft id i is target id i + d2t[i]), ``t2d`` (bool [V]) and ``lm_head.weight`` [N, H], the
target's lm_head rows at those ids (frozen, carried so that vLLM, which otherwise shares the target's whole head
and keeps its first N logits, projects on the right rows), and the draft's logits exist only at those N target
ids: ``compute_logits`` projects on those rows and puts -inf at every other target id, as vLLM's drafters do.

Logits: apply the target's lm_head ONLY. A target that divides its logits (Granite's
``logits_scaling``) has that division folded into ``norm.weight`` at export, so engines that apply
lm_head alone and tapdraft agree on every logit (and so on every sampling distribution).

The call signature matches the reference DFlash release's draft class (``position_ids``,
``noise_embedding``, ``target_hidden``, ``past_key_values``, ``use_cache``), so its decoding loop runs
on this model: ``position_ids`` covers the new context rows followed by the block's slots; with a
cache, keys/values of earlier context rows come from it.

Shapes: B batch, C new context rows, L block slots, H hidden, n/kv heads, D head dim.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config


class DFlashRMSNorm(nn.Module):
    """RMSNorm normalised in float32 (or wider), cast back, then scaled by the weight."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _rope(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) float32 [B, L, D] for integer positions [B, L] (rotate-half layout)."""
    inv = 1.0 / (float(theta) ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = positions.float()[..., None] * inv.float().to(positions.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, L, D] rotated by tables [B, L, D], computed in float32."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    x1, x2 = xf.chunk(2, dim=-1)
    half = torch.cat([-x2, x1], dim=-1)
    return (xf * cos[:, None] + half * sin[:, None]).to(x.dtype)


class DFlashAttention(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        dcfg = getattr(config, "dflash_config", None) or {}
        self.window = int(dcfg["swa_window_size"]) if dcfg.get("use_swa") else None
        self.n, self.kv = config.num_attention_heads, config.num_key_value_heads
        self.d = getattr(config, "head_dim", None) or config.hidden_size // self.n
        H, eps = config.hidden_size, config.rms_norm_eps
        self.q_proj = nn.Linear(H, self.n * self.d, bias=False)
        self.k_proj = nn.Linear(H, self.kv * self.d, bias=False)
        self.v_proj = nn.Linear(H, self.kv * self.d, bias=False)
        self.o_proj = nn.Linear(self.n * self.d, H, bias=False)
        self.q_norm = DFlashRMSNorm(self.d, eps)
        self.k_norm = DFlashRMSNorm(self.d, eps)

    def _kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, L, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, L, self.kv, self.d)).transpose(1, 2)
        v = self.v_proj(x).view(B, L, self.kv, self.d).transpose(1, 2)
        return _rotate(k, cos, sin), v

    def forward(self, x: torch.Tensor, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention_mask: torch.Tensor | None, past_key_values: Any) -> torch.Tensor:
        B, L, _ = x.shape
        C = context.shape[1]
        q = self.q_norm(self.q_proj(x).view(B, L, self.n, self.d)).transpose(1, 2)
        q = _rotate(q, cos[:, C:], sin[:, C:])
        k_c, v_c = self._kv(context, cos[:, :C], sin[:, :C])
        k_x, v_x = self._kv(x, cos[:, C:], sin[:, C:])
        k, v = torch.cat([k_c, k_x.to(k_c.dtype)], 2), torch.cat([v_c, v_x.to(v_c.dtype)], 2)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        if attention_mask is None and self.window is not None:
            K = k.shape[2]
            q_pos = torch.arange(K - L, K, device=k.device)[:, None]
            attention_mask = (q_pos - torch.arange(K, device=k.device)[None]).abs() < self.window  # [L, K]
        rep = self.n // self.kv
        if rep > 1:
            k = k[:, :, None].expand(B, self.kv, rep, *k.shape[2:]).reshape(B, self.n, *k.shape[2:])
            v = v[:, :, None].expand(B, self.kv, rep, *v.shape[2:]).reshape(B, self.n, *v.shape[2:])
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, scale=self.d**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(B, L, self.n * self.d))


class DFlashMLP(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        H, inter = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(H, inter, bias=False)
        self.up_proj = nn.Linear(H, inter, bias=False)
        self.down_proj = nn.Linear(inter, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config, layer_idx)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DFlashMLP(config)

    def forward(self, x, context, cos, sin, attention_mask, past_key_values):
        x = x + self.self_attn(self.input_layernorm(x), context, cos, sin, attention_mask, past_key_values)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(PreTrainedModel):
    """The DFlash drafter: target hidden states + block embeddings -> final-normed block hidden states."""

    config_class = Qwen3Config
    base_model_prefix = "dflash"
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        dcfg = getattr(config, "dflash_config", None) or {}
        self.target_layer_ids = list(dcfg.get("target_layer_ids") or config.target_layer_ids)
        self.mask_token_id = int(dcfg.get("mask_token_id", getattr(config, "mask_token_id", 0)))
        self.block_size = int(config.block_size)
        H = config.hidden_size
        self.fc = nn.Linear(len(self.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = DFlashRMSNorm(H, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = DFlashRMSNorm(H, config.rms_norm_eps)
        self.head_dim = getattr(config, "head_dim", None) or H // config.num_attention_heads
        rope = getattr(config, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"this DFlash draft uses plain RoPE, got rope_type {rope.get('rope_type')!r}")
        self.rope_theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        n = getattr(config, "draft_vocab_size", None)
        self.draft_vocab_size = None if n is None else int(n)
        if self.draft_vocab_size is not None:  # filled from the export's weights
            self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
            self.lm_head = nn.Linear(H, self.draft_vocab_size, bias=False)  # the target's rows at the draft ids
        self.post_init()

    def compute_logits(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., V] over the target vocabulary from ``forward``'s output and the target's lm_head
        weight [V, H]: all of it, or with a draft vocabulary the export's own N rows (the target's at the draft ids)
        and -inf at every other target id."""
        w = lm_head_weight.to(hidden.dtype)
        if self.draft_vocab_size is None:
            return hidden @ w.T
        ids = self.d2t + torch.arange(self.draft_vocab_size, device=self.d2t.device)
        z = hidden @ self.lm_head.weight.to(hidden.dtype).T
        out = z.new_full((*z.shape[:-1], w.shape[0]), float("-inf"))
        out[..., ids] = z
        return out

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(0.0, 0.02)
        elif isinstance(module, DFlashRMSNorm):
            module.weight.data.fill_(1.0)

    def forward(self, position_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                noise_embedding: torch.Tensor | None = None, target_hidden: torch.Tensor | None = None,
                past_key_values: Any = None, use_cache: bool = False, **kwargs: Any) -> torch.Tensor:
        """Block hidden states [B, L, H] after the final norm.

        ``target_hidden`` [B, C, n*H]: the target's hidden states (outputs of the decoder layers at
        ``target_layer_ids``, concatenated in that order) of the C context rows not yet in the cache;
        ``noise_embedding`` [B, L, H]: the target's embeddings of the block (anchor token, then mask
        tokens); ``position_ids`` [B, C + L]: positions of those context rows, then of the block slots.
        ``attention_mask`` (optional): bool or additive, broadcastable to [B, heads, L, cached + C + L].
        """
        if noise_embedding is None or target_hidden is None:
            raise ValueError("DFlashDraftModel needs noise_embedding and target_hidden")
        x = noise_embedding.to(self.fc.weight.dtype)
        context = self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))
        cos, sin = _rope(position_ids, self.head_dim, self.rope_theta)
        for layer in self.layers:
            x = layer(x, context, cos, sin, attention_mask, past_key_values)
        return self.norm(x)
