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

The frozen head's dtype is fitted here too (``head_dtype``, for ``train.head_dtype: auto``): bf16 on CUDA, and on
a CPU with bf16 instructions when the lm_head is real-sized, where its matmuls are most of a step; fp32 otherwise.
It reads the CPU's flags and the shape, never a timing.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path

import torch

from tapdraft.shards.bundle import TargetBundle
from tapdraft.train.config import RunConfig

LOSS_GFLOP = {"cpu": 120.0, "cuda": 5100.0}
"""Head-matmul GFLOP per micro-batch that a null ``max_loss_rows`` is fitted to, per device type."""
DRAFT_GFLOP = {"cpu": 120.0}
"""Draft-stack GFLOP per micro-batch that a null ``train.max_tokens`` is fitted to (other devices: DEFAULT_TOKENS)."""
MIN_LOSS_ROWS = 64
"""The fewest loss rows a fitted budget gives (a whole block or a whole chain of any usual size)."""
MIN_TOKENS = 256
DEFAULT_TOKENS = 8192
"""Micro-batch tokens of a null ``max_tokens`` where nothing fits them (the full-size recipes' value)."""


def fit_to_device(run: RunConfig, bundle: TargetBundle, device: torch.device) -> tuple[RunConfig, str | None]:
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
        dtype = head_dtype(device, run.train.head_dtype, vocab * hidden)
        rate = matmul_rate(hidden, dtype=dtype)
        line += (f", ~{gflop / rate:.1f} s a step at the {rate:.0f} GFLOP/s a quick {str(dtype)[6:]} probe measures "
                 "now")
    return run, line + "; set drafter.max_loss_rows=N and train.max_tokens=N to choose"


def matmul_rate(hidden: int, *, dtype: torch.dtype = torch.float32, seconds: float = 0.2) -> float:
    """GFLOP/s of a [256, H] x [H, 8192] matmul in ``dtype`` (the frozen head's) on this CPU now, at torch's thread
    setting: an estimate for the start line, never a setting."""
    x, w = torch.randn(256, hidden, dtype=dtype), torch.randn(8192, hidden, dtype=dtype)
    torch.matmul(x, w.T)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        torch.matmul(x, w.T)
        n += 1
    return 2.0 * 256 * hidden * 8192 * n / (time.perf_counter() - t0) / 1e9


BF16_HEAD_MIN_WEIGHTS = 1 << 24
"""The smallest lm_head (V x H weights) that ``head_dtype: auto`` keeps in bf16 on a CPU with bf16 instructions."""


@functools.cache
def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively, from the kernel's CPU flags (``cpuinfo_has_bf16``); False where
    they cannot be read (another OS): bf16 stays opt-in there."""
    try:
        return cpuinfo_has_bf16(Path("/proc/cpuinfo").read_text())
    except OSError:
        return False


def cpuinfo_has_bf16(text: str) -> bool:
    """Whether a /proc/cpuinfo text lists bf16 instructions: x86 ``avx512_bf16`` or ``amx_bf16``, Arm's ``bf16``."""
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def head_dtype(device: torch.device, setting: str, head_weights: int = 0) -> torch.dtype:
    """The frozen embedding and lm_head's dtype; ``setting`` ``auto`` picks bf16 where it pays:

    - CUDA: bf16 (tensor cores);
    - a CPU with bf16 instructions (``cpu_has_bf16``) and an lm_head of at least ``BF16_HEAD_MIN_WEIGHTS``
      weights (``head_weights``), where its matmuls are most of a step: bf16. At SmolLM2's 49,152 x 576 a DFlash
      step measured 1.37x faster than fp32 with the loss equal to 5e-6 (benchmarks/train_step.py); a toy head's
      matmuls cost little either way, so small heads stay fp32;
    - any other CPU: fp32 (without the instructions bf16 is emulated, slower than fp32).

    The real checkpoints' heads are stored in bf16, so the weights lose nothing; the rows are rounded to bf16 at
    the matmul, the logits come back in bf16 and every softmax and loss after them runs in fp32. The choice reads
    only the CPU's flags and the shape, so one machine resolves a run the same way on every resume.
    """
    if setting == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if head_weights >= BF16_HEAD_MIN_WEIGHTS and cpu_has_bf16() else torch.float32
    return torch.bfloat16 if setting == "bfloat16" else torch.float32
