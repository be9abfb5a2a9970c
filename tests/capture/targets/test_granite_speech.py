"""Granite Speech: torch log-mel vs a float64 numpy reference, the adapter vs the model's own forward."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from tapdraft.capture.forward import SampleSpec, run_batch
from tapdraft.capture.targets.granite_speech import GraniteLogMel, GraniteSpeechTarget, htk_mel_filterbank
from tapdraft.capture.targets.load import load_target
from tests.capture.speech_models import (GRANITE_PREPROCESSOR, audio_conv, decoder_inputs_embeds,
                                         layers_and_logits, save_granite_speech)


@pytest.fixture(scope="session")
def granite_dir(tmp_path_factory) -> Path:
    return save_granite_speech(tmp_path_factory.mktemp("granite_speech"))


@pytest.fixture()
def target(granite_dir) -> GraniteSpeechTarget:
    t = load_target(granite_dir)
    assert isinstance(t, GraniteSpeechTarget)
    return t


def _numpy_log_mel(wave: np.ndarray, sr=16000, n_fft=512, win=400, hop=160, n_mels=80) -> np.ndarray:
    """float64 reference written from the documented recipe, frame by frame."""
    x = np.pad(wave.astype(np.float64), n_fft // 2, mode="reflect")
    w = np.zeros(n_fft)
    lo = (n_fft - win) // 2
    w[lo : lo + win] = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(win) / win)  # periodic Hann, centred in n_fft
    n_frames = 1 + (x.shape[0] - n_fft) // hop
    power = np.stack([np.abs(np.fft.rfft(x[t * hop : t * hop + n_fft] * w)) ** 2 for t in range(n_frames)])
    hz_to_mel = lambda f: 2595 * np.log10(1 + f / 700)  # noqa: E731
    f_pts = 700 * (10 ** (np.linspace(hz_to_mel(0.0), hz_to_mel(sr / 2), n_mels + 2) / 2595) - 1)
    freqs = np.linspace(0, sr // 2, n_fft // 2 + 1)
    fb = np.zeros((freqs.shape[0], n_mels))
    for m in range(n_mels):
        left, mid, right = f_pts[m], f_pts[m + 1], f_pts[m + 2]
        fb[:, m] = np.maximum(0, np.minimum((freqs - left) / (mid - left), (right - freqs) / (right - mid)))
    logmel = np.log10(np.maximum(power @ fb, 1e-10))
    logmel = np.maximum(logmel, logmel.max() - 8.0) / 4 + 1
    F = logmel.shape[0] // 2 * 2
    return logmel[:F].reshape(F // 2, 2 * n_mels)


def test_log_mel_equals_a_float64_reference():
    fe = GraniteLogMel(**{k: v for k, v in GRANITE_PREPROCESSOR.items() if not k.endswith(("_type", "_class"))})
    rng = np.random.default_rng(0)
    for n in (16000, 8161, 3205):  # odd and even frame counts
        t = np.arange(n) / 16000
        wave = (0.3 * np.sin(2 * np.pi * 440 * t) + rng.normal(0, 0.05, n)).astype(np.float32)
        got = fe.log_mel(torch.from_numpy(wave)).double().numpy()
        ref = _numpy_log_mel(wave)
        assert got.shape == ref.shape == ((n // 160 + 1) // 2, 160)
        np.testing.assert_allclose(got, ref, atol=2e-5, rtol=0)
    # the filterbank also equals transformers' own HTK construction (audio_utils, no norm)
    from transformers.audio_utils import mel_filter_bank

    ref_fb = mel_filter_bank(num_frequency_bins=257, num_mel_filters=80, min_frequency=0.0, max_frequency=8000.0,
                             sampling_rate=16000, norm=None, mel_scale="htk")
    np.testing.assert_allclose(htk_mel_filterbank(257, 80, 16000).double().numpy(), ref_fb, atol=1e-6)


def test_settings_come_from_preprocessor_config(tmp_path):
    cfg = {**GRANITE_PREPROCESSOR, "n_mels": 40, "hop_length": 200, "projector_window_size": 10,
           "projector_downsample_rate": 2}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(cfg))
    fe = GraniteLogMel.from_config_file(tmp_path / "preprocessor_config.json")
    wave = np.random.default_rng(0).normal(0, 0.1, 12345).astype(np.float32)
    out = fe([wave, wave[:5000]])
    assert out["input_features"].shape == (2, (12345 // 200 + 1) // 2, 80)
    # projector frames: ceil(encoder frames / window) * (window // downsample)
    assert out["audio_embed_sizes"] == [math.ceil(((n // 200 + 1) // 2) / 10) * 5 for n in (12345, 5000)]
    assert out["input_features_mask"].sum(-1).tolist() == out["audio_embed_sizes"]
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps({**cfg, "feature_extractor_type": "WhisperFeatureExtractor"}))
    with pytest.raises(ValueError, match="GraniteSpeechFeatureExtractor"):
        GraniteLogMel.from_config_file(tmp_path / "preprocessor_config.json")


def _conv(sid, n_samples, seed, reply="you said one two ."):
    return audio_conv("<|audio|>", sid, n_samples, seed, reply)


def _own_forward(target, conv):
    """The processor + the model's own forward on one conversation; outputs of every decoder layer, logits."""
    text = target.tokenizer.apply_chat_template(conv.messages, tokenize=False)
    inputs = target.processor(text=text, audio=[a.array for a in conv.audios], return_tensors="pt")
    return (inputs, *layers_and_logits(target, inputs))


def test_taps_and_teacher_equal_the_models_own_forward(target):
    L = target.num_layers
    assert target.logits_scaling == 4.0 and target.audio_bundle()["frame_seconds"] == pytest.approx(0.1)
    convs = [_conv("a", 20000, 0), _conv("b", 7000, 1, "you said three .")]
    batch = [target.prepare(c, i) for i, c in enumerate(convs)]
    assert batch[0].length != batch[1].length  # the batch is padded
    with torch.no_grad():
        res = run_batch(target, batch, SampleSpec(tap_ids=list(range(L)), top_k=4))
        for c, p, r in zip(convs, batch, res):
            inputs, hs, logits = _own_forward(target, c)
            assert r["input_ids"].tolist() == inputs["input_ids"][0].tolist()  # the processor's expansion
            n_audio = target.feature_extractor._get_num_audio_features([c.audios[0].array.size])[0]
            assert int(r["is_audio"].sum()) == n_audio
            for i in range(L):
                torch.testing.assert_close(r["taps"][:, i].float(), hs[i][0].to(torch.bfloat16).float(),
                                           rtol=0.02, atol=0.02)
            # Granite's LM divides by logits_scaling (the composite model's head leaves it out)
            ref = torch.log_softmax(logits[0].double() / 4.0, dim=-1)[r["topk_rows"].long()]
            torch.testing.assert_close(r["topk_logprobs"].double(), ref.topk(4, dim=-1).values, rtol=1e-4, atol=1e-4)
            assert r["topk_ids"][:, 0].tolist() == ref.argmax(-1).tolist()


def test_merge_equals_the_models_inputs_embeds(target):
    c = _conv("a", 12000, 3)
    seen = decoder_inputs_embeds(target, lambda: _own_forward(target, c))
    with torch.no_grad():
        ex = target.embed([target.prepare(c, 0)])[0]
    torch.testing.assert_close(ex.inputs_embeds, seen[0], rtol=1e-6, atol=1e-6)
    supervised = target.tokenizer.convert_ids_to_tokens(ex.input_ids[ex.loss_mask].tolist())
    assert supervised == ["you", "said", "one", "two", ".", "<|im_end|>"]


def test_a_lora_adapter_directory_is_refused(granite_dir, tmp_path):
    import shutil

    d = tmp_path / "with_adapter"
    shutil.copytree(granite_dir, d)
    (d / "adapter_config.json").write_text("{}")
    with pytest.raises(ValueError, match="merge it into the weights"):
        load_target(d)
