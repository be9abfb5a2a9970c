"""DFlash2's settings: DFlash's plus the in-block convolutions and the path selector."""

from __future__ import annotations

from dataclasses import dataclass

from tapdraft.train.drafters.common.settings import MAX_DRAFT_RANK, check_count
from tapdraft.train.drafters.dflash.config import DFlashConfig
from tapdraft.train.drafters.dflash2.selector import GOLD_MISS_POLICIES


@dataclass(frozen=True)
class DFlash2Config(DFlashConfig):
    """DFlash settings plus the convolutions and the path selector."""

    serves_window = False

    slot_weightings = ("decay",)
    """Its loss weighs slots by the fixed decay only (its rows' weights are set before their losses are known)."""

    chunk_rows: int = 0
    """Rows per checkpointed chunk of draft logits (CE, KD and the selector see a chunk's dense logits);
    0 = derived from the vocabulary size and ``logits_budget_mib``."""
    logits_budget_mib: int = 1024
    """With chunk_rows 0: memory one chunk's [rows, V] float32 logits and temporaries may take (V=152k: 441 rows)."""
    conv_group_size: int = 16
    """Channels per group sharing one dynamic correction of the conv taps (must divide the hidden size)."""
    conv_kernel_size: int = 2
    """Taps of each in-block convolution (2: the slot itself and its predecessor)."""
    selector_candidates: int = 16
    """K: top candidates of the draft logits per slot the selector re-ranks."""
    selector_rank: int = 256
    """r: rank of the codebooks A, B and of W_h."""
    selector_gold_miss: str = "drop"
    """When gold is not among the K candidates: drop the row from the selector loss, or insert gold."""
    selector_loss_weight: float = 1.0
    """Weight of the selector term in the total loss."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.draft_vocab is not None:
            raise ValueError("draft_vocab is DFlash-only: DFlash2's selector re-ranks the top candidates of the dense "
                             "full-vocabulary logits and its reference export has no d2t; use family dflash or drop it")
        if self.logits_budget_mib < 1:
            raise ValueError(f"logits_budget_mib must be >= 1, got {self.logits_budget_mib}")
        if self.conv_group_size < 1:
            raise ValueError(f"conv_group_size must be >= 1, got {self.conv_group_size}")
        if not 1 <= self.conv_kernel_size <= self.block_size:
            raise ValueError(
                f"conv_kernel_size must be in [1, block_size {self.block_size}], got {self.conv_kernel_size}")
        if self.selector_candidates < 1:
            raise ValueError(f"selector_candidates must be >= 1, got {self.selector_candidates}")
        check_count("selector_rank", self.selector_rank, 1, MAX_DRAFT_RANK, "two [vocab, rank] codebooks")
        if self.selector_gold_miss not in GOLD_MISS_POLICIES:
            raise ValueError(f"selector_gold_miss must be one of {GOLD_MISS_POLICIES}, got {self.selector_gold_miss!r}")
        if self.selector_loss_weight < 0:
            raise ValueError(f"selector_loss_weight must be >= 0, got {self.selector_loss_weight}")
