"""The MTP head modules (DeepSeek-V3's multi-token prediction layer) whose names are the checkpoint's.

Names: the heads live at ``model.layers.{L + i}`` (L = the target's layer count) with DeepSeek-V3's
MTP parameter names (``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``, ``self_attn.*``,
``mlp.*``), so checkpoints and exports are already in the layout DeepSeek-style engines load.

Shapes: Bs batch, T positions, H hidden.
"""

from __future__ import annotations

import torch
from torch import nn

from tapdraft.train.drafters.common.layers import DecoderLayer, RMSNorm


class SharedHead(nn.Module):
    """DeepSeek-V3's ``shared_head``: its own output norm (``head`` is the target's lm_head, shared)."""

    def __init__(self, H: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(H, eps)


class MTPHead(DecoderLayer):
    """One DeepSeek-V3 MTP module: a causal Qwen3 decoder layer plus enorm, hnorm, eh_proj and an output norm.

    It IS the decoder layer (``self_attn``, ``mlp``, ``input_layernorm``, ...), so its parameter
    names are DeepSeek-V3's MTP names as they are: ``enorm``, ``hnorm``, ``eh_proj``,
    ``shared_head.norm``, ``self_attn.q_proj``, ...
    """

    def __init__(self, H: int, heads: int, kv_heads: int, head_dim: int, inter: int, eps: float) -> None:
        super().__init__(H, heads, kv_heads, head_dim, inter, eps)
        self.enorm = RMSNorm(H, eps)
        self.hnorm = RMSNorm(H, eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.shared_head = SharedHead(H, eps)

    def step(self, emb: torch.Tensor, h_prev: torch.Tensor, rope, *, mask: torch.Tensor | None = None,
             cache: tuple[torch.Tensor, torch.Tensor] | None = None, return_kv: bool = False):
        """emb, h_prev [Bs, Q, H] -> h^k [Bs, Q, H] (before the output norm); causal over the rows unless ``mask``
        (over [cache | own] keys) is given; ``return_kv``: also this step's (keys, values)."""
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h_prev)], dim=-1))
        return self(x, rope, mask=mask, is_causal=mask is None, cache=cache, return_kv=return_kv)


class _Model(nn.Module):
    """Holds the heads as ``model.layers.{L + i}``: DeepSeek-V3 numbers MTP layers after the target's L."""

    def __init__(self, heads: dict[str, MTPHead]) -> None:
        super().__init__()
        self.layers = nn.ModuleDict(heads)

