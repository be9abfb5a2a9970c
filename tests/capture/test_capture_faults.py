"""Capture under faults: a changed input on resume, a kill inside finalize, a second writer, a stale lock."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import tapdraft.common.atomic as atomic
from tapdraft.capture import pipeline
from tapdraft.capture.pipeline import capture
from tapdraft.common.errors import InputChangedError, LockedError
from tapdraft.shards.manifest import writer_lock
from tests.capture.test_pipeline import _cfg

ROOT = Path(__file__).resolve().parents[2]


class Kill(BaseException):
    """Stands for SIGKILL at that instant."""


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.name.endswith(".lock")}


def _kill_at_batch(monkeypatch, n: int) -> None:
    real, calls = pipeline.run_batch, []

    def dying(*a, **k):
        calls.append(1)
        if len(calls) == n:
            raise Kill
        return real(*a, **k)

    monkeypatch.setattr(pipeline, "run_batch", dying)


def test_resume_over_a_changed_input_is_refused_naming_it(salm_dir, tone_manifest, tmp_path, monkeypatch):
    cfg = _cfg(salm_dir, tone_manifest, tmp_path / "ds", batch_tokens=70, shard_bytes=3000)
    _kill_at_batch(monkeypatch, 3)
    with pytest.raises(Kill):
        capture(cfg)
    monkeypatch.undo()
    lines = tone_manifest.read_text().splitlines(keepends=True)
    tone_manifest.write_text("".join(reversed(lines)))  # same file, same samples, another order
    with pytest.raises(InputChangedError, match=rf"input {tone_manifest} \(split train\) changed.*--restart"):
        capture(cfg)
    tone_manifest.write_text("".join(lines))  # the original content resumes and completes
    m = capture(cfg)
    assert m["splits"]["train"]["samples"] == 10
    assert m["capture_config"]["inputs"]["train"]["sha256"]


def test_kill_inside_finalize_then_rerun_gives_the_same_dataset(salm_dir, tone_manifest, tmp_path, monkeypatch):
    kw = dict(batch_tokens=70, shard_bytes=3000)
    ref = capture(_cfg(salm_dir, tone_manifest, tmp_path / "ref", **kw))
    assert len(ref["splits"]["train"]["shards"]) >= 3
    real_fin, real_rename = pipeline.finalize_dataset, atomic._rename

    def finalize_dying(*a, **k):  # die at the 3rd rename of finalize: shards half moved
        calls = []

        def dying(src, dst):
            calls.append(1)
            if len(calls) == 3:
                raise Kill
            real_rename(src, dst)

        monkeypatch.setattr(atomic, "_rename", dying)
        return real_fin(*a, **k)

    monkeypatch.setattr(pipeline, "finalize_dataset", finalize_dying)
    cut = tmp_path / "cut"
    with pytest.raises(Kill):
        capture(_cfg(salm_dir, tone_manifest, cut, **kw))
    monkeypatch.undo()
    assert not (cut / "manifest.json").exists()
    m = capture(_cfg(salm_dir, tone_manifest, cut, **kw))
    assert m["run_stats"]["train"]["written"] == 0  # nothing recomputed: finalize was only finished
    got, want = _tree(cut), _tree(tmp_path / "ref")
    for f in ("manifest.json", "README.md", "capture_config.json"):  # they name their directory
        got.pop(f), want.pop(f)
    assert got == want
    a = json.loads((cut / "manifest.json").read_text())
    assert a["splits"] == ref["splits"]


def test_a_second_capture_on_the_same_output_is_refused(salm_dir, tone_manifest, tmp_path):
    out = tmp_path / "ds"
    with writer_lock(str(out), 0):
        with pytest.raises(LockedError, match=rf"{out} is in use by a capture \(rank 0\) \(pid {os.getpid()} on "):
            capture(_cfg(salm_dir, tone_manifest, out, max_samples=2))
    # another process holds it; once that process is killed (-9), its lock is stale and taken over
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from tapdraft.shards.manifest import writer_lock
        with writer_lock({str(out)!r}, 0):
            print("held", flush=True)
            time.sleep(60)
    """)], cwd=ROOT, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(LockedError, match=rf"pid {holder.pid} on .*wait for it to finish") as e:
            capture(_cfg(salm_dir, tone_manifest, out, max_samples=2))
        assert "\n" not in str(e.value)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert capture(_cfg(salm_dir, tone_manifest, out, max_samples=2))["splits"]["train"]["samples"] == 2
