"""Fixtures shared by the real targets' tests."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture
def fake_speech(monkeypatch):
    """espeak-ng replaced by a tone whose length follows the text (the splits' logic, not the voice, is tested)."""
    spoken = []

    def speak(text, voice, speed):
        spoken.append((text, voice, speed))
        return (0.1 * np.sin(np.arange(800 * len(text.split())) / 7)).astype(np.float32)

    monkeypatch.setattr("tapdraft.demo.real.listen.speak", speak)
    return spoken


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Qwen2-Audio in its real layout, loaded, and its processor."""
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

    from tests.capture.speech_models import save_qwen2_audio

    d = tmp_path_factory.mktemp("qwen2_audio")
    save_qwen2_audio(d, seed=3)
    return Qwen2AudioForConditionalGeneration.from_pretrained(d).eval(), AutoProcessor.from_pretrained(d)
