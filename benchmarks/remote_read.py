"""Read throughput from S3 vs local disk on the same dataset: open + stream a whole split to sample dicts.

A dataset of ``--samples`` x ``--tokens`` at a real-model width (hidden 1024, six taps, top-64 teacher
rows; gaussian taps, zstd-1, ~32 MiB shards) is written locally and pushed (``shards.transfer.push``) to
a SeaweedFS server on 127.0.0.1 (``tests/s3server.py``: master, volume, filer and S3 gateway in one
process on this machine, so the "network" is loopback and the server shares the 2 CPUs). Variants,
interleaved in each round, median of ``--rounds``:

    local          open_dataset(local dir); the files are in the page cache (hot), see BENCHMARKS.md
    s3_cold        open_dataset(s3://...) with an empty cache directory (every range fetched), prefetch 8
    s3_cold_nopf   the same with prefetch 0 (every range fetched when the stream reaches it)
    s3_warm        open_dataset(s3://...) with the cache the cold run filled (listing + manifest from S3)

Figures: wall seconds of open + one epoch of ``Dataset.stream`` (seed 0), tokens/s, shard MB/s, and
each S3 variant's ratio to local in the same round. Writes benchmarks/results/remote_read.json.

    python -m benchmarks.remote_read [--samples 48 --tokens 512 --rounds 5]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import write_result
from tapdraft.shards.reader import open_dataset
from tapdraft.shards.remote import RemoteConfig
from tapdraft.shards.transfer import push
from tapdraft.shards.shard_file import ShardConfig
from tests.s3server import SeaweedS3
from tests.shards.synthetic import tiny_layout, write_dataset


def read_split(url: str, remote: RemoteConfig | None) -> tuple[float, float, int]:
    """(open seconds, open + stream seconds, tokens) of one epoch of the train split."""
    t0 = time.perf_counter()
    ds = open_dataset(url, remote)
    t_open = time.perf_counter() - t0
    tokens = sum(int(s["input_ids"].shape[0]) for s in ds.stream("train", seed=0))
    return t_open, time.perf_counter() - t0, tokens


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="remote-read-"))
    try:
        local = work / "ds"
        lay = tiny_layout(hidden_size=1024, num_layers=36, tap_ids=(1, 9, 17, 25, 33, 35), top_k=64)
        t0 = time.perf_counter()
        write_dataset(str(local), lay, ShardConfig(shard_bytes=32 << 20), [args.tokens] * args.samples)
        shard_bytes = sum(p.stat().st_size for p in (local / "data").iterdir())
        print(f"dataset: {args.samples} x {args.tokens} tokens, {shard_bytes / 1e6:.1f} MB of shards "
              f"({time.perf_counter() - t0:.1f} s to write)")
        with SeaweedS3(work / "s3") as s3:
            opts = tuple(s3.storage_options().items())
            url = s3.url("bench")
            t0 = time.perf_counter()
            push(str(local), url, config=RemoteConfig(storage_options=opts), progress=False)
            t_push = time.perf_counter() - t0
            warm_dir = work / "warm"
            cfg = {"s3_cold": lambda i: RemoteConfig(cache_dir=str(work / f"cold{i}"), storage_options=opts),
                   "s3_cold_nopf": lambda i: RemoteConfig(cache_dir=str(work / f"nopf{i}"), prefetch=0,
                                                          storage_options=opts),
                   "s3_warm": lambda i: RemoteConfig(cache_dir=str(warm_dir), storage_options=opts)}
            read_split(url, cfg["s3_warm"](0))  # fill the warm cache once
            rows = {k: [] for k in ("local", *cfg)}
            for i in range(args.rounds):
                rows["local"].append(read_split(str(local), None))
                for name, make in cfg.items():
                    rows[name].append(read_split(url, make(i)))
                for d in work.glob(f"*{i}"):
                    if d.name.startswith(("cold", "nopf")):
                        shutil.rmtree(d)
                print(f"round {i}: " + "  ".join(f"{k} {v[-1][1]:.2f}s" for k, v in rows.items()))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    tokens = rows["local"][0][2]
    out = {}
    for name, rs in rows.items():
        wall = statistics.median(r[1] for r in rs)
        out[name] = {"open_s": round(statistics.median(r[0] for r in rs), 4), "open_and_stream_s": round(wall, 4),
                     "tokens_per_s": round(tokens / wall), "shard_MB_per_s": round(shard_bytes / wall / 1e6, 1)}
        if name != "local":
            out[name]["ratio_vs_local"] = round(statistics.median(lr[1] / r[1] for lr, r in zip(rows["local"], rs)),
                                                3)
    print(f"{'variant':<14}{'open s':>9}{'total s':>9}{'tok/s':>10}{'MB/s':>8}{'vs local':>10}")
    for name, r in out.items():
        print(f"{name:<14}{r['open_s']:>9.3f}{r['open_and_stream_s']:>9.3f}{r['tokens_per_s']:>10}"
              f"{r['shard_MB_per_s']:>8}{r.get('ratio_vs_local', 1.0):>10.3f}")
    doc = {"what": "open + one epoch of Dataset.stream from S3 (SeaweedFS on loopback) vs the local directory",
           "dataset": {"samples": args.samples, "tokens_per_sample": args.tokens, "hidden": 1024, "taps": 6,
                       "top_k": 64, "shard_bytes_total": shard_bytes, "codec": "bf16 planes, zstd-1"},
           "rounds": args.rounds, "push_s": round(t_push, 3), "results": out,
           "notes": "ratio = local seconds / variant seconds in the same round (1.0 = as fast as local disk); "
                    "local files hot in the page cache; the S3 server runs on the same 2 shared CPUs"}
    write_result("remote_read.json", doc)
    return doc


if __name__ == "__main__":
    main()
