"""What a reply is and how replies are asked for: :class:`GenerationConfig`, :class:`ReplyConfig`, :class:`Generation`
and :func:`context_length`. Capture's config, the in-process decoder (``capture.replies``) and vLLM's
(``capture.vllm.regenerate``) all use them; here, below all three, none of them imports another for a type.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tapdraft.capture.targets.base import Expanded, Target


@dataclass(frozen=True)
class GenerationConfig:
    """How replies are decoded: greedy by default, or seeded sampling."""

    max_new_tokens: int = 256
    """Reply tokens at most; a reply that reaches it without an end of turn is truncated."""
    temperature: float = 0.0
    """0: greedy argmax; > 0: sample from softmax(logits / temperature)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (sampling only)."""
    seed: int = 0
    """Base seed; each reply's generator is seeded from (seed, sample id, turn)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_dict(self) -> dict:
        return {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "seed": self.seed, "greedy": self.greedy}


@dataclass
class Generation:
    """One reply: its tokens (without the stop id) and, with taps, the states of every position."""

    tokens: list[int]
    stop_id: int | None
    """The end-of-turn id that ended the reply; None when it hit max_new_tokens (truncated)."""
    expanded: Expanded | None
    """The prompt as the target saw it (None from an engine that expands it itself: ``capture.vllm.regenerate``)."""
    taps: torch.Tensor | None = None  # [T, n, H], T = prompt + tokens (+ stop id)
    last: torch.Tensor | None = None  # [T, H], last decoder layer, pre-norm
    error: bool = False
    """The target produced NaN/Inf logits while decoding this reply."""
    audio_seconds: float = 0.0
    """Seconds of audio in the prompt."""

    @property
    def truncated(self) -> bool:
        return self.stop_id is None

    @property
    def ids(self) -> list[int]:
        """The reply as the target emitted it: tokens plus the stop id when there is one."""
        return self.tokens + ([] if self.stop_id is None else [self.stop_id])


@dataclass(frozen=True)
class ReplyConfig:
    """Which assistant turns the target rewrites and how (shared by ``regenerate`` and ``capture --regenerate``)."""

    generation: GenerationConfig = field(default_factory=GenerationConfig)
    """Greedy or seeded sampling, and the reply length cap."""
    last_turn_only: bool = False
    """Replace only the last assistant turn (earlier ones stay as given)."""
    keep_truncated: bool = False
    """``--on-limit keep``: keep replies that hit max_new_tokens, marked ``"truncated": true`` (their ids are
    supervised, no end of turn), instead of dropping them (the default: a target that never ends its turns, from
    a wrong template or end-of-turn id, then shows as drops rather than as a dataset of cut replies)."""
    max_conversation_tokens: int | None = None
    """``--max-conversation-tokens``: positions a conversation may reach (prompt + reply). The turn whose prompt plus
    ``max_new_tokens`` would pass it is not regenerated: the conversation ends at the reply before it (``cut``,
    counted with the turns it lost), or is dropped as ``over_budget`` when that is its first turn. None: only the
    target's context bounds a conversation. Long multi-turn data (ShareGPT) is kept to what a drafter trains on."""

    def __post_init__(self) -> None:
        if not isinstance(self.generation, GenerationConfig):
            raise ValueError("ReplyConfig.generation must be a GenerationConfig")
        b = self.max_conversation_tokens
        if b is not None and b <= self.generation.max_new_tokens:
            raise ValueError(f"--max-conversation-tokens ({b}) must be above --max-new-tokens "
                             f"({self.generation.max_new_tokens}): no turn would fit")

    def over_budget(self, prompt_length: int) -> bool:
        """A turn whose prompt has ``prompt_length`` positions could pass the conversation's budget."""
        b = self.max_conversation_tokens
        return b is not None and prompt_length + self.generation.max_new_tokens > b

    @property
    def from_target(self) -> bool:
        """Every supervised turn is the target's own greedy reply (offline tau is then exact for greedy decoding)."""
        return self.generation.greedy and not self.last_turn_only

    def to_dict(self) -> dict[str, Any]:
        budget = {} if self.max_conversation_tokens is None else {"max_conversation_tokens": self.max_conversation_tokens}
        return {"generation": self.generation.to_dict(), "last_turn_only": self.last_turn_only,
                "keep_truncated": self.keep_truncated, **budget}


def context_length(target: Target) -> int | None:
    """Positions the target's decoder supports (``max_position_embeddings``), when it says."""
    n = getattr(target.lm_config, "max_position_embeddings", None)
    return None if n is None else int(n)
