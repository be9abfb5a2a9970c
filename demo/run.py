"""The built-in demo, end to end: target -> dataset -> DFlash drafter -> offline and live acceptance.

    1. demo.data.prepare_demo: build and briefly train a small SALM on tone-coded digits (cached
       in WORKDIR/target), write its audio and conversations (replies = its own greedy output) and
       capture WORKDIR/dataset
    2. train the ``dflash_demo`` recipe from the dataset alone (WORKDIR/runs/dflash)
    3. offline acceptance on the validation split (eval.json + acceptance.png in the run)
    4. live speculative decoding with the target on held-out conversations: greedy output must
       equal the target's own, tau counted per target forward
    5. export the draft for serving (WORKDIR/export/dflash)

Every step resumes or reuses what an earlier run left in WORKDIR. ``quick`` shrinks everything
to seconds for smoke tests (the numbers then mean nothing).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from demo.data import prepare_demo
from speculate.run import SpeculateConfig, run_speculate
from train.config import load_run_config
from train.evaluate import evaluate
from train.export import export_run
from train.loop import train

RECIPE = "dflash_demo"
QUICK_OVERRIDES = ("max_steps=30", "log_every=10", "ckpt_every=30")


def run_demo(workdir: str | Path, *, quick: bool = False, progress: bool = True,
             live_samples: int = 120) -> dict[str, Any]:
    """Run (or finish) the demo in ``workdir``; returns every figure ``format_demo`` prints."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the demo's models are tiny: one thread is faster than two on 2 cores
    try:
        return _run(Path(workdir), quick, progress, live_samples)
    finally:
        torch.set_num_threads(threads)


def _run(root: Path, quick: bool, progress: bool, live_samples: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    paths = prepare_demo(root, quick=quick, progress=progress)
    t_data = time.perf_counter() - t0
    run = load_run_config(RECIPE, overrides=list(QUICK_OVERRIDES) if quick else [])
    run_dir = root / "runs" / "dflash"
    t1 = time.perf_counter()
    summary = train(run, paths.dataset, run_dir)
    t_train = time.perf_counter() - t1
    offline = evaluate(run_dir, paths.dataset)
    live = run_speculate(
        SpeculateConfig(target=str(paths.target), draft=str(run_dir), data=str(paths.dataset),
                        conversations=str(paths.val_manifest), max_samples=4 if quick else live_samples,
                        max_new_tokens=32),
        progress=progress,
    )
    export = export_run(run_dir, root / "export" / "dflash")
    return {
        "workdir": str(root),
        "target": str(paths.target),
        "dataset": str(paths.dataset),
        "run": str(run_dir),
        "export": str(root / "export" / "dflash"),
        "target_and_data_seconds": round(t_data, 1),
        "train_seconds": round(t_train, 1),
        "total_seconds": round(time.perf_counter() - t0, 1),
        "train_loss": [summary.get("first_loss"), summary.get("final_loss")],
        "offline": offline,
        "live": live,
        "export_info": export,
    }


def format_demo(r: dict[str, Any]) -> str:
    off, live = r["offline"], r["live"]
    B = off["block_size"]
    lines = [
        f"target + data + capture: {r['target_and_data_seconds']} s; drafter training: {r['train_seconds']} s; "
        f"total {r['total_seconds']} s",
        f"DFlash drafter (block size {B}) trained from {r['dataset']}",
        f"  loss {r['train_loss'][0]:.3f} -> {r['train_loss'][1]:.3f}",
        f"  offline acceptance length tau = {off['tau']:.3f} (of at most {B}) on {off['samples']} "
        f"{off['split']} samples; plot: {off.get('plot', '-')}",
        f"  offline replay of decoding rounds: tau = {off['tau_replayed']:.3f} (what live decoding should give)",
        f"  live speculative decoding: tau = {live['tau']:.3f} tokens per target forward over "
        f"{live['samples']} conversations; identical to the target's greedy output: {live.get('matches_greedy')}",
        f"  exported for serving: {r['export']}",
        f"acceptance length (tau): {off['tau']:.2f}",
    ]
    return "\n".join(lines)
