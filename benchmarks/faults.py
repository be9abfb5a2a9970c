"""Fault campaign: the failures integrity and crash safety exist for, with real processes and the CLI.

The fast versions live in tests/ (tests/shards/test_integrity.py, test_finalize_faults.py,
tests/capture/test_capture_faults.py); this script repeats them at a larger scale, with ``kill -9``
instead of an exception and ``tapdraft`` commands instead of function calls, on a capture of the
demo SALM's architecture (random init: only the control flow and the bytes matter here).

    flips      N random single-bit flips per format, each in a fresh copy of a captured dataset, at a
               random byte of a random shard; read back (a) with tapdraft's reader (the trainer's,
               eval's and ``inspect --sample``'s path) and (b) with the stock libraries (``datasets``
               + ``decode_row``, ``webdataset`` + ``decode_wds_sample``). Each flip is caught (an error
               naming the shard), harmless (decodes to the same values) or SILENT (different values).
    finalize   a capture process SIGKILLed at each rename of its finalize in turn, then the same
               ``tapdraft capture`` rerun: the dataset must equal an uninterrupted capture's.
    input      ``tapdraft capture`` SIGKILLed after its first shard, the JSONL reversed, rerun: refused
               in one line naming the file (exit 2); restored and rerun: complete, no duplicates.
    lock       a second ``tapdraft capture`` on the same --out while the first runs: one line, exit 2.

    python -m benchmarks.faults [--flips 50]      -> benchmarks/results/faults.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf
import torch

from benchmarks.common import write_result

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
CAPTURE_ARGS = ["--top-k", "4", "--batch-tokens", "120", "--shard-bytes", "12000", "--device", "cpu"]


def _cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tapdraft.cli", *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=timeout)


def _capture_args(target: Path, manifest: Path, out: Path, fmt: str = "arrow") -> list[str]:
    return ["capture", "--target", str(target), "--data", str(manifest), "--out", str(out), "--format", fmt,
            *CAPTURE_ARGS]


def _inputs(work: Path, n: int) -> tuple[Path, Path]:
    """The demo SALM (random init) saved to disk and a JSONL of ``n`` tone-digit conversations."""
    from tapdraft.demo.target import QUICK, build_demo_salm
    from tapdraft.demo.task import tone_audio

    torch.manual_seed(0)
    target = work / "salm"
    build_demo_salm(QUICK, seed=0).save_pretrained(target)
    rng = np.random.default_rng(0)
    (work / "audio").mkdir()
    lines = []
    for i in range(n):
        digits = [int(x) for x in rng.integers(0, 10, size=int(rng.integers(2, 6)))]
        sf.write(work / "audio" / f"u{i}.wav", tone_audio(digits, rng), 16000, subtype="PCM_16")
        lines.append(json.dumps({"id": f"u{i}", "conversations": [
            {"from": "User", "type": "audio", "value": f"audio/u{i}.wav"},
            {"from": "User", "type": "text", "value": "what did i say ?"},
            {"from": "Assistant", "type": "text", "value": "you said " + " ".join(["one"] * len(digits)) + " ."}]}))
    manifest = work / "train.jsonl"
    manifest.write_text("\n".join(lines) + "\n")
    return target, manifest


def _tree(root: Path, skip: tuple[str, ...] = ()) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.name.endswith(".lock") and str(p.relative_to(root)) not in skip}


def _same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        for k in x:
            if k.startswith("__"):
                continue
            if isinstance(x[k], torch.Tensor):
                if not (x[k].dtype == y[k].dtype and torch.equal(x[k], y[k])):
                    return False
            elif x[k] != y[k]:
                return False
    return True


# ---------------------------------------------------------------------------------------------- flips
def _read_tapdraft(root: Path) -> list[dict[str, Any]]:
    from tapdraft.shards.reader import open_dataset

    return list(open_dataset(str(root)).stream("train", seed=0, shuffle=False))


def _stock_arrow(root: Path, files: list[str], cache: Path) -> list[dict[str, Any]]:
    import datasets

    from tapdraft.shards.formats.arrow import decode_row

    meta = json.loads((root / "manifest.json").read_text())["field_meta"]
    datasets.disable_progress_bars()
    ds = datasets.load_dataset("arrow", data_files=files, split="train", cache_dir=str(cache))
    return [decode_row(r, meta) for r in ds]


def _stock_wds(root: Path, files: list[str], cache: Path) -> list[dict[str, Any]]:
    import webdataset

    from tapdraft.shards.formats.wds import decode_wds_sample

    return list(webdataset.WebDataset(files, shardshuffle=False).map(decode_wds_sample))


STOCK_READERS = {"arrow": _stock_arrow, "wds": _stock_wds}
"""Storage format -> how its stock library (HF datasets, webdataset) reads a dataset's shards."""


def _read_stock(root: Path, fmt: str, cache: Path) -> list[dict[str, Any]]:
    return STOCK_READERS[fmt](root, sorted(str(p) for p in (root / "data").iterdir()), cache)


def flips(clean: Path, fmt: str, n: int, work: Path) -> dict[str, Any]:
    want = _read_tapdraft(clean)
    want_stock = _read_stock(clean, fmt, work / "hf-clean")
    shards = sorted((clean / "data").iterdir())
    rng = random.Random(7)
    out = {"reader": {"caught": 0, "caught_naming_shard": 0, "harmless": 0, "silent": 0},
           "stock": {"caught": 0, "harmless": 0, "silent": 0}, "flips": n}
    for t in range(n):
        copy = work / f"flip{t}"
        shutil.copytree(clean, copy)
        shard = rng.choice(shards)
        path = copy / "data" / shard.name
        data = bytearray(path.read_bytes())
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
        try:
            got = _read_tapdraft(copy)
            out["reader"]["harmless" if _same(got, want) else "silent"] += 1
        except (ValueError, OSError) as e:
            out["reader"]["caught"] += 1
            out["reader"]["caught_naming_shard"] += shard.name in str(e)
        try:
            got = _read_stock(copy, fmt, work / f"hf{t}")
            out["stock"]["harmless" if _same(got, want_stock) else "silent"] += 1
        except Exception:  # whatever the stock library raises: the flip did not pass silently
            out["stock"]["caught"] += 1
        shutil.rmtree(copy)
        shutil.rmtree(work / f"hf{t}", ignore_errors=True)
    print(f"flips {fmt:<5}  reader: {out['reader']}   stock: {out['stock']}", flush=True)
    return out


# ---------------------------------------------------------------------------------------------- finalize
_DIE_IN_FINALIZE = textwrap.dedent("""
    import os, signal, sys
    import tapdraft.common.atomic as atomic
    from tapdraft.capture import pipeline
    from tapdraft.cli import main
    K = int(os.environ["TAPDRAFT_FAULT_K"])
    real_fin, real_rename = pipeline.finalize_dataset, atomic._rename
    def finalize(*a, **k):
        calls = []
        def rename(src, dst):
            calls.append(1)
            if len(calls) == K + 1:
                os.kill(os.getpid(), signal.SIGKILL)
            real_rename(src, dst)
        atomic._rename = rename
        return real_fin(*a, **k)
    pipeline.finalize_dataset = finalize
    sys.argv = ["tapdraft"] + sys.argv[1:]
    main()
""")


def finalize_kills(target: Path, manifest: Path, ref: Path, work: Path) -> dict[str, Any]:
    parts = json.loads((ref / "manifest.json").read_text())
    renames = 2 * len(parts["splits"]["train"]["shards"]) + 1 + 2  # shards and their indexes, the part, card, manifest
    skip = ("manifest.json", "README.md", "capture_config.json")  # these name their own directory
    want = _tree(ref, skip)
    results = []
    for k in range(renames):
        out = work / f"k{k}"
        proc = subprocess.run([sys.executable, "-c", _DIE_IN_FINALIZE, *_capture_args(target, manifest, out)],
                              cwd=ROOT, env={**ENV, "TAPDRAFT_FAULT_K": str(k)}, capture_output=True, text=True,
                              timeout=600)
        killed = proc.returncode == -signal.SIGKILL
        rerun = _cli(*_capture_args(target, manifest, out))
        same = rerun.returncode == 0 and _tree(out, skip) == want
        results.append({"rename": k, "killed": killed, "rerun_exit": rerun.returncode, "identical": same})
        shutil.rmtree(out)
    ok = sum(r["killed"] and r["identical"] for r in results)
    print(f"finalize: killed at each of {renames} renames, rerun -> identical dataset {ok}/{renames}", flush=True)
    return {"renames": renames, "identical_after_rerun": ok, "runs": results}


# ---------------------------------------------------------------------------------------------- input, lock
def _wait_for(path: Path, proc: subprocess.Popen, seconds: float = 300) -> bool:
    t0 = time.time()
    while time.time() - t0 < seconds and proc.poll() is None:
        if path.exists() and path.stat().st_size > 0:
            return True
        time.sleep(0.05)
    return False


def changed_input(target: Path, manifest: Path, n: int, work: Path) -> dict[str, Any]:
    out = work / "changed"
    a = subprocess.Popen([sys.executable, "-m", "tapdraft.cli", *_capture_args(target, manifest, out)], cwd=ROOT, env=ENV,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started = _wait_for(out / "_parts" / "train-rank00000.json", a)
    a.send_signal(signal.SIGKILL)
    a.wait()
    original = manifest.read_text()
    manifest.write_text("".join(reversed(original.splitlines(keepends=True))))
    refused = _cli(*_capture_args(target, manifest, out))
    manifest.write_text(original)
    resumed = _cli(*_capture_args(target, manifest, out))
    from tapdraft.shards.reader import open_dataset

    ids = [s["sample_id"] for s in open_dataset(str(out)).stream("train", seed=0, shuffle=False)]
    verify = _cli("verify", str(out))
    lines = refused.stderr.strip().splitlines()
    res = {"killed_after_first_shard": started, "refused_exit": refused.returncode, "refused_stderr": lines,
           "one_line_naming_file": len(lines) == 1 and manifest.name in lines[0],
           "resumed_exit": resumed.returncode, "samples": len(ids), "distinct": len(set(ids)), "inputs": n,
           "verify_exit": verify.returncode}
    print(f"changed input: refused exit {res['refused_exit']} one line naming the file {res['one_line_naming_file']};"
          f" restored rerun {len(set(ids))}/{n} distinct samples, verify exit {verify.returncode}", flush=True)
    return res


_SLOW_CAPTURE = textwrap.dedent("""
    import sys, time
    from tapdraft.capture import pipeline
    from tapdraft.cli import main
    real = pipeline.run_batch
    def slow(*a, **k):  # the first capture stays busy while the second one starts
        time.sleep(2.0)
        return real(*a, **k)
    pipeline.run_batch = slow
    sys.argv = ["tapdraft"] + sys.argv[1:]
    main()
""")


def second_writer(target: Path, manifest: Path, work: Path) -> dict[str, Any]:
    out = work / "locked"
    a = subprocess.Popen([sys.executable, "-c", _SLOW_CAPTURE, *_capture_args(target, manifest, out)], cwd=ROOT,
                         env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    held = _wait_for(out / "_parts" / "rank00000.lock", a)
    b = _cli(*_capture_args(target, manifest, out))
    running = a.poll() is None
    a_done = a.wait(timeout=600)
    lines = b.stderr.strip().splitlines()
    res = {"first_held_lock": held, "first_still_running_when_refused": running, "second_exit": b.returncode,
           "second_stderr": lines, "one_line": len(lines) == 1 and "in use by a capture" in lines[0],
           "first_exit": a_done, "verify_exit": _cli("verify", str(out)).returncode}
    print(f"second writer: exit {b.returncode}, one line {res['one_line']}: {lines[:1]}; first capture exit "
          f"{a_done}, verify exit {res['verify_exit']}", flush=True)
    return res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flips", type=int, default=50, help="flips per format")
    ap.add_argument("--conversations", type=int, default=20)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    doc: dict[str, Any] = {"benchmark": "faults", "conversations": args.conversations}
    with tempfile.TemporaryDirectory(prefix="tapdraft-faults-") as tmp:
        work = Path(tmp)
        target, manifest = _inputs(work, args.conversations)
        refs = {}
        for fmt in ("arrow", "wds"):
            refs[fmt] = work / f"ref-{fmt}"
            r = _cli(*_capture_args(target, manifest, refs[fmt], fmt))
            assert r.returncode == 0, r.stderr[-2000:]
        doc["shards"] = {f: len(list((p / "data").iterdir())) for f, p in refs.items()}
        doc["flips"] = {fmt: flips(refs[fmt], fmt, args.flips, work) for fmt in ("arrow", "wds")}
        doc["finalize"] = finalize_kills(target, manifest, refs["arrow"], work)
        doc["changed_input"] = changed_input(target, manifest, args.conversations, work)
        doc["second_writer"] = second_writer(target, manifest, work)
    write_result("faults.json", doc, indent=1)
    return doc


if __name__ == "__main__":
    main()
