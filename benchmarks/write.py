"""Writer throughput at a real width: DatasetWriter (validate, encode, zstd, shard files) vs torch.save.

Content: samples of T tokens at hidden 4096 (an 8B target's width) with the taps a 5-layer draft
captures (6 taps: five DFlash taps + the last layer) and top-64 teacher rows on the supervised half,
bf16 N(0, 1) with a few outlier channels (what a decoder's pre-norm stream looks like; random data
is the pessimistic case for compression, so the MB/s is a floor for zstd's share).

    A  tapdraft   DatasetWriter.write for every sample + close (Arrow), fresh directory, for each
                  (zstd level, writer lanes) asked for: lanes are threads, each with its own shards
    B  peer       one uncompressed torch.save dict per sample (benchmarks/baseline_pt.py)

Ratio = B time / A time (higher is better: > 1 means tapdraft writes the same content faster than
the uncompressed baseline). Interleaved A.. B A.. B, median of the rounds; MB/s counts the tensors'
in-memory bytes (what capture hands the writer), tokens/s the tokens. Each config also reports its
tokens per CPU second (the process's CPU time over all threads: what one core does, which other load on
the machine disturbs less than the wall clock) and, from that, the cores a capture at ``--goal`` tokens/s
needs if lanes scale (they share nothing but the disk; the wall-clock rate of 1 vs 2 lanes on a quiet
machine shows how far they do).

    python -m benchmarks.write [--hidden 4096] [--samples 12] [--tokens 1024] [--pairs 5]
                               [--levels 1,0,0/raw,0/split] [--writers 1,2] [--goal 37000] [--dataset DIR]

``--dataset DIR`` writes a captured dataset's samples instead (real activations at their own width); tokens a
CPU second are then converted to the goal's shape by bytes (the writer's cost is per byte).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.baseline_pt import write_pt_dataset
from benchmarks.common import write_result
from tapdraft.shards.schema import Layout, teacher_rows
from tapdraft.shards.shard_file import ShardConfig
from tapdraft.shards.writer import DatasetWriter

TAPS = (1, 9, 17, 25, 33, 35)


def make_samples(n: int, T: int, H: int, k: int = 64, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    outliers = torch.randint(0, H, (8,), generator=g)
    out = []
    for i in range(n):
        taps = torch.randn(T, len(TAPS), H, generator=g)
        taps[..., outliers] *= 40.0
        loss = torch.zeros(T, dtype=torch.bool)
        loss[T // 2:] = True
        rows = teacher_rows(loss)
        R = rows.shape[0]
        lps = -torch.rand(R, k, generator=g).mul(10).sort(dim=-1).values.flip(-1)
        out.append({"sample_id": f"s{i}", "source": "bench", "audio_seconds": 0.0,
                    "input_ids": torch.randint(0, 150_000, (T,), generator=g, dtype=torch.int32),
                    "is_audio": torch.zeros(T, dtype=torch.bool), "loss_mask": loss,
                    "taps": taps.to(torch.bfloat16),
                    "topk_rows": rows, "topk_ids": torch.randint(0, 150_000, (R, k), generator=g, dtype=torch.int32),
                    "topk_logprobs": lps})
    return out


def _bytes(samples: list[dict]) -> int:
    """The tensors' in-memory bytes: what capture hands the writer."""
    return sum(t.numel() * t.element_size() for s in samples for t in s.values() if isinstance(t, torch.Tensor))


def write_tapdraft(out: Path, samples: list[dict], layout: Layout, cfg: ShardConfig,
                   cpu: list[float] | None = None) -> float:
    """Seconds to write ``samples``; ``cpu`` gets the process's CPU seconds appended (all threads)."""
    t0, c0 = time.perf_counter(), time.process_time()
    w = DatasetWriter(str(out), cfg, layout, fingerprint="0" * 64)
    for i, s in enumerate(samples):
        w.write(s, i)
    w.close()
    if cpu is not None:
        cpu.append(time.process_time() - c0)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--samples", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--format", default="arrow")
    ap.add_argument("--levels", default="1", help="zstd level/bf16 layout pairs to time, comma-separated, e.g. "
                    "1/planes,0/raw (0: uncompressed; the layout defaults to planes)")
    ap.add_argument("--writers", default="1", help="writer lanes to time, comma-separated")
    ap.add_argument("--goal", type=int, default=37_000, help="tokens/s a capture must sustain (an H100's prefill)")
    ap.add_argument("--dataset", default=None, help="write a captured dataset's own samples (real activations, its "
                    "shape) instead of the synthetic ones; cores_for_goal then scales its bytes a CPU second to "
                    "the goal's shape (--hidden x 6 taps)")
    ap.add_argument("--name", default="write.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    layout = Layout(hidden_size=args.hidden, num_layers=36, tap_ids=TAPS, top_k=64, audio_token_id=0)
    samples = make_samples(args.samples, args.tokens, args.hidden)
    goal_bytes_per_token = _bytes(samples) / (args.samples * args.tokens)  # the goal's shape, synthetic or not
    if args.dataset:
        from tapdraft.shards.reader import open_dataset

        ds = open_dataset(args.dataset)
        layout = ds.layout
        samples = [ds.sample("train", i) for i in range(min(args.samples, ds.num_samples("train")))]
    nbytes = _bytes(samples)
    tokens = sum(int(s["input_ids"].shape[0]) for s in samples)
    levels = [(int(x.split("/")[0]), (x.split("/") + ["planes"])[1]) for x in args.levels.split(",")]
    configs = [ShardConfig(format=args.format, zstd_level=lvl, bf16_layout=lay, writers=w)
               for lvl, lay in levels for w in map(int, args.writers.split(","))]
    scratch = Path(tempfile.mkdtemp(prefix="write-bench-"))
    a: list[list[float]] = [[] for _ in configs]
    cpu: list[list[float]] = [[] for _ in configs]
    b, loads, disk = [], [], [0] * len(configs)
    for i in range(args.pairs):
        loads.append(os.getloadavg()[0])
        for c, cfg in enumerate(configs):
            a[c].append(write_tapdraft(scratch / f"t{i}", samples, layout, cfg, cpu[c]))
            disk[c] = sum(p.stat().st_size for p in (scratch / f"t{i}").rglob("*") if p.is_file())
            shutil.rmtree(scratch / f"t{i}")
        t0 = time.perf_counter()
        write_pt_dataset(scratch / f"p{i}", samples)
        b.append(time.perf_counter() - t0)
        shutil.rmtree(scratch / f"p{i}")
        print(f"round {i}: torch.save {b[-1]:.2f} s; " + "; ".join(
            f"zstd {cfg.zstd_level} {cfg.bf16_layout} x{cfg.writers} {a[c][-1]:.2f} s ({tokens / a[c][-1]:,.0f} tok/s)"
            for c, cfg in enumerate(configs)), flush=True)
    shutil.rmtree(scratch, ignore_errors=True)
    rows = []
    for c, cfg in enumerate(configs):
        med = statistics.median(a[c])
        tps = tokens / med
        per_core = tokens / statistics.median(cpu[c])  # tokens a CPU second: what a core does, whatever the load
        goal_per_core = nbytes / statistics.median(cpu[c]) / goal_bytes_per_token  # the goal shape's tokens a CPU s
        rows.append({"zstd_level": cfg.zstd_level, "bf16_layout": cfg.bf16_layout, "writers": cfg.writers,
                     "seconds_median": round(med, 3),
                     "ratio_median": round(statistics.median(y / x for x, y in zip(a[c], b)), 3),
                     "tokens_per_s": round(tps), "MB_per_s": round(nbytes / med / 1e6, 1),
                     "tokens_per_cpu_s": round(per_core), "cpu_s_median": round(statistics.median(cpu[c]), 3),
                     "disk_bytes": disk[c],
                     "disk_ratio": round(disk[c] / nbytes, 3),
                     "cores_for_goal": round(args.goal / goal_per_core, 2)})
        print(f"zstd {cfg.zstd_level} {cfg.bf16_layout} x{cfg.writers}: {tps:,.0f} tok/s ({per_core:,.0f} a core), "
              f"{nbytes / med / 1e6:.0f} MB/s, ratio vs torch.save {rows[-1]['ratio_median']}, disk "
              f"{rows[-1]['disk_ratio']}x; {args.goal:,} tok/s needs {rows[-1]['cores_for_goal']} cores")
    res = {
        "benchmark": "write",
        "what": "DatasetWriter (A, per zstd level and writer lanes) vs per-sample torch.save (B), same content; "
                "ratio = B/A (higher is better)",
        "target_shape": {"hidden_size": args.hidden, "num_taps": len(TAPS), "top_k": 64,
                         "tokens_per_sample": args.tokens},
        "configs": rows, "goal_tokens_per_s": args.goal,
        "torch_save_s_median": round(statistics.median(b), 3),
        "torch_save_MB_per_s": round(nbytes / statistics.median(b) / 1e6, 1),
        "input_bytes": nbytes, "samples": len(samples), "tokens": tokens, "dataset": args.dataset,
        "goal_bytes_per_token": round(goal_bytes_per_token, 1),
        "load_avg_1m_per_round": [round(x, 2) for x in loads],
        "command": f"python -m benchmarks.write --hidden {args.hidden} --samples {args.samples} "
                   f"--tokens {args.tokens} --pairs {args.pairs} --format {args.format} --levels {args.levels} "
                   f"--writers {args.writers} --goal {args.goal}" + (f" --dataset {args.dataset}" if args.dataset else ""),
        "config": configs[0].to_dict(), "machine_extra": {"torch_threads": 1},
    }
    write_result(args.name, res)


if __name__ == "__main__":
    main()
