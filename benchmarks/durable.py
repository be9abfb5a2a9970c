"""What durable commits cost: a capture, and the writer alone at a real width, with and without the fsyncs.

``common.atomic`` fsyncs every committed file (a staged directory: every file and directory in it) before its
rename and the directory after. Both sides below run the same code on the same content; only
``common.atomic.DURABLE`` differs:

    A  durable   the default: fsync before and after each commit's rename
    B  plain     DURABLE = False: the same renames, no fsync (a process crash is covered, a power cut is not)

Workloads:
    capture   capture.pipeline.capture with the CLI's defaults on a random-init target of a named shape
              (shards, indexes, the target bundle, the manifest), into a fresh directory
    writer    DatasetWriter.write + close at hidden 4096 with six taps and top-64 rows (benchmarks.write's
              content): a 4096-wide target makes the writer the bottleneck, so this is the worst case a capture
              can see (its forward only adds time that fsync does not touch)

Ratio = A / B (1.0: durability is free). Pairs interleaved, the order alternating (A B, B A, ...), median of the
pairs; each side also counts its fsyncs and the seconds spent inside them. The load average is recorded per pair.

    python -m benchmarks.durable [--shape qwen3-256x4] [--conversations 24] [--pairs 5] [--samples 16]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from benchmarks.common import write_result
from tapdraft.common import atomic


class _FsyncMeter:
    """Counts os.fsync calls and the seconds inside them (installed for the whole run, both sides)."""

    def __init__(self) -> None:
        self.calls, self.seconds, self._real = 0, 0.0, os.fsync

    def __call__(self, fd: int) -> None:
        t0 = time.perf_counter()
        self._real(fd)
        self.seconds += time.perf_counter() - t0
        self.calls += 1


def _timed(fn: Callable[[Path], None], out: Path, durable: bool, meter: _FsyncMeter) -> tuple[float, int, float]:
    """(seconds, fsyncs, seconds in fsync) of ``fn(out)`` with durability on or off; ``out`` is removed after."""
    atomic.DURABLE = durable
    calls, secs = meter.calls, meter.seconds
    try:
        t0 = time.perf_counter()
        fn(out)
        wall = time.perf_counter() - t0
    finally:
        atomic.DURABLE = True
    shutil.rmtree(out, ignore_errors=True)
    return wall, meter.calls - calls, meter.seconds - secs


def _pairs(name: str, fn: Callable[[Path], None], scratch: Path, pairs: int, meter: _FsyncMeter) -> dict:
    fn(scratch / f"{name}-warm")  # imports, allocator, page cache: neither side pays them
    shutil.rmtree(scratch / f"{name}-warm", ignore_errors=True)
    a, b, loads = [], [], []
    for i in range(pairs):
        loads.append(os.getloadavg()[0])
        order = (True, False) if i % 2 == 0 else (False, True)
        got = {d: _timed(fn, scratch / f"{name}-{i}-{int(d)}", d, meter) for d in order}
        a.append(got[True])
        b.append(got[False])
        print(f"{name} pair {i}: durable {got[True][0]:.2f} s ({got[True][1]} fsyncs, {got[True][2]:.2f} s in them)  "
              f"plain {got[False][0]:.2f} s  ratio {got[True][0] / got[False][0]:.3f}", flush=True)
    ratios = [x[0] / y[0] for x, y in zip(a, b)]
    return {"ratio_median": round(statistics.median(ratios), 3), "ratios": [round(r, 3) for r in ratios],
            "durable_s_median": round(statistics.median(x[0] for x in a), 3),
            "plain_s_median": round(statistics.median(y[0] for y in b), 3),
            "fsyncs_per_run": a[0][1], "plain_fsyncs_per_run": b[0][1],
            "fsync_s_median": round(statistics.median(x[2] for x in a), 3),
            "load_avg_1m_per_pair": [round(x, 2) for x in loads]}


def _capture_workload(shape: str, conversations: int, workdir: Path) -> tuple[Callable[[Path], None], dict]:
    from benchmarks.shapes import conversations as make_conversations
    from benchmarks.shapes import shape_facts, synthetic_target
    from tapdraft.capture.config import CaptureConfig
    from tapdraft.capture.pipeline import capture
    from tapdraft.capture.targets.load import load_target

    root = workdir / f"durable-{shape}"
    root.mkdir(parents=True, exist_ok=True)
    target_dir = synthetic_target(shape, root / "target")
    data = make_conversations(root / "conversations.jsonl", conversations, max_tokens=1024)
    target = load_target(target_dir)
    cfg = CaptureConfig(target=str(target_dir), out="", data=(("train", str(data)),), progress=False)

    def run(out: Path) -> None:
        capture(dataclasses.replace(cfg, out=str(out)), target=target)

    return run, {"shape": shape, **shape_facts(shape), "conversations": conversations, "max_tokens": 1024}


def _writer_workload(samples: int, tokens: int) -> tuple[Callable[[Path], None], dict]:
    from benchmarks.write import TAPS, make_samples, write_tapdraft
    from tapdraft.shards.schema import Layout
    from tapdraft.shards.shard_file import ShardConfig

    layout = Layout(hidden_size=4096, num_layers=36, tap_ids=TAPS, top_k=64, audio_token_id=0)
    content = make_samples(samples, tokens, 4096)
    cfg = ShardConfig()  # the defaults

    def run(out: Path) -> None:
        write_tapdraft(out, content, layout, cfg)

    return run, {"hidden": 4096, "taps": len(TAPS), "samples": samples, "tokens_per_sample": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-256x4", help="the capture's random-init target (benchmarks.shapes)")
    ap.add_argument("--conversations", type=int, default=24, help="synthetic conversations (512-1024 tokens)")
    ap.add_argument("--samples", type=int, default=16, help="writer workload: samples of --tokens at hidden 4096")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--workdir", help="where the target is built and cached (default: the temp directory)")
    ap.add_argument("--only", choices=["capture", "writer"], help="run one workload")
    ap.add_argument("--name", default="durable.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    meter = _FsyncMeter()
    os.fsync = meter  # atomic calls os.fsync at call time
    scratch = Path(tempfile.mkdtemp(prefix="durable-bench-", dir=args.workdir))
    workdir = Path(args.workdir or tempfile.gettempdir())
    res: dict = {"benchmark": "durable", "what": "fsync before and after each commit's rename (A) vs the same "
                 "commits without fsync (B); ratio A/B", "workloads": {}}
    try:
        for name in ("capture", "writer"):
            if args.only and args.only != name:
                continue
            fn, facts = (_capture_workload(args.shape, args.conversations, workdir) if name == "capture"
                         else _writer_workload(args.samples, args.tokens))
            res["workloads"][name] = {**facts, **_pairs(name, fn, scratch, args.pairs, meter)}
    finally:
        os.fsync = meter._real
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"{'workload':<10}{'durable s':>11}{'plain s':>9}{'ratio':>8}{'fsyncs':>8}{'in fsync s':>12}")
    for name, w in res["workloads"].items():
        print(f"{name:<10}{w['durable_s_median']:>11.3f}{w['plain_s_median']:>9.3f}{w['ratio_median']:>8.3f}"
              f"{w['fsyncs_per_run']:>8}{w['fsync_s_median']:>12.3f}")
    res["machine_extra"] = {"threads": 1, "filesystem": _filesystem(scratch.parent)}
    write_result(args.name, res)


def _filesystem(path: Path) -> str:
    """The mount type holding ``path`` (fsync's cost depends on it: ext4 on a virtual disk here)."""
    best, kind = "", "unknown"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, fstype = line.split()[:3]
            if str(path.resolve()).startswith(mnt) and len(mnt) > len(best):
                best, kind = mnt, f"{fstype} ({dev})"
    except OSError:
        pass
    return kind


if __name__ == "__main__":
    main()
