"""Conversation manifests, HF datasets, audio decoding and resampling, and every bad-input error."""

from __future__ import annotations

import math

import numpy as np
import pytest
import soundfile as sf

from capture.inputs import BadInput, Conversation, read_hf_dataset, read_jsonl, resample
from capture.targets.salm.target import SALMTarget
from tests.capture.util import conv_record, write_manifest, write_wav

PH = "<|audioplaceholder|>"


def test_nemo_style_and_role_content_records(tmp_path):
    write_wav(tmp_path / "a.wav", [1, 2])
    write_wav(tmp_path / "b.wav", [3])
    recs = [
        conv_record("x1", "a.wav"),
        {"messages": [{"role": "system", "content": "be brief"},
                      {"role": "user", "content": f"compare {PH} and {PH}",
                       "audio": ["a.wav", {"path": "b.wav", "offset": 0.1, "duration": 0.2}]},
                      {"role": "assistant", "content": "they differ ."}]},
    ]
    items = list(read_jsonl(write_manifest(tmp_path / "m.jsonl", recs), placeholder=PH))
    assert all(isinstance(c, Conversation) for c in items)
    a, b = items
    assert a.sample_id == "x1" and a.line == 1
    assert a.messages == [{"role": "user", "content": f"{PH} what did i say ?"},
                          {"role": "assistant", "content": "you said one two ."}]
    assert a.audios[0].path == str(tmp_path / "a.wav")
    assert b.sample_id == "m-2" and [m["role"] for m in b.messages] == ["system", "user", "assistant"]
    assert [(x.offset, x.duration) for x in b.audios] == [(0.0, None), (0.1, 0.2)]


def test_each_bad_line_gets_its_reason(tmp_path):
    write_wav(tmp_path / "a.wav", [1])
    recs = [
        "{not json",
        {"id": "noturns"},
        {"id": "mismatch", "conversations": [{"from": "User", "value": f"{PH} {PH}", "audio": "a.wav"},
                                             {"from": "Assistant", "value": "x"}]},
        {"id": "empty", "conversations": [{"from": "User", "type": "audio", "value": "a.wav"},
                                          {"from": "Assistant", "value": "  "}]},
        {"id": "role", "conversations": [{"from": "Robot", "value": "hi"}]},
        {"id": "noasst", "conversations": [{"from": "User", "value": "hi"}]},
    ]
    items = list(read_jsonl(write_manifest(tmp_path / "m.jsonl", recs), placeholder=PH))
    assert all(isinstance(i, BadInput) for i in items)
    reasons = {i.sample_id: (i.line, i.reason) for i in items}
    assert reasons["m-1"][0] == 1 and "malformed JSON" in reasons["m-1"][1]
    assert "conversations" in reasons["noturns"][1]
    assert "2 placeholder" in reasons["mismatch"][1] and "1 audio" in reasons["mismatch"][1]
    assert "empty assistant turn" in reasons["empty"][1]
    assert "unknown role" in reasons["role"][1]
    assert "no assistant turn" in reasons["noasst"][1]
    err = items[0].error()
    assert "m-1" in str(err) and ":1" in str(err)


def test_audio_errors_surface_in_prepare(tmp_path, salm):
    target = SALMTarget(salm)
    (tmp_path / "garbage.wav").write_bytes(b"RIFF0000WAVEnot really audio")
    write_wav(tmp_path / "low.wav", [1, 2], sr=4000)
    write_wav(tmp_path / "ok.wav", [1, 2])
    cases = {"missing.wav": "does not exist", "garbage.wav": "cannot decode", "low.wav": "4000 Hz"}
    recs = [conv_record(name, name) for name in cases]
    recs.append({"id": "past", "conversations": [
        {"from": "User", "type": "audio", "value": "ok.wav", "offset": 30.0},
        {"from": "Assistant", "value": "you said one ."}]})
    cases["past"] = "past the end"
    recs.append({"id": "negative", "conversations": [
        {"from": "User", "type": "audio", "value": "ok.wav", "offset": -1.0},
        {"from": "Assistant", "value": "you said one ."}]})
    cases["negative"] = "offset must be >= 0"
    recs.append({"id": "overrun", "conversations": [  # never cut silently
        {"from": "User", "type": "audio", "value": "ok.wav", "offset": 0.25, "duration": 100.0},
        {"from": "Assistant", "value": "you said one ."}]})
    cases["overrun"] = r"0.25s \+ duration 100.0s runs past the end"
    for conv in read_jsonl(write_manifest(tmp_path / "m.jsonl", recs), placeholder=PH):
        with pytest.raises(ValueError, match=cases[conv.sample_id]):
            target.prepare(conv, 0)


def test_offset_duration_and_resampling_to_encoder_rate(tmp_path, salm):
    sr = 8000
    t = np.arange(sr) / sr
    sf.write(tmp_path / "s.flac", (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), sr)
    rec = {"id": "s", "conversations": [{"from": "User", "type": "audio", "value": "s.flac", "offset": 0.25,
                                         "duration": 0.5}, {"from": "Assistant", "value": "one ."}]}
    conv = next(read_jsonl(write_manifest(tmp_path / "m.jsonl", [rec]), placeholder=PH))
    p = SALMTarget(salm).prepare(conv, 0)
    assert p.audio_seconds == pytest.approx(0.5)
    assert p.waveforms[0].shape[0] == 8000  # 0.5 s at 16 kHz


def test_resample_matches_analytic_sine():
    """float64 reference: a band-limited sine resampled 8k -> 16k and 16k -> 11025 stays that sine."""
    for src, dst, f in ((8000, 16000, 440.0), (16000, 11025, 1000.0), (44100, 16000, 3000.0)):
        t = np.arange(int(src * 0.5)) / src
        y = resample(np.sin(2 * np.pi * f * t).astype(np.float32), src, dst)
        assert y.shape[0] == math.ceil(dst * t.shape[0] / src)
        ref = np.sin(2 * np.pi * f * np.arange(y.shape[0]) / dst)
        mid = slice(y.shape[0] // 10, -y.shape[0] // 10)  # edges see zero padding
        assert np.abs(y[mid] - ref[mid]).max() < 2e-3


def test_hf_dataset_with_audio_column(tmp_path):
    import datasets

    write_wav(tmp_path / "a.wav", [4, 2])
    ds = datasets.Dataset.from_dict({"id": ["h0", "h1"], "audio": [str(tmp_path / "a.wav")] * 2,
                                     "text": ["four two .", ""]})
    ds = ds.cast_column("audio", datasets.Audio(decode=False))
    ds.save_to_disk(str(tmp_path / "hf"))
    items = list(read_hf_dataset(str(tmp_path / "hf"), placeholder=PH))
    assert isinstance(items[0], Conversation) and items[0].messages[1]["content"] == "four two ."
    assert items[0].audios[0].path or items[0].audios[0].data
    assert isinstance(items[1], BadInput) and "empty assistant" in items[1].reason


def test_duration_may_overrun_by_rounding_only(tmp_path, salm):
    write_wav(tmp_path / "ok.wav", [1, 2])
    total = sf.info(str(tmp_path / "ok.wav")).frames / 16000
    recs = [{"id": f"d{i}", "conversations": [{"from": "User", "type": "audio", "value": "ok.wav", "offset": 0.5,
                                               "duration": round(total - 0.5 + extra, 3)},
                                              {"from": "Assistant", "value": "one ."}]}
            for i, extra in enumerate((0.004, 0.05))]
    convs = list(read_jsonl(write_manifest(tmp_path / "m.jsonl", recs), placeholder=PH))
    p = SALMTarget(salm).prepare(convs[0], 0)  # a rounded duration: the rest of the file
    assert p.audio_seconds == pytest.approx(total - 0.5)
    with pytest.raises(ValueError, match="runs past the end"):
        SALMTarget(salm).prepare(convs[1], 0)


def test_hf_dataset_conversations_take_the_audio_column(tmp_path):
    """Audio turns without a path (and bare placeholders) take the row's audio column, in order."""
    import datasets

    write_wav(tmp_path / "a.wav", [4, 2])
    turns = [{"from": "User", "type": "audio", "value": None}, {"from": "User", "type": "text", "value": "what ?"},
             {"from": "Assistant", "type": "text", "value": "four two ."}]
    two = [{"from": "User", "type": "text", "value": f"{PH} and {PH}"}, turns[2]]
    ds = datasets.Dataset.from_dict({"id": ["c0", "c1"], "audio": [str(tmp_path / "a.wav")] * 2,
                                     "conversations": [turns, two]})
    ds.cast_column("audio", datasets.Audio(decode=False)).save_to_disk(str(tmp_path / "hf"))
    items = list(read_hf_dataset(str(tmp_path / "hf"), placeholder=PH))
    assert isinstance(items[0], Conversation), items[0]
    assert items[0].messages == [{"role": "user", "content": f"{PH} what ?"},
                                 {"role": "assistant", "content": "four two ."}]
    assert len(items[0].audios) == 1 and (items[0].audios[0].path or items[0].audios[0].data)
    assert isinstance(items[1], BadInput) and "2 audio placeholder(s) without a path but 1 audio(s)" in items[1].reason
    # a manifest line has no audio column: an audio turn without a path is that line's error
    m = write_manifest(tmp_path / "m.jsonl", [{"id": "j", "conversations": turns}])
    (bad,) = list(read_jsonl(m, placeholder=PH))
    assert isinstance(bad, BadInput) and "without a path" in bad.reason
