"""The adapter for any HF causal LM on text-only conversations (an audio in its inputs is refused)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from torch import nn

from tapdraft.capture.inputs import Conversation
from tapdraft.capture.targets.base import Expanded, Prepared, Target, expand_placeholders


class CausalLMTarget(Target):
    """Any HF causal LM on text-only conversations, with its tokenizer's chat template (or an override)."""

    kind = "causal_lm"
    vllm_refused = None  # tests/engines/test_vllm_capture.py

    tokenizer_subdir = None  # HF layout: tokenizer files beside the weights

    def __init__(self, lm: nn.Module, tokenizer, path: str | Path | None = None):
        self.lm = lm.eval()
        self.tokenizer = tokenizer
        self.audio_token_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
        self._path = None if path is None else Path(path)

    def prepare(self, conv: Conversation, index: int) -> Prepared:
        if conv.audios:
            raise ValueError(f"has {len(conv.audios)} audio(s) but the target is a text-only causal LM")
        tok = self._tokenize(conv)
        return Prepared(index, conv.sample_id, conv.source, tok.ids, tok.mask, [], [], 0.0, int(tok.ids.shape[0]),
                        conv.line, len(tok.unsupervised))

    def embed(self, batch: Sequence[Prepared]) -> list[Expanded]:
        emb = self.lm.get_input_embeddings()
        return [
            expand_placeholders(p.token_ids.to(self.device), p.assistant_mask.to(self.device), [],
                                placeholder_id=-1, audio_token_id=self.audio_token_id, embed=emb)
            for p in batch
        ]

    def audio_bundle(self) -> dict[str, Any]:
        return {}
