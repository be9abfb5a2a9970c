"""Drafter quality: acceptance length tau of each drafter family on a target, greedy and sampled,
offline and live.

Builds (or reuses, cached in ``--workdir``) a target and its captured dataset: ``--target demo`` is
the demo SALM (``demo.data.prepare_demo``, a 54-word vocabulary), ``--target bpe`` a Qwen3 causal LM
with an 8,192-token BPE vocabulary trained on the Python docs (``demo.bpe.prepare_bpe``, captured
with the CLI's defaults). Both datasets hold the target's own greedy replies, so the offline greedy
figures are exact. Each recipe trains with ``train.loop.train`` on the same data and steps; per run:

    tau                 teacher-forced greedy tau over uniform anchors (a training metric)
    tau_replayed        greedy decoding replayed round by round on the dataset (what live T=0 gives)
    tau_sampled         expected speculative-SAMPLING tau at T=1 from the exact target rows, every family
                        (``evaluate``: sum_v min(p, q) per draft position, teacher-forced)
    live                ``speculate.run.run_speculate`` on validation prompts at each ``--temperatures``
                        (T=0: output must equal the target's greedy output; T=1: rejection sampling)

and, per live temperature, what a round costs and what decoding delivers (``speculate``'s report):

    round_cost          R: a round (draft + verify) over a plain decode step of the same target, both timed in
                        the same run by tapdraft's in-process decoding (batch 1, CPU, not vLLM)
    speedup             tau / R, the decode phase's expected speedup (break-even at tau = R)
    tokens_per_s        emitted tokens over speculate's decoding seconds; ``vs_target`` divides it by the target
                        decoding the same prompts alone (timed by the T=0 greedy check, same run)

The baseline in the same run is the same drafter after one step (tau_untrained). ``--recipes families`` is one
recipe per family (:data:`FAMILY_RECIPES`: DFlash, DFlash2, DSpark, LiLiCorr and LiLiCorr on DFlash2's
convolutions, EAGLE-3, MTP): before training, :func:`one_budget` checks that every recipe resolves to the same
training config (steps, tokens per batch, learning rate) and that the DFlash-backbone recipes share one block
size and depth, and raises where they do not. Ends with one table; writes benchmarks/results/NAME.

    python -m benchmarks.quality --quick              # tiny demo, few steps (CI-sized)
    python -m benchmarks.quality                      # full demo, recipe dflash_demo
    python -m benchmarks.quality --dataset DIR        # an already captured dataset (no live decoding)
    python -m benchmarks.quality --recipes dflash_demo,dflash2_demo,mtp_demo,mtp_lk_demo,mtp_lk_adaptive_demo \\
        --name quality_drafters.json                  # every family on the same budget
    python -m benchmarks.quality --target bpe --workdir bpe_work --steps 150 --set train.max_tokens=768 \\
        --recipes dflash_demo,dflash2_demo,mtp_demo,mtp_lk_demo --live 64 --name quality_bpe.json
                                                      # 8k-vocabulary target, T=0 and T=1 (~30 min, 1 thread)
    python -m benchmarks.quality --target bpe --workdir bpe_work --recipes families --steps 120 \\
        --set train.max_tokens=512 --live 32 --name quality_families.json
                                                      # every family, one budget: 44 min at load 7-22 on 2
                                                      # shared cores (the 49k-vocabulary SmolLM2 target, with
                                                      # a 6x larger vocabulary, was not tried for six families)
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import write_result
from tapdraft.train.config import load_run_config
from tapdraft.train.evaluate import evaluate
from tapdraft.train.loop import train

FAMILY_RECIPES = ("dflash_demo", "dflash2_demo", "dspark_demo", "lilicorr_demo", "lilicorr_conv_demo",
                  "eagle3_demo", "mtp_demo")
"""``--recipes families``: every drafter family in its demo-sized form, all on ``_demo_train``'s budget. The four
DFlash-backbone recipes share ``dflash_demo``'s drafter (2 layers, block 8) and add one head each, as ModelOpt's
matched comparison (PR #2342) keeps DFlash's backbone and block 16; EAGLE-3 drafts 4 steps, MTP one depth (what
vLLM serves)."""

SMALL_FAMILY_RECIPES = ("dflash_small", "dflash2_small", "dspark_small", "lilicorr_small", "eagle3_small", "mtp_small")
"""``--recipes families_small``: every drafter family in the form for a small target served on a CPU (SmolLM2-135M
class), all on ``dflash_small``'s budget; the four DFlash-backbone recipes share its one layer and block 4 (only
DFlash takes a draft vocabulary: the others score the whole vocabulary, as their serving code does)."""


def one_budget(runs: dict[str, Any]) -> dict[str, Any]:
    """The budget every run shares: the same training config, and for the recipes whose drafter has a block (the
    DFlash backbone) the same block size and depth. ``ValueError`` naming the recipe that differs, else the shared
    training config and block."""
    items = list(runs.items())
    if not items:
        raise ValueError("no recipes to compare")
    first, ref = items[0]
    for name, run in items[1:]:
        if dataclasses.replace(run.train, seed=ref.train.seed) != ref.train:  # seeds may differ (--seeds)
            diff = sorted(k for k, v in dataclasses.asdict(run.train).items()
                          if v != getattr(ref.train, k) and k != "seed")
            raise ValueError(f"recipe {name} trains on another budget than {first} ({', '.join(diff)} differ); "
                             f"give them one with --set train.KEY=VALUE or compare them in separate runs")
    blocks = {name: (run.drafter.block_size, run.drafter.num_layers) for name, run in items
              if hasattr(run.drafter, "block_size")}
    if len(set(blocks.values())) > 1:
        raise ValueError(f"the DFlash-backbone recipes differ in (block_size, num_layers): {blocks}; give them one "
                         "with --set drafter.block_size=N or compare them in separate runs")
    return {"train": dataclasses.asdict(ref.train),
            "block": None if not blocks else dict(zip(("block_size", "num_layers"), next(iter(blocks.values()))))}


def prepare(args: argparse.Namespace) -> dict[str, Any]:
    """The dataset (and, when built here, the target and held-out conversations for live decoding)."""
    if args.dataset:
        return {"dataset": Path(args.dataset), "target": None, "conversations": None, "info": {}}
    if args.target == "smollm2":  # the real text target: the stages benchmarks.real_speedup caches in --workdir
        from tapdraft.demo.real.speedup import SpeedupConfig, run_speedup, target_dir

        cfg = SpeedupConfig(target="text", train=args.train)
        run_speedup(args.workdir, cfg, stop_after="capture")
        work = Path(args.workdir).resolve()
        return {"dataset": work / "dataset", "target": target_dir(cfg), "conversations": work / "data" /
                "validation.jsonl", "info": {"train_conversations": cfg.train, "max_tokens": cfg.max_tokens}}
    if args.target == "bpe":
        from tapdraft.demo.bpe import prepare_bpe

        p = prepare_bpe(args.workdir, quick=args.quick, progress=False)
    else:
        from tapdraft.demo.data import prepare_demo

        p = prepare_demo(args.workdir, quick=args.quick, progress=False)
    return {"dataset": p.dataset, "target": p.target, "conversations": p.val_manifest, "info": p.info}


def live(target: Path, run_dir: Path, dataset: Path, conversations: Path, *, temperature: float, samples: int,
         max_new_tokens: int) -> dict[str, Any]:
    """Real speculative decoding with the live target (``tapdraft speculate``'s function)."""
    from tapdraft.speculate.run import SpeculateConfig, run_speculate

    t0 = time.perf_counter()
    r = run_speculate(SpeculateConfig(target=str(target), draft=str(run_dir), data=str(dataset),
                                      conversations=str(conversations), max_samples=samples,
                                      max_new_tokens=max_new_tokens, temperature=temperature), progress=False)
    cost, b = r["cost"], r["breakeven"]
    rnd = lambda x, n=4: None if x is None or x != x else round(x, n)  # noqa: E731 (alpha@k: null where unreached)
    out = {"tau": round(r["tau"], 4), "alpha": [rnd(a) for a in r["alpha"]],
           "samples": r["samples"], "tokens": r["tokens"], "rounds": r["rounds"],
           "drafts_per_round": r["drafts_per_round"], "seconds": round(time.perf_counter() - t0, 2),
           "round_ms": rnd(cost["round_seconds"] and 1e3 * cost["round_seconds"], 3),
           "plain_step_ms": rnd(cost["plain_step_seconds"] and 1e3 * cost["plain_step_seconds"], 3),
           "round_cost": rnd(cost["round_cost"]), "speedup": None if b is None else round(b["speedup"], 4),
           "tokens_per_s": rnd(r["tokens"] / r["seconds_speculative"] if r["seconds_speculative"] else None, 2)}
    if "matches_greedy" in r:
        out["matches_greedy"] = r["matches_greedy"]
        out["target_tokens_per_s"] = rnd(r["tokens"] / r["seconds_target_alone"]
                                         if r["seconds_target_alone"] else None, 2)
    return out


def recipe_config(recipe: str, steps: int, args: argparse.Namespace, seed: int | None = None) -> Any:
    sets = [f"max_steps={steps}", "progress=false", f"log_every={max(steps // 10, 1)}", "ckpt_every=100000",
            *args.overrides, *([f"seed={seed}"] if seed is not None else [])]
    return load_run_config(recipe, overrides=sets)


def run_label(recipe: str, seed: int | None) -> str:
    """A row's name: the recipe, and with --seeds its seed (``dflash_demo@1``)."""
    return recipe if seed is None else f"{recipe}@{seed}"


def run_recipe(label: str, run: Any, args: argparse.Namespace, prep: dict[str, Any], runs_root: Path,
               temperatures: list[float]) -> dict[str, Any]:
    recipe, _, seed = label.partition("@")  # run_label's two parts
    dataset, steps = str(prep["dataset"]), run.train.max_steps
    # runs with other --set overrides go to their own folders, so variants of one recipe can run at once
    tag = "-" + hashlib.sha256("\n".join(args.overrides).encode()).hexdigest()[:8] if args.overrides else ""
    tag += f"-seed{seed}" if seed else ""
    base_dir, run_dir = runs_root / f"{recipe}{tag}-step1", runs_root / f"{recipe}{tag}-{steps}"
    for d in (base_dir, run_dir):
        if d.exists():
            shutil.rmtree(d)
    train(run, dataset, base_dir, stop_at=1)
    base = evaluate(base_dir, dataset, split="validation", plot=False)
    t1 = time.perf_counter()
    summary = train(run, dataset, run_dir)
    train_s = time.perf_counter() - t1
    res = evaluate(run_dir, dataset, split="validation")
    row: dict[str, Any] = {
        "recipe": recipe, "seed": run.train.seed, "family": run.family, "steps": steps, "block_size": res["block_size"],
        "tau": round(res["tau"], 4), "tau_untrained": round(base["tau"], 4),
        "tau_gain": round(res["tau"] - base["tau"], 4),
        "tau_replayed": None if res.get("tau_replayed") is None else round(res["tau_replayed"], 4),
        "alpha": [round(a, 4) for a in res["alpha"]],
        "tau_sampled": None,
        "train_seconds": round(train_s, 2), "first_loss": summary["first_loss"], "final_loss": summary["final_loss"],
        "eval_samples": res["samples"], "eval_blocks": res["blocks"], "note": res["note"], "plot": res.get("plot"),
    }
    if res.get("tau_sampled") is not None:  # speculative SAMPLING at T=1 (what the LK loss optimises), every family
        row["tau_sampled"] = round(res["tau_sampled"], 4)
        row["alpha_sampled"] = [round(a, 4) for a in res["alpha_sampled"]]
    if prep["target"] is not None and args.live > 0:
        row["live"] = {f"T={t:g}": live(prep["target"], run_dir, prep["dataset"], prep["conversations"],
                                         temperature=t, samples=args.live, max_new_tokens=args.max_new_tokens)
                       for t in temperatures}
        target_tps = row["live"].get("T=0", {}).get("target_tokens_per_s")
        for v in row["live"].values():
            if target_tps and v["tokens_per_s"] is not None:
                v["vs_target"] = round(v["tokens_per_s"] / target_tps, 4)
    row["load_avg"] = [round(x, 2) for x in os.getloadavg()]
    return row


def _run_in_worker(recipe: str, run: Any, args: argparse.Namespace, prep: dict[str, Any], runs_root: Path,
                   temperatures: list[float]) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    return run_recipe(recipe, run, args, prep, runs_root, temperatures)


def run_all(runs: dict[str, Any], args: argparse.Namespace, prep: dict[str, Any], runs_root: Path,
            temperatures: list[float]) -> list[dict[str, Any]]:
    """Every recipe's row, in the given order: one after another, or ``--jobs`` at a time in worker processes of
    ``--threads`` each (each row records the load it ran under)."""
    if args.jobs <= 1:
        rows = []
        for recipe, run in runs.items():
            rows.append(run_recipe(recipe, run, args, prep, runs_root, temperatures))
            print(format_row(rows[-1]), flush=True)
        return rows
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_run_in_worker, recipe, run, args, prep, runs_root, temperatures): recipe
                   for recipe, run in runs.items()}
        done = {}
        for f in as_completed(futures):
            done[futures[f]] = f.result()
            print(format_row(done[futures[f]]), flush=True)
    return [done[r] for r in runs]


def format_row(row: dict[str, Any]) -> str:
    opt = lambda x: "    -" if x is None else f"{x:5.3f}"  # noqa: E731
    lv = row.get("live", {})
    live_s = "  ".join(f"live {k} {v['tau']:.3f}" + (f" ({v['matches_greedy']} exact)" if "matches_greedy" in v else "")
                       for k, v in lv.items())
    return (f"{run_label(row['recipe'], row.get('seed')):13s} B={row['block_size']:2d} steps={row['steps']:4d}  tau {row['tau']:.3f} "
            f"(untrained {row['tau_untrained']:.3f})  replayed {opt(row['tau_replayed'])}  sampled "
            f"{opt(row['tau_sampled'])}  {live_s}  train {row['train_seconds']:.0f}s  "
            f"loss {row['first_loss']:.3f} -> {row['final_loss']:.3f}")


def over_seeds(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per recipe, over its seeds' rows: the mean, min and max of the first two slots' acceptance, tau and tau
    replayed (the spread one seed cannot show)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for recipe in dict.fromkeys(r["recipe"] for r in rows):
        mine = [r for r in rows if r["recipe"] == recipe]
        figures = {"first_slot": [r["alpha"][0] for r in mine],
                   "second_slot": [r["alpha"][1] if len(r["alpha"]) > 1 else None for r in mine],
                   "tau": [r["tau"] for r in mine], "tau_replayed": [r["tau_replayed"] for r in mine]}
        out[recipe] = {k: {"mean": round(sum(v) / len(v), 4), "min": min(v), "max": max(v), "n": len(v)}
                       for k, v in figures.items() if v and None not in v}
    return out


def format_over_seeds(summary: dict[str, dict[str, dict[str, float]]]) -> str:
    lines = []
    for recipe, figs in summary.items():
        lines.append(f"{recipe:18s} " + "  ".join(f"{k} {v['mean']:.3f} [{v['min']:.3f}, {v['max']:.3f}]"
                                                  for k, v in figs.items()) + f"  (seeds: {next(iter(figs.values()))['n']})")
    return "\n".join(lines)


def table(rows: list[dict[str, Any]], temperatures: list[float]) -> str:
    """One line per recipe: offline tau, then per live temperature tau, round cost R, tau / R, tokens/s and the
    ratio to the target alone."""
    f = lambda x, w=5, p=3: f"{'-':>{w}}" if x is None else f"{x:{w}.{p}f}"  # noqa: E731
    head = f"{'recipe':18s} {'family':8s} K  train_s  tau   replay sampl"
    for t in temperatures:
        head += f" | T={t:g}: tau     R  tau/R tok/s  xtgt"
    lines = [head, "-" * len(head)]
    for r in rows:
        lv = r.get("live", {})
        k = next((v["drafts_per_round"] for v in lv.values()), None)
        line = (f"{run_label(r['recipe'], r.get('seed')):18s} {r['family']:8s} {'-' if k is None else k:<2} {r['train_seconds']:7.0f} "
                f"{r['tau']:5.3f} {f(r['tau_replayed'])} {f(r['tau_sampled'])}")
        for t in temperatures:
            v = lv.get(f"T={t:g}", {})
            line += (f" |      {f(v.get('tau'))} {f(v.get('round_cost'), 5, 2)} {f(v.get('speedup'), 5, 2)} "
                     f"{f(v.get('tokens_per_s'), 5, 0)} {f(v.get('vs_target'), 5, 2)}")
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", choices=("demo", "bpe", "smollm2"), default="demo",
                    help="demo: the demo SALM (54 words); bpe: Qwen3 causal LM with an 8k BPE vocabulary; smollm2: "
                    "SmolLM2-135M-Instruct from PyPI, its own replies through vLLM (benchmarks.real_speedup's stages)")
    ap.add_argument("--train", type=int, default=None,
                    help="--target smollm2: training conversations (default: benchmarks.real_speedup's 1,800)")
    ap.add_argument("--workdir", default="demo_work", help="target, data, dataset and runs cache")
    ap.add_argument("--quick", action="store_true", help="tiny target and data")
    ap.add_argument("--steps", type=int, default=None, help="training steps (default: the recipe's; 40 with --quick)")
    ap.add_argument("--recipes", default="dflash_demo",
                    help="comma-separated recipe names, or 'families' (demo-sized) or 'families_small' (a small "
                    "target on a CPU): one recipe per family on one budget")
    ap.add_argument("--dataset", default=None, help="use this already captured dataset (no target build, no live)")
    ap.add_argument("--temperatures", default="0,1", help="live decoding temperatures (comma-separated)")
    ap.add_argument("--live", type=int, default=64, help="validation conversations decoded live per temperature "
                    "(0: no live decoding)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="live decoding reply cap")
    ap.add_argument("--jobs", type=int, default=1, help="recipes trained and measured at once, each in its own "
                    "process of --threads threads (their round costs are then timed side by side)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 on a shared box; 2 threads fighting "
                    "other processes for 2 cores ran 4x slower here)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="extra key=value overrides")
    ap.add_argument("--seeds", default=None, help="comma-separated training seeds: every recipe trains once per "
                    "seed, and the results add each recipe's mean and range over them (default: the recipe's seed)")
    ap.add_argument("--name", default=None, help="results file name (default quality.json, quality_quick.json)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    temperatures = [float(t) for t in args.temperatures.split(",") if t.strip()]
    t0 = time.perf_counter()
    prep = prepare(args)
    prep_s = time.perf_counter() - t0
    torch.set_num_threads(args.threads)
    runs_root = Path(args.workdir) / "quality_runs"
    sets = {"families": FAMILY_RECIPES, "families_small": SMALL_FAMILY_RECIPES}
    names = list(sets.get(args.recipes, [r for r in args.recipes.split(",") if r]))
    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [None]
    runs = {run_label(r, seed): recipe_config(r, args.steps or (40 if args.quick else load_run_config(r).train.max_steps),
                                              args, seed)
            for r in names for seed in seeds}
    budget = one_budget(runs) if args.recipes in sets else None
    load_start = [round(x, 2) for x in os.getloadavg()]
    rows = run_all(runs, args, prep, runs_root, temperatures)
    print(table(rows, temperatures))
    seed_rows = over_seeds(rows) if args.seeds else None
    if seed_rows:
        print(format_over_seeds(seed_rows))
    from tapdraft.shards.reader import open_dataset

    cfg = open_dataset(str(prep["dataset"])).bundle().config
    name = args.name or ("quality_quick.json" if args.quick else "quality.json")
    return write_result(name, {
        "benchmark": "quality",
        "what": "tau of drafters on the target's validation split: offline greedy (uniform anchors; replayed "
                "round by round), offline sampled (exact target rows, every family), live speculative decoding "
                "at T=0 and T=1",
        "target": {"kind": "dataset" if args.dataset else args.target, "quick": args.quick,
                   "workdir": str(args.workdir), "dataset": str(prep["dataset"]),
                   "prepare_seconds": round(prep_s, 2), "build": prep["info"],
                   **{k: cfg.get(k) for k in ("hidden_size", "num_hidden_layers", "vocab_size")}},
        "budget": budget,
        "results": rows,
        "over_seeds": seed_rows,
        "table": table(rows, temperatures).splitlines(),
        "seconds": round(time.perf_counter() - t0, 1),
        "config": vars(args),
        "machine_extra": {"threads": args.threads, "jobs": args.jobs, "device": "cpu", "load_avg_start": load_start},
    })


if __name__ == "__main__":
    main()
