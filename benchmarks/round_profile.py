"""Where a served round's time goes: the round cost R in vLLM, taken apart.

A drafter pays when tau > R, R being a speculative round's cost over a plain decode step. ``per_kind`` infers R from
two wall clocks (tau / speedup); this serves the same requests alone and with an export under Python's profiler
(vLLM's engine in one process) and reads the engine's own steps: per step, the target's forward, the proposer (the
drafter's forward, its head, its sampling) and the rest (the target's logits, sampling and verification, input
preparation). Alternated ``--pairs`` times (alone, spec, spec, alone, ...); the medians are the figures.

    python -m benchmarks.round_profile --target general --workdir general/n1500 --run dflash_small \\
        --conversations general/n1500/kinds/other.jsonl --requests 4

R from the profile counts only the engine's steps (``execute_model`` + ``sample_tokens``); R from the wall clock is
the same runs' seconds per round over seconds per token. The profiler slows Python code and not torch's kernels, so
the Python-heavy parts (the proposer's bookkeeping, input preparation) read a little high on both sides.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks.common import write_result
from tapdraft.demo.real.speedup import LAYOUT_HELP, SpeedupConfig, served_method, stage_export, target_dir

RUNNER = "vllm/v1/worker/gpu_model_runner.py"
PARTS = {"execute": f"{RUNNER}:execute_model", "sample": f"{RUNNER}:sample_tokens",
         "target_forward": f"{RUNNER}:_model_forward", "proposer": f"{RUNNER}:propose_draft_token_ids"}
"""The engine's functions per step in vLLM's V1 model runner (the CPU runner inherits them): a step is
``execute_model`` (inputs, the target's forward and logits) then ``sample_tokens`` (sampling, verification and,
with a drafter, the proposer)."""


def step_parts(profile: dict[str, dict[str, float]]) -> dict[str, float]:
    """Milliseconds per engine step: the whole step, the target's forward, the proposer, the rest."""
    steps = profile["execute"]["calls"]
    if not steps:
        raise ValueError("the profile holds no engine step: is this vLLM's V1 runner (benchmarks.round_profile.PARTS)?")
    ms = {k: 1e3 * v["seconds"] / steps for k, v in profile.items()}
    step = ms["execute"] + ms["sample"]
    return {"steps": steps, "step_ms": step, "target_forward_ms": ms["target_forward"], "proposer_ms": ms["proposer"],
            "rest_ms": step - ms["target_forward"] - ms["proposer"]}


def run_figures(res: dict[str, Any]) -> dict[str, Any]:
    """One served run: its per-step parts, tokens, rounds (verifying steps) and wall seconds."""
    tokens = sum(len(o["token_ids"]) for o in res["outputs"])
    spec = [o["spec"]["per_step_accepted"] for o in res["outputs"] if o["spec"]]
    return {**step_parts(res["profile"]), "tokens": tokens, "rounds": sum(map(len, spec)),
            "accepted": sum(map(sum, spec)), "seconds": res["seconds"][-1]}


def round_cost(alone: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    """One pair: R from the profile (a round's step over a plain step) with its parts in plain steps, R from the wall
    clock, vLLM's tau and the speedup."""
    base = alone["step_ms"]
    tau = 1 + spec["accepted"] / max(spec["rounds"], 1)  # vLLM's acceptance length
    return {"R": spec["step_ms"] / base,
            "verify_extra": (spec["target_forward_ms"] - alone["target_forward_ms"]) / base,
            "proposer": spec["proposer_ms"] / base,
            "rest_extra": (spec["rest_ms"] - alone["rest_ms"]) / base,
            "R_wall": (spec["seconds"] / max(spec["rounds"], 1)) / (alone["seconds"] / alone["tokens"]),
            "tau": tau, "speedup": alone["seconds"] / spec["seconds"] * spec["tokens"] / alone["tokens"]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", choices=["text", "general", "self", "speech", "assistant"], default="general")
    ap.add_argument("--workdir", required=True, type=Path, help="a benchmarks.real_speedup work directory (exports/RUN)")
    ap.add_argument("--run", required=True, help="the run's name in WORKDIR (exports/RUN, exported from runs/RUN if not yet)")
    ap.add_argument("--conversations", required=True, type=Path, help="JSONL conversations to serve (their prompts)")
    ap.add_argument("--requests", type=int, default=4, help="requests served a run")
    ap.add_argument("--k", type=int, default=3, help="drafts a round")
    ap.add_argument("--layout", default=None, help=LAYOUT_HELP + ", for a run not yet exported")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--engine-threads", type=int, default=1)
    ap.add_argument("--name", default=None)
    a = ap.parse_args(argv)
    from tapdraft.engines.serving import engine_venv, serve_vllm, vllm_requests

    work = a.workdir.resolve()
    cfg = SpeedupConfig(target=a.target, run=a.run, layout=a.layout)
    try:
        export = stage_export(work, cfg)
    except FileNotFoundError as e:
        raise SystemExit(f"error: {e}") from None
    target = target_dir(cfg)
    requests, _, _ = vllm_requests(target, a.conversations, a.requests, a.conversations.parent / "audio")
    method = served_method(json.loads((export / "config.json").read_text()).get("tapdraft", {}), "dflash")
    job = {"target": str(target), "requests": requests, "max_tokens": a.max_tokens, "max_model_len": a.max_model_len,
           "warmup": 1, "repeats": 1, "profile": PARTS}
    spec_job = {**job, "speculative": {"method": method, "model": str(export), "num_speculative_tokens": a.k}}
    venv = engine_venv("vllm")
    runs: dict[str, list[dict[str, Any]]] = {"alone": [], "spec": []}
    for p in range(a.pairs):
        for name in (("alone", "spec") if p % 2 == 0 else ("spec", "alone")):
            res = serve_vllm(venv, spec_job if name == "spec" else job, work / "vllm" / "profile", timeout=3600,
                             threads=a.engine_threads)
            runs[name].append(run_figures(res))
            r = runs[name][-1]
            print(f"pair {p + 1}/{a.pairs} {name}: {r['step_ms']:.1f} ms a step (target forward "
                  f"{r['target_forward_ms']:.1f}, proposer {r['proposer_ms']:.1f}), {r['tokens'] / r['seconds']:.1f} "
                  f"tokens/s", flush=True)
    pairs = [round_cost(al, sp) for al, sp in zip(runs["alone"], runs["spec"])]
    figures = {k: statistics.median(p[k] for p in pairs) for k in pairs[0]}
    print(f"R {figures['R']:.3f} (wall {figures['R_wall']:.3f}) = 1 + verify {figures['verify_extra']:+.3f} + proposer "
          f"{figures['proposer']:+.3f} + rest {figures['rest_extra']:+.3f}; tau {figures['tau']:.3f}, speedup "
          f"{figures['speedup']:.3f}x; tau for 1.4x: {1.4 * figures['R']:.2f}")
    write_result(a.name or f"round_profile_{a.target}_{a.run}.json",
                 {"target": a.target, "run": a.run, "method": method, "k": a.k, "requests": a.requests,
                  "conversations": str(a.conversations), "max_model_len": a.max_model_len, "max_tokens": a.max_tokens,
                  "pairs": pairs, "runs": runs, **figures, "tau_for_1.4x": 1.4 * figures["R"],
                  "machine_extra": {"engine_threads": a.engine_threads}})


if __name__ == "__main__":
    main()
