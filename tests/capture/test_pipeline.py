"""The capture pipeline end to end: dataset contents, kill -9 + resume, bad inputs, NaN, multi-rank."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tapdraft.capture import pipeline
from tapdraft.capture.config import CaptureConfig
from tapdraft.capture.forward import SampleSpec, run_batch
from tapdraft.capture.pipeline import CaptureError, bucket, capture, rank_slice
from tapdraft.capture.targets.load import load_target
from tapdraft.shards.manifest import write_or_check_bundle, writer_lock
from tapdraft.shards.reader import open_dataset
from tapdraft.shards.shard_file import ShardConfig
from tapdraft.shards.verify import verify_dataset
from tests.capture.util import conv_record, write_manifest, write_wav

ROOT = Path(__file__).resolve().parents[2]


def _cfg(salm_dir, manifest, out, **kw) -> CaptureConfig:
    base = dict(target=str(salm_dir), out=str(out), data=(("train", str(manifest)),), top_k=4, window=4,
                batch_tokens=120, progress=False)
    base.update(kw)
    shard = {k: base.pop(k) for k in ("format", "shard_bytes", "writers") if k in base}
    base["shard"] = ShardConfig(**{"shard_bytes": 6000, **shard})
    return CaptureConfig(**base)


def _samples(path, split="train"):
    ds = open_dataset(str(path))
    return [ds.sample(split, i) for i in range(ds.num_samples(split))]


def _equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def test_capture_writes_what_the_target_computes(salm_dir, tone_manifest, tmp_path):
    m = capture(_cfg(salm_dir, tone_manifest, tmp_path / "ds"))
    assert m["complete"] and m["splits"]["train"]["samples"] == 10
    assert m["capture_config"]["top_k"] == 4 and m["extra"]["audio_token_id"] == m["layout"]["audio_token_id"]
    assert m["extra"]["target_kind"] == "salm"  # the adapter's stable kind, never its class name
    assert verify_dataset(str(tmp_path / "ds"), progress=False).ok
    got = {s["sample_id"]: s for s in _samples(tmp_path / "ds")}
    assert sorted(got) == sorted(f"u{i}" for i in range(10))
    target = load_target(salm_dir)
    from tapdraft.capture.inputs import read_jsonl

    conv = [c for c in read_jsonl(tone_manifest, placeholder=target.placeholder)][3]
    ref = run_batch(target, [target.prepare(conv, 0)], SampleSpec(tap_ids=m["layout"]["tap_ids"], top_k=4))[0]
    s = got["u3"]
    assert s["taps"].shape[1] == len(m["layout"]["tap_ids"]) and m["layout"]["tap_ids"][-1] == target.num_layers - 1
    assert torch.equal(s["input_ids"], ref["input_ids"]) and torch.equal(s["loss_mask"], ref["loss_mask"])
    assert torch.equal(s["topk_rows"], ref["topk_rows"])
    torch.testing.assert_close(s["taps"].float(), ref["taps"].float(), rtol=0.02, atol=0.02)  # batched vs alone
    # a rerun of a complete dataset is a no-op
    assert capture(_cfg(salm_dir, tone_manifest, tmp_path / "ds"))["run_stats"] == {"already_complete": True}


@pytest.mark.slow
@pytest.mark.parametrize("writers", [1, 2])
def test_kill9_and_resume_equals_uninterrupted(salm_dir, tone_manifest, tmp_path, writers):
    ref_dir, cut_dir = tmp_path / "ref", tmp_path / "cut"
    kw = dict(batch_tokens=70, shard_bytes=3000, writers=writers)  # ~2 samples a batch, ~1 a shard
    capture(_cfg(salm_dir, tone_manifest, ref_dir, threads=1, **kw))  # the killed run's count, pinned below
    script = textwrap.dedent("""
        import os, signal, time, torch
        torch.set_num_threads(1)
        from tapdraft.capture import pipeline
        from tapdraft.capture.config import CaptureConfig
        real, calls = pipeline.run_batch, [0]
        def dying(*a, **k):
            calls[0] += 1
            if calls[0] == 4:
                part = PART
                for _ in range(600):  # wait until the writer thread has finished a shard, then die hard
                    if os.path.exists(part):
                        break
                    time.sleep(0.1)
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*a, **k)
        pipeline.run_batch = dying
        from tapdraft.shards.shard_file import ShardConfig
        cfg = CFG
        pipeline.capture(CaptureConfig(**{**cfg, "shard": ShardConfig(**cfg["shard"])}))
    """).replace("CFG", repr(dataclasses.asdict(_cfg(salm_dir, tone_manifest, cut_dir, **kw)))).replace(
        "PART", repr(str(cut_dir / "_parts" / "train-rank00000.json")))
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert not (cut_dir / "manifest.json").exists()
    part = json.loads((cut_dir / "_parts" / "train-rank00000.json").read_text())
    assert len(part["shards"]) >= 1  # some shards were final before the kill, some work was lost
    from tapdraft.capture.stages import torch_threads

    # resumed where torch has another count: it computes on the count the capture began with
    with torch_threads(2), pytest.warns(UserWarning, match="with the 1 CPU threads it began with"):
        m = capture(_cfg(salm_dir, tone_manifest, cut_dir, **kw))
    assert m["complete"] and m["run_stats"]["train"]["written"] < 10
    a, b = _samples(ref_dir), _samples(cut_dir)
    assert len(a) == len(b) == 10
    for x, y in zip(a, b):
        _equal(x, y)
    assert verify_dataset(str(cut_dir), progress=False).ok
    shards = [[(s["name"], s["sha256"]) for s in open_dataset(str(d)).manifest["splits"]["train"]["shards"]]
              for d in (ref_dir, cut_dir)]
    assert shards[0] == shards[1]  # the same files, byte for byte, whatever the lanes' timing


def test_changed_config_is_refused_naming_the_field(salm_dir, tone_manifest, tmp_path):
    cfg = _cfg(salm_dir, tone_manifest, tmp_path / "ds", max_samples=3)
    capture(cfg)
    with pytest.raises(ValueError, match="top_k=4.*top_k=8"):
        capture(dataclasses.replace(cfg, top_k=8))
    capture(dataclasses.replace(cfg, on_error="skip"))  # runtime-only fields may change


def _bad_manifest(tmp_path):
    write_wav(tmp_path / "ok.wav", [1, 2])
    write_wav(tmp_path / "low.wav", [1, 2], sr=4000)
    (tmp_path / "garbage.wav").write_bytes(b"RIFF....WAVEjunk")
    long_audio = write_wav(tmp_path / "long.wav", [1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2])
    recs = [
        conv_record("good0", "ok.wav"),
        conv_record("missing", "nope.wav"),
        conv_record("good1", "ok.wav"),
        "{broken json",
        conv_record("garbage", "garbage.wav"),
        conv_record("lowrate", "low.wav"),
        {"id": "mismatch", "conversations": [{"from": "User", "value": "<|audioplaceholder|> x"},
                                             {"from": "Assistant", "value": "y ."}]},
        {"id": "empty", "conversations": [{"from": "User", "type": "audio", "value": "ok.wav"},
                                          {"from": "Assistant", "value": ""}]},
        conv_record("toolong", long_audio.name),
        {"id": "negoffset", "conversations": [{"from": "User", "type": "audio", "value": "ok.wav", "offset": -0.5},
                                              {"from": "Assistant", "value": "y ."}]},
        {"id": "overrun", "conversations": [{"from": "User", "type": "audio", "value": "ok.wav", "duration": 60.0},
                                            {"from": "Assistant", "value": "y ."}]},
        conv_record("good2", "ok.wav"),
    ]
    return write_manifest(tmp_path / "bad.jsonl", recs)


def test_on_error_fail_stops_resumably_then_skip_finishes(salm_dir, tmp_path):
    man = _bad_manifest(tmp_path)
    cfg = _cfg(salm_dir, man, tmp_path / "ds", max_length=60, window=3)
    with pytest.raises(CaptureError, match=r"'missing'.*line 2.*does not exist"):
        capture(cfg)
    part = json.loads((tmp_path / "ds" / "_parts" / "train-rank00000.json").read_text())
    assert part["closed"] and [s["samples"] for s in part["shards"]] == [1]  # good0 is kept
    m = capture(dataclasses.replace(cfg, on_error="skip"))
    assert m["splits"]["train"]["samples"] == 3
    skipped = {s["sample_id"]: s["reason"] for s in m["skipped"]["train"]}
    assert set(skipped) == {"missing", "bad-4", "garbage", "lowrate", "mismatch", "empty", "toolong", "negoffset",
                            "overrun"}
    assert "offset must be >= 0" in skipped["negoffset"] and "runs past the end" in skipped["overrun"]
    assert "malformed JSON" in skipped["bad-4"] and "cannot decode" in skipped["garbage"]
    assert "4000 Hz" in skipped["lowrate"] and "placeholder" in skipped["mismatch"]
    assert "empty assistant" in skipped["empty"] and skipped["toolong"].startswith("too long")
    assert sorted(s["sample_id"] for s in _samples(tmp_path / "ds")) == ["good0", "good1", "good2"]


def test_nan_is_never_written(salm_dir, tone_manifest, tmp_path, monkeypatch):
    target = load_target(salm_dir)
    real = target.embed

    def poisoned(batch):
        out = real(batch)
        for p, e in zip(batch, out):
            if p.sample_id == "u5":
                e.inputs_embeds[0, 0] = float("nan")
        return out

    monkeypatch.setattr(target, "embed", poisoned)
    with pytest.raises(CaptureError, match="u5.*NaN"):
        capture(_cfg(salm_dir, tone_manifest, tmp_path / "a"), target=target)
    m = capture(_cfg(salm_dir, tone_manifest, tmp_path / "b", on_error="skip"), target=target)
    assert [s["sample_id"] for s in m["skipped"]["train"]] == ["u5"]
    assert m["splits"]["train"]["samples"] == 9


def test_multi_rank_slices_and_merge(salm_dir, tone_manifest, tmp_path, monkeypatch):
    monkeypatch.setattr(pipeline, "_barrier", lambda world: None)
    out = tmp_path / "ds"
    out.mkdir()
    with writer_lock(str(out), 0):  # what rank 0 does before the first barrier (its lock first, then the bundle)
        write_or_check_bundle(str(out), **load_target(salm_dir).bundle_parts())
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in (1, 0):  # rank 0 finalizes after both wrote
        monkeypatch.setenv("RANK", str(rank))
        m = capture(_cfg(salm_dir, tone_manifest, out, format="wds"))
    assert m["complete"] and m["format"] == "wds" and m["splits"]["train"]["samples"] == 10
    parts = sorted(json.loads(p.read_text())["rank"] for p in (out / "_parts").glob("*.json"))
    assert parts == [0, 1]
    assert verify_dataset(str(out), progress=False).ok


def test_stages_are_pure_functions():
    assert list(rank_slice(enumerate("abcdefg"), 1, 3)) == [(0, "b"), (1, "e")]
    lengths = {0: 10, 1: 50, 2: 12, 3: 48, 4: 11, 5: 200}
    b = bucket(lengths, batch_tokens=100, max_batch_size=3)
    assert b == [[5], [1, 3], [0, 2, 4]]
    assert bucket(lengths, batch_tokens=100, max_batch_size=3) == b


def test_optional_fields_and_lossy_codec(salm_dir, tone_manifest, tmp_path):
    m = capture(_cfg(salm_dir, tone_manifest, tmp_path / "ds", codec="fp8", final_hidden=True, audio_embeds=True,
                     taps=(0, 2), max_samples=4))
    assert m["codec"]["lossy"] and m["layout"]["tap_ids"] == [0, 2]
    s = _samples(tmp_path / "ds")[0]
    assert s["final_hidden"].shape == (s["input_ids"].shape[0], s["taps"].shape[-1])
    assert s["audio_embeds"].shape[0] == int(s["is_audio"].sum())
    # fp8 taps are close to, not equal to, the lossless last-layer state
    torch.testing.assert_close(s["taps"][:, 1].float(), s["final_hidden"].float(), rtol=0.15, atol=0.05)
    with pytest.raises(ValueError, match="out of range"):
        capture(_cfg(salm_dir, tone_manifest, tmp_path / "bad", taps=(0, 7)))


@pytest.mark.gpu
def test_cuda_capture_matches_cpu(salm_dir, tone_manifest, tmp_path):
    """Side-stream device-to-host copies deliver the same rows as a CPU capture (float32 both)."""
    capture(_cfg(salm_dir, tone_manifest, tmp_path / "cpu", device="cpu"))
    capture(_cfg(salm_dir, tone_manifest, tmp_path / "gpu", device="cuda", dtype="float32"))
    for a, b in zip(_samples(tmp_path / "cpu"), _samples(tmp_path / "gpu")):
        assert a["sample_id"] == b["sample_id"] and torch.equal(a["topk_rows"], b["topk_rows"])
        torch.testing.assert_close(a["taps"].float(), b["taps"].float(), rtol=0.02, atol=0.02)


def test_the_two_pass_regenerate_gets_every_setting_the_configs_share(tmp_path):
    from tapdraft.capture.replies.generate import GenerationConfig
    from tapdraft.capture.replies.regenerate import RegenerateConfig
    from tapdraft.capture.replies.windows import ReplyConfig

    replies = ReplyConfig(GenerationConfig(max_new_tokens=7), last_turn_only=True)
    cfg = CaptureConfig(target="t", out=str(tmp_path / "ds"), data=(("train", "in.jsonl"),), replies=replies,
                        fused=False, max_samples=3, batch_tokens=999, max_batch_size=5, window=11, dtype="float32",
                        device="cpu", llm_config="llm", chat_template="t.jinja",
                        template_kwargs={"enable_thinking": False}, on_error="skip", progress=False,
                        allow_outside_paths=True)
    assert pipeline.regenerate_config(cfg, "train", "in.jsonl") == RegenerateConfig(
        target="t", data="in.jsonl", out=str(tmp_path / "ds.regenerated" / "train.jsonl"), replies=replies,
        max_samples=3, batch_tokens=999, max_batch_size=5, window=11, dtype="float32", device="cpu",
        llm_config="llm", chat_template="t.jinja", template_kwargs={"enable_thinking": False}, on_error="skip",
        progress=False, allow_outside_paths=True)
    assert set(pipeline.SHARED_WITH_REGENERATE) == {
        "target", "replies", "max_samples", "batch_tokens", "max_batch_size", "window", "dtype", "device",
        "llm_config", "chat_template", "template_kwargs", "on_error", "progress", "allow_outside_paths", "engine",
        "vllm", "vllm_python"}  # the engine ones: --regenerate refuses --engine vllm, so they pass on their defaults
