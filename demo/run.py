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

from tapdraft.demo.data import DemoPaths, one_thread, prepare_demo
from tapdraft.speculate.run import SpeculateConfig, run_speculate
from tapdraft.train.config import RunConfig, load_run_config
from tapdraft.train.evaluate import evaluate
from tapdraft.train.export import export_run
from tapdraft.train.loop import train

RECIPE = "dflash_demo"
QUICK_OVERRIDES = ("max_steps=30", "log_every=10", "ckpt_every=30")


def run_demo(workdir: str | Path, *, quick: bool = False, progress: bool = True,
             live_samples: int = 120) -> dict[str, Any]:
    """Run (or finish) the demo in ``workdir``; returns every figure ``format_demo`` prints."""
    with one_thread():
        return _run(Path(workdir), quick, progress, live_samples)


def _run(root: Path, quick: bool, progress: bool, live_samples: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    paths = prepare_demo(root, quick=quick, progress=progress)
    t_data = time.perf_counter() - t0
    run = load_run_config(RECIPE, overrides=list(QUICK_OVERRIDES) if quick else [])
    run_dir = root / "runs" / "dflash"
    t1 = time.perf_counter()
    losses = _train_drafter(run, paths, run_dir)
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
        "train_loss": losses,
        "offline": offline,
        "live": live,
        "export_info": export,
    }


def _train_drafter(run: RunConfig, paths: DemoPaths, run_dir: Path) -> list[float | None]:
    """Train, resume or (when complete) reuse the drafter; returns its [first, final] training loss.

    ``train`` validates a reused run (same config, same target fingerprint) and trains nothing when it
    is complete, so the losses of the calls that trained are kept in ``demo.json`` for later runs.
    """
    summary = train(run, paths.dataset, run_dir)
    if summary["first_loss"] is not None and not summary.get("already_complete"):
        first = summary["first_loss"]
        kept = paths.info.get("drafter")
        if summary["resumed_from_step"] and kept and kept.get("first_loss") is not None:
            first = kept["first_loss"]  # resumed: the loss at step 1 is the earlier call's
        paths.record("drafter", {"first_loss": first, "final_loss": summary["final_loss"], "steps": summary["steps"]})
    kept = paths.info.get("drafter") or {}
    return [kept.get("first_loss"), kept.get("final_loss")]


def _loss(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def format_demo(r: dict[str, Any]) -> str:
    """The demo's summary; the last line headlines the tau that serving sees (live decoding, which the
    offline replay of decoding rounds predicts); the teacher-forced figure over every anchor is a
    training metric that counts anchors a decoder never starts from, so it reads higher."""
    off, live = r["offline"], r["live"]
    B = off["block_size"]
    replayed = "-" if off.get("tau_replayed") is None else f"{off['tau_replayed']:.3f}"
    lines = [
        f"target + data + capture: {r['target_and_data_seconds']} s; drafter training: {r['train_seconds']} s; "
        f"total {r['total_seconds']} s",
        f"DFlash drafter (block size {B}) trained from {r['dataset']}",
        f"  loss {_loss(r['train_loss'][0])} -> {_loss(r['train_loss'][1])}",
        f"  live speculative decoding: tau = {live['tau']:.3f} tokens per target forward over {live['samples']} "
        f"conversations; identical to the target's greedy output: {live.get('matches_greedy')}",
        f"  offline replay of the same decoding rounds: tau = {replayed} on {off['samples']} {off['split']} samples "
        f"(predicts live decoding)",
        f"  teacher-forced at every anchor: tau = {off['tau']:.3f} (of at most {B}; a training metric, not what "
        f"serving sees); plot: {off.get('plot', '-')}",
        f"  exported for serving: {r['export']}",
        f"acceptance length (tau), live speculative decoding: {live['tau']:.2f} tokens per target forward "
        f"(offline replay: {replayed})",
    ]
    return "\n".join(lines)
