"""The dflash and eagle3 recipes' first training step by default, before vs after, on a real-vocabulary dataset.

Each run is ``tapdraft train --recipe R --set max_steps=1`` in a fresh run directory, in a subprocess whose
``PYTHONPATH`` is one source tree: A = ``--before`` (a checkout of the baseline commit), B = this tree. The
figure is the step's ``elapsed_s`` in metrics.jsonl (the first batch read, forward, backward and optimizer step;
not the process start), with the process's wall time beside it. Pairs are interleaved A B A B per recipe and the
1-minute load average is recorded before every run: the machine is shared, so only a ratio within one run means
much. The dataset is a capture of the real 49,152-token SmolLM2-135M-Instruct (``python -m tapdraft.demo.real build``)
over a few dozen text conversations; B's start line (the fitted budget, ``train.fit``) is recorded.

    python -m benchmarks.recipe_first_step --data DS --before /path/to/baseline/checkout [--pairs 2]
    python -m benchmarks.recipe_first_step --data DS [--runs 3]     # this tree only, against the 10 s goal
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import write_result

HERE = Path(__file__).resolve().parents[1]


def first_step(tree: Path, recipe: str, data: str, threads: int) -> dict[str, Any]:
    """One fresh ``max_steps=1`` training with ``tree``'s code: its first step's seconds and its start line."""
    out = Path(tempfile.mkdtemp(prefix=f"first-step-{recipe}-"))
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    res = subprocess.run(
        [sys.executable, "-m", "tapdraft.cli", "train", "--recipe", recipe, "--data", data, "--out", str(out / "run"),
         "--threads", str(threads), "--set", "max_steps=1", "--set", "progress=false"],
        cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise RuntimeError(f"{recipe} with {tree} failed:\n{res.stderr[-3000:]}")
    rec = json.loads((out / "run" / "metrics.jsonl").read_text().splitlines()[0])
    cfg = json.loads((out / "run" / "config.json").read_text())
    shutil.rmtree(out, ignore_errors=True)
    line = next((ln for ln in res.stderr.splitlines() if ln.startswith("step cost:")), None)
    return {"step_s": rec["elapsed_s"], "wall_s": round(wall, 1), "load_1min": round(load, 2), "loss": rec["loss"],
            "max_loss_rows": cfg["drafter"].get("max_loss_rows"), "max_tokens": cfg["train"].get("max_tokens"),
            "start_line": line}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="dataset captured from a real-vocabulary target")
    ap.add_argument("--before", default=None, help="source tree of the baseline (A); without it, this tree only")
    ap.add_argument("--recipes", nargs="+", default=["dflash", "eagle3"])
    ap.add_argument("--pairs", type=int, default=2, help="runs of each side (with no --before: runs of this tree)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="recipe_first_step.json")
    args = ap.parse_args(argv)
    trees = {"after": HERE} if args.before is None else {"before": Path(args.before).resolve(), "after": HERE}
    rows = []
    for recipe in args.recipes:
        runs: dict[str, list[dict[str, Any]]] = {side: [] for side in trees}
        for _ in range(args.pairs):
            for side in trees:
                runs[side].append(first_step(trees[side], recipe, args.data, args.threads))
                print(recipe, side, runs[side][-1], flush=True)
        med = {s: statistics.median(r["step_s"] for r in runs[s]) for s in runs}
        row = {"recipe": recipe, "after_s": med["after"], "goal": "< 10 s", "runs": runs}
        if "before" in med:
            row.update(before_s=med["before"], speedup=round(med["before"] / med["after"], 2))
        rows.append(row)
    print(f"{'recipe':<8} {'before s':>9} {'after s':>8} {'ratio':>6}  loads")
    for r in rows:
        loads = [x["load_1min"] for s in trees for x in r["runs"][s]]
        before = f"{r['before_s']:>9.1f}" if "before_s" in r else f"{'-':>9}"
        ratio = f"{r['speedup']:>6.2f}" if "speedup" in r else f"{'-':>6}"
        print(f"{r['recipe']:<8} {before} {r['after_s']:>8.1f} {ratio}  {loads}")
    doc = {"benchmark": "recipe_first_step", "data": args.data, "before": args.before and str(trees["before"]),
           "threads": args.threads, "pairs": args.pairs, "results": rows}
    write_result(args.out, doc)
    return doc


if __name__ == "__main__":
    main()
