"""Metadata cost at 1 GB .. 30 TB: open, first sample and finalize, O(shards) manifest vs the per-batch one.

No terabytes are written. One real Arrow shard (``SAMPLES`` one-sample record batches of a tiny layout,
zero-padded sparsely to 1 GiB) and its real index file are hard-linked under every shard name (ext4
allows 65,000 links to one file), so every structure a reader or finalize touches is real: the
directory listing with 1 GiB sizes, the manifest, each shard's index file, heads and record batches
with their checksums. Geometry: 1 GiB shards of 100 samples (10 MB a sample: 3M samples and ~30k
shards at 30 TB), one record batch a sample (a 10 MB sample is a batch of its own), written by 1,024
ranks, the partial indexes laid out as ``DatasetWriter`` writes them.

Per size (1 GB .. 30 TB, ``--sizes`` in GiB):
- finalize: ``finalize_dataset`` of the 1,024 ranks' parts (renames every shard and index file, writes
  the journal, card and manifest), median of ``--finalize-repeats`` fresh builds.
- open / first sample: a fresh ``python`` process (so import costs and peaks are its own) opens the
  dataset, reads ``sample(train, 0)``, then the first sample of ``stream(rank 0 of 8, shuffle buffer
  1024)``; RSS growth over the imports, from /proc/self/statm. The baseline is the same process
  running the code of commit ``BASELINE`` (schema 1.2: every record batch in manifest.json, every
  shard's head read at open) on the same shards with a per-batch manifest; interleaved A B A B,
  median of ``--pairs`` pairs (wall seconds, and the process's CPU seconds, which a shared machine's load
  inflates far less), up to ``--baseline-max-gib`` (above it the baseline is skipped: ~3 GB
  of JSON objects at 30 TB). Ratio = baseline / new (higher is better).

Run: python -m benchmarks.metadata        -> benchmarks/results/metadata.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import write_result

GIB = 1 << 30
SAMPLES = 100
RANKS = 1024
WORLD = 8
BASELINE = "522a4e4"
"""The last commit with the per-batch manifest (schema 1.2)."""
GOALS = {"open_s": 1.0, "open_rss_mb": 200.0, "first_sample_s": 1.0, "finalize_s": 10.0}
"""Issue 20's goals at 30 TB / 3M samples / 30k shards."""
REPO = Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, os, resource, sys, time
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
import tapdraft.shards.reader as reader
base = rss()
c = time.process_time(); t = time.perf_counter(); ds = reader.open_dataset(sys.argv[1])
t_open, c_open = time.perf_counter() - t, time.process_time() - c
r_open = rss() - base
c = time.process_time(); t = time.perf_counter(); ds.sample("train", 0)
t_sample, c_sample = time.perf_counter() - t, time.process_time() - c
c = time.process_time(); t = time.perf_counter()
it = ds.stream("train", seed=0, rank=0, world_size=int(sys.argv[2]), shuffle_buffer=1024)
next(it); t_stream, c_stream = time.perf_counter() - t, time.process_time() - c
print(json.dumps({"open_s": t_open, "sample_s": t_sample, "stream_first_s": t_stream, "open_cpu_s": c_open,
                  "first_sample_cpu_s": max(c_sample, c_stream),
                  "open_rss_mb": r_open / 2**20, "after_first_sample_rss_mb": (rss() - base) / 2**20,
                  "process_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def _prototype(work: Path) -> tuple[Path, Path, dict[str, Any], dict[str, Any]]:
    """A real shard of SAMPLES one-sample batches, padded sparsely to 1 GiB, and its index (bytes fixed up)."""
    from tapdraft.shards.schema import Layout
    from tapdraft.shards.shard_index import index_name, write_index
    from tapdraft.shards.shard_file import ShardConfig
    from tapdraft.shards.writer import DatasetWriter

    import fsspec
    import torch

    layout = Layout(hidden_size=8, num_layers=2, tap_ids=(1,), top_k=0, audio_token_id=3)
    src = work / "proto"
    fp = "b" * 64  # no bundle: neither finalize nor the reads measured here load it
    cfg = ShardConfig(shard_bytes=GIB, batch_bytes=1)
    g = torch.Generator().manual_seed(0)
    with DatasetWriter(str(src), cfg, layout, fingerprint=fp, lineage="metadata benchmark") as w:
        for i in range(SAMPLES):
            w.write({"sample_id": f"s{i}", "source": "synthetic", "audio_seconds": 0.0,
                     "input_ids": torch.randint(4, 64, (4,), generator=g, dtype=torch.int32),
                     "is_audio": torch.zeros(4, dtype=torch.bool), "loss_mask": torch.ones(4, dtype=torch.bool),
                     "taps": torch.randn(4, 1, 8, generator=g).to(torch.bfloat16)}, i)
    part = json.loads((src / "_parts" / "train-rank00000.json").read_text())
    entry = part["shards"][0]
    shard = work / "shard.arrow"
    shutil.copy(src / entry["name"], shard)
    os.truncate(shard, GIB)
    doc = json.loads((src / index_name(entry["name"])).read_text())
    doc["bytes"] = GIB
    index = work / "index.json"
    rec = write_index(fsspec.filesystem("file"), str(index), doc)
    entry.update(bytes=GIB, index=rec)
    return shard, index, {**part, "shards": []}, {"entry": entry, "doc": doc, "layout": layout, "fp": fp}


def _build_parts(root: Path, n_shards: int, shard: Path, index: Path, part0: dict[str, Any], entry: dict[str, Any]):
    """RANKS closed partial indexes holding n_shards shards round robin, each shard and index file a hard link."""
    from tapdraft.shards.manifest import part_name, rank_shard_name
    from tapdraft.shards.shard_index import index_name

    for d in ("data", "index", "_parts"):
        (root / d).mkdir(parents=True)
    per_rank: dict[int, list[dict[str, Any]]] = {r: [] for r in range(RANKS)}
    for i in range(n_shards):
        r = i % RANKS
        seq = len(per_rank[r])
        name = rank_shard_name("train", r, seq, "arrow")
        os.link(shard, root / name)
        os.link(index, root / index_name(name))
        first = (i // RANKS * RANKS + r) * SAMPLES
        per_rank[r].append({**entry, "name": name, "indices": [[first, first + SAMPLES]]})
    for r, entries in per_rank.items():
        (root / part_name("train", r)).write_text(json.dumps({**part0, "rank": r, "shards": entries, "closed": True}))


def _finalize(root: Path, proto: dict[str, Any]) -> float:
    from tapdraft.shards.finalize import finalize_dataset

    c, t = time.process_time(), time.perf_counter()
    finalize_dataset(str(root), layout=proto["layout"], fingerprint=proto["fp"], capture_config={"benchmark": True})
    return time.perf_counter() - t, time.process_time() - c


def _per_batch_copy(new: Path, old: Path, proto: dict[str, Any]) -> None:
    """The same dataset as schema 1.2 described it: every shard's record batches, head and tail in manifest.json."""
    man = json.loads((new / "manifest.json").read_text())
    inline = {k: proto["doc"][k] for k in ("head", "batches", "tail")}
    for sh in man["splits"]["train"]["shards"]:
        sh.pop("index")
        sh.update(inline)
    man["schema_version"] = man["field_meta"]["schema_version"] = "1.2"
    old.mkdir()
    (old / "data").symlink_to(new / "data")
    (old / "manifest.json").write_text(json.dumps(man, indent=1, sort_keys=True))


def _child(code: Path, root: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(code)}
    out = subprocess.run([sys.executable, "-c", _CHILD, str(root), str(WORLD)], env=env, capture_output=True,
                         text=True, timeout=900, cwd=str(code))
    if out.returncode != 0:
        raise RuntimeError(f"measuring child failed: {out.stderr[-2000:]}")
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    doc["first_sample_s"] = max(doc["sample_s"], doc["stream_first_s"])
    doc["load_avg_1m"] = os.getloadavg()[0]
    return doc


def _median(runs: list[dict[str, Any]]) -> dict[str, float]:
    keys = [k for k in runs[0] if isinstance(runs[0][k], (int, float))]
    return {k: round(statistics.median(r[k] for r in runs), 4) for k in keys}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1,10,100,1000,10000,30000", help="dataset sizes in GiB (1 GiB a shard)")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--finalize-repeats", type=int, default=3)
    ap.add_argument("--baseline-max-gib", type=int, default=10000)
    ap.add_argument("--out", default="metadata.json")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="tapdraft-metadata-") as tmp:
        work = Path(tmp)
        shard, index, part0, proto = _prototype(work)
        old_code = work / "baseline_code"
        old_code.mkdir()
        subprocess.run(f"git -C {REPO} archive {BASELINE} shards | tar -x -C {old_code}", shell=True, check=True)
        for gib in sizes:
            fin = []
            for k in range(args.finalize_repeats):
                root = work / f"ds{gib}-{k}"
                _build_parts(root, gib, shard, index, part0, proto["entry"])
                fin.append(_finalize(root, proto))  # (wall, CPU) seconds
                if k:
                    shutil.rmtree(root)
            root = work / f"ds{gib}-0"
            old = work / f"old{gib}"
            baseline = gib <= args.baseline_max_gib
            if baseline:
                _per_batch_copy(root, old, proto)
            new_runs, old_runs = [], []
            for _ in range(args.pairs):
                new_runs.append(_child(REPO, root))
                if baseline:
                    old_runs.append(_child(old_code, old))
            row: dict[str, Any] = {
                "gib": gib, "shards": gib, "samples": gib * SAMPLES, "record_batches": gib * SAMPLES,
                "manifest_bytes": (root / "manifest.json").stat().st_size,
                "finalize_s": round(statistics.median(f[0] for f in fin), 3),
                "finalize_cpu_s": round(statistics.median(f[1] for f in fin), 3),
                "finalize_runs_s": [round(f[0], 3) for f in fin],
                "new": _median(new_runs)}
            if baseline:
                row["baseline"] = _median(old_runs)
                row["baseline_manifest_bytes"] = (old / "manifest.json").stat().st_size
                row["ratio_baseline_over_new"] = {
                    k: round(statistics.median(o[k] / max(n[k], 1e-9) for n, o in zip(new_runs, old_runs)), 2)
                    for k in ("open_s", "first_sample_s", "open_rss_mb")}
                shutil.rmtree(old)
            rows.append(row)
            r = row["new"]
            print(f"{gib:>6} GiB  shards {gib:>6}  manifest {row['manifest_bytes'] / 1e6:8.2f} MB  finalize "
                  f"{row['finalize_s']:6.2f} s  open {r['open_s']:6.3f} s  +{r['open_rss_mb']:6.1f} MB  first sample "
                  f"{r['first_sample_s']:6.3f} s" + (f"  baseline/new open {row['ratio_baseline_over_new']['open_s']}x "
                                                     f"rss {row['ratio_baseline_over_new']['open_rss_mb']}x"
                                                     if baseline else ""), flush=True)
            shutil.rmtree(root)
    top = rows[-1]
    goals = {k: {"goal": g, "at_gib": top["gib"], "got": top["finalize_s"] if k == "finalize_s" else top["new"][k],
                 "met": (top["finalize_s"] if k == "finalize_s" else top["new"][k]) <= g} for k, g in GOALS.items()}
    write_result(args.out, {"what": "open / first sample / finalize cost vs dataset size, O(shards) manifest vs the "
                                    f"per-batch manifest of {BASELINE}", "geometry": {
                                        "shard_bytes": GIB, "samples_per_shard": SAMPLES, "batches_per_shard": SAMPLES,
                                        "ranks": RANKS, "stream": f"rank 0 of {WORLD}, shuffle buffer 1024"},
                            "goals": goals, "rows": rows})


if __name__ == "__main__":
    main()
