"""Demo drafter quality: offline acceptance length tau of DFlash on the demo target, and training time.

Builds (or reuses, cached in ``--workdir``) the demo SALM and its captured dataset with
``demo.data.prepare_demo``, trains a DFlash drafter per recipe with ``train.loop.train``, and
evaluates teacher-forced greedy acceptance on the validation split with ``train.evaluate.evaluate``.
The baseline in the same run is the same drafter after one step (an untrained draft): the
figure is tau and its gain over that baseline. Training time is wall time on this machine.
Writes benchmarks/results/quality.json.

    python -m benchmarks.quality --quick              # tiny demo, few steps (CI-sized)
    python -m benchmarks.quality                      # full demo, recipe dflash_demo
    python -m benchmarks.quality --dataset DIR        # an already captured demo dataset
    python -m benchmarks.quality --recipes dflash_demo,dflash2_demo,mtp_demo,mtp_lk_demo,mtp_lk_adaptive_demo \
        --name quality_drafters.json                  # every family on the same budget; MTP rows add tau_sampled
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from benchmarks.common import write_result
from train.config import load_run_config
from train.evaluate import evaluate
from train.loop import train



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="demo_work", help="demo cache (target, data, dataset) and runs")
    ap.add_argument("--quick", action="store_true", help="tiny demo target and data")
    ap.add_argument("--steps", type=int, default=None, help="training steps (default: the recipe's; 40 with --quick)")
    ap.add_argument("--recipes", default="dflash_demo", help="comma-separated recipe names")
    ap.add_argument("--dataset", default=None, help="use this already captured demo dataset (skips prepare_demo)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 on a shared box; 2 threads fighting "
                    "other processes for 2 cores ran 4x slower here)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="extra key=value overrides")
    ap.add_argument("--name", default=None, help="results file name (default quality.json, quality_quick.json)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    if args.dataset:
        dataset = Path(args.dataset)
    else:
        from demo.data import prepare_demo

        dataset = prepare_demo(args.workdir, quick=args.quick, progress=False).dataset
    prep_s = time.perf_counter() - t0
    runs_root = Path(args.workdir) / "quality_runs"
    rows = []
    for recipe in [r for r in args.recipes.split(",") if r]:
        steps = args.steps or (40 if args.quick else load_run_config(recipe).train.max_steps)
        sets = [f"max_steps={steps}", "progress=false", f"log_every={max(steps // 10, 1)}", "ckpt_every=100000",
                *args.overrides]
        run = load_run_config(recipe, overrides=sets)
        base_dir, run_dir = runs_root / f"{recipe}-step1", runs_root / f"{recipe}-{steps}"
        for d in (base_dir, run_dir):
            if d.exists():
                import shutil

                shutil.rmtree(d)
        train(run, str(dataset), base_dir, stop_at=1)
        base = evaluate(base_dir, str(dataset), split="validation", plot=False)
        t1 = time.perf_counter()
        summary = train(run, str(dataset), run_dir)
        train_s = time.perf_counter() - t1
        res = evaluate(run_dir, str(dataset), split="validation")
        row = {
            "recipe": recipe, "steps": steps, "block_size": res["block_size"],
            "tau": round(res["tau"], 4), "tau_untrained": round(base["tau"], 4),
            "tau_gain": round(res["tau"] - base["tau"], 4),
            "tau_replayed": None if res.get("tau_replayed") is None else round(res["tau_replayed"], 4),
            "alpha": [round(a, 4) for a in res["alpha"]],
            "train_seconds": round(train_s, 2), "first_loss": summary["first_loss"], "final_loss": summary["final_loss"],
            "eval_samples": res["samples"], "eval_blocks": res["blocks"], "note": res["note"], "plot": res.get("plot"),
        }
        if run.family == "mtp":  # speculative SAMPLING acceptance, what the LK loss optimises
            from train.acceptance import sampled_acceptance

            sampled = sampled_acceptance(run_dir, str(dataset), split="validation")
            row["tau_sampled"] = round(sampled["tau_sampled"], 4)
            row["alpha_sampled"] = [round(a, 4) for a in sampled["alpha_sampled"]]
        rows.append(row)
        replayed = "" if row["tau_replayed"] is None else f"  replayed {row['tau_replayed']:.3f}"
        print(f"{recipe:10s} B={row['block_size']:2d} steps={steps:4d}  tau {row['tau']:.3f} (untrained "
              f"{row['tau_untrained']:.3f}, +{row['tau_gain']:.3f}){replayed}  train {row['train_seconds']:.1f}s  "
              f"loss {row['first_loss']:.3f} -> {row['final_loss']:.3f}", flush=True)
    name = args.name or ("quality_quick.json" if args.quick else "quality.json")
    write_result(name, {
        "benchmark": "quality",
        "what": "offline teacher-forced greedy tau (uniform anchors; DFlash families also replayed round by round) of drafters on the demo target's validation split",
        "demo": {"quick": args.quick, "workdir": str(args.workdir), "prepare_seconds": round(prep_s, 2),
                 "dataset": str(dataset)},
        "results": rows,
        "config": vars(args),
        "machine_extra": {"threads": args.threads, "device": "cpu"},
    })


if __name__ == "__main__":
    main()
