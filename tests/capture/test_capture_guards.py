"""What capture refuses, caps, skips, counts and keeps: foreign --out, top-k above the vocabulary,
samples past max_position_embeddings, conversations without a user turn, <unk> replies, portable
paths, a full disk (no temp files left) and Ctrl-C (what was kept is said and resumed)."""

from __future__ import annotations

import errno
import json

import pytest

from tapdraft.capture import pipeline
from tapdraft.capture.config import CaptureConfig, migrate_capture_record
from tapdraft.capture.inputs import BadInput, Conversation, read_jsonl
from tapdraft.capture.pipeline import capture
from tapdraft.capture.targets.load import load_target
from tapdraft.common.errors import Interrupted
from tapdraft.shards.manifest import foreign_directory
from tapdraft.shards.reader import open_dataset
from tapdraft.shards.verify import verify_dataset
from tapdraft.shards.shard_file import ShardConfig
from tests.capture.util import conv_record, write_manifest


def _cfg(salm_dir, manifest, out, **kw) -> CaptureConfig:
    base = dict(target=str(salm_dir), out=str(out), data=(("train", str(manifest)),), top_k=4, window=4,
                batch_tokens=120, progress=False)
    base.update(kw)
    return CaptureConfig(shard=ShardConfig(shard_bytes=6000), **base)


def _leftovers(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.name.endswith((".tmp", ".old")))


def test_conversation_without_user_turn_is_a_bad_input(tmp_path):
    man = write_manifest(tmp_path / "m.jsonl", [
        {"id": "a", "conversations": [{"from": "System", "value": "be brief"}, {"from": "Assistant", "value": "hi ."}]},
        {"id": "b", "conversations": [{"from": "User", "value": "hello"}, {"from": "Assistant", "value": "hi ."}]},
    ])
    items = list(read_jsonl(man, placeholder="<|audioplaceholder|>"))
    assert isinstance(items[0], BadInput) and "no user turn" in items[0].reason
    assert isinstance(items[1], Conversation)


def test_foreign_directory(tmp_path):
    assert not foreign_directory(str(tmp_path / "missing")) and not foreign_directory(str(tmp_path))
    (tmp_path / ".lock").write_text("1")
    assert not foreign_directory(str(tmp_path))  # hidden entries do not count
    other = tmp_path / "other"
    other.mkdir()
    (other / "README.md").write_text("my project")
    assert foreign_directory(str(other))
    for folder in ("data", "index", "target", "target.tmp"):  # a project has these too: they prove nothing
        (other / folder).mkdir()
        assert foreign_directory(str(other)), folder
    (other / "capture_config.json").write_text("{}")
    assert not foreign_directory(str(other), own=("capture_config.json",))
    (other / "capture_config.json").unlink()
    (other / "_parts").mkdir()  # every writer's lock makes it before writing anything else
    assert not foreign_directory(str(other))
    (other / "_parts").rmdir()
    (other / "manifest.json").write_text("{}")
    assert not foreign_directory(str(other))


def test_capture_refuses_a_foreign_out_directory(salm_dir, tone_manifest, tmp_path):
    out = tmp_path / "project"
    out.mkdir()
    (out / "README.md").write_text("my project")
    with pytest.raises(ValueError, match="not a tapdraft dataset"):
        capture(_cfg(salm_dir, tone_manifest, out))
    assert (out / "README.md").read_text() == "my project" and sorted(p.name for p in out.iterdir()) == ["README.md"]


def test_top_k_capped_at_vocab_long_samples_skipped_unk_counted_paths_portable(salm_dir, tmp_path):
    from tests.capture.util import write_wav

    write_wav(tmp_path / "audio" / "a.wav", [1, 2])
    write_wav(tmp_path / "audio" / "long.wav", [1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3, 4])
    man = write_manifest(tmp_path / "train.jsonl", [
        conv_record("ok", "audio/a.wav"),
        conv_record("unk", "audio/a.wav", reply="you said zebra giraffe ."),
        conv_record("long", "audio/long.wav"),
    ])
    target = load_target(salm_dir)
    vocab = target.lm.get_output_embeddings().weight.shape[0]
    lengths = {c.sample_id: target.prepare(c, 0).length for c in read_jsonl(man, placeholder=target.placeholder)}
    limit = lengths["long"] - 1
    assert max(lengths["ok"], lengths["unk"]) <= limit
    target.lm_config.max_position_embeddings = limit
    with pytest.warns(UserWarning, match=f"k = {vocab}"):
        m = capture(_cfg(salm_dir, man, tmp_path / "ds", top_k=vocab + 10), target=target)
    assert m["layout"]["top_k"] == vocab and m["capture_config"]["top_k"] == vocab + 10
    skipped = m["skipped"]["train"]
    assert [(s["sample_id"], "max_position_embeddings" in s["reason"]) for s in skipped] == [("long", True)]
    assert m["run_stats"]["train"]["skipped"] == {"too_long": 1}
    assert m["run_stats"]["train"]["supervised_unk"] == 2
    assert "2 supervised tokens are <unk>" in pipeline.summary(m)
    ds = open_dataset(str(tmp_path / "ds"))
    assert sorted(ds.sample("train", i)["source"] for i in range(2)) == ["train.jsonl:1", "train.jsonl:2"]
    assert ds.sample("train", 0)["topk_ids"].shape[1] == vocab
    assert m["capture_config"]["target"] == salm_dir.name and m["capture_config"]["data"] == [["train", "train.jsonl"]]
    for name in ("manifest.json", "README.md", "capture_config.json"):
        text = (tmp_path / "ds" / name).read_text()
        assert str(tmp_path) not in text and str(salm_dir) not in text, name
    assert verify_dataset(str(tmp_path / "ds"), progress=False).ok


def test_old_absolute_records_resume_as_portable(salm_dir, tone_manifest, tmp_path):
    rec = _cfg(salm_dir, tone_manifest, tmp_path / "ds").to_dict()
    old = {**rec, "target": str(salm_dir), "data": [["train", str(tone_manifest)]], "out": str(tmp_path / "ds")}
    assert migrate_capture_record(old) == {**rec, "out": "ds"}


def test_full_disk_leaves_no_temp_files_and_resumes(salm_dir, tone_manifest, tmp_path, monkeypatch):
    from tapdraft.shards import shard_file

    real = shard_file._HashingSink.write
    budget = {"bytes": 9000}  # the first shard fits, the second hits the "full disk"

    def write(self, data):
        budget["bytes"] -= memoryview(data).nbytes
        if budget["bytes"] < 0:
            raise OSError(errno.ENOSPC, "No space left on device", "data/train-rank00000-00001.arrow.tmp")
        return real(self, data)

    monkeypatch.setattr(shard_file._HashingSink, "write", write)
    out = tmp_path / "ds"
    with pytest.raises(OSError) as e:
        capture(_cfg(salm_dir, tone_manifest, out))
    assert e.value.errno == errno.ENOSPC
    assert _leftovers(out) == [] and not (out / "manifest.json").exists()
    assert json.loads((out / "_parts" / "train-rank00000.json").read_text())["shards"]  # the first shard is kept
    monkeypatch.setattr(shard_file._HashingSink, "write", real)
    m = capture(_cfg(salm_dir, tone_manifest, out))
    assert m["splits"]["train"]["samples"] == 10 and verify_dataset(str(out), progress=False).ok


def test_ctrl_c_keeps_finished_work_and_says_so(salm_dir, tone_manifest, tmp_path, monkeypatch):
    real = pipeline.run_batch
    calls = {"n": 0}

    def run_batch(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(pipeline, "run_batch", run_batch)
    out = tmp_path / "ds"
    with pytest.raises(Interrupted, match=r"split 'train' has \d+ of 10 inputs done and kept.*rerun the same") as e:
        capture(_cfg(salm_dir, tone_manifest, out))
    kept = int(str(e.value).split(" has ")[1].split(" of ")[0])
    assert kept > 0 and _leftovers(out) == []
    monkeypatch.setattr(pipeline, "run_batch", real)
    m = capture(_cfg(salm_dir, tone_manifest, out))
    assert m["run_stats"]["train"]["written"] == 10 - kept and m["splits"]["train"]["samples"] == 10
    assert verify_dataset(str(out), progress=False).ok


def test_loading_a_target_prints_no_library_progress_bar(salm_dir, capfd):
    from transformers.utils import logging as hf_logging

    load_target(salm_dir)
    err = capfd.readouterr().err
    assert "Loading weights" not in err, err
    assert hf_logging.is_progress_bar_enabled()  # restored for the caller


def test_ctrl_c_while_loading_says_nothing_was_lost(salm_dir, tone_manifest, tmp_path, monkeypatch):
    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "load_target", interrupted)
    with pytest.raises(Interrupted, match="outside its sample loop.*rerun the same command"):
        capture(_cfg(salm_dir, tone_manifest, tmp_path / "ds"))


def test_audio_far_too_long_is_skipped_from_its_header_without_decoding(salm_dir, tmp_path, monkeypatch):
    """An hour of WAV was decoded whole (3.4 GB) before being skipped as too long: its header says enough. Audio
    that may fit is still decoded and measured exactly."""
    import numpy as np
    import soundfile as sf

    from tapdraft.capture.targets.salm import target as salm_target
    from tests.capture.util import write_wav

    frame_s = load_target(salm_dir).audio_bundle()["frame_seconds"]
    max_length = 200
    sf.write(tmp_path / "long.wav", np.zeros(int(3 * max_length * frame_s * 16000), np.int16), 16000)
    write_wav(tmp_path / "short.wav", [1, 2])
    man = write_manifest(tmp_path / "m.jsonl", [conv_record("long", "long.wav"), conv_record("short", "short.wav")])
    decoded = []
    real = salm_target.load_audio
    monkeypatch.setattr(salm_target, "load_audio", lambda ref, **kw: decoded.append(ref.path) or real(ref, **kw))
    m = capture(_cfg(salm_dir, man, tmp_path / "ds", max_length=max_length))
    assert [str(p).rsplit("/", 1)[-1] for p in decoded] == ["short.wav"]
    (skip,) = m["skipped"]["train"]
    assert skip["sample_id"] == "long" and skip["reason"].startswith("too long: ") and "not decoded" in skip["reason"]
    assert m["splits"]["train"]["samples"] == 1


def within(seconds: float, fn, fifos=()):
    """``fn()``'s result, or a test failure when it has not returned after ``seconds`` (a thread stuck opening a FIFO
    is then released by opening each of ``fifos`` for writing, so the suite goes on)."""
    import os
    import threading

    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 (handed to the test)
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        for f in fifos:
            try:
                os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        t.join(30)
        pytest.fail(f"still running after {seconds}s (stuck opening a FIFO?)")
    if "error" in box:
        raise box["error"]
    return box["value"]


def special_audio(tmp_path):
    """A manifest over a FIFO, a directory and a character device (a link to /dev/zero, inside the manifest's
    directory) given as audio, and one real file; returns (manifest, FIFO path)."""
    import os

    from tests.capture.util import write_wav

    os.mkfifo(tmp_path / "pipe.wav")
    (tmp_path / "folder.wav").mkdir()
    (tmp_path / "zero.wav").symlink_to("/dev/zero")
    write_wav(tmp_path / "ok.wav", [1, 2])
    man = write_manifest(tmp_path / "m.jsonl", [conv_record(n, f"{n}.wav") for n in ("pipe", "folder", "zero", "ok")])
    return man, tmp_path / "pipe.wav"


SPECIAL_AUDIO = {"pipe": "is a FIFO (named pipe), not a regular file", "folder": "is a directory",
                 "zero": "is a character device, not a regular file"}


def test_an_audio_path_that_is_no_regular_file_is_refused_before_it_is_opened(salm_dir, tmp_path):
    """A FIFO given as audio hung capture for minutes, past Ctrl-C (opening it waits for a writer, inside
    libsndfile), and a directory or a device was called "does not exist". Each is refused as what it is, naming the
    path and what to give instead, without being opened: skipped and counted, or under the default on_error the
    capture stops on the first in one line."""
    from tapdraft.common.errors import CaptureError

    man, fifo = special_audio(tmp_path)
    m = within(60, lambda: capture(_cfg(salm_dir, man, tmp_path / "ds", on_error="skip")), fifos=[fifo])
    reasons = {s["sample_id"]: s["reason"] for s in m["skipped"]["train"]}
    assert reasons.keys() == SPECIAL_AUDIO.keys()
    for sid, what in SPECIAL_AUDIO.items():
        assert f"audio path {tmp_path / (sid + '.wav')} {what}" in reasons[sid] and "give the path of an audio file" \
            in reasons[sid], reasons[sid]
    assert m["splits"]["train"]["samples"] == 1
    with pytest.raises(CaptureError, match=r"'pipe'.*line 1.*is a FIFO \(named pipe\)") as e:
        within(60, lambda: capture(_cfg(salm_dir, man, tmp_path / "fail")), fifos=[fifo])
    assert "\n" not in str(e.value)


def huge_turn(target) -> str:
    """A text turn of 2 MB: past the demo target's text bound (1024 positions x 20 characters), small enough for a
    test's memory (the 50 MB turn of the report needs no more than this to show the bound comes first)."""
    bound, _ = target.template.text_bound(target.max_positions)
    text = "what did i say ? " * (2_000_000 // 17)
    assert len(text) > bound
    return text


def tokenized_lengths(monkeypatch) -> list[int]:
    """The length of every text the chat template renders or tokenizes from now on."""
    from tapdraft.capture.template import ChatTemplate

    seen: list[int] = []
    render, encode = ChatTemplate.render, ChatTemplate.encode
    monkeypatch.setattr(ChatTemplate, "render", lambda self, m, **kw: (seen.append(sum(len(x["content"]) for x in m)),
                                                                        render(self, m, **kw))[1])
    monkeypatch.setattr(ChatTemplate, "encode", lambda self, text: (seen.append(len(text)), encode(self, text))[1])
    return seen


def test_a_huge_text_turn_is_refused_before_the_tokenizer_sees_it(salm_dir, tmp_path, monkeypatch):
    """A 50 MB text turn aborted capture (SIGABRT, exit 134: the Rust tokenizer failed to allocate). Text past what
    the target's positions can hold at its tokenizer's longest token is a bad input, never rendered or tokenized:
    skipped and counted, or under the default on_error one line naming the sample and line."""
    from tapdraft.common.errors import CaptureError
    from tests.capture.util import write_wav

    write_wav(tmp_path / "ok.wav", [1, 2])
    big = conv_record("big", "ok.wav", prompt=huge_turn(load_target(salm_dir)))
    man = write_manifest(tmp_path / "m.jsonl", [big, conv_record("ok", "ok.wav")])
    seen = tokenized_lengths(monkeypatch)
    m = capture(_cfg(salm_dir, man, tmp_path / "ds", on_error="skip"))
    (skip,) = m["skipped"]["train"]
    assert skip["sample_id"] == "big" and skip["reason"].startswith("too long to tokenize: its text is 2,0")
    assert "turn 1, user: 2,0" in skip["reason"] and "1024 positions" in skip["reason"]
    assert m["splits"]["train"]["samples"] == 1 and seen and max(seen) < 1000
    with pytest.raises(CaptureError, match=r"'big'.*line 1.*too long to tokenize") as e:
        capture(_cfg(salm_dir, man, tmp_path / "fail"))
    assert "\n" not in str(e.value) and max(seen) < 1000
