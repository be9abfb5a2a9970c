"""DFlash's settings and how they resolve against a target bundle and dataset.

``DFlashConfig`` is validated in ``__post_init__``; its None fields are filled from the target by
``resolve``, which also refuses a dataset that cannot feed the draft. The default mask token is a
dedicated id past every id the tokenizer uses, as the reference DFlash drafters add ``<|MASK|>``
(``default_mask_id``). The model is ``train.drafters.dflash.model``; the loss-row budget ``train_anchors`` bounds
is explained in ``train.drafters.dflash.loss``.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

from tapdraft.shards.bundle import TargetBundle
from tapdraft.shards.schema import Layout
from tapdraft.shards.taps import default_tap_ids
from tapdraft.shards.tokenizer_doc import tokenizer_config, tokenizer_vocab
from tapdraft.train.drafters.base import layer_shape
from tapdraft.train.drafters.common.settings import (MAX_ANCHORS, MAX_DRAFT_LAYERS, MAX_DRAFT_TOKENS, check_count,
                                                     check_target_layer_ids)

KD_MODES = ("none", "topk", "exact")
ATTENTION = ("dense", "flex")


UNFITTED_LOSS_ROWS = 8192
"""The loss-row budget of a config whose ``max_loss_rows`` is None when no training fitted it to a device."""


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
    """Slot k weighs exp(-(k-1)/gamma) (``slot_weighting: decay``)."""
    slot_weighting: str = "decay"
    """decay (exp(-(k-1)/gamma)), reach (slot k weighs how often the micro-batch's drafts reach it, from their own
    detached label probabilities: ``common.losses.reach_weights``) or dpace (D-PACE's per-row weights,
    ``common.losses.dpace_weights``); gamma is used by decay only."""
    dpace_alpha: float = 0.5
    """D-PACE smoothing: each slot's factor is (1 - alpha) q + alpha (1: the plain suffix length; 0: the raw
    product)."""
    mask_token_id: int | None = None
    """Token id of the mask slots (default: a dedicated id, the first row of the embedding table past the
    tokenizer's ids, as the reference drafters add ``<|MASK|>``; the pad id, with a warning, when there is none)."""
    target_layer_ids: tuple[int, ...] | None = None
    """HF decoder-layer ids fused as context (default: the DFlash tap rule if stored, else all non-last taps)."""
    context_taps: int | None = None
    """With target_layer_ids unset: how many target layers the tap rule spreads (None: one per draft layer, the
    references' rule, so a one-layer draft reads the middle layer alone). The context's fc takes any count."""
    num_anchors: int = 512
    """Most blocks per sequence."""
    max_total_anchors: int = 4096
    """Most blocks per micro-batch."""
    max_loss_rows: int | None = 8192
    """Training loss-row budget: most blocks x (block_size - 1) per micro-batch (bounds the lm_head cost); None:
    fitted to the device when training starts (``train.fit``; a drafter built outside training takes 8192)."""
    full_blocks_only: bool = False
    """Anchors need p + B <= length (True) or only p + 1 < length (False, overhang masked)."""
    attention: str = "dense"
    """dense (SDPA with a bool mask; trains on CPU) or flex (BlockMask; backward needs a GPU)."""
    sliding_window: int | None = None
    """Sliding-window draft layers: a slot at position p attends to context keys above p - W only (and its whole
    block), the rule of the DFlash reference model and of vLLM, which the export tells (``dflash_config.use_swa``,
    ``swa_window_size``). None: every layer attends the whole context before its anchor. At least block_size. It pays
    where replies read like text (SmolLM2, the 8k-BPE target) and costs where they follow the audio, whose frames it
    hides from the draft (the demo speech target: tau 6.85 -> 3.76 at W=8; docs/speedup.md)."""
    flex_block_size: int = 128
    """BlockMask block size (a multiple of the Flex kernel tile)."""
    compile: bool = False
    """torch.compile the draft layers (static anchor count)."""
    chunk_rows: int = 2048
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
    split's supervised positions (plus eos), mapped back to target ids for verification (``common.draft_vocab``)."""

    slot_weightings = ("decay", "reach", "dpace")
    """The slot weightings this family's loss implements (a class attribute, not a setting)."""
    serves_window = True
    """Whether the family's export tells engines a sliding window (DFlash's does, checked against vLLM)."""

    def __post_init__(self) -> None:
        check_count("num_layers", self.num_layers, 1, MAX_DRAFT_LAYERS, "draft decoder layers")
        if self.context_taps is not None and self.context_taps < 1:
            raise ValueError(f"context_taps must be >= 1 or null (one per draft layer), got {self.context_taps}")
        check_count("block_size", self.block_size, 2, MAX_DRAFT_TOKENS, "slot 0 is the anchor; drafts a round")
        if not self.gamma > 0:
            raise ValueError(f"gamma must be > 0, got {self.gamma}")
        if self.slot_weighting not in self.slot_weightings:
            raise ValueError(f"slot_weighting must be one of {self.slot_weightings} for this family, got "
                             f"{self.slot_weighting!r}")
        if not 0.0 <= self.dpace_alpha <= 1.0:
            raise ValueError(f"dpace_alpha must be in [0, 1], got {self.dpace_alpha}")
        check_count("num_anchors", self.num_anchors, 1, MAX_ANCHORS, "blocks per sequence, at most one a position")
        if self.max_total_anchors < 1:
            raise ValueError(f"max_total_anchors must be >= 1, got {self.max_total_anchors}")
        if self.max_loss_rows is not None and self.max_loss_rows < self.block_size - 1:
            raise ValueError(f"max_loss_rows must hold one block's {self.block_size - 1} loss rows, "
                             f"got {self.max_loss_rows}; raise it or lower block_size")
        if self.sliding_window is not None and self.sliding_window < self.block_size:
            raise ValueError(f"sliding_window must be >= block_size ({self.block_size}) so a slot sees its whole block, "
                             f"got {self.sliding_window}; or null for full attention")
        if self.sliding_window is not None and not self.serves_window:
            raise ValueError("sliding_window is DFlash's only: this family's export does not tell an engine the "
                             "window (vLLM serves it in its V2 runner, whose model was not checked for one); use "
                             "family dflash or drop it")
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
        object.__setattr__(self, "target_layer_ids", check_target_layer_ids(self.target_layer_ids))
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
        rows = UNFITTED_LOSS_ROWS if self.max_loss_rows is None else self.max_loss_rows
        return min(self.max_total_anchors, rows // (self.block_size - 1))

    def loss_row_flops(self, vocab: int, hidden: int) -> float:
        """Head-matmul FLOPs of one loss row (``train.fit``): the draft's logits, the CE gradient (unless
        ce_weight is 0), and with KD its gradient (+ the teacher's logits for kd='exact'), each 2 N H."""
        n = self.draft_vocab or vocab
        matmuls = 1 + (self.ce_weight > 0) + {"none": 0, "topk": 1, "exact": 2}[self.kd]
        return 2.0 * matmuls * n * hidden

    def resolve(self, bundle: TargetBundle, layout: Layout) -> "DFlashConfig":
        """Fill None fields from the target, and refuse a dataset that cannot feed this draft."""
        H, heads, kv, head_dim, inter = layer_shape(bundle, self)
        if layout.hidden_size != H:
            raise ValueError(f"dataset hidden size {layout.hidden_size} != its target bundle's {H}")
        V = int(bundle.lm_head.shape[0])
        mask_id = self.mask_token_id
        if mask_id is None:
            mask_id = default_mask_id(bundle, layout)
        if not 0 <= mask_id < V:
            raise ValueError(f"mask_token_id {mask_id} is outside the target vocabulary [0, {V})")
        if self.mask_token_id is not None and zero_embedding(bundle, mask_id):
            warn_zero_mask(mask_id)
        if self.draft_vocab is not None and self.draft_vocab > V:
            raise ValueError(f"draft_vocab {self.draft_vocab} exceeds the target vocabulary ({V}); lower it or drop it")
        ids = self.target_layer_ids
        if ids is None:
            taps = self.context_taps or self.num_layers
            rule = sorted(set(default_tap_ids(layout.num_layers, taps)))
            if set(rule) <= set(layout.tap_ids):
                ids = tuple(rule)
            else:
                non_last = [i for i in layout.tap_ids if i != layout.num_layers - 1]
                ids = tuple(non_last or layout.tap_ids)
                # warned from this line (as warn_zero_mask): shown once per run, not once per place that resolves
                warnings.warn(
                    f"the DFlash tap rule for {taps} context taps over {layout.num_layers} target layers "
                    f"is {rule}, but the dataset stores taps {list(layout.tap_ids)}: training on {list(ids)} instead "
                    "(recorded as drafter.target_layer_ids in the run's config.json). Set drafter.target_layer_ids "
                    f"to choose, or capture with --draft-layers {taps}", UserWarning, stacklevel=1)
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


def tokenizer_ids(bundle: TargetBundle) -> set[int] | None:
    """Every id the bundle's tokenizer can produce (``tokenizer.json``: its vocab and added tokens), or None."""
    vocab = tokenizer_vocab(bundle)  # checked by shape: a mistyped or deeply nested file is one line naming it
    return None if vocab is None else vocab[0]


def warn_zero_mask(mask_id: int) -> None:
    # warned from this line (not the caller's): shown once per run however many places resolve the config
    warnings.warn(f"mask_token_id {mask_id} has an all-zero embedding row in the target: every mask slot's first draft "
                  "layer sees zeros (no query, key or value; uniform attention), which stalls training; choose an id "
                  "whose row is nonzero", stacklevel=1)


def zero_embedding(bundle: TargetBundle, token_id: int) -> bool:
    """Whether the target's input embedding row of ``token_id`` is all zeros (HF zero-initialises the pad row of an
    ``nn.Embedding(padding_idx=...)`` and that row never gets a gradient). A mask slot fed such a row is useless:
    its first draft layer's input is RMSNorm(0) = 0, so it has no query, key or value, attends uniformly, and
    every mask slot of a block computes the same thing there (a 1-layer draft predicts one distribution for all
    B - 1 slots)."""
    return not bool(bundle.embed_tokens[int(token_id)].any())


def default_mask_id(bundle: TargetBundle, layout: Layout) -> int:
    """A dedicated mask id: the first embedding row past every id the tokenizer (and the audio sentinel) uses.

    This is the id ``<|MASK|>`` gets when added to the tokenizer, as the reference DFlash drafters do; it
    never collides with a token the target reads or emits. Targets whose embedding table has no such row
    (vocab_size == tokenizer size) use, silently, a reserved token no reply holds (:func:`reserved_ids`: the
    pad, unk or bos token, in that order) whose row is not all zeros (:func:`zero_embedding`): the mask then
    costs nothing. Only without one does it fall back, with a warning that says what it can cost, to the
    lowest id whose row is not zero: that id's tokens then read as masks.
    """
    V = int(bundle.lm_head.shape[0])
    used = tokenizer_ids(bundle)
    if used is not None:
        first_free = max(used | {int(layout.audio_token_id)}) + 1
        if first_free < V and not zero_embedding(bundle, first_free):
            return first_free
    eos = bundle.config.get("eos_token_id")
    eos = set(eos if isinstance(eos, list) else [eos])
    for i in reserved_ids(bundle):
        if 0 <= i < V and i not in eos and not zero_embedding(bundle, i):
            return i
    fallback = next((i for i in range(V) if not zero_embedding(bundle, i)), None)
    if fallback is None:
        raise ValueError("the target's input embedding is all zeros: no usable mask row; check the target weights")
    why = "has no tokenizer.json" if used is None else f"uses every embedding row (vocab {V})"
    # warned from this line (not the caller's): shown once per run however many places resolve the config
    warnings.warn(f"the target's tokenizer {why} and has no pad, unk or bos token with a nonzero embedding, so the "
                  f"mask slots use id {fallback}, a token replies may hold: a block anchored on it reads as all "
                  f"masks, which costs acceptance on the share of supervised tokens that are id {fallback}. Set "
                  "drafter.mask_token_id to an id the replies never use (a reserved or special token)", stacklevel=1)
    return fallback


def reserved_ids(bundle: TargetBundle) -> list[int]:
    """Ids of the pad, unk and bos tokens (the bundle config's ids, then the tokenizer config's token names looked
    up in tokenizer.json): tokens a conversation's replies never hold, so a mask that shares one costs nothing."""
    names = tokenizer_config(bundle)
    by_name = (tokenizer_vocab(bundle) or (set(), {}))[1]
    out: list[int] = []
    for kind in ("pad", "unk", "bos"):
        cid = bundle.config.get(f"{kind}_token_id")
        name = names.get(f"{kind}_token")
        for i in (cid, by_name.get(name) if isinstance(name, str) else None):
            if isinstance(i, int) and i not in out:
                out.append(i)
    return out
