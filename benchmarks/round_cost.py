"""Does tau / R predict the speedup? R is a round's cost (drafting + the verifying forward) over a plain decode
step, measured by ``tapdraft speculate`` in tapdraft's own engine (transformers, batch 1); break-even lies at
tau = R. Per repeat, on the demo chain (its SALM target and a DFlash drafter, ``demo.run``): live tau, R, the
predicted speedup tau / R, and the measured one, the target alone's wall time over speculative decoding's on the
same conversations (each decoded both ways in turn, so load hits both alike; both include one prefill per
conversation, which the prediction leaves out).

    python -m benchmarks.round_cost --workdir demo_work --samples 32 --repeats 3
    python -m benchmarks.round_cost --workdir /tmp/q --quick     # seconds; the figures then mean little

The ratio ``predicted / measured`` is the figure: near 1 means the break-even line ``speculate`` prints can be
trusted on this engine. It says nothing about vLLM's R (docs/speedup.md).

Measured (results/round_cost_demo.json: the full demo, 32 validation conversations, 5 repeats, 1 thread on 2
shared CPU cores at load ~6.5): tau 4.880, R 2.00 (1.89-2.13; a round 14-19 ms, a plain step 7-9 ms), predicted
2.44x, measured 1.92x (predicted / measured 1.27). The gap is the prefill: the demo's replies are 8.6 tokens, and
each conversation spends ~11 ms outside the timed steps on either side (1.4 plain steps), which the speedup of
the decode phase does not cover. R from medians moved more (2.01-2.46 predicted) than from means.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from statistics import median

from benchmarks.common import write_result
from tapdraft.demo.run import run_demo
from tapdraft.demo.data import one_thread
from tapdraft.speculate.run import SpeculateConfig, run_speculate


def measure(workdir: Path, *, quick: bool, samples: int, repeats: int, max_new_tokens: int) -> dict:
    demo = run_demo(workdir, quick=quick, progress=False, live_samples=1)
    rows = []
    with one_thread():
        for _ in range(repeats):
            r = run_speculate(SpeculateConfig(target=demo["target"], draft=demo["run"], data=demo["dataset"],
                                              conversations=str(workdir / "data" / "validation.jsonl"),
                                              max_samples=samples, max_new_tokens=max_new_tokens), progress=False)
            c, n = r["cost"], r["samples"]
            rounds_s = sum(t for conv in r["conversations"] for t in conv["round_seconds"])
            # wall time outside the timed steps, per conversation: the prefill, the session and proposer set-up
            outside = {"speculative_ms": 1e3 * (r["seconds_speculative"] - rounds_s) / n,
                       "target_alone_ms": 1e3 * (r["seconds_target_alone"]
                                                 - c["plain_step_seconds"] * c["plain_steps_timed"]) / n}
            rows.append({"tau": r["tau"], "round_cost": c["round_cost"], "round_ms": 1e3 * c["round_seconds"],
                         "plain_step_ms": 1e3 * c["plain_step_seconds"], "predicted": r["tau"] / c["round_cost"],
                         "predicted_median": r["tau"] * c["plain_step_seconds_median"] / c["round_seconds_median"],
                         "measured": r["seconds_target_alone"] / r["seconds_speculative"],
                         "outside_steps_per_conversation": outside, "samples": n, "tokens": r["tokens"],
                         "drafts_per_round": r["drafts_per_round"]})
    keys = ("tau", "round_cost", "predicted", "predicted_median", "measured")
    med = {k: median(row[k] for row in rows) for k in keys}
    med["predicted_over_measured"] = med["predicted"] / med["measured"]
    return {"rows": rows, "median": med, "quick": quick, "max_new_tokens": max_new_tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, required=True, help="The demo's work directory (reused when present).")
    ap.add_argument("--quick", action="store_true", help="The quick demo (seconds; the numbers mean little).")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    args = ap.parse_args()
    res = measure(args.workdir, quick=args.quick, samples=args.samples, repeats=args.repeats,
                  max_new_tokens=args.max_new_tokens)
    print(f"{'repeat':>6} {'tau':>6} {'R':>6} {'round ms':>9} {'step ms':>8} {'tau/R':>6} {'medians':>7} "
          f"{'measured':>8} {'outside ms (spec / alone)':>26}")
    for i, row in enumerate(res["rows"]):
        out = row["outside_steps_per_conversation"]
        print(f"{i:>6} {row['tau']:>6.3f} {row['round_cost']:>6.2f} {row['round_ms']:>9.2f} "
              f"{row['plain_step_ms']:>8.2f} {row['predicted']:>6.2f} {row['predicted_median']:>7.2f} "
              f"{row['measured']:>7.2f}x {out['speculative_ms']:>12.1f} / {out['target_alone_ms']:.1f}")
    m = res["median"]
    print(f"median: tau {m['tau']:.3f}, R {m['round_cost']:.2f}, predicted {m['predicted']:.2f}x (from medians "
          f"{m['predicted_median']:.2f}x), measured "
          f"{m['measured']:.2f}x (predicted / measured {m['predicted_over_measured']:.2f})")
    write_result(f"round_cost_demo{'_quick' if args.quick else ''}.json",
                 {**res, "machine_extra": {"threads": 1, "device": "cpu"}})


if __name__ == "__main__":
    main()
