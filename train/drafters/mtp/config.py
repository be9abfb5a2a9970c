"""MTP's settings: a frozen dataclass validated in ``__post_init__`` (``mtp_native`` extends it)."""

from __future__ import annotations

from dataclasses import dataclass

from tapdraft.train.drafters.common.divergences import DEFAULT_ETA, parse_lk_lambda
from tapdraft.train.drafters.common.settings import MAX_DRAFT_TOKENS, check_count


LOSS_TYPES = ("ce", "lk")
TRAINING_MODES = ("head_only",)
TEACHERS = ("auto", "exact", "topk")
RECURSIONS = ("pre_norm", "post_norm")
CHAINS = ("sequence", "rerun")


@dataclass(frozen=True)
class MTPConfig:
    """MTP heads: architecture, objective and teacher."""

    num_depths: int = 1
    """D: tokens predicted beyond the target's own next token."""
    use_repeated_layer: bool = False
    """One physical head applied at every depth (D depths, one set of weights)."""
    num_heads: int | None = None
    """Attention heads of the block; None = the target's."""
    num_kv_heads: int | None = None
    """K/V heads of the block; None = the target's."""
    head_dim: int | None = None
    """Per-head width; None = the target's."""
    intermediate_size: int | None = None
    """SwiGLU width of the block; None = the target's."""
    recursion: str = "pre_norm"
    """What depth k + 1 reads of depth k: pre_norm (h^k, DeepSeek-V3) or post_norm (FinalNorm_k(h^k), Qwen3-Next)."""
    chain: str = "sequence"
    """How depth k >= 2 runs: ``sequence`` (DeepSeek-V3: causally over the whole sequence of depth k-1 states) or
    ``rerun`` (how vLLM drafts past the first token: the one layer reruns at the next position on its own previous
    output, attending the depth-1 keys of the rows up to its anchor and its own chain's keys, as EAGLE-3's
    training-time test; a head trained so is served by vLLM with num_depths drafts a round)."""
    training_mode: str = "head_only"
    """head_only: only the heads train (a dataset holds no target backbone to train)."""
    loss_type: str = "ce"
    """ce: dataset labels; lk: lambda*KL + (1-lambda)*TV against the frozen target."""
    lk_lambda: float | str = 0.5
    """LK mixture weight in [0, 1], or 'adaptive' for exp(-lk_eta * mean acceptance)."""
    lk_eta: float = DEFAULT_ETA
    """eta of the adaptive lambda."""
    teacher: str = "auto"
    """LK teacher: exact (per-row projection of the last hidden), topk (stored top-k + tail), auto."""
    draft_vocab: int | None = None
    """N: the head scores only the N target tokens seen most often where the training split is supervised (plus
    eos), mapped back to target ids (``common.draft_vocab``); None = the target's whole vocabulary. CE only."""
    chunk_rows: int = 1024
    """Rows per checkpointed lm_head chunk (bounds [rows, V] memory); <= 0 = one chunk."""
    init_std: float = 0.02
    """Std of the normal init of the heads' linear layers."""

    def __post_init__(self) -> None:
        check_count("num_depths", self.num_depths, 1, MAX_DRAFT_TOKENS, "tokens drafted past the target's own")
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        if self.recursion not in RECURSIONS:
            raise ValueError(f"recursion must be one of {RECURSIONS}, got {self.recursion!r}")
        if self.chain not in CHAINS:
            raise ValueError(f"chain must be one of {CHAINS}, got {self.chain!r}")
        if self.chain == "rerun" and (self.recursion != "pre_norm" or (self.num_depths > 1
                                                                        and not self.use_repeated_layer)):
            raise ValueError("chain: rerun runs one layer at every depth on its pre-norm output (vLLM's proposer): set "
                             "use_repeated_layer: true and recursion: pre_norm")
        if self.training_mode not in TRAINING_MODES:
            raise ValueError(
                f"training_mode must be one of {TRAINING_MODES}, got {self.training_mode!r}: a dataset holds only "
                "the target's frozen embedding, final norm and lm_head, not the backbone; use training_mode: head_only"
            )
        object.__setattr__(self, "lk_lambda", parse_lk_lambda(self.lk_lambda))
        if not self.init_std > 0:
            raise ValueError(f"init_std must be > 0, got {self.init_std}")
        if self.lk_eta <= 0:
            raise ValueError(f"lk_eta must be > 0, got {self.lk_eta}")
        if self.draft_vocab is not None and self.draft_vocab < 1:
            raise ValueError(f"draft_vocab must be >= 1 (or null: the full vocabulary), got {self.draft_vocab}")
        if self.draft_vocab is not None and self.loss_type != "ce":
            raise ValueError("draft_vocab trains with loss_type: ce (LK's divergence is over the target's whole "
                             "vocabulary); set loss_type: ce or drop draft_vocab")
        if self.teacher not in TEACHERS:
            raise ValueError(f"teacher must be one of {TEACHERS}, got {self.teacher!r}")
        for name in ("num_heads", "num_kv_heads", "head_dim", "intermediate_size"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ValueError(f"{name} must be positive or null, got {v}")
