"""DSpark's settings: DFlash's plus its alignment, Markov head, confidence head and loss weights."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from tapdraft.train.drafters.common.settings import MAX_DRAFT_RANK, check_count
from tapdraft.train.drafters.dflash.config import DFlashConfig
from tapdraft.train.drafters.dspark.markov import HEAD_TYPES


@dataclass(frozen=True)
class DSparkConfig(DFlashConfig):
    """DFlash settings with DSpark's alignment, Markov head, confidence head and loss weights."""

    serves_window = False

    slot_weightings = ("decay",)
    """Its loss weighs slots by the fixed decay only (its rows' weights are set before their losses are known)."""

    block_size: int = 16
    """B: slot 0 holds the anchor, slots 1..B-1 the mask; every slot k predicts a + k + 1 (K = B drafts)."""
    gamma: float = 7.0
    """Slot k (from 0) weighs exp(-k / gamma)."""
    ce_weight: float = 0.1
    """Weight of the cross-entropy term on the Markov-corrected logits."""
    kd: str = "topk"
    """The teacher rows of the L1 and confidence terms: topk (stored top-k + tail bin) or exact (final hidden)."""
    tv_weight: float = 0.9
    """Weight of the L1 = 2 TV distance between the corrected draft and the teacher row."""
    markov_rank: int = 256
    """r: rank of markov_w1 (V x r) and markov_w2 (r -> V)."""
    markov_head_type: str = "vanilla"
    """Markov head variant; vanilla only (vLLM 0.32 loads no other: ``train.drafters.dspark.markov``)."""
    confidence_head: bool = False
    """Train the acceptance-confidence head (exported as ``confidence_head.proj``)."""
    confidence_weight: float = 1.0
    """Weight of the confidence head's BCE towards 1 - TV (with confidence_head)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kd not in ("topk", "exact"):
            raise ValueError(f"DSpark's L1 and confidence terms need teacher rows: kd must be 'topk' or 'exact', "
                             f"got {self.kd!r}")
        if self.markov_head_type not in HEAD_TYPES:
            raise ValueError(f"markov_head_type {self.markov_head_type!r} is not servable: vLLM 0.32's "
                             "Qwen3DSparkModel builds the vanilla Markov head only (qwen3_dspark.py), and its "
                             f"Qwen3-Omni validator requires 'vanilla'; use one of {HEAD_TYPES}")
        check_count("markov_rank", self.markov_rank, 1, MAX_DRAFT_RANK, "two [vocab, rank] tables")
        if self.tv_weight < 0 or self.confidence_weight < 0:
            raise ValueError("tv_weight and confidence_weight must be >= 0")
        if self.draft_vocab is not None:
            raise ValueError("draft_vocab is DFlash-only: the Markov bias is over the full vocabulary here; drop it")
        if self.kd_weight != 1.0:
            warnings.warn("kd_weight is ignored by DSpark: its teacher term is the L1 distance, weighted by tv_weight",
                          UserWarning, stacklevel=3)

    @property
    def train_anchors(self) -> int:
        """Most blocks per training micro-batch: every one of a block's B slots is a loss row."""
        return min(self.max_total_anchors, max(1, self.max_loss_rows // self.block_size))
