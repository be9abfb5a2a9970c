"""Acceptance cost of a reduced draft vocabulary: the same DFlash recipe trained with the full vocabulary and with
N-token draft vocabularies (``train.drafters.common.draft_vocab``), same data, steps and seed, evaluated on the
validation split.

Per run: coverage (the fraction of the training split's supervised tokens inside the subset, and of the
validation split's: a validation token outside it can never be drafted), tau (uniform anchors), tau_replayed
(greedy decoding replayed round by round: what live T=0 gives), tau_sampled (speculative sampling at T=1 from
the exact target rows), and the training time. The baseline is the full-vocabulary run of the same
invocation; ``tau_*_ratio`` = reduced / full. Runs are sequential, so their times are context, not a measured
ratio (``benchmarks/train_step.py --draft-vocab`` times steps in interleaved pairs).

Targets as in ``benchmarks/quality.py``: ``--target bpe`` (8,192-token BPE vocabulary, ``demo.bpe``) or
``--target demo`` (the demo SALM, 54 tokens).

    python -m benchmarks.draft_vocab --target bpe --workdir /tmp/bpe_work --sizes 2048,4096 --steps 150 \\
        --set train.max_tokens=768
    python -m benchmarks.draft_vocab --target demo --workdir demo_work --sizes 12,24

``--dataset DIR`` uses an already captured dataset instead of building the target's (``--target`` then only
names it in the results).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import write_result
from benchmarks.quality import prepare
from tapdraft.shards.reader import open_dataset
from tapdraft.train.config import load_run_config
from tapdraft.train.drafters.common.draft_vocab import DraftVocab, token_counts
from tapdraft.train.evaluate import evaluate
from tapdraft.train.loop import train
from tapdraft.train.run import load_run


def one(recipe: str, size: int | None, args: argparse.Namespace, dataset: Path, runs: Path) -> dict[str, Any]:
    """Train and evaluate one draft-vocabulary size (None: the full vocabulary)."""
    sets = [f"max_steps={args.steps}", "progress=false", f"log_every={max(args.steps // 10, 1)}",
            "ckpt_every=100000", f"draft_vocab={'null' if size is None else size}", *args.overrides]
    run = load_run_config(recipe, overrides=sets)
    out = runs / f"{recipe}-{'full' if size is None else size}-{args.steps}"
    if out.exists():
        shutil.rmtree(out)
    t0 = time.perf_counter()
    summary = train(run, str(dataset), out)
    seconds = time.perf_counter() - t0
    res = evaluate(out, str(dataset), split="validation", plot=False)
    row: dict[str, Any] = {"draft_vocab": size, "steps": args.steps, "train_seconds": round(seconds, 2),
                           "first_loss": summary["first_loss"], "final_loss": summary["final_loss"],
                           "tau": round(res["tau"], 4), "tau_replayed": res.get("tau_replayed"),
                           "tau_sampled": res.get("tau_sampled"), "alpha": [round(a, 4) for a in res["alpha"]]}
    for k in ("tau_replayed", "tau_sampled"):
        if row[k] is not None:
            row[k] = round(row[k], 4)
    if size is not None:
        ds = open_dataset(str(dataset))
        _, _, state = load_run(out)
        V = int(state.draft["t2d"].numel())
        vocab = DraftVocab.from_d2t(state.draft["d2t"], V)
        row["coverage_train"] = summary["draft_vocab"]["coverage"]
        row["coverage_validation"] = round(vocab.coverage(token_counts(ds, "validation", V)), 6)
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", choices=("demo", "bpe"), default="demo", help="demo SALM or the 8k-BPE causal LM")
    ap.add_argument("--workdir", default="demo_work", help="target, data, dataset and runs cache")
    ap.add_argument("--quick", action="store_true", help="tiny target and data")
    ap.add_argument("--recipe", default="dflash_demo", help="the DFlash recipe every run trains")
    ap.add_argument("--sizes", default="12,24",
                    help="comma-separated draft vocabulary sizes (the full one always runs)")
    ap.add_argument("--steps", type=int, default=300, help="training steps of every run")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="extra key=value overrides")
    ap.add_argument("--dataset", default=None, help="an already captured dataset of that target (no build)")
    ap.add_argument("--name", default=None, help="results file (default draft_vocab_TARGET.json)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    prep = prepare(args)
    torch.set_num_threads(args.threads)
    runs = Path(args.workdir) / "draft_vocab_runs"
    rows = []
    for size in [None, *(int(s) for s in args.sizes.split(",") if s.strip())]:
        rows.append(one(args.recipe, size, args, prep["dataset"], runs))
        r = rows[-1]
        print(f"draft_vocab {str(size or 'full'):>6}  tau {r['tau']:.3f}  replayed {r['tau_replayed']}  "
              f"sampled {r['tau_sampled']}  coverage {r.get('coverage_validation', 1.0)}  "
              f"train {r['train_seconds']:.0f}s", flush=True)
    full = rows[0]
    for r in rows[1:]:
        for k in ("tau", "tau_replayed", "tau_sampled"):
            if r[k] is not None and full[k]:
                r[f"{k}_ratio"] = round(r[k] / full[k], 4)
    cfg = open_dataset(str(prep["dataset"])).bundle().config
    doc = {"benchmark": "draft_vocab",
           "what": "acceptance of the same DFlash recipe with the full vocabulary and reduced draft vocabularies",
           "command": "python -m benchmarks.draft_vocab " + " ".join(argv if argv is not None else sys.argv[1:]),
           "target": {"kind": args.target, "quick": args.quick, "dataset": str(prep["dataset"]), "build": prep["info"],
                      **{k: cfg.get(k) for k in ("hidden_size", "num_hidden_layers", "vocab_size")}},
           "recipe": args.recipe, "results": rows, "config": vars(args),
           "machine_extra": {"threads": args.threads, "device": "cpu"}}
    write_result(args.name or f"draft_vocab_{args.target}.json", doc)
    return doc


if __name__ == "__main__":
    main()
