"""Fixtures for capture tests: a tiny random-init SALM saved to disk, tone wav files, manifests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from capture.demo import QUICK, build_demo_salm, tone_audio
from capture.salm import SALM


@pytest.fixture(scope="session")
def salm_dir(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("salm")
    build_demo_salm(QUICK, seed=0).save_pretrained(d)
    return d


@pytest.fixture()
def salm(salm_dir) -> SALM:
    return SALM.from_pretrained(salm_dir)


def write_wav(path: Path, digits: list[int], seed: int = 0, sr: int = 16000) -> Path:
    wave = tone_audio(digits, np.random.default_rng(seed))
    if sr != 16000:
        from capture.inputs import resample

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


@pytest.fixture()
def tone_manifest(tmp_path) -> Path:
    """10 conversations over 2-5 digit tone audios of varied length."""
    rng = np.random.default_rng(1)
    recs = []
    for i in range(10):
        digits = [int(x) for x in rng.integers(0, 10, size=int(rng.integers(2, 6)))]
        write_wav(tmp_path / "audio" / f"u{i}.wav", digits, seed=i)
        recs.append(conv_record(f"u{i}", f"audio/u{i}.wav", reply="you said " + " ".join(["one"] * len(digits)) + " ."))
    return write_manifest(tmp_path / "train.jsonl", recs)
