"""Writer throughput at a real width: DatasetWriter (validate, encode, zstd, shard files) vs torch.save.

Content: samples of T tokens at hidden 4096 (an 8B target's width) with the taps a 5-layer draft
captures (6 taps: five DFlash taps + the last layer) and top-64 teacher rows on the supervised half,
bf16 N(0, 1) with a few outlier channels (what a decoder's pre-norm stream looks like; random data
is the pessimistic case for compression, so the MB/s is a floor for zstd's share).

    A  tapdraft   DatasetWriter.write for every sample + close (Arrow, CLI defaults), fresh directory
    B  peer       one uncompressed torch.save dict per sample (benchmarks/baseline_pt.py)

Ratio = B time / A time (higher is better: > 1 means tapdraft writes the same content faster than
the uncompressed baseline). Interleaved A B A B, median of the pairs; MB/s counts the tensors'
in-memory bytes (what capture hands the writer), tokens/s the tokens.

    python -m benchmarks.write [--hidden 4096] [--samples 12] [--tokens 1024] [--pairs 5]
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
from shards.schema import Layout, teacher_rows
from shards.writer import DatasetWriter, ShardConfig

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


def write_tapdraft(out: Path, samples: list[dict], layout: Layout, cfg: ShardConfig) -> float:
    t0 = time.perf_counter()
    w = DatasetWriter(str(out), cfg, layout, fingerprint="0" * 64)
    for i, s in enumerate(samples):
        w.write(s, i)
    w.close()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--samples", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--format", default="arrow")
    ap.add_argument("--name", default="write.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    layout = Layout(hidden_size=args.hidden, num_layers=36, tap_ids=TAPS, top_k=64, audio_token_id=0)
    samples = make_samples(args.samples, args.tokens, args.hidden)
    nbytes = sum(t.numel() * t.element_size() for s in samples for t in s.values() if isinstance(t, torch.Tensor))
    tokens = args.samples * args.tokens
    cfg = ShardConfig(format=args.format)
    scratch = Path(tempfile.mkdtemp(prefix="write-bench-"))
    a, b, loads, disk = [], [], [], 0
    for i in range(args.pairs):
        loads.append(os.getloadavg()[0])
        a.append(write_tapdraft(scratch / f"t{i}", samples, layout, cfg))
        disk = sum(p.stat().st_size for p in (scratch / f"t{i}").rglob("*") if p.is_file())
        shutil.rmtree(scratch / f"t{i}")
        t0 = time.perf_counter()
        write_pt_dataset(scratch / f"p{i}", samples)
        b.append(time.perf_counter() - t0)
        shutil.rmtree(scratch / f"p{i}")
        print(f"pair {i}: tapdraft {a[-1]:.2f} s ({nbytes / a[-1] / 1e6:.0f} MB/s)  torch.save {b[-1]:.2f} s  "
              f"ratio {b[-1] / a[-1]:.3f}")
    shutil.rmtree(scratch, ignore_errors=True)
    ratios = [y / x for x, y in zip(a, b)]
    res = {
        "benchmark": "write",
        "what": "DatasetWriter (A) vs per-sample torch.save (B), same content; ratio = B/A (higher is better)",
        "target_shape": {"hidden_size": args.hidden, "num_taps": len(TAPS), "top_k": 64,
                         "tokens_per_sample": args.tokens},
        "ratio_median": round(statistics.median(ratios), 3), "ratios": [round(r, 3) for r in ratios],
        "tapdraft_s_median": round(statistics.median(a), 3), "torch_save_s_median": round(statistics.median(b), 3),
        "tapdraft_MB_per_s": round(nbytes / statistics.median(a) / 1e6, 1),
        "tapdraft_tokens_per_s": round(tokens / statistics.median(a)),
        "torch_save_MB_per_s": round(nbytes / statistics.median(b) / 1e6, 1),
        "input_bytes": nbytes, "disk_bytes": disk, "samples": args.samples, "tokens": tokens,
        "load_avg_1m_per_pair": [round(x, 2) for x in loads],
        "command": f"python -m benchmarks.write --hidden {args.hidden} --samples {args.samples} "
                   f"--tokens {args.tokens} --pairs {args.pairs} --format {args.format}",
        "config": cfg.to_dict(), "machine_extra": {"threads": 1},
    }
    print(f"tapdraft {res['tapdraft_MB_per_s']} MB/s ({res['tapdraft_tokens_per_s']:,} tok/s), "
          f"torch.save {res['torch_save_MB_per_s']} MB/s; ratio (median of {args.pairs}) {res['ratio_median']}")
    write_result(args.name, res)


if __name__ == "__main__":
    main()
