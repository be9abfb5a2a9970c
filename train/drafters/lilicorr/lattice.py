"""LiLiCorr's lattice head: a small bidirectional transformer over each block's candidate lattice, and its walk.

A DFlash block drafts its S = B - 1 mask slots in one non-causal pass, so slot s cannot know what slot s - 1 commits
to. LiLiCorr takes the top-k (k = 8) candidates of every slot (the "lattice", S x k tokens), runs L = 2 pre-norm
transformer layers over all S * k of them at once (no mask: a learned per-head additive bias by slot distance and
same-slot), and scores transitions:

    x_{s,j}   = token_proj(E[c_{s,j}]) + pass_hidden_proj(h_s) + feature_mlp(LN(f_{s,j})) + slot_s + rank_j
                f = [log p, p, log p - max log p, j / (k - 1), j == 0]    (p: the draft's own full softmax)
    y         = output_norm(layers(x)),    a = anchor_norm(context_proj(ctx_{anchor - 1}))   (0 when no context)
    g_{s,j}   = silu(factor_input_proj([y_{s,j}; a; y_{s,j} * a]))
    out, in   = unit(out_head(g)), unit(in_head(g))                     (F.normalize, eps = vector_eps)
    start[j]  = scale * <unit(anchor_out_head(a)), in_{0,j}>            anchor -> slot 0
    pair[s, i, j] = scale * <out_{s,i}, in_{s+1,j}>                     slot s candidate i -> slot s + 1 candidate j

Drafting (:func:`walk`) is greedy left to right over the lattice: slot 0 takes argmax start, slot s takes argmax of
pair[s - 1, previous index]; sampling draws from the softmax of that row at the temperature instead.

Names, shapes and arithmetic are vLLM 0.32's (vllm/model_executor/models/lilicorr.py: ``LiLiCorrHead.score`` /
``forward``, ``LiLiCorrLayer``, ``LiLiCorrLatticeAttention``; the walk is ``_selector_walk_kernel`` in
vllm/v1/worker/gpu/spec_decode/dflash2/speculator.py, the scores laid out [S, k predecessors, k] with slot 0's row
repeated), so the exported ``lilicorr.*`` tensors load there unrenamed. vLLM evaluates the factor projection split
into three blocks of ``factor_input_proj.weight``; here it is the one concatenated product it equals. Every Linear
carries a bias (vLLM's ReplicatedLinear and NemotronHMLP(bias=True)); ``token_proj`` exists only when the lattice
width differs from the draft's hidden size (else identity, as there).

Initialisation (no public trainer to copy): Linear weights N(0, std), biases, slot/rank embeddings and the
attention biases zero, norms one.

Shapes: M blocks, S candidate slots (B - 1), k candidates, Hm the draft's hidden, H the lattice width, f factor dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

NUM_FEATURES = 5
"""Per-candidate features: log p, p, log p - max, rank fraction, is-top-1."""


class MLP(nn.Module):
    """up_proj -> silu -> down_proj, both with bias (vLLM's NemotronHMLP(hidden_act='silu', bias=True))."""

    def __init__(self, d_in: int, d_mid: int, d_out: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(d_in, d_mid, bias=True)
        self.down_proj = nn.Linear(d_mid, d_out, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.up_proj(x)))


class LatticeAttention(nn.Module):
    """Unmasked multi-head attention over the flattened lattice with an additive per-head bias."""

    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        if num_heads <= 0 or hidden % num_heads:
            raise ValueError(f"lilicorr_hidden_size {hidden} must be divisible by lilicorr_num_heads {num_heads}")
        self.num_heads = num_heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * hidden, hidden))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * hidden))
        self.out_proj = nn.Linear(hidden, hidden, bias=True)

    def forward(self, x_MLH: torch.Tensor, bias_1nLL: torch.Tensor) -> torch.Tensor:
        M, L, H = x_MLH.shape
        q, k, v = F.linear(x_MLH, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        shape = (M, L, self.num_heads, H // self.num_heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias_1nLL.to(q.dtype))
        return self.out_proj(out.transpose(1, 2).reshape(M, L, H))


class LatticeLayer(nn.Module):
    def __init__(self, hidden: int, num_heads: int, mlp_ratio: float, eps: float) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(hidden, eps=eps)
        self.attn = LatticeAttention(hidden, num_heads)
        self.mlp_norm = nn.RMSNorm(hidden, eps=eps)
        self.mlp = MLP(hidden, int(hidden * mlp_ratio), hidden)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), bias)
        return x + self.mlp(self.mlp_norm(x))


class LiLiCorrHead(nn.Module):
    """The lattice scorer (vLLM's ``LiLiCorrHead``): transition logits [M, S, k, k] for a block's candidates."""

    def __init__(self, *, model_hidden: int, block_size: int, eps: float, hidden: int, topk: int, num_heads: int,
                 num_layers: int, mlp_ratio: float, factor_dim: int, vector_eps: float, logit_scale: float,
                 std: float = 0.02) -> None:
        super().__init__()
        S = block_size - 1
        self.block_size, self.topk, self.hidden = block_size, topk, hidden
        self.vector_eps, self.logit_scale, self.factor_dim = vector_eps, logit_scale, factor_dim
        self.token_proj = nn.Identity() if hidden == model_hidden else nn.Linear(model_hidden, hidden, bias=True)
        self.pass_hidden_proj = nn.Linear(model_hidden, hidden, bias=True)
        self.feature_norm = nn.LayerNorm(NUM_FEATURES)
        self.feature_mlp = MLP(NUM_FEATURES, hidden, hidden)
        self.slot_embedding = nn.Parameter(torch.zeros(1, 1, S, 1, hidden))
        self.rank_embedding = nn.Parameter(torch.zeros(1, 1, 1, topk, hidden))
        self.relative_slot_bias = nn.Parameter(torch.zeros(num_heads, 2 * block_size - 1))
        self.same_slot_bias = nn.Parameter(torch.zeros(num_heads))
        self.context_proj = nn.Linear(model_hidden, hidden, bias=True)
        self.layers = nn.ModuleList(LatticeLayer(hidden, num_heads, mlp_ratio, eps) for _ in range(num_layers))
        self.output_norm = nn.RMSNorm(hidden, eps=eps)
        self.anchor_norm = nn.RMSNorm(hidden, eps=eps)
        self.factor_input_proj = nn.Linear(3 * hidden, hidden, bias=True)
        self.out_head = nn.Linear(hidden, factor_dim, bias=True)
        self.in_head = nn.Linear(hidden, factor_dim, bias=True)
        self.anchor_out_head = nn.Linear(hidden, factor_dim, bias=True)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                nn.init.zeros_(m.bias)
        for layer in self.layers:
            nn.init.normal_(layer.attn.in_proj_weight, std=std)

    def attention_bias(self, n_slots: int) -> torch.Tensor:
        """[1, heads, S*k, S*k]: relative_slot_bias[:, slot(q) - slot(k) + B - 1] + same_slot_bias [slot(q) == slot(k)]
        over the first ``n_slots`` slots (the trained offset kept for a shorter draft, as vLLM)."""
        slot = torch.arange(n_slots, device=self.same_slot_bias.device).repeat_interleave(self.topk)
        rel = slot[:, None] - slot[None, :]
        bias = self.relative_slot_bias[:, rel + self.block_size - 1]
        same = (slot[:, None] == slot[None, :]).to(bias.dtype)
        return (bias + same[None] * self.same_slot_bias[:, None, None])[None]

    def features(self, logp_MSk: torch.Tensor) -> torch.Tensor:
        """The five candidate features [M, S, k, 5] (float32, as vLLM computes them)."""
        lp = logp_MSk.float()
        k = lp.shape[-1]
        rank = (torch.arange(k, device=lp.device, dtype=torch.float32) / float(k - 1)) if k > 1 \
            else torch.zeros(k, device=lp.device)
        top1 = torch.zeros(k, device=lp.device)
        top1[0] = 1.0
        return torch.stack([lp, lp.exp(), lp - lp.max(-1, keepdim=True).values,
                            rank.expand_as(lp), top1.expand_as(lp)], -1)

    def forward(self, tok_MSkHm: torch.Tensor, logp_MSk: torch.Tensor, pass_MSHm: torch.Tensor,
                anchor_MHm: torch.Tensor, anchor_valid_M: torch.Tensor) -> torch.Tensor:
        """Scores [M, S, k, k] (float32): row s, predecessor i, candidate j; slot 0's row is ``start`` for every i."""
        M, S, k = logp_MSk.shape
        dt = self.slot_embedding.dtype
        x = self.token_proj(tok_MSkHm.to(dt)) + self.pass_hidden_proj(pass_MSHm.to(dt)).unsqueeze(-2)
        x = x + self.feature_mlp(self.feature_norm(self.features(logp_MSk).to(dt)))
        x = x + self.slot_embedding[:, 0, :S] + self.rank_embedding[:, 0]
        x = x.reshape(M, S * k, self.hidden)
        a = self.context_proj(anchor_MHm.to(dt)) * anchor_valid_M[:, None].to(dt)
        bias = self.attention_bias(S)
        for layer in self.layers:
            x = layer(x, bias)
        y = self.output_norm(x).reshape(M, S, k, self.hidden)
        a = self.anchor_norm(a)
        a_row = a[:, None, None, :].expand_as(y)
        g = F.silu(self.factor_input_proj(torch.cat([y, a_row, y * a_row], -1)))
        out_v = F.normalize(self.out_head(g), dim=-1, eps=self.vector_eps)
        in_v = F.normalize(self.in_head(g), dim=-1, eps=self.vector_eps)
        anchor_out = F.normalize(self.anchor_out_head(a), dim=-1, eps=self.vector_eps)
        start = (anchor_out[:, None, :] * in_v[:, 0]).sum(-1)  # [M, k]
        pairs = out_v[:, :-1] @ in_v[:, 1:].transpose(-1, -2)  # [M, S-1, k, k]
        first = start[:, None, None, :].expand(M, 1, k, k)
        return self.logit_scale * torch.cat([first, pairs], 1).float()


def walk(scores_MSkk: torch.Tensor, cand_MSk: torch.Tensor, *, temperature: float = 0.0,
         generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The left-to-right lattice walk: predecessor index 0 at slot 0, then the chosen index. Returns tokens [M, S],
    chosen indices [M, S] and, when sampling, each slot's distribution over its k candidates [M, S, k]."""
    M, S, k = cand_MSk.shape
    prev = torch.zeros(M, dtype=torch.long, device=cand_MSk.device)
    rows = torch.arange(M, device=cand_MSk.device)
    idx, qs = [], []
    for s in range(S):
        z = scores_MSkk[rows, s, prev]  # [M, k]
        if temperature > 0:
            q = torch.softmax(z.double() / temperature, -1)
            prev = torch.multinomial(q.float(), 1, generator=generator).squeeze(-1)
            qs.append(q)
        else:
            prev = z.argmax(-1)
        idx.append(prev)
    idx_MS = torch.stack(idx, 1)
    return cand_MSk.gather(-1, idx_MS[..., None]).squeeze(-1), idx_MS, (torch.stack(qs, 1) if qs else None)
