"""demo.real.listen's parts: the task's splits, WER, resampling, and the fast encoder pass against the model's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tapdraft.demo.real.build import build_real_targets, check_wave
from tapdraft.demo.real.listen import VOCAB_OOV, encode_audio, encode_audio_full, resample, sentences, wer


def test_splits_are_disjoint_and_oov_holds_unseen_words(monkeypatch):
    d = sentences(490, 30, 20)
    assert [len(d[k]) for k in ("train", "test", "oov")] == [490, 30, 20]
    assert not set(d["train"]) & set(d["test"]) and not set(d["train"]) & set(d["oov"])
    seen = {w for s in d["train"] for w in s.split()}
    assert {w for s in d["test"] for w in s.split()} <= seen
    assert all(VOCAB_OOV & set(s.split()) or any(w.rstrip("s") in VOCAB_OOV for w in s.split()) for s in d["oov"])
    assert not VOCAB_OOV & seen
    assert sentences(490, 30, 20) == d  # a pure function of the seed
    monkeypatch.setattr("tapdraft.demo.real.listen.TEMPLATES", ["turn {dir}"])  # 2 sentences in all
    with pytest.raises(ValueError, match="fewer than 5 distinct train"):
        sentences(5, 1, 1)


def test_wer_is_the_word_edit_distance():
    assert wer("the cat sees the dog", "the cat sees the dog") == (0, 5)
    assert wer("the cat sees the dog", "a cat sees dog") == (2, 5)
    assert wer("a b", "") == (2, 2) and wer("", "x y") == (2, 0)


def test_resample_keeps_a_tone_and_the_duration():
    t = np.arange(22050) / 22050
    y = resample(np.sin(2 * np.pi * 440 * t).astype(np.float32), 22050, 16000)
    ref = np.sin(2 * np.pi * 440 * np.arange(16000) / 16000)
    assert y.shape == (16000,) and np.abs(y[100:-100] - ref[100:-100]).max() < 1e-3


@pytest.mark.slow
def test_fast_encoder_pass_equals_the_models_masked_one():
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

    d = build_real_targets().speech
    model = Qwen2AudioForConditionalGeneration.from_pretrained(d).eval()
    fe = AutoProcessor.from_pretrained(d).feature_extractor
    waves = [check_wave(1.7), check_wave(3.0)[::-1].copy()]
    for a, b in zip(encode_audio(model, waves, fe), encode_audio_full(model, waves, fe)):
        assert a.shape == b.shape and a.shape[0] in (42, 75)  # 25 frames a second
        assert torch.allclose(a, b, atol=1e-4, rtol=0)
