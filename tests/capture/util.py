"""Helpers for capture tests: tone wav files and conversation manifests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import soundfile as sf

from tapdraft.demo.task import tone_audio


def write_wav(path: Path, digits: list[int], seed: int = 0, sr: int = 16000) -> Path:
    wave = tone_audio(digits, np.random.default_rng(seed))
    if sr != 16000:
        from tapdraft.capture.inputs import resample

        wave = resample(wave, 16000, sr)
    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(path, wave, sr, subtype="PCM_16")
    return path


def conv_record(sid: str, wav: str, reply: str = "you said one two .", prompt: str = "what did i say ?") -> dict:
    return {"id": sid, "conversations": [
        {"from": "User", "type": "audio", "value": wav},
        {"from": "User", "type": "text", "value": prompt},
        {"from": "Assistant", "type": "text", "value": reply},
    ]}


def write_manifest(path: Path, records: list[dict | str]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path
