"""Fitting a recipe's work per step to the device it trains on: the loss-row budget and the micro-batch tokens.

At a real vocabulary a step's cost is its loss rows' head matmuls, each 2 N H FLOPs over the head's N outputs
(the drafter config's ``loss_row_flops`` counts them: DFlash's CE 2, EAGLE-3's KL 4 with its trained head), and
for EAGLE-3 also its draft stack, which runs the layer over every token of the micro-batch at each of its steps
(``token_flops``). A fixed budget cannot suit both a GPU and a CPU: the dflash recipe's 8192 rows took 43 s a
step on a CPU at SmolLM2's 49k vocabulary. So a recipe leaves ``max_loss_rows`` (and EAGLE-3's ``max_tokens``)
null and training fits them:

    rows   = max(MIN_LOSS_ROWS, LOSS_GFLOP[device type] / GFLOP of a row)
    tokens = min(DEFAULT_TOKENS, max(MIN_TOKENS, DRAFT_GFLOP[device type] / GFLOP of a token))  (None on a GPU: 8192)

CPU 120 + 120 GFLOP (~1.1k DFlash rows, or ~530 EAGLE-3 rows and ~900 tokens, at 49,152 x 576; measured on this
project's shared 2-core AVX512 CPU: the dflash recipe's first step 8.1x faster than with 8192 rows, eagle3's 7-8 s,
benchmarks/results/recipe_first_step_*.json); GPU 5100 GFLOP of rows (the former 8192 DFlash rows at Qwen3's
151,936 x 1024) and 8192 tokens. The rule reads only the device type, the target's shape and the configs, never a
timing, so the same recipe fits the same way on every machine of a type and a resume fits the same budget (the
fitted values are what the run's config records). When training starts, and only when it fitted something, one
line says the budget, what it costs, a step's estimated time from a short matmul probe (an estimate only, it sets
nothing), and how to choose.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

LOSS_GFLOP = {"cpu": 120.0, "cuda": 5100.0}
"""Head-matmul GFLOP per micro-batch that a null ``max_loss_rows`` is fitted to, per device type."""
DRAFT_GFLOP = {"cpu": 120.0}
"""Draft-stack GFLOP per micro-batch that a null ``train.max_tokens`` is fitted to (other devices: DEFAULT_TOKENS)."""
MIN_LOSS_ROWS = 64
"""The fewest loss rows a fitted budget gives (a whole block or a whole chain of any usual size)."""
MIN_TOKENS = 256
DEFAULT_TOKENS = 8192
"""Micro-batch tokens of a null ``max_tokens`` where nothing fits them (the full-size recipes' value)."""


def fit_to_device(run: Any, bundle: Any, device: torch.device) -> tuple[Any, str | None]:
    """(run with a null ``drafter.max_loss_rows`` / ``train.max_tokens`` fitted to ``device``, the one line to
    print when training starts, or None when nothing was fitted: a budget set by hand is the user's choice)."""
    cfg, tc = run.drafter, run.train
    vocab, hidden = (int(n) for n in bundle.lm_head.shape)
    gflop = 0.0
    fitted = tc.max_tokens is None or getattr(cfg, "max_loss_rows", 0) is None
    if tc.max_tokens is None:
        tokens = DEFAULT_TOKENS
        if hasattr(cfg, "token_flops") and device.type in DRAFT_GFLOP:
            per_token = float(cfg.token_flops(bundle))
            tokens = min(DEFAULT_TOKENS, max(MIN_TOKENS, int(DRAFT_GFLOP[device.type] * 1e9 // per_token)))
        run = dataclasses.replace(run, train=dataclasses.replace(tc, max_tokens=tokens))
    if hasattr(cfg, "token_flops"):
        gflop += run.train.max_tokens * float(cfg.token_flops(bundle)) / 1e9
    if not (fitted and hasattr(cfg, "max_loss_rows") and hasattr(cfg, "loss_row_flops")):
        return run, None
    per_row = float(cfg.loss_row_flops(vocab, hidden))
    auto = cfg.max_loss_rows is None
    rows = max(MIN_LOSS_ROWS, int(LOSS_GFLOP.get(device.type, LOSS_GFLOP["cuda"]) * 1e9 // per_row)) if auto \
        else int(cfg.max_loss_rows)
    if auto:
        run = dataclasses.replace(run, drafter=dataclasses.replace(cfg, max_loss_rows=rows))
    gflop += rows * per_row / 1e9
    line = (f"step cost: at most {rows:,} loss rows ({'fitted to ' + device.type if auto else 'as set'}; "
            f"{per_row / 1e9:.3f} GFLOP of head matmuls a row at {vocab:,} x {hidden}) and {run.train.max_tokens:,} "
            f"tokens a micro-batch: ~{gflop:,.0f} GFLOP")
    if device.type == "cpu":
        rate = matmul_rate(hidden)
        line += f", ~{gflop / rate:.1f} s a step at the {rate:.0f} GFLOP/s a quick probe measures now"
    return run, line + "; set drafter.max_loss_rows=N and train.max_tokens=N to choose"


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
