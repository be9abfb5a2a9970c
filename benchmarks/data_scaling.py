"""How much broad data buys how much acceptance: a general drafter's tau per kind of request at several training sizes.

    python -m benchmarks.data_scaling --workdir general/n1500 --recipe dflash_small --sizes 375,750,1500 \\
        --name data_scaling_general_dflash_small.json

The sizes are the first N conversations of the work directory's training split in the dataset's file order (``tapdraft
derive --max-samples N``: capture's shard order, not the pool's, so a size is a subset of the pool's conversations that
holds every smaller derived size, not the pool's first N), each trained with the same recipe and step budget; the
whole split is the work directory's own run. ``--set KEY=VALUE`` (another step budget, say) trains every size again,
under a run named for its overrides, so curves at several budgets sit side by side. Every size is scored on the
requests of ``benchmarks.per_kind`` (run it first: its ``kinds/`` holds the requests, the target's replies and their
capture) by ``tapdraft speculate``: live speculative decoding in-process, whose rounds ``benchmarks.per_kind`` holds
equal to vLLM's, and the offline replay of the same conversations. Per size: tau per kind, the median and the worst
kind, the training split's conversations and tokens, the run's steps and training time, and the training batches'
tau at the end (``fit``: well above the kinds', more steps mostly fit the training data). Stages are cached under
``WORKDIR/scaling/nN/`` (a rerun continues), the scores too, kind by kind: sizes run as separate processes side by
side, then one call over all of them writes the curve.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, environment, invocation
from benchmarks.per_kind import KINDS
from tapdraft.common.atomic import staged
from tapdraft.demo.real.commands import run_cli
from tapdraft.demo.real.speedup import SpeedupConfig, speculate_served, target_dir


def split_counts(dataset: Path, split: str = "train") -> dict[str, Any]:
    """A dataset's split as the manifest counts it: samples, tokens, supervised tokens."""
    meta = json.loads((dataset / "manifest.json").read_text())["splits"][split]
    return {k: meta.get(k) for k in ("samples", "tokens", "supervised_tokens")}


def run_name(recipe: str, sets: tuple[str, ...] = ()) -> str:
    """A run's directory name: the recipe, then its training overrides if any (``dflash_small+max_steps-1800``), so a
    curve at another budget never reuses a run trained at the recipe's own."""
    return "+".join([recipe, *(s.replace("=", "-").replace("/", "-") for s in sets)])


def parse_sizes(text: str, full: int) -> list[int]:
    """``--sizes``: training conversations, comma-separated, ``all`` for the whole split; sorted, each once."""
    try:
        return sorted({full if s.strip() == "all" else int(s) for s in text.split(",")})
    except ValueError:
        raise ValueError(f"--sizes {text!r}: give comma-separated whole numbers of conversations or all, e.g. "
                         "469,932,all") from None


def size_run(work: Path, size: int, recipe: str, threads: int, sets: tuple[str, ...] = (), log=print) -> Path:
    """The run trained on the first ``size`` training conversations: at the whole split it reads the work directory's
    own dataset (``WORKDIR/runs/NAME``, the chain's own run when there are no overrides); a smaller size's prefix is
    derived and trained under ``WORKDIR/scaling/nSIZE/``. Both resume from their last checkpoint."""
    full = split_counts(work / "dataset")["samples"]
    if size > full:
        raise ValueError(f"{work / 'dataset'} trains on {full} conversations; asked for a size of {size}")
    if size == full:
        dataset, run = work / "dataset", work / "runs" / run_name(recipe, sets)
    else:
        here = work / "scaling" / f"n{size}"
        dataset, run = here / "dataset", here / "runs" / run_name(recipe, sets)
        if not (dataset / "manifest.json").is_file():
            run_cli("derive", str(work / "dataset"), "--out", str(dataset), "--splits", "train,validation",
                    "--max-samples", str(size), log=log)
    if not (run / "summary.json").is_file():
        run_cli("train", "--data", str(dataset), "--recipe", recipe, "--out", str(run), "--threads", str(threads),
                *[x for s in sets for x in ("--set", s)], log=log)
    return run


def kind_taus(work: Path, run: Path, target: Path, per_kind_max: int, max_tokens: int,
              cache: Path | None = None) -> dict[str, dict[str, Any]]:
    """``tapdraft speculate``'s tau (and the offline replay's) on every kind's requests of ``benchmarks.per_kind``;
    with ``cache``, each kind's row is kept there as it is scored and a rerun scores only the kinds it lacks (the
    file names what it scored: the run's final checkpoint, the requests a kind, the reply cap)."""
    kinds = work / "kinds"
    if not (kinds / "dataset" / "manifest.json").is_file():
        raise FileNotFoundError(f"{kinds / 'dataset'} is missing: run python -m benchmarks.per_kind --workdir {work} "
                                "--stop-after capture first (it writes the kinds' requests, replies and capture)")
    scored = {"run": str(run.resolve()), "checkpoint": json.loads((run / "summary.json").read_text()).get("checkpoint"),
              "per_kind": per_kind_max, "max_tokens": max_tokens}
    rows: dict[str, dict[str, Any]] = {}
    if cache is not None and cache.is_file():
        doc = json.loads(cache.read_text())
        rows = doc["kinds"] if doc["scored"] == scored else {}
    for kind in KINDS:
        if kind in rows:
            continue
        n = sum(1 for line in (kinds / f"{kind}.jsonl").read_text().splitlines() if line.strip())
        ours = speculate_served(kinds / f"{kind}.jsonl", target, run, kinds / "dataset", min(n, per_kind_max),
                                max_tokens)
        rows[kind] = {"requests": min(n, per_kind_max), "tau": ours["tau"],
                      "offline_tau_replayed": ours.get("offline_tau_replayed") if ours.get("offline_same") else None}
        if cache is not None:
            with staged(cache) as tmp:
                tmp.write_text(json.dumps({"scored": scored, "kinds": rows}, indent=1) + "\n")
    return {kind: rows[kind] for kind in KINDS}


def summary(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The median kind's tau and the worst kind's (never the best)."""
    taus = {k: r["tau"] for k, r in rows.items()}
    worst = min(taus, key=taus.get)
    return {"median": statistics.median(taus.values()), "worst": taus[worst], "worst_kind": worst}


def fit_tau(run: Path) -> float | None:
    """The training batches' tau over the last tenth of the logged steps (``metrics.jsonl``), beside the held-out
    kinds' taus: far above them, further steps mostly fit the training conversations and more data is the lever."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        return None
    taus = [r["tau"] for r in map(json.loads, path.read_text().splitlines()) if "loss" in r and "tau" in r]
    tail = taus[-max(1, len(taus) // 10):]
    return statistics.fmean(tail) if tail else None


def format_curve(sizes: dict[int, dict[str, Any]]) -> str:
    kinds = list(next(iter(sizes.values()))["kinds"])
    lines = [f"{'size':>6} {'tokens':>9} {'steps':>6} " + " ".join(f"{k:>8}" for k in kinds)
             + f" {'median':>7} {'worst':>6} {'fit':>6}"]
    for size, s in sizes.items():
        fit = s.get("fit_tau")
        lines.append(f"{size:>6} {s['train']['tokens'] or 0:>9} {s.get('steps') or 0:>6} "
                     + " ".join(f"{s['kinds'][k]['tau']:>8.3f}" for k in kinds)
                     + f" {s['median']:>7.3f} {s['worst']:>6.3f} " + (f"{fit:>6.3f}" if fit is not None else f"{'-':>6}"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    d = SpeedupConfig()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", choices=["general", "self"], default="general")
    ap.add_argument("--workdir", required=True, help="a benchmarks.real_speedup work directory, per_kind run on it")
    ap.add_argument("--recipe", default="dflash_small")
    ap.add_argument("--sizes", required=True, help="training conversations, comma-separated, all for the whole split "
                    "(prefixes of the dataset's file order)")
    ap.add_argument("--set", action="append", default=[], help="training override KEY=VALUE (repeatable)")
    ap.add_argument("--per-kind", type=int, default=16, help="at most this many requests a kind")
    ap.add_argument("--max-tokens", type=int, default=None, help="reply cap (default: the target's)")
    ap.add_argument("--threads", type=int, default=d.threads)
    ap.add_argument("--name", default=None)
    a = ap.parse_args(argv)
    cfg = SpeedupConfig(target=a.target, max_tokens=a.max_tokens)
    work, log = Path(a.workdir).resolve(), (lambda m: print(m, flush=True))
    target = target_dir(cfg, log)
    sizes = {}
    for size in parse_sizes(a.sizes, split_counts(work / "dataset")["samples"]):
        run = size_run(work, size, a.recipe, a.threads, tuple(a.set), log)
        rows = kind_taus(work, run, target, a.per_kind, cfg.max_tokens,
                         cache=work / "scaling" / f"n{size}" / f"taus-{run.name}.json")
        data = work / "dataset" if run.parent.parent == work else run.parent.parent / "dataset"
        trained = json.loads((run / "summary.json").read_text())
        sizes[size] = {"run": str(run), "train": split_counts(data), "steps": trained.get("steps"),
                       "train_seconds": trained.get("train_seconds"), "fit_tau": fit_tau(run), "kinds": rows,
                       **summary(rows)}
        log(f"size {size}: median kind tau {sizes[size]['median']:.3f}, worst {sizes[size]['worst']:.3f} "
            f"({sizes[size]['worst_kind']})")
    print(format_curve(sizes))
    out = RESULTS / (a.name or f"data_scaling_{a.target}_{a.recipe}.json")
    doc = {"target": a.target, "recipe": a.recipe, "sets": a.set, "max_tokens": cfg.max_tokens,
           "command": invocation(), **environment(threads=a.threads), "sizes": sizes}
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
