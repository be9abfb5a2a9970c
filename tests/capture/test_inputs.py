"""Conversation manifests, HF datasets, audio decoding and resampling, and every bad-input error."""

from __future__ import annotations

import json
import math
import os
import re

import numpy as np
import pytest
import soundfile as sf

from tapdraft.capture.inputs import BadInput, Conversation, read_hf_dataset, read_inputs, read_jsonl, resample
from tapdraft.capture.targets.salm.target import SALMTarget
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


# ------------------------------------------------------------------- hostile inputs: each ends in one line or a skip
def _hostile_inputs(root):
    """A manifest whose lines cover every class of bad input a shared JSONL can hold, beside good ones:
    id -> the reason its line must give (None: a good line)."""
    write_wav(root / "a.wav", [1, 2])
    write_wav(root.parent / "outside.wav", [3])
    whole = write_wav(root / "whole.wav", [1, 2, 3, 4, 5])
    data = whole.read_bytes()
    (root / "cut.wav").write_bytes(data[: len(data) // 3])  # a copy cut short: its header still says the whole
    lines = [
        (conv_record("ok", "a.wav"), None),
        (conv_record("ok", "a.wav"), r"id 'ok' repeats the id of .*m\.jsonl:1; ids must be unique"),
        ({**conv_record("x", "a.wav"), "id": None}, "id null is not a non-empty string"),
        ({**conv_record("x", "a.wav"), "id": 7}, "id 7 is not a non-empty string"),
        (b'{"id": "latin1", "conversations": "caf\xe9"}', r"not valid UTF-8 \(byte 0xe9 at column 39\)"),
        (conv_record("up", "../outside.wav"), "leaves the manifest's directory"),
        (conv_record("abs", str(root.parent / "outside.wav")), "leaves the manifest's directory"),
        (conv_record("inside", str(root / "a.wav")), None),  # absolute, but inside: allowed
        (conv_record("m-11", "a.wav"), None),  # an explicit id that line 11's default id repeats
        (conv_record("cut", "cut.wav"), None),  # parses; decoding it says so (test below)
        ({k: v for k, v in conv_record("", "a.wav").items() if k != "id"}, r"id 'm-11' repeats the id of .*m\.jsonl:9"),
    ]
    raw = b"".join((rec if isinstance(rec, bytes) else json.dumps(rec).encode()) + b"\n" for rec, _ in lines)
    (root / "m.jsonl").write_bytes(raw)
    return root / "m.jsonl", lines


def test_hostile_lines_are_bad_inputs_with_file_line_and_reason(tmp_path):
    path, lines = _hostile_inputs(tmp_path)
    items = list(read_inputs(str(path), placeholder=PH))
    assert len(items) == len(lines)
    for lineno, (item, (_, reason)) in enumerate(zip(items, lines), start=1):
        assert item.line == lineno
        if reason is None:
            assert isinstance(item, Conversation), item
        else:
            assert isinstance(item, BadInput) and re.search(reason, item.reason), (lineno, item)
            assert f"{path}:{lineno}" in str(item.error())


def test_outside_paths_are_an_opt_in(tmp_path):
    path, _ = _hostile_inputs(tmp_path)
    items = {i.line: i for i in read_inputs(str(path), placeholder=PH, allow_outside_paths=True)}
    for line in (6, 7):
        assert isinstance(items[line], Conversation)
        assert os.path.normpath(items[line].audios[0].path) == str(tmp_path.parent / "outside.wav")


def test_a_truncated_wav_is_refused_not_shortened(tmp_path, salm):
    path, _ = _hostile_inputs(tmp_path)
    cut = next(i for i in read_inputs(str(path), placeholder=PH) if i.sample_id == "cut")
    with pytest.raises(ValueError, match=r"cut\.wav holds 0\.\d+s, its header declares \d\.\d+s: the file is "
                                         "truncated"):
        SALMTarget(salm).prepare(cut, 0)
    whole = next(read_jsonl(write_manifest(tmp_path / "w.jsonl", [conv_record("w", "whole.wav")]), placeholder=PH))
    assert SALMTarget(salm).prepare(whole, 0).audio_seconds > 0


def test_a_repeated_id_never_makes_a_dataset_verify_rejects(salm_dir, tone_manifest, tmp_path, capsys):
    """Issue 28: the same id on two lines was captured twice (exit 0, skipped 0) into a dataset its own verify
    rejected. Now: one line naming both lines and exit 2, or under --on-error skip a counted skip."""
    from tapdraft.cli import main
    from tapdraft.capture.config import CaptureConfig
    from tapdraft.capture.pipeline import capture
    from tapdraft.shards.verify import verify_dataset
    from tapdraft.shards.writer import ShardConfig

    lines = tone_manifest.read_text().splitlines()
    tone_manifest.write_text("\n".join(lines[:4] + [lines[1]] + lines[4:6]) + "\n")  # line 5 repeats line 2
    args = ["capture", "--target", str(salm_dir), "--data", str(tone_manifest), "--top-k", "4", "--device", "cpu"]
    with pytest.raises(SystemExit) as e:
        main(args + ["--out", str(tmp_path / "failed")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert re.search(r"bad input 'u1' \(.*train\.jsonl, line 5\): id 'u1' repeats the id of .*train\.jsonl:2", err[0])
    m = capture(CaptureConfig(target=str(salm_dir), out=str(tmp_path / "ds"), data=(("train", str(tone_manifest)),),
                              top_k=4, window=4, batch_tokens=120, progress=False, on_error="skip",
                              shard=ShardConfig(shard_bytes=6000)))
    assert m["splits"]["train"]["samples"] == 6 and m["run_stats"]["train"]["skipped"] == {"error": 1}
    assert [s["sample_id"] for s in m["skipped"]["train"]] == ["u1"]
    assert verify_dataset(str(tmp_path / "ds"), progress=False).ok


def test_capture_confines_audio_unless_allowed(salm_dir, tmp_path):
    from tapdraft.capture.config import CaptureConfig
    from tapdraft.capture.pipeline import capture

    write_wav(tmp_path / "audio" / "a.wav", [1, 2])
    write_wav(tmp_path / "lists" / "x.wav", [3])
    man = write_manifest(tmp_path / "lists" / "m.jsonl", [conv_record("a", "../audio/a.wav"),
                                                          conv_record("b", "x.wav")])

    def run(out, **kw):
        return capture(CaptureConfig(target=str(salm_dir), out=str(tmp_path / out), data=(("train", str(man)),),
                                     top_k=4, progress=False, on_error="skip", **kw))

    m = run("confined")
    assert m["splits"]["train"]["samples"] == 1
    assert "leaves the manifest's directory" in m["skipped"]["train"][0]["reason"]
    assert run("allowed", allow_outside_paths=True)["splits"]["train"]["samples"] == 2
    assert "allow_outside_paths" not in CaptureConfig(target="t", out="o", data=(("train", "m"),)).identity()
