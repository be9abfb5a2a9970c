"""DFlash: a block-diffusion drafter that predicts B-1 tokens in one forward from the target's taps.

Model (DESIGN section 4):
    context_BTH = RMSNorm(W_fc concat(taps at target_layer_ids))            computed once per batch
    block j: slot 0 = token at anchor_j, slots 1..B-1 = mask token, positions anchor_j + k,
             embedded with the target's FROZEN embedding
    n Qwen3-style pre-norm layers, NON-causal within a block; each layer projects the context with
             its own k/v and prepends it to the block's K/V (context rows are never queried)
    final RMSNorm -> the target's FROZEN head (lm_head, bias, scaling, soft cap: shards.head) -> slot k
             predicts input_ids[a + k]; block tokens are embedded as the target embeds them (embed_scale)
Visibility (``train.mask``): block j sees context positions < anchor_j and its own block.

Anchors: positions p with loss_mask[p] and room for the block (``full_blocks_only``: p + B <= len;
default: p + 1 < len, so short replies at the end of a sequence still train, the overhanging slots
masked), sampled without replacement, sorted; at most ``num_anchors`` per sequence and
``max_total_anchors`` per micro-batch (the per-sequence cap is lowered evenly, water-filling,
until the batch fits). With FlexAttention or torch.compile the block count per sequence is fixed
(min(num_anchors, max_total_anchors // Bs)) so shapes stay static; eager sizes it to the batch.

Loss-row budget: a training micro-batch carries at most ``max_loss_rows`` loss rows (blocks x
(B - 1) slots), so its blocks are capped at ``train_anchors = min(max_total_anchors,
max_loss_rows // (B - 1))``. Each row costs a [V, H] lm_head matmul forward and backward (0.62
GFLOP at Qwen3's V = 151,936, H = 1024), which is most of a step at a real vocabulary
(benchmarks/train_step.py measures step time against rows), so the budget, not the sequence
length, sets a step's cost. Evaluation (``acceptance``) is not budgeted: it keeps the anchor caps.

Draft vocabulary (``draft_vocab = N``, off by default; the subset rule is ``train.draft_vocab``): the
draft's logits are computed over the N subset rows of the frozen lm_head only, W_S = lm_head[S]. With
S the subset and z_S = scale(W_S h) the draft's logits over it, for a loss row with label y:

    q_S      = softmax(z_S)                                   the draft's distribution, over S only
    CE       = -log q_S(y)                     y in S; a row whose label is outside S carries no loss
                                               (CE nor KD): the draft can never emit it, so no gradient
                                               can help it; acceptance still counts it as a miss
    KD       = KL(p_S || q_S),  p_S(v) = p(v) / sum_{u in S} p(u) = softmax over S of the teacher's
                                               logits (the exact teacher restricted and renormalised;
                                               kd='topk' is refused: its tail's share of S is unknown)

so the loss is the full-vocabulary loss with lm_head replaced by W_S and labels by their draft ids.
Everything that drafts (eval, replay, live ``propose``) sees logits over the target vocabulary, -inf
outside S, so a token outside S is never proposed and ids are target ids throughout. The subset is
kept as EAGLE-3's persistent ``d2t`` / ``t2d`` buffers (checkpoint and export carry them).

Module names match the DFlash reference release (``fc``, ``hidden_norm``, ``layers.N.self_attn.q_proj``,
``norm``), so exported weights load in serving engines.

Shapes: Bs batch, T positions, N blocks per sequence, B block size, H hidden, V vocab, R loss rows.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from shards.head import embed, head_spec, project, teacher_logits
from shards.taps import default_tap_ids, to_vllm
from train.acceptance import AcceptanceCounts, replay_rounds
from train.drafter import Drafter, LossOutput, one_sequence_batch, pick_tokens
from train.layers import DecoderLayer, RMSNorm, RotaryEmbedding
from train.losses import row_losses, slot_weights, weighted_terms
from train.mask import dense_mask, flex_block_mask
from train.chunks import map_row_chunks
from train.divergences import kl_tv_full
from train.draft_vocab import DraftVocab, draft_index
from train.teacher import exact_last_tap, gather_exact, gather_topk, last_hidden, require_last_hidden

KD_MODES = ("none", "topk", "exact")
ATTENTION = ("dense", "flex")


@dataclass(frozen=True)
class DFlashConfig:
    """DFlash drafter settings; None fields are filled from the target bundle by ``resolve``."""

    num_layers: int = 1
    """Draft decoder layers."""
    num_heads: int | None = None
    """Query heads (default: the target's)."""
    num_kv_heads: int | None = None
    """K/V heads (default: the target's)."""
    head_dim: int | None = None
    """Per-head width (default: the target's)."""
    intermediate_size: int | None = None
    """SwiGLU width (default: the target's)."""
    block_size: int = 16
    """B: slot 0 is the anchor token, slots 1..B-1 are predicted."""
    gamma: float = 7.0
    """Slot k weighs exp(-(k-1)/gamma)."""
    mask_token_id: int | None = None
    """Token id of the mask slots (default: a dedicated id, the first row of the embedding table past the
    tokenizer's ids, as the reference drafters add ``<|MASK|>``; the pad id, with a warning, when there is none)."""
    target_layer_ids: tuple[int, ...] | None = None
    """HF decoder-layer ids fused as context (default: the DFlash tap rule if stored, else all non-last taps)."""
    num_anchors: int = 512
    """Most blocks per sequence."""
    max_total_anchors: int = 4096
    """Most blocks per micro-batch."""
    max_loss_rows: int = 8192
    """Training loss-row budget: most blocks x (block_size - 1) per micro-batch (bounds the lm_head cost)."""
    full_blocks_only: bool = False
    """Anchors need p + B <= length (True) or only p + 1 < length (False, overhang masked)."""
    attention: str = "dense"
    """dense (SDPA with a bool mask; trains on CPU) or flex (BlockMask; backward needs a GPU)."""
    flex_block_size: int = 128
    """BlockMask block size (a multiple of the Flex kernel tile)."""
    compile: bool = False
    """torch.compile the draft layers (static anchor count)."""
    ce_chunk_size: int = 2048
    """Rows per lm_head + CE chunk (each chunk checkpointed); <= 0 = one chunk."""
    ce_weight: float = 1.0
    """Weight of the cross-entropy term."""
    kd: str = "none"
    """Distillation teacher: none, topk (stored top-k + tail bin) or exact (per-row final hidden)."""
    kd_weight: float = 1.0
    """Weight of the KD term (forward KL(teacher || draft))."""
    init_std: float = 0.02
    """Std of the normal init of draft linear layers."""
    draft_vocab: int | None = None
    """Reduced draft vocabulary (off: None): logits over only the N target tokens most frequent at the training
    split's supervised positions (plus eos), mapped back to target ids for verification (``train.draft_vocab``)."""

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (slot 0 is the anchor), got {self.block_size}")
        if not self.gamma > 0:
            raise ValueError(f"gamma must be > 0, got {self.gamma}")
        if self.num_anchors < 1 or self.max_total_anchors < 1:
            raise ValueError("num_anchors and max_total_anchors must be >= 1")
        if self.max_loss_rows < self.block_size - 1:
            raise ValueError(f"max_loss_rows must hold one block's {self.block_size - 1} loss rows, "
                             f"got {self.max_loss_rows}; raise it or lower block_size")
        if self.attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {self.attention!r}")
        if self.kd not in KD_MODES:
            raise ValueError(f"kd must be one of {KD_MODES}, got {self.kd!r}")
        if self.flex_block_size < 16 or self.flex_block_size % 16:
            raise ValueError(f"flex_block_size must be a positive multiple of 16, got {self.flex_block_size}")
        if self.ce_weight < 0 or self.kd_weight < 0 or (self.ce_weight == 0 and self.kd == "none"):
            raise ValueError("loss weights must be >= 0 and some term must be on")
        if self.draft_vocab is not None and self.draft_vocab < 1:
            raise ValueError(f"draft_vocab must be >= 1 (or null: the full vocabulary), got {self.draft_vocab}")
        if self.draft_vocab is not None and self.kd == "topk":
            raise ValueError("draft_vocab needs kd 'none' or 'exact': the stored top-k cannot say how much of its tail "
                             "lies inside the draft vocabulary, so the restricted teacher is unknown")
        if self.target_layer_ids is not None:
            object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        for name in ("num_heads", "num_kv_heads", "head_dim", "intermediate_size"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")

    @property
    def static_anchors(self) -> bool:
        return self.attention == "flex" or self.compile

    @property
    def train_anchors(self) -> int:
        """Most blocks per training micro-batch: the anchor cap and the loss-row budget, whichever binds."""
        return min(self.max_total_anchors, self.max_loss_rows // (self.block_size - 1))

    def resolve(self, bundle: Any, layout: Any) -> "DFlashConfig":
        """Fill None fields from the target, and refuse a dataset that cannot feed this draft."""
        tc = bundle.config
        H = int(tc["hidden_size"])
        if layout.hidden_size != H:
            raise ValueError(f"dataset hidden size {layout.hidden_size} != its target bundle's {H}")
        heads = self.num_heads or int(tc["num_attention_heads"])
        kv = self.num_kv_heads or int(tc.get("num_key_value_heads") or heads)
        head_dim = self.head_dim or int(tc.get("head_dim") or H // heads)
        inter = self.intermediate_size or int(tc.get("intermediate_size") or 4 * H)
        V = int(bundle.lm_head.shape[0])
        mask_id = self.mask_token_id
        if mask_id is None:
            mask_id = default_mask_id(bundle, layout)
        if not 0 <= mask_id < V:
            raise ValueError(f"mask_token_id {mask_id} is outside the target vocabulary [0, {V})")
        if self.draft_vocab is not None and self.draft_vocab > V:
            raise ValueError(f"draft_vocab {self.draft_vocab} exceeds the target vocabulary ({V}); lower it or drop it")
        ids = self.target_layer_ids
        if ids is None:
            rule = sorted(set(default_tap_ids(layout.num_layers, self.num_layers)))
            if set(rule) <= set(layout.tap_ids):
                ids = tuple(rule)
            else:
                non_last = [i for i in layout.tap_ids if i != layout.num_layers - 1]
                ids = tuple(non_last or layout.tap_ids)
                warnings.warn(
                    f"the DFlash tap rule for a {self.num_layers}-layer draft over {layout.num_layers} target layers "
                    f"is {rule}, but the dataset stores taps {list(layout.tap_ids)}: training on {list(ids)} instead "
                    "(recorded as drafter.target_layer_ids in the run's config.json). Set drafter.target_layer_ids "
                    f"to choose, or capture with --draft-layers {self.num_layers}", UserWarning, stacklevel=2)
        missing = [i for i in ids if i not in layout.tap_ids]
        if missing:
            raise ValueError(
                f"target_layer_ids {list(ids)} include {missing}, which the dataset did not store "
                f"(stored taps: {list(layout.tap_ids)}); set target_layer_ids to a subset or recapture"
            )
        return dataclasses.replace(
            self, num_heads=heads, num_kv_heads=kv, head_dim=head_dim, intermediate_size=inter,
            mask_token_id=mask_id, target_layer_ids=tuple(ids),
        )


MASK_TOKEN = "<|MASK|>"
"""The mask token's name in the reference DFlash releases (engines add it to the tokenizer when they need a name)."""


def tokenizer_ids(bundle: Any) -> set[int] | None:
    """Every id the bundle's tokenizer can produce (``tokenizer.json``: its vocab and added tokens), or None."""
    raw = getattr(bundle, "tokenizer_files", {}).get("tokenizer.json")
    if raw is None:
        return None
    doc = json.loads(raw)
    vocab = (doc.get("model") or {}).get("vocab") or {}
    ids = set(vocab.values()) if isinstance(vocab, dict) else set(range(len(vocab)))  # WordPiece/BPE dict, Unigram list
    ids |= {int(t["id"]) for t in doc.get("added_tokens") or []}
    return ids


def default_mask_id(bundle: Any, layout: Any) -> int:
    """A dedicated mask id: the first embedding row past every id the tokenizer (and the audio sentinel) uses.

    This is the id ``<|MASK|>`` gets when added to the tokenizer, as the reference DFlash drafters do; it
    never collides with a token the target reads or emits. Targets whose embedding table has no such row
    (vocab_size == tokenizer size) fall back to the pad id with a warning: the mask then shares its input
    embedding with padding.
    """
    V = int(bundle.lm_head.shape[0])
    used = tokenizer_ids(bundle)
    if used is not None:
        first_free = max(used | {int(layout.audio_token_id)}) + 1
        if first_free < V:
            return first_free
    tc = bundle.config
    pad = tc.get("pad_token_id")
    fallback = int(pad) if pad is not None else V - 1
    why = "has no tokenizer.json" if used is None else f"uses every embedding row (vocab {V})"
    # warned from this line (not the caller's): shown once per run however many places resolve the config
    warnings.warn(f"the target's tokenizer {why}: no dedicated mask id, the mask slots use id {fallback} "
                  "(set drafter.mask_token_id to choose one)", stacklevel=1)
    return fallback


def allocate_anchor_counts(eligible_B: torch.Tensor, per_seq: int, total: int) -> torch.Tensor:
    """Per-sequence anchor counts summing to min(total, sum(min(eligible, per_seq))).

    Water-filling: min(eligible, cap) with the largest cap <= per_seq whose sum fits ``total``; the
    rest of ``total`` goes one each to the first sequences still below their eligible count (so a
    budget smaller than the batch still draws anchors instead of none).
    """
    e = eligible_B.clamp(max=per_seq)
    if int(e.sum()) <= total:
        return e
    lo, hi = 0, per_seq  # largest cap with sum(min(e, cap)) <= total
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if int(e.clamp(max=mid).sum()) <= total:
            lo = mid
        else:
            hi = mid - 1
    counts = e.clamp(max=lo)
    more = e > lo
    extra = (more.cumsum(0) <= total - int(counts.sum())) & more
    return counts + extra.to(counts.dtype)


def sample_anchors(
    loss_mask_BT: torch.Tensor,
    lengths_B: torch.Tensor,
    *,
    block_size: int,
    num_anchors: int,
    max_total_anchors: int,
    full_blocks_only: bool = False,
    static: bool = False,
    generator: torch.Generator | None = None,
    take_all: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchors long [Bs, N] (sorted; padding blocks 0) and valid bool [Bs, N].

    Sampled without replacement among eligible positions (uniform random keys from ``generator``,
    drawn on the CPU so results do not depend on the device). ``take_all`` takes the first
    eligible positions in order instead (deterministic evaluation).
    """
    Bs, T = loss_mask_BT.shape
    pos = torch.arange(T)
    lm = loss_mask_BT.cpu()
    L = lengths_B.cpu()[:, None]
    room = pos + block_size <= L if full_blocks_only else pos + 1 < L
    eligible = lm & room
    n_el = eligible.sum(1)
    counts = allocate_anchor_counts(n_el, num_anchors, max_total_anchors)
    if static:
        N = max(1, min(num_anchors, max_total_anchors // max(Bs, 1)))
        counts = counts.clamp(max=N)
    else:
        N = max(1, int(counts.max()) if Bs else 1)
    if take_all:
        keys = pos.float().expand(Bs, T).clone()
    else:
        keys = torch.rand(Bs, T, generator=generator)
    keys = keys.masked_fill(~eligible, float("inf"))
    k = min(N, T)
    picked = keys.topk(k, dim=1, largest=False).indices  # [Bs, k] lowest keys
    slot = torch.arange(k)[None]
    valid = slot < counts[:, None]
    anchors = torch.where(valid, picked, torch.full_like(picked, T + 1))
    anchors = anchors.sort(dim=1).values  # valid first (padding sentinel T+1 sorts last)
    valid = slot < counts[:, None]
    anchors = torch.where(valid, anchors, torch.zeros_like(anchors))
    if k < N:
        anchors = torch.cat([anchors, anchors.new_zeros(Bs, N - k)], 1)
        valid = torch.cat([valid, valid.new_zeros(Bs, N - k)], 1)
    dev = loss_mask_BT.device
    return anchors.to(dev), valid.to(dev)


def acceptance_counts(correct_BNK: torch.Tensor, valid_BNK: torch.Tensor) -> AcceptanceCounts:
    """Teacher-forced acceptance counts from per-slot correctness [Bs, N, B-1] (slots 1..B-1)."""
    ok = (correct_BNK.bool() & valid_BNK).long()
    prefix = torch.cumprod(ok, dim=-1)  # slots 1..k all accepted
    before = torch.cat([torch.ones_like(prefix[..., :1]), prefix[..., :-1]], -1)
    reached = before * valid_BNK.long()
    block_valid = valid_BNK.any(-1)
    return AcceptanceCounts(
        accepted=prefix.sum((0, 1)).double(),
        reached=reached.sum((0, 1)).double(),
        correct=ok.sum((0, 1)).double(),
        valid=valid_BNK.long().sum((0, 1)).double(),
        blocks=int(block_valid.sum()),
    )


class DFlashDrafter(Drafter):
    family = "dflash"
    frozen = ("embed_tokens", "lm_head", "target_norm", "target_norm_bias", "lm_head_bias")

    def __init__(self, config: DFlashConfig, bundle: Any, layout: Any) -> None:
        super().__init__(config, bundle, layout)
        cfg = config.resolve(bundle, layout)
        self.config = cfg
        tc = bundle.config
        H = int(tc["hidden_size"])
        self.head_spec = head_spec(bundle)
        eps = self.head_spec.eps
        self.eps = eps
        self.hidden_size = H
        self.scaling = self.head_spec.logits_scaling
        self.target_num_layers = layout.num_layers
        self.fingerprint = bundle.fingerprint
        self.rope_theta = float(tc.get("rope_theta") or 10000.0)
        rope = tc.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"the target uses {rope.get('rope_type')!r} RoPE scaling; the drafters implement "
                             "plain RoPE (rope_theta) only, so their positions would not mean the target's")
        self.max_positions = int(tc.get("max_position_embeddings") or 32768)
        self.target_layer_types = tc.get("layer_types")  # the draft itself attends its whole context
        self.vocab_size = int(bundle.lm_head.shape[0])
        used = tokenizer_ids(bundle)
        # named <|MASK|> when the id is the one adding that token to the tokenizer gives
        self.mask_token = MASK_TOKEN if used is not None and cfg.mask_token_id == max(used) + 1 else None
        self.last_tap = exact_last_tap(layout)
        self.register_buffer(
            "tap_index", torch.tensor([layout.tap_ids.index(i) for i in cfg.target_layer_ids]), persistent=False
        )
        n = len(cfg.target_layer_ids)
        self.fc = nn.Linear(n * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, eps)
        self.layers = nn.ModuleList(
            DecoderLayer(H, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size, eps)
            for _ in range(cfg.num_layers)
        )
        self.norm = RMSNorm(H, eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, self.rope_theta)
        # frozen target pieces: buffers, never trained, checkpointed or exported
        self.register_buffer("embed_tokens", bundle.embed_tokens.detach().float().clone(), persistent=False)
        self.register_buffer("lm_head", self.embed_tokens if self.head_spec.tied
                             else bundle.lm_head.detach().float().clone(), persistent=False)
        self.register_buffer("target_norm", bundle.norm_weight.detach().float().clone(), persistent=False)
        for name, t in (("target_norm_bias", bundle.norm_bias), ("lm_head_bias", bundle.lm_head_bias)):
            self.register_buffer(name, None if t is None else t.detach().float().clone(), persistent=False)
        self.register_buffer("weights_k", slot_weights(cfg.block_size, cfg.gamma), persistent=False)
        if cfg.draft_vocab is not None:  # EAGLE-3's buffers, filled by set_draft_vocab (or a checkpoint); -1 = unset
            self.register_buffer("d2t", torch.full((cfg.draft_vocab,), -1, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(self.vocab_size, dtype=torch.bool))
        self._init_weights(cfg.init_std)
        self._stack = self._run_layers
        if cfg.compile:
            self._stack = torch.compile(self._run_layers, dynamic=None)

    @classmethod
    def check_dataset(cls, config: DFlashConfig, bundle: Any, layout: Any) -> None:
        cfg = config.resolve(bundle, layout)
        if cfg.kd == "exact":
            require_last_hidden(layout, "kd='exact'")
        if cfg.kd == "topk" and layout.top_k == 0:
            raise ValueError("kd='topk' needs a dataset with top-k teacher rows (captured with top_k > 0)")

    def _init_weights(self, std: float) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)

    # -- draft vocabulary ----------------------------------------------------------------------
    def set_draft_vocab(self, vocab: DraftVocab) -> None:
        """Install the draft vocabulary (``train.draft_vocab.setup`` fits it on the training split)."""
        if self.config.draft_vocab != vocab.size or vocab.vocab_size != self.vocab_size:
            raise ValueError(f"a {vocab.size}-token draft vocabulary of a {vocab.vocab_size}-token target does not fit "
                             f"draft_vocab={self.config.draft_vocab} over {self.vocab_size} tokens")
        self.d2t.copy_(vocab.d2t)
        self.t2d.copy_(vocab.t2d)

    def draft_ids(self) -> torch.Tensor | None:
        """Target ids [N] of the draft vocabulary (None: the full vocabulary)."""
        if self.config.draft_vocab is None:
            return None
        ids = self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)
        if int(ids[0]) < 0:
            raise RuntimeError("the draft vocabulary was never set: train.draft_vocab.setup (or loading a checkpoint) "
                               "fills it before the drafter runs")
        return ids

    def draft_head(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The lm_head rows (and bias) the draft's logits use: the subset's, or all of them."""
        ids = self.draft_ids()
        if ids is None:
            return self.lm_head, self.lm_head_bias
        bias = None if self.lm_head_bias is None else self.lm_head_bias.index_select(0, ids)
        return self.lm_head.index_select(0, ids), bias

    # -- model -------------------------------------------------------------------------------
    def context(self, taps_BTnH: torch.Tensor) -> torch.Tensor:
        """Fused context [Bs, T, H] = RMSNorm(fc(concat of the chosen taps))."""
        x = taps_BTnH.index_select(2, self.tap_index.to(taps_BTnH.device))
        x = x.reshape(*x.shape[:2], -1).to(self.fc.weight.dtype)
        return self.hidden_norm(self.fc(x))

    def _run_layers(self, x, rope, mask, ctx, ctx_rope):
        for layer in self.layers:
            x = layer(x, rope, mask=mask, context=ctx, context_rope=ctx_rope)
        return self.norm(x)

    def block_hidden(
        self, input_ids_BT: torch.Tensor, ctx_BTH: torch.Tensor, anchors_BN: torch.Tensor
    ) -> torch.Tensor:
        """Draft hidden states [Bs, N, B, H] (after the final norm) for blocks at ``anchors``."""
        cfg = self.config
        Bs, T = input_ids_BT.shape
        N, B = anchors_BN.shape[1], cfg.block_size
        dev = input_ids_BT.device
        ids = torch.full((Bs, N, B), cfg.mask_token_id, dtype=torch.long, device=dev)
        ids[:, :, 0] = input_ids_BT.gather(1, anchors_BN.clamp(max=T - 1))
        x = embed(ids.view(Bs, N * B), self.embed_tokens, self.head_spec).to(ctx_BTH.dtype)
        pos = (anchors_BN[:, :, None] + torch.arange(B, device=dev)).view(Bs, N * B)
        rope = self.rotary(pos)
        ctx_rope = self.rotary(torch.arange(T, device=dev)[None].expand(Bs, T))
        if cfg.attention == "flex":
            mask = flex_block_mask(anchors_BN, T, B, cfg.flex_block_size)
        else:
            mask = dense_mask(anchors_BN, T, B)
        h = self._stack(x, rope, mask, ctx_BTH, ctx_rope)
        return h.view(Bs, N, B, -1)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Draft logits over the target vocabulary for hidden rows (through the target's frozen head); with a
        draft vocabulary, its rows only and -inf at every other target id (never proposed)."""
        ids = self.draft_ids()
        if ids is None:
            return project(h, self.lm_head, self.head_spec, self.lm_head_bias)
        lm_head, bias = self.draft_head()
        z = project(h, lm_head, self.head_spec, bias)
        out = z.new_full((*z.shape[:-1], self.vocab_size), float("-inf"))
        out[..., ids] = z
        return out

    # -- targets -----------------------------------------------------------------------------
    def _targets(self, batch: dict[str, Any], anchors: torch.Tensor, valid_blocks: torch.Tensor):
        """Slot targets for k = 1..B-1: labels, validity, positions; each [Bs, N, B-1]."""
        B = self.config.block_size
        ids, lm, L = batch["input_ids"], batch["loss_mask"], batch["lengths"].to(anchors.device)
        T = ids.shape[1]
        tpos = anchors[:, :, None] + torch.arange(1, B, device=anchors.device)
        inside = tpos < L[:, None, None]
        tc = tpos.clamp(max=T - 1)
        Bs = ids.shape[0]
        flat = tc.view(Bs, -1)
        labels = ids.gather(1, flat).view_as(tpos)
        sup = lm.gather(1, flat).view_as(tpos)
        valid = valid_blocks[:, :, None] & inside & sup
        return labels, valid, tpos

    def _anchors(self, batch: dict[str, Any], generator: torch.Generator | None, take_all: bool = False):
        """Training anchors (within the loss-row budget), or with ``take_all`` evaluation's (caps only)."""
        cfg = self.config
        return sample_anchors(
            batch["loss_mask"], batch["lengths"], block_size=cfg.block_size, num_anchors=cfg.num_anchors,
            max_total_anchors=cfg.max_total_anchors if take_all else cfg.train_anchors,
            full_blocks_only=cfg.full_blocks_only,
            static=cfg.static_anchors, generator=generator, take_all=take_all,
        )

    def kd_teacher(self, batch: dict[str, Any], valid: torch.Tensor, tpos: torch.Tensor, w: torch.Tensor,
                   head: tuple[torch.Tensor, torch.Tensor | None] | None = None):
        """Teacher rows anchor+k-1 of the valid slots and their KD weights; (None, None) without KD.

        ``exact``: gather those rows' last hidden -> bundle final norm -> lm_head (``head``: the rows and bias
        to project on, default the whole lm_head; a draft vocabulary's rows give the renormalised restriction);
        ``topk``: the stored rows (a slot whose row was not stored gets weight 0).
        """
        cfg = self.config
        if cfg.kd == "none":
            return None, None
        b_idx = torch.arange(valid.shape[0], device=valid.device)[:, None, None].expand_as(valid)[valid]
        rows = tpos[valid] - 1
        if cfg.kd == "exact":
            lm_head, bias = head or (self.lm_head, self.lm_head_bias)
            teacher = gather_exact(batch, b_idx, rows, last_tap=self.last_tap, bundle_norm=self.target_norm,
                                   lm_head=lm_head, head=self.head_spec, norm_bias=self.target_norm_bias,
                                   lm_head_bias=bias)
            return teacher, w
        teacher, has = gather_topk(batch, b_idx, rows)
        return teacher, w * has.to(w.dtype)

    # -- training ----------------------------------------------------------------------------
    def forward(self, batch: dict[str, Any], generator: torch.Generator | None = None) -> LossOutput:
        cfg = self.config
        anchors, vblk = self._anchors(batch, generator)
        ctx = self.context(batch["taps"])
        h = self.block_hidden(batch["input_ids"], ctx, anchors)  # [Bs, N, B, H]
        labels, valid, tpos = self._targets(batch, anchors, vblk)
        lm_head, bias = self.draft_head()
        if cfg.draft_vocab is None:
            rows_ok, y = valid, labels[valid]
        else:  # loss rows: labels the draft vocabulary holds, as draft ids (module docstring)
            rows_ok = valid & self.t2d[labels]
            y = draft_index(self.t2d, labels[rows_ok])
        h_rows = h[:, :, 1:][rows_ok]  # [R, H]
        w = self.weights_k.to(h.device).expand_as(rows_ok)[rows_ok]
        teacher, kd_w = self.kd_teacher(batch, rows_ok, tpos, w, (lm_head, bias))
        ce, correct, kd = row_losses(h_rows, y, lm_head, head=self.head_spec, lm_head_bias=bias,
                                     chunk_rows=cfg.ce_chunk_size, teacher=teacher)
        terms = weighted_terms(ce, w, kd, kd_w, ce_weight=cfg.ce_weight, kd_weight=cfg.kd_weight)
        # keep every parameter in the graph even when no row carries a loss (DDP waits on all grads)
        terms["ce"] = (terms["ce"][0] + 0.0 * h.sum(), terms["ce"][1], terms["ce"][2])
        corr = torch.zeros(valid.shape, dtype=torch.bool, device=h.device)
        corr[rows_ok] = correct.detach().bool()  # a label outside the draft vocabulary is a miss
        return LossOutput(terms=terms, metrics=_metrics(acceptance_counts(corr, valid)))

    @torch.no_grad()
    def propose(self, ids_T: torch.Tensor, taps_PnH: torch.Tensor, *, temperature: float = 0.0,
                generator: torch.Generator | None = None,
                extras: Mapping[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One block anchored at P (slot 0 = ids[P], slots 1..B-1 masked): K = B - 1 drafts."""
        b, anchors = self._live_block(ids_T, taps_PnH)
        h = self.block_hidden(b["input_ids"], self.context(b["taps"]), anchors)  # [1, 1, B, H]
        tokens, q = pick_tokens(self.logits(h[0, 0, 1:]), temperature, generator)
        return tokens.cpu(), q

    def _live_block(self, ids_T: torch.Tensor, taps_PnH: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor]:
        """The one-sequence batch of a live prefix and its single anchor P [1, 1]."""
        p = next(self.parameters())
        b = one_sequence_batch(ids_T, taps_PnH, dtype=p.dtype, device=p.device)
        return b, torch.tensor([[taps_PnH.shape[0]]], device=p.device)

    def eval_anchors(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Every eligible anchor of every sequence, in order [Bs, N] (evaluation measures all of them: the
        training caps ``num_anchors`` / ``max_total_anchors`` bound memory, not what is measured)."""
        Bs, T = batch["input_ids"].shape
        cfg = self.config
        return sample_anchors(batch["loss_mask"], batch["lengths"], block_size=cfg.block_size, num_anchors=T,
                              max_total_anchors=Bs * T, full_blocks_only=cfg.full_blocks_only, take_all=True)

    def anchor_chunks(self, anchors_BN: torch.Tensor) -> list[slice]:
        """Column slices of the anchors holding at most ``max_total_anchors`` blocks each (bounded eval memory)."""
        Bs, N = anchors_BN.shape
        step = max(1, self.config.max_total_anchors // max(Bs, 1))
        return [slice(s, s + step) for s in range(0, N, step)]

    @torch.no_grad()
    def draft_slots(self, batch: dict[str, Any], ctx_BTH: torch.Tensor, anchors_BN: torch.Tensor) -> torch.Tensor:
        """Greedy drafts long [Bs, N, B-1] of slots 1..B-1 for blocks at ``anchors`` (argmax of the draft logits)."""
        h = self.block_hidden(batch["input_ids"], ctx_BTH, anchors_BN)[:, :, 1:]
        rows = h.reshape(-1, h.shape[-1])
        pred = [self.logits(r).argmax(-1) for r in rows.split(self.logits_chunk_rows())]
        return (torch.cat(pred) if pred else rows.new_zeros(0, dtype=torch.long)).view(h.shape[:3])

    @torch.no_grad()
    def acceptance(self, batch: dict[str, Any], generator: torch.Generator | None = None) -> AcceptanceCounts:
        """Teacher-forced greedy acceptance at every eligible anchor, in order, ``max_total_anchors`` blocks
        at a time."""
        anchors, vblk = self.eval_anchors(batch)
        ctx = self.context(batch["taps"])
        pred = torch.cat([self.draft_slots(batch, ctx, anchors[:, c]) for c in self.anchor_chunks(anchors)], 1)
        labels, valid, _ = self._targets(batch, anchors, vblk)
        corr = (pred == labels) & valid
        return _with_rounds(acceptance_counts(corr, valid), batch, anchors, corr, valid)

    def _logits_rule(self) -> dict[str, Any]:
        """How an engine turns the exported draft's output into tapdraft's logits. Engines apply the target's
        lm_head only, so a pure division (logits_scaling) is folded into ``norm.weight`` at export; a head
        with an lm_head bias cannot take the fold (the bias would be divided too) and says so instead."""
        if self.head_spec.lm_head_bias:
            return {"logits": "target lm_head(draft output) with its bias, then the target head's logits_scaling "
                              "and softcap (target_head); nothing is folded into norm.weight"}
        cap = " then the target head's final_logit_softcap" if self.head_spec.final_logit_softcap else ""
        return {"logits_scaling_folded_into": "norm.weight",
                "logits": f"target lm_head(draft output){cap}: the target's logits_scaling is folded into "
                          "norm.weight (exported norm.weight = trained norm.weight / logits_scaling)"}

    def logits_chunk_rows(self) -> int:
        """Rows whose [rows, V] logits evaluation builds at a time (``ce_chunk_size``; <= 0: 2048)."""
        return self.config.ce_chunk_size if self.config.ce_chunk_size > 0 else 2048

    def slot_logits(self, h_RH: torch.Tensor, prev_R: torch.Tensor, temperature: float) -> torch.Tensor:
        """Tempered draft logits [R, V] of slots whose hidden rows are ``h_RH``: softmax of them is what
        sampled drafting draws from (``prev_R``, each slot's predecessor token, is unused by DFlash)."""
        return self.logits(h_RH) / temperature

    @torch.no_grad()
    def sampled_acceptance(self, batch: dict[str, Any], temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """sum_v min(p_v, q_v) per slot k (p: the target's exact row a + k - 1; q: the slot's sampling distribution),
        summed over every eligible anchor's valid slots, teacher-forced; ([B-1], [B-1]) float64."""
        if temperature <= 0:
            raise ValueError(f"sampled acceptance needs a temperature > 0, got {temperature}")
        ids = batch["input_ids"]
        Bs, T = ids.shape
        K = self.config.block_size - 1
        anchors, vblk = self.eval_anchors(batch)
        _, valid, tpos = self._targets(batch, anchors, vblk)
        last = last_hidden(batch, self.last_tap)
        ctx = self.context(batch["taps"])
        sums, counts = torch.zeros(K, dtype=torch.float64), torch.zeros(K, dtype=torch.float64)
        for c in self.anchor_chunks(anchors):
            v, tp = valid[:, c], tpos[:, c]
            if not bool(v.any()):
                continue
            h = self.block_hidden(ids, ctx, anchors[:, c])[:, :, 1:][v]  # [R, H]
            b = torch.arange(Bs, device=ids.device)[:, None, None].expand_as(v)[v]
            row = tp[v] - 1  # the target row predicting the slot's token
            prev = ids[b, row]  # the slot's teacher-forced predecessor

            def alpha(hq, ht, pv):
                p = teacher_logits(ht, self.target_norm, self.lm_head, self.head_spec,
                                   norm_bias_H=self.target_norm_bias, lm_head_bias_V=self.lm_head_bias) / temperature
                q = self.slot_logits(hq, pv, temperature)
                return (1.0 - kl_tv_full(p.to(q.dtype), q)[1],)

            (a,) = map_row_chunks(alpha, [h, last[b, row], prev], self.logits_chunk_rows())
            slot = torch.arange(K, device=ids.device).expand_as(v)[v]
            sums.index_add_(0, slot.cpu(), a.double().cpu())
            counts.index_add_(0, slot.cpu(), torch.ones_like(a, dtype=torch.float64).cpu())
        return sums, counts

    # -- export ------------------------------------------------------------------------------
    def export_config(self) -> dict[str, Any]:
        cfg = self.config
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "auto_map": {"AutoModel": "modeling_dflash.DFlashDraftModel"},
            "hidden_size": self.hidden_size,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim,
            "intermediate_size": cfg.intermediate_size,
            "hidden_act": "silu",
            "rms_norm_eps": self.eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rope_scaling": None,
            "max_position_embeddings": self.max_positions,
            "layer_types": ["full_attention"] * cfg.num_layers,
            "use_sliding_window": False,
            "sliding_window": None,
            "vocab_size": self.vocab_size,
            "attention_bias": False,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            "block_size": cfg.block_size,
            "num_target_layers": self.target_num_layers,
            "target_layer_ids": list(cfg.target_layer_ids),
            "target_layer_ids_vllm": to_vllm(cfg.target_layer_ids),
            "mask_token_id": cfg.mask_token_id,
            "logits_scaling": self.scaling,
            "target_head": self.head_spec.to_dict(),
            **self._logits_rule(),
            "dflash_config": {
                "mask_token_id": cfg.mask_token_id,
                **({"mask_token": self.mask_token} if self.mask_token else {}),
                "target_layer_ids": list(cfg.target_layer_ids),
            },
            **self._draft_vocab_config(),
            "tapdraft": {
                "family": self.family,
                "target_fingerprint": self.fingerprint,
                "tap_numbering": "target_layer_ids: HF decoder-layer ids (output of layer i, pre-norm); "
                "target_layer_ids_vllm = ids + 1",
                "uses_target_embedding_and_lm_head": True,
                "target_layer_types": self.target_layer_types,
            },
        }

    def _draft_vocab_config(self) -> dict[str, Any]:
        """EAGLE-3's config key for a reduced draft vocabulary (``d2t`` / ``t2d`` ride in the weights); {} when off."""
        if self.config.draft_vocab is None:
            return {}
        return {"draft_vocab_size": self.config.draft_vocab,
                "draft_vocab": "logits only at target ids arange(draft_vocab_size) + d2t (EAGLE-3's "
                               "draft_id_to_target_id), from those lm_head rows; -inf at every other target id; "
                               "t2d[v]: target id v is drafted (modeling_dflash.DFlashDraftModel.compute_logits)"}


def _with_rounds(acc: AcceptanceCounts, batch: dict[str, Any], anchors: torch.Tensor, correct: torch.Tensor,
                 valid: torch.Tensor) -> AcceptanceCounts:
    acc.round_tokens, acc.rounds = replay_rounds(batch["loss_mask"], anchors, correct, valid)
    return acc


def _metrics(acc: AcceptanceCounts) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """acc@k (unconditional) and alpha@k (conditional on slots < k accepted) as (sum, count)."""
    m = {}
    for k in range(acc.accepted.shape[0]):
        m[f"acc@{k + 1}"] = (acc.correct[k], acc.valid[k])
        m[f"alpha@{k + 1}"] = (acc.accepted[k], acc.reached[k])
    return m


CONFIG = DFlashConfig
DRAFTER = DFlashDrafter
