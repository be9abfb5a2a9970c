"""What would move a ``benchmarks.peers`` row, measured on tapdraft's side alone (the row's recipe, data and
precision, one torch thread), each variant interleaved step by step with the default in one process:

    loss-dtype   the loss's passes over the [rows, V] logits in the logits' dtype, as ModelOpt computes them (the
                 fp32 upcast of ``shards.head.scale_logits`` left out for the run; not a tapdraft setting): s/step
    torch-init   the trainable linears re-made with torch's default init (ModelOpt's) instead of tapdraft's: the
                 training loss after ``--steps`` steps and the held-out loss after them

Plus the elementwise passes themselves on one [rows, V] tensor in bf16 and fp32 (log_softmax, exp, the cast).

    python -m benchmarks.peer_variants --row dflash-ce [--steps 8] [--name NAME.json]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

import tapdraft.shards.head as head_math
from benchmarks.common import write_result
from benchmarks.peers import PRECISIONS, ROW_SPECS, SHAPE, TapdraftSide, build_dataset
from benchmarks.shapes import SHAPES
from tapdraft.train.loop import make_optimizer


@contextlib.contextmanager
def logits_dtype_loss() -> Iterator[None]:
    """The loss computed in the logits' dtype: ``scale_logits`` keeps an unscaled, uncapped head's logits as they
    come from the matmul (bf16 at bf16) for as long as the block runs."""
    upcast = head_math.scale_logits

    def keep(z: torch.Tensor, spec: head_math.HeadSpec) -> torch.Tensor:
        return z if spec.logits_scaling == 1.0 and spec.final_logit_softcap is None else upcast(z, spec)

    head_math.scale_logits = keep
    try:
        yield
    finally:
        head_math.scale_logits = upcast


def torch_init(side: TapdraftSide) -> None:
    """Re-make the trainable linears with torch's default init, and a fresh optimizer over them."""
    for m in side.model.modules():
        if isinstance(m, torch.nn.Linear) and m.weight.requires_grad:
            m.reset_parameters()
    side.opt, _ = make_optimizer(side.model, side.run.train)
    for g in side.opt.param_groups:  # as TapdraftSide: the schedule's warm-up step 0 undone
        g["lr"] = side.run.train.lr


def pass_seconds(rows: int, vocab: int, reps: int = 4) -> dict[str, float]:
    """Seconds of the loss's elementwise passes over one [rows, vocab] tensor, the best of ``reps``."""
    z32 = torch.randn(rows, vocab)
    z16 = z32.to(torch.bfloat16)

    def best(f: Callable[[], Any]) -> float:
        f()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            f()
            times.append(time.perf_counter() - t0)
        return min(times)

    return {"log_softmax_bf16": best(lambda: torch.log_softmax(z16, -1)),
            "log_softmax_fp32": best(lambda: torch.log_softmax(z32, -1)),
            "exp_bf16": best(lambda: z16.exp()), "exp_fp32": best(lambda: z32.exp()),
            "cast_bf16_to_fp32": best(lambda: z16.float()), "cast_fp32_to_bf16": best(lambda: z32.to(torch.bfloat16))}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--row", default="dflash-ce", choices=sorted(ROW_SPECS))
    ap.add_argument("--precision", default="bfloat16", choices=PRECISIONS)
    ap.add_argument("--steps", type=int, default=8, help="training steps per side (the peers' rows: 1 + 7)")
    ap.add_argument("--workdir", default="/tmp/tapdraft-peers")
    ap.add_argument("--name", default=None, help="result file in benchmarks/results/ (none: print only)")
    a = ap.parse_args(argv)
    if a.steps < 2:
        raise SystemExit("--steps must be at least 2 (the first is not timed)")
    torch.set_num_threads(1)  # as the row times it
    row, vocab = ROW_SPECS[a.row], SHAPES[SHAPE].vocab
    data = build_dataset(Path(a.workdir) / f"dataset-{row.family}-2+2x512", samples=4, tokens=512, family=row.family)

    def side() -> TapdraftSide:
        torch.manual_seed(0)
        return TapdraftSide(data, row, anchors=32, samples=2, tokens=512, mask_token_id=vocab - 1,
                            precision=a.precision, heldout=2)

    sides = {"default": side(), "loss-dtype": side(), "torch-init": side()}
    torch.manual_seed(0)
    torch_init(sides["torch-init"])
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in sides}
    load = os.getloadavg()[0]
    for _ in range(a.steps):
        for name, s in sides.items():
            with logits_dtype_loss() if name == "loss-dtype" else contextlib.nullcontext():
                runs[name].append(s.step())
    out: dict[str, Any] = {"benchmark": "peer_variants", "row": a.row, "precision": a.precision, "steps": a.steps,
                           "load_avg_1m": [load, os.getloadavg()[0]]}
    for name, s in sides.items():
        with logits_dtype_loss() if name == "loss-dtype" else contextlib.nullcontext():
            held = s.heldout_loss()["loss"]
        timed = [r["s"] for r in runs[name][1:]]
        out[name] = {"s_per_step": statistics.median(timed), "runs_s": timed, "loss_after": runs[name][-1]["loss"],
                     "heldout_loss": held}
        print(f"{a.row} {name:>10}: {out[name]['s_per_step']:.2f} s a step, loss after {a.steps} steps "
              f"{out[name]['loss_after']:.4f}, held-out {held:.4f}")
    ratios = [d["s"] / v["s"] for d, v in zip(runs["default"][1:], runs["loss-dtype"][1:])]
    out["loss_dtype_speedup"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    rows = int(runs["default"][-1]["rows"])
    out["passes"] = {"rows": rows, "vocab": vocab, **pass_seconds(rows, vocab)}
    print(f"the loss in the logits' dtype: {out['loss_dtype_speedup']['median']:.2f}x the default's step "
          f"({min(ratios):.2f}-{max(ratios):.2f}); passes over [{rows}, {vocab}]: "
          + ", ".join(f"{k} {v:.3f} s" for k, v in out["passes"].items() if k not in ("rows", "vocab")))
    if a.name:
        write_result(a.name, out)
    return out


if __name__ == "__main__":
    main()
