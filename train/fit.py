"""Fitting a recipe's work per step to the device it trains on: the loss-row budget.

At a real vocabulary a step's cost is its loss rows' head matmuls, each 2 N H FLOPs over the head's N outputs
(the drafter config's ``loss_row_flops`` counts them: DFlash's CE 2, EAGLE-3's KL 4 with its trained head),
not the draft layers. A fixed budget cannot suit both a GPU and a CPU: the dflash recipe's 8192 rows took 43 s
a step on a CPU at SmolLM2's 49k vocabulary. So a recipe leaves ``max_loss_rows`` null and training fits it:

    rows = max(MIN_LOSS_ROWS, LOSS_GFLOP[device type] / GFLOP of a row)

CPU 160 GFLOP (~1.4k DFlash rows, ~0.7k EAGLE-3 rows at 49,152 x 576: a few seconds a step on one thread of
this project's AVX512 CPU, benchmarks/results/recipe_first_step.json), GPU 5100 GFLOP (the former 8192 DFlash
rows at Qwen3's 151,936 x 1024). The rule reads only the device type, the target's shape and the drafter
config, never a timing, so the same recipe fits the same way on every machine of a type and a resume fits the
same budget (the fitted value is what the run's config records). At start one line says the budget, what it
costs, a step's estimated time from a short matmul probe (an estimate only, it sets nothing), and how to choose.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

LOSS_GFLOP = {"cpu": 160.0, "cuda": 5100.0}
"""Head-matmul GFLOP per micro-batch that a null ``max_loss_rows`` is fitted to, per device type."""
MIN_LOSS_ROWS = 64
"""The fewest loss rows a fitted budget gives (a whole block or a whole chain of any usual size)."""


def fit_loss_rows(run: Any, vocab: int, hidden: int, device: torch.device) -> tuple[Any, str | None]:
    """(run with a null ``drafter.max_loss_rows`` fitted to ``device``, the one line to print at start);
    a family without a loss-row budget passes through with no line."""
    cfg = run.drafter
    if not (hasattr(cfg, "max_loss_rows") and hasattr(cfg, "loss_row_flops")):
        return run, None
    per_row = float(cfg.loss_row_flops(vocab, hidden))
    auto = cfg.max_loss_rows is None
    rows = max(MIN_LOSS_ROWS, int(LOSS_GFLOP.get(device.type, LOSS_GFLOP["cuda"]) * 1e9 // per_row)) if auto \
        else int(cfg.max_loss_rows)
    if auto:
        run = dataclasses.replace(run, drafter=dataclasses.replace(cfg, max_loss_rows=rows))
    how = f"fitted to {device.type}" if auto else "as set"
    line = (f"loss rows: at most {rows:,} a micro-batch ({how}; {per_row / 1e9:.3f} GFLOP of head matmuls a row at "
            f"{vocab:,} x {hidden}, {rows * per_row / 1e9:,.0f} GFLOP a step")
    if device.type == "cpu":
        rate = matmul_rate(hidden)
        line += f", ~{rows * per_row / 1e9 / rate:.1f} s at the {rate:.0f} GFLOP/s a quick probe measures now"
    return run, line + "); set drafter.max_loss_rows=N to choose"


def matmul_rate(hidden: int, *, seconds: float = 0.2) -> float:
    """GFLOP/s of a float32 [256, H] x [H, 8192] matmul on this CPU now, at torch's thread setting: an estimate
    for the start line, never a setting."""
    x, w = torch.randn(256, hidden), torch.randn(8192, hidden)
    torch.matmul(x, w.T)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        torch.matmul(x, w.T)
        n += 1
    return 2.0 * 256 * hidden * 8192 * n / (time.perf_counter() - t0) / 1e9
