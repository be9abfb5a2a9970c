"""Where tapdraft's step goes on a ``benchmarks.peers`` row: the same side (``TapdraftSide``: the row's recipe, data,
precision and one torch thread, as the row times it), warm-up steps, then ``torch.profiler`` over ``--steps`` steps,
the ops ranked by self CPU time and grouped into what any trainer of the row must do (the frozen head's matmuls: the
student's logits, the teacher's, the input gradient back through the head) and the rest (the softmax and divergence
passes over the [rows, V] logits, the draft itself, the optimizer).

    python -m benchmarks.peer_profile --row dflash-kd [--precision bfloat16] [--steps 3] [--name NAME.json]

A row's head matmuls are a floor both sides share: when they are most of the step, no loss-side work can make one
trainer much faster than the other at equal precision (docs/performance.md).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import write_result
from benchmarks.peers import PRECISIONS, ROW_SPECS, SHAPE, TapdraftSide, build_dataset
from benchmarks.shapes import SHAPES

HEAD_OPS = ("aten::mm", "aten::addmm", "aten::matmul", "aten::linear", "aten::bmm")
"""Matmul ops; those whose [*, V] side has the vocabulary's width are the frozen head's."""


def profile_side(side: TapdraftSide, steps: int, vocab: int) -> dict[str, Any]:
    """Self CPU time per op over ``steps`` steps, and the share of the head's matmuls (an op whose input shapes
    hold the vocabulary's width)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            side.step()
    ops: dict[str, float] = {}
    head = 0.0
    for e in prof.key_averages(group_by_input_shape=True):
        us = e.self_cpu_time_total
        ops[e.key] = ops.get(e.key, 0.0) + us
        if e.key in HEAD_OPS and any(vocab in s for s in e.input_shapes if isinstance(s, list)):
            head += us
    total = sum(ops.values())
    top = sorted(ops.items(), key=lambda kv: -kv[1])[:15]
    return {"steps": steps, "s_per_step": total / 1e6 / steps, "head_matmul_share": head / total,
            "head_matmul_s_per_step": head / 1e6 / steps,
            "top_ops": [{"op": k, "s_per_step": v / 1e6 / steps, "share": v / total} for k, v in top]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--row", default="dflash-kd", choices=sorted(ROW_SPECS))
    ap.add_argument("--precision", default="bfloat16", choices=PRECISIONS)
    ap.add_argument("--steps", type=int, default=3, help="profiled steps (after --warmup)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--anchors", type=int, default=32)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--workdir", default="/tmp/tapdraft-peers")
    ap.add_argument("--name", default=None, help="result file in benchmarks/results/ (none: print only)")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 1:
        raise SystemExit("--steps and --warmup must be at least 1")
    torch.set_num_threads(1)  # as the row times it
    row = ROW_SPECS[args.row]
    data = build_dataset(Path(args.workdir) / f"dataset-{row.family}-{args.samples}+0x{args.tokens}",
                         samples=args.samples, tokens=args.tokens, family=row.family)
    vocab = SHAPES[SHAPE].vocab
    side = TapdraftSide(data, row, anchors=args.anchors, samples=args.samples, tokens=args.tokens,
                        mask_token_id=vocab - 1, precision=args.precision)  # the samples' ids stop below it
    for _ in range(args.warmup):
        side.step()
    load = os.getloadavg()[0]
    prof = profile_side(side, args.steps, vocab)
    out = {"benchmark": "peer_profile", "row": args.row, "precision": args.precision, "dtypes": side.dtypes(),
           "vocab_size": vocab, "load_avg_1m": load, **prof}
    print(f"{args.row} at {args.precision}: {prof['s_per_step']:.2f} s a step profiled (load {load:.1f}); the frozen "
          f"head's matmuls {prof['head_matmul_s_per_step']:.2f} s ({100 * prof['head_matmul_share']:.0f}%)")
    for o in prof["top_ops"]:
        print(f"  {o['op']:<40} {o['s_per_step']:.3f} s  {100 * o['share']:.1f}%")
    if args.name:
        write_result(args.name, out)
    return out


if __name__ == "__main__":
    main()
