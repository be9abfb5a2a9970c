"""Fixtures for capture tests: a tiny random-init SALM saved to disk, tone wav files, manifests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tapdraft.capture.targets.salm.model import SALM
from tests.capture.util import conv_record, write_manifest, write_wav


@pytest.fixture()
def salm(salm_dir) -> SALM:
    return SALM.from_pretrained(salm_dir)


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


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models run fastest on one thread, and the CI machine's cores are shared."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
