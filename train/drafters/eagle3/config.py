"""EAGLE-3's settings: a frozen dataclass validated in ``__post_init__``, resolved against the target and the
dataset's taps (``resolve``)."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

from tapdraft.shards.bundle import TargetBundle
from tapdraft.shards.schema import Layout
from tapdraft.shards.taps import eagle3_tap_ids
from tapdraft.train.drafters.base import layer_shape
from tapdraft.train.drafters.common.settings import MAX_DRAFT_TOKENS, check_count, check_target_layer_ids
from tapdraft.train.drafters.common.divergences import DEFAULT_ETA, parse_lk_lambda

LOSS_TYPES = ("kl", "ce", "lk")
TEACHERS = ("auto", "exact", "topk")
ATTENTION = ("dense", "flex")


@dataclass(frozen=True)
class Eagle3Config:
    """EAGLE-3 drafter: architecture, training-time test and objective; None fields are filled by ``resolve``."""

    num_steps: int = 5
    """K: steps of the training-time test, = drafts per round when served."""
    target_layer_ids: tuple[int, ...] | None = None
    """HF decoder-layer ids fused by fc (default: shards.taps.eagle3_tap_ids if stored)."""
    qk_norm: bool = True
    """Qwen3 attention with QK-norm (vLLM Eagle3Qwen3ForCausalLM); false: Llama's (Eagle3LlamaForCausalLM)."""
    num_heads: int | None = None
    """Attention heads; None = the target's."""
    num_kv_heads: int | None = None
    """K/V heads; None = the target's."""
    head_dim: int | None = None
    """Per-head width; None = the target's."""
    intermediate_size: int | None = None
    """SwiGLU width; None = the target's."""
    loss_type: str = "kl"
    """kl: forward KL(p || q) against the teacher rows; ce: dataset labels; lk: lambda*KL + (1-lambda)*TV."""
    lk_lambda: float | str = 0.5
    """LK mixture weight in [0, 1], or 'adaptive'."""
    lk_eta: float = DEFAULT_ETA
    """eta of the adaptive lambda."""
    teacher: str = "auto"
    """kl / lk teacher: exact (per-row projection of the last hidden), topk (stored top-k + tail), auto."""
    step_decay: float = 0.8
    """Step j's loss weight is step_decay ** j (EAGLE-3's 0.8)."""
    draft_vocab: int | None = None
    """N: the draft's vocabulary (common.draft_vocab; vLLM's draft_vocab_size with d2t); None = the target's."""
    train_lm_head: bool = True
    """Train the draft's own lm_head (EAGLE-3 does); false keeps the target's rows frozen."""
    attention: str = "dense"
    """dense (an SDPA mask; CPU trains only this way) or flex (FlexAttention's block mask skips the empty blocks)."""
    flex_block_size: int = 128
    """FlexAttention block size (a multiple of 16)."""
    chunk_rows: int = 1024
    """Rows per lm_head chunk (bounds [rows, V] memory); <= 0 = one chunk."""
    max_loss_rows: int | None = None
    """Loss rows per micro-batch over all steps, at most: max_loss_rows // num_steps positions are sampled (the
    same at every step, so chains stay whole) and bound the head's cost; None: every supervised row, or, when
    training starts, fitted to the device (``train.fit``)."""
    init_std: float = 0.02
    """Std of the normal init of fc and the layer's linear maps."""

    def __post_init__(self) -> None:
        check_count("num_steps", self.num_steps, 1, MAX_DRAFT_TOKENS, "steps of the training-time test, drafts a round")
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        if self.attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {self.attention!r}")
        if self.teacher not in TEACHERS:
            raise ValueError(f"teacher must be one of {TEACHERS}, got {self.teacher!r}")
        object.__setattr__(self, "lk_lambda", parse_lk_lambda(self.lk_lambda))
        if self.lk_eta <= 0 or not 0 < self.step_decay <= 1 or not self.init_std > 0:
            raise ValueError("need lk_eta > 0, 0 < step_decay <= 1 and init_std > 0")
        if self.max_loss_rows is not None and self.max_loss_rows < self.num_steps:
            raise ValueError(f"max_loss_rows must hold one position's {self.num_steps} steps, got {self.max_loss_rows}")
        if self.draft_vocab is not None and self.draft_vocab < 1:
            raise ValueError(f"draft_vocab must be >= 1 or null, got {self.draft_vocab}")
        ids = check_target_layer_ids(self.target_layer_ids)
        if ids is not None:  # fc reads them ascending, as vLLM does
            object.__setattr__(self, "target_layer_ids", tuple(sorted(set(ids))))
        for name in ("num_heads", "num_kv_heads", "head_dim", "intermediate_size"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ValueError(f"{name} must be positive or null, got {v}")

    def loss_row_flops(self, vocab: int, hidden: int) -> float:
        """Head-matmul FLOPs of one loss row (``train.fit``), each matmul 2 N H over the draft vocabulary: the draft's
        logits and the rows' gradient, the teacher's logits (kl, lk; the exact teacher assumed), the head's gradient
        when it trains, and lk's recompute of draft and teacher in its activation checkpoint."""
        n = self.draft_vocab or vocab
        matmuls = 2 + {"ce": 0, "kl": 1, "lk": 3}[self.loss_type] + self.train_lm_head
        return 2.0 * matmuls * n * hidden

    def token_flops(self, bundle: TargetBundle) -> float:
        """Draft-stack FLOPs of one micro-batch token, forward and backward (``train.fit``): fc once, then the layer's
        linear maps at every step (6 x parameters a token; attention's T-dependent part left out)."""
        H, heads, kv, head_dim, inter = layer_shape(bundle, self)
        taps = len(self.target_layer_ids or (0, 0, 0))
        layer = 2 * H * (heads + 2 * kv) * head_dim + heads * head_dim * H + 3 * H * inter
        return 6.0 * (taps * H * H + self.num_steps * layer)

    def resolve(self, bundle: TargetBundle, layout: Layout) -> "Eagle3Config":
        """Fill None fields from the target and the dataset's taps; refuse what the dataset cannot feed."""
        H, heads, kv, head_dim, inter = layer_shape(bundle, self)
        if layout.hidden_size != H:
            raise ValueError(f"dataset hidden size {layout.hidden_size} != its target bundle's {H}")
        V = int(bundle.lm_head.shape[0])
        if self.draft_vocab is not None and self.draft_vocab >= V:
            raise ValueError(f"draft_vocab {self.draft_vocab} is not below the target vocabulary ({V}); drop it "
                             "(null drafts over the whole vocabulary)")
        ids = self.target_layer_ids
        if ids is None:
            rule = eagle3_tap_ids(layout.num_layers)
            if set(rule) <= set(layout.tap_ids):
                ids = tuple(rule)
            else:
                below = [i for i in layout.tap_ids if i != layout.num_layers - 1] or list(layout.tap_ids)
                ids = tuple(sorted({below[0], below[len(below) // 2], below[-1]}))
                warnings.warn(
                    f"EAGLE-3's default taps over {layout.num_layers} target layers are {rule}, but the dataset "
                    f"stores {list(layout.tap_ids)}: fusing {list(ids)} instead (recorded as drafter.target_layer_ids "
                    "in the run's config.json); set drafter.target_layer_ids to choose, or capture with the default "
                    "taps", UserWarning, stacklevel=2)
        missing = [i for i in ids if i not in layout.tap_ids]
        if missing:
            raise ValueError(f"target_layer_ids {list(ids)} include {missing}, which the dataset did not store "
                             f"(stored taps: {list(layout.tap_ids)}); choose stored taps or recapture")
        return dataclasses.replace(
            self, num_heads=heads, num_kv_heads=kv, head_dim=head_dim, intermediate_size=inter,
            target_layer_ids=tuple(ids))
