"""Qwen3-style building blocks shared by every drafter family (DFlash, DFlash2, MTP, EAGLE-3).

Why one home: the drafters must match the target's conventions exactly (RMSNorm computed in
float32, RoPE with the target's base and the rotate-half layout, QK-norm before RoPE), and
serving engines load the exported weights by these module names (``q_proj``, ``k_norm``,
``input_layernorm``, ...), so each rule is written once here.

Attention takes four optional extras the drafters need (and ``input_size``: EAGLE-3's q/k/v read a 2H-wide
input while its output stays H wide):

- ``kv_prefix``: keys/values computed elsewhere (DFlash's target context, projected by this
  layer's own ``k_proj``/``v_proj`` via :meth:`Attention.project_kv`) prepended to the layer's own
  keys and values. Prefix rows are never queried.
- ``mask``: ``None`` (full), ``is_causal``, a boolean tensor broadcastable to
  ``[B, 1, Lq, Lkv]`` (True = may attend), an additive float tensor, or a FlexAttention
  ``BlockMask`` (then the Flex kernel runs).
- ``return_kv``: the own rows' keys and values come back too, so a caller can prepend them to later
  queries (EAGLE-3's unrolled training-time test caches each step's keys this way).
- grouped K/V heads are repeated to the query heads before either kernel: Flex's ``enable_gqa``
  backward was measured 10x slower than repeating first.

Shapes: B batch, L query rows, C context (prefix) rows, H hidden, n/kv heads, D head_dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tapdraft.shards.head import rms_norm

try:  # FlexAttention ships with torch >= 2.5
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover - older torch
    BlockMask = None  # type: ignore[assignment,misc]
    flex_attention = None  # type: ignore[assignment]

Rope = tuple[torch.Tensor, torch.Tensor]
"""(cos, sin), each float32 [B, L, D]."""


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalise in (at least) float32, scale by ``weight`` in the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """RoPE tables for arbitrary (possibly non-contiguous) integer positions.

    ``base`` must be the target's ``rope_theta`` so that the drafter's positions mean the same as
    the target's. Positions are absolute sequence positions (a DFlash block slot k of anchor a sits
    at a + k), so the tables are computed per call from a position tensor.
    """

    def __init__(self, head_dim: int, base: float) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        inv = 1.0 / (float(base) ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        self.register_buffer("inv_freq", inv.float(), persistent=False)
        self.base = float(base)

    def forward(self, positions: torch.Tensor) -> Rope:
        """positions: int [B, L] -> (cos, sin) float32 [B, L, D]."""
        freqs = positions.float()[..., None] * self.inv_freq.to(positions.device)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """x: [B, heads, L, D]; rope tables [B, L, D]. Computed in float32, returned in x's dtype."""
    cos, sin = rope
    cos, sin = cos[:, None], sin[:, None]
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, kv, L, D] -> [B, kv * n_rep, L, D] (each kv head serves n_rep consecutive query heads)."""
    if n_rep == 1:
        return x
    B, kv, L, D = x.shape
    return x[:, :, None].expand(B, kv, n_rep, L, D).reshape(B, kv * n_rep, L, D)


class Attention(nn.Module):
    """Qwen3 attention (no bias, QK-norm on each head before RoPE) with an optional K/V prefix."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float = 1e-6,
        qk_norm: bool = True,
        input_size: int | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        d_in = input_size or hidden_size  # EAGLE-3's q/k/v read [embedding ; hidden], 2H wide
        self.q_proj = nn.Linear(d_in, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(d_in, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(d_in, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else nn.Identity()
        self.scale = head_dim**-0.5

    def project_kv(self, x: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, C, H] -> keys (normed, rotated) and values, each [B, kv, C, D]."""
        B, C, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, C, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, C, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, rope), v

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        *,
        mask: torch.Tensor | "BlockMask | None" = None,
        is_causal: bool = False,
        kv_prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
        return_kv: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x [B, L, H] -> [B, L, H]. Keys are ``cat(prefix, own)``, so masks index kv as [prefix | own].
        ``return_kv``: also return the own rows' keys and values [B, kv, L, D] (a caller's cache for later queries)."""
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, L, self.num_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, rope)
        k, v = self.project_kv(x, rope)
        own = (k, v)
        if kv_prefix is not None:
            k = torch.cat([kv_prefix[0].to(k.dtype), k], dim=2)
            v = torch.cat([kv_prefix[1].to(v.dtype), v], dim=2)
        n_rep = self.num_heads // self.num_kv_heads
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        if BlockMask is not None and isinstance(mask, BlockMask):
            out = _flex(q, k, v, mask, self.scale)
        else:
            if is_causal and kv_prefix is not None:
                raise ValueError("is_causal with a kv_prefix is ambiguous: pass an explicit mask")
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=self.scale)
        out = self.o_proj(out.transpose(1, 2).reshape(B, L, self.num_heads * self.head_dim))
        return (out, own) if return_kv else out


_COMPILED_FLEX = None


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: "BlockMask", scale: float) -> torch.Tensor:
    """FlexAttention: compiled with a pinned tile on GPU (the tile divides the mask block), eager on CPU."""
    if not q.is_cuda:
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale)
    global _COMPILED_FLEX
    if _COMPILED_FLEX is None:
        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
    from tapdraft.train.drafters.common.mask import flex_tile

    bs = block_mask.BLOCK_SIZE
    tile = flex_tile(min(bs) if isinstance(bs, tuple) else bs)
    return _COMPILED_FLEX(q, k, v, block_mask=block_mask, scale=scale,
                          kernel_options={"BLOCK_M": tile, "BLOCK_N": tile})


class SwiGLU(nn.Module):
    """Qwen3 MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm Qwen3 decoder layer. With ``context`` ([B, C, H], already normalised by the caller)
    the layer projects it with its own k/v and prepends it to the keys/values (DFlash KV injection).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        intermediate_size: int,
        eps: float = 1e-6,
        qk_norm: bool = True,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.self_attn = Attention(hidden_size, num_heads, num_kv_heads, head_dim, eps, qk_norm)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.mlp = SwiGLU(hidden_size, intermediate_size)

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        *,
        mask: torch.Tensor | "BlockMask | None" = None,
        is_causal: bool = False,
        context: torch.Tensor | None = None,
        context_rope: Rope | None = None,
        cache: tuple[torch.Tensor, torch.Tensor] | None = None,
        return_kv: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x [B, L, H] -> [B, L, H]. ``cache``: keys and values [B, kv, C, D] computed earlier (a drafter's own
        cache: masks index kv as [cache | own]); ``return_kv``: also return the own rows' (keys, values)."""
        prefix = cache
        if context is not None:
            if context_rope is None:
                raise ValueError("context needs context_rope (the RoPE tables of the context positions)")
            if cache is not None:
                raise ValueError("a layer takes either a context to project or a cache, not both")
            prefix = self.self_attn.project_kv(context, context_rope)
        out = self.self_attn(self.input_layernorm(x), rope, mask=mask, is_causal=is_causal, kv_prefix=prefix,
                             return_kv=return_kv)
        h, kv = out if return_kv else (out, None)
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x))
        return (x, kv) if return_kv else x
