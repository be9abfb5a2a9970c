"""The settings of a target's own MTP module fine-tuned in place (Qwen3.5)."""

from __future__ import annotations

from dataclasses import dataclass

from tapdraft.train.drafters.mtp.config import MTPConfig


@dataclass(frozen=True)
class MTPNativeConfig(MTPConfig):
    """The target's own MTP module (Qwen3.5), fine-tuned head-only."""

    checkpoint: str = ""
    """The target checkpoint directory: its config.json and the ``mtp.*`` tensors of its safetensors."""
    recursion: str = "post_norm"
    """Fixed: the next step reads the MTP's normed output, as vLLM feeds it."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.checkpoint:
            raise ValueError("drafter.checkpoint must name the target checkpoint directory (its mtp.* weights "
                             "initialise the head); pass --set drafter.checkpoint=DIR")
        if self.num_depths != 1:
            raise ValueError(
                "the target's MTP module trains one depth (num_depths: 1): vLLM drafts a further token by running the "
                "same layer again at the next position over its own cache, which tapdraft's depth chain does not "
                "reproduce; serve it with num_speculative_tokens: 1")
        if self.recursion != "post_norm":
            raise ValueError("the target's MTP feeds a further step its normed output: recursion must be post_norm")
        for name in ("num_heads", "num_kv_heads", "head_dim", "intermediate_size"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name} is the checkpoint's own for its MTP module; leave it null")
        if self.draft_vocab is not None:
            raise ValueError("the target's own MTP module is served on the target's whole lm_head: drop draft_vocab")
