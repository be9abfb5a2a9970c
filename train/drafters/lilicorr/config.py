"""LiLiCorr's settings: DFlash's plus the lattice head's geometry and its two loss terms."""

from __future__ import annotations

from dataclasses import dataclass

from tapdraft.train.drafters.common.settings import MAX_DRAFT_HEADS, MAX_DRAFT_LAYERS, MAX_DRAFT_RANK, check_count
from tapdraft.train.drafters.dflash.config import DFlashConfig


PENALTIES = ("exact", "topk_bound")


@dataclass(frozen=True)
class LiLiCorrConfig(DFlashConfig):
    """DFlash settings plus the lattice head's geometry and its two loss terms."""

    serves_window = False

    slot_weightings = ("decay",)
    """Its loss weighs slots by the fixed decay only (its rows' weights are set before their losses are known)."""

    candidate_topk: int = 8
    """k: candidates per slot (vLLM: a power of two <= 16)."""
    lattice_hidden: int | None = None
    """Width of the lattice transformer (None: the draft's hidden size, token_proj then the identity)."""
    lattice_layers: int = 2
    """Bidirectional layers over the lattice."""
    lattice_heads: int = 4
    """Attention heads of the lattice layers."""
    lattice_mlp_ratio: float = 2.0
    """MLP width / lattice width."""
    factor_dim: int = 64
    """Width of the unit out/in transition vectors."""
    vector_eps: float = 1e-6
    """F.normalize's eps on those vectors."""
    logit_scale: float = 16.0
    """Scores = logit_scale x cosine (the walk's logits)."""
    lattice_weight: float = 1.0
    """Weight of the listwise CE over the candidates (given the teacher-forced predecessor)."""
    penalty: str = "exact"
    """The penalty's target probabilities: exact (final pre-norm state + bundle head) or topk_bound."""
    penalty_weight: float = 1.0
    """Weight of the rejection penalty 1 - sum_j min(p_j, q_j)."""
    conv_kernel_size: int = 0
    """lilicorr_conv: taps of DFlash2's in-block convolutions (0: none, the DFlash backbone)."""
    conv_group_size: int = 0
    """lilicorr_conv: channels per group sharing one dynamic tap correction (0 with conv_kernel_size 0)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        k = self.candidate_topk
        if k <= 0 or k > 16 or k & (k - 1):
            raise ValueError(f"candidate_topk must be a power of two <= 16 (vLLM's LiLiCorrHead), got {k}")
        if self.block_size < 3:
            raise ValueError(f"LiLiCorr needs block_size >= 3 (a transition between two slots), got {self.block_size}")
        if self.penalty not in PENALTIES:
            raise ValueError(f"penalty must be one of {PENALTIES}, got {self.penalty!r}")
        check_count("lattice_layers", self.lattice_layers, 1, MAX_DRAFT_LAYERS, "bidirectional layers over the lattice")
        check_count("lattice_heads", self.lattice_heads, 1, MAX_DRAFT_HEADS, "attention heads of the lattice layers")
        check_count("factor_dim", self.factor_dim, 1, MAX_DRAFT_RANK, "width of the transition vectors")
        if not self.lattice_mlp_ratio > 0:
            raise ValueError(f"lattice_mlp_ratio must be > 0, got {self.lattice_mlp_ratio}")
        if self.lattice_weight < 0 or self.penalty_weight < 0:
            raise ValueError("lattice_weight and penalty_weight must be >= 0")
        if self.conv_kernel_size < 0 or self.conv_group_size < 0 or \
                bool(self.conv_kernel_size) != bool(self.conv_group_size):
            raise ValueError("conv_kernel_size and conv_group_size are both 0 (LiLiCorr) or both > 0 (lilicorr_conv), "
                             f"as vLLM's LiLiCorr requires; got {self.conv_kernel_size} and {self.conv_group_size}")
        if self.conv_kernel_size > self.block_size:
            raise ValueError(f"conv_kernel_size must be <= block_size {self.block_size}, got {self.conv_kernel_size}")
        if self.draft_vocab is not None:
            raise ValueError("draft_vocab is DFlash-only: vLLM's LiLiCorr needs the full target vocabulary; drop it")
