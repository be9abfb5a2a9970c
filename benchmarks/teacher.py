"""Per-row teacher vs full [B, T, V] teacher logits: peak memory and step time of a KD loss step.

Both variants run the SAME loss step (draft rows -> ``train.drafters.common.losses.row_losses``: chunked lm_head,
CE + KL(teacher || draft), backward), so the only difference is where the teacher comes from:

- full (the common pattern being replaced): project the whole sequence's last hidden state through
  final norm + lm_head into [T, V] teacher logits once, then index the rows each chunk needs;
- per-row (``train.drafters.common.teacher`` / ``...common.losses.row_losses``): gather only the rows a loss reads
  ([R, H] hidden), and project them inside each checkpointed chunk.

Sizes: B = 1, T in {2048, 8192}, V in {32768, 152064}, tiny H (default 16), R = 1024 loss rows
(64 anchors x 16 slots), chunk 256 rows, float32 on CPU. Peak memory: each variant runs once in a
forked child; the figure is the child's peak RSS minus its RSS just before the step. Time:
in-process, interleaved per-row/full pairs, median of ``--pairs`` (>= 5). Ratio = per-row / full
(lower is better for both). Writes benchmarks/results/teacher.json.

    python -m benchmarks.teacher            # full grid
    python -m benchmarks.teacher --quick    # T=8192, V=152064 only
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.common import peak_memory_growth, write_result
from tapdraft.shards.head import HeadSpec, rms_norm
from tapdraft.train.drafters.common.losses import row_losses
from tapdraft.train.drafters.common.teacher import ExactTeacher


def make_inputs(T: int, V: int, H: int, R: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "final_hidden": torch.randn(T, H, generator=g),
        "norm": 1 + 0.1 * torch.randn(H, generator=g),
        "lm_head": torch.randn(V, H, generator=g) / H**0.5,
        "h": torch.randn(R, H, generator=g),
        "labels": torch.randint(0, V, (R,), generator=g),
        "rows": torch.randint(0, T, (R,), generator=g),
        "w": torch.rand(R, generator=g),
    }


def step_per_row(x: dict, chunk: int) -> float:
    h = x["h"].clone().requires_grad_(True)
    teacher = ExactTeacher(x["final_hidden"][x["rows"]], x["norm"], x["lm_head"], HeadSpec(eps=1e-6))
    ce, _, kd = row_losses(h, x["labels"], x["lm_head"], chunk_rows=chunk, teacher=teacher)
    loss = (x["w"] * (ce + kd)).sum() / x["w"].sum()
    loss.backward()
    return float(loss.detach())


class FullLogitsTeacher:
    """The replaced pattern: teacher logits for the WHOLE sequence, then rows indexed per chunk."""

    def __init__(self, logits_TV: torch.Tensor, rows_R: torch.Tensor) -> None:
        self.logits_TV, self.rows_R = logits_TV, rows_R

    def chunk_logits(self, start: int, end: int) -> torch.Tensor:
        return self.logits_TV[self.rows_R[start:end]]


def step_full(x: dict, chunk: int) -> float:
    h = x["h"].clone().requires_grad_(True)
    with torch.no_grad():  # the [B, T, V] teacher logits (B = 1)
        t_logits = F.linear(rms_norm(x["final_hidden"], x["norm"], 1e-6), x["lm_head"])
    teacher = FullLogitsTeacher(t_logits, x["rows"])
    ce, _, kd = row_losses(h, x["labels"], x["lm_head"], chunk_rows=chunk, teacher=teacher)
    loss = (x["w"] * (ce + kd)).sum() / x["w"].sum()
    loss.backward()
    return float(loss.detach())


STEPS = {"per_row": step_per_row, "full": step_full}


def peak_memory(variant: str, T: int, V: int, H: int, R: int, chunk: int) -> int:
    return peak_memory_growth(lambda: make_inputs(T, V, H, R), lambda x: STEPS[variant](x, chunk),
                              f"{variant} T={T} V={V}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="only T=8192, V=152064")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=16)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(1)
    grid = [(8192, 152064)] if args.quick else [(2048, 32768), (2048, 152064), (8192, 32768), (8192, 152064)]
    H, R, chunk = args.hidden, args.rows, args.chunk
    rows = []
    for T, V in grid:
        # same numbers from both variants (a correctness check riding along)
        x = make_inputs(T, V, H, R)
        a, b = step_per_row(x, chunk), step_full(x, chunk)
        assert abs(a - b) < 1e-4 * max(1.0, abs(b)), (a, b)
        mem = {v: peak_memory(v, T, V, H, R, chunk) for v in ("per_row", "full")}
        times = {"per_row": [], "full": []}
        for _ in range(args.pairs):
            for v in ("per_row", "full"):
                t0 = time.perf_counter()
                STEPS[v](x, chunk)
                times[v].append(time.perf_counter() - t0)
        ratios = [p / f for p, f in zip(times["per_row"], times["full"])]
        row = {
            "T": T, "V": V, "H": H, "rows": R, "chunk": chunk,
            "peak_mem_MiB": {k: round(v / 2**20, 1) for k, v in mem.items()},
            "mem_ratio": round(mem["per_row"] / mem["full"], 4),
            "step_s_median": {k: round(statistics.median(v), 4) for k, v in times.items()},
            "time_ratio_median": round(statistics.median(ratios), 4),
            "pairs": args.pairs,
        }
        rows.append(row)
        print(f"T={T:5d} V={V:6d}  mem per-row {row['peak_mem_MiB']['per_row']:8.1f} MiB  full "
              f"{row['peak_mem_MiB']['full']:8.1f} MiB  ratio {row['mem_ratio']:.3f}   time per-row "
              f"{row['step_s_median']['per_row']:.3f}s full {row['step_s_median']['full']:.3f}s  ratio "
              f"{row['time_ratio_median']:.3f}", flush=True)
        del x
    write_result("teacher.json", {
        "benchmark": "teacher",
        "what": "KD loss step (chunked CE + KL, backward): per-row teacher vs full [1, T, V] teacher logits",
        "results": rows,
        "config": vars(args),
        "machine_extra": {"threads": 1, "device": "cpu"},
    })


if __name__ == "__main__":
    main()
