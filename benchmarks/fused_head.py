"""The loss levers of issue 29 at SmolLM2's head (V = 49,152, H = 576), each A vs B interleaved on the same rows.

- ``eagle3_kl``: EAGLE-3's KL loss forward + backward on R rows through its trained head and the exact teacher:
  A = autograd through activation-checkpointed chunks with TV (the path ``lk`` keeps), B = the fused
  ``train.drafters.common.losses.trained_head_losses`` (gradients for rows and head in the forward).
- ``dflash_ce0``: DFlash's fused loss with the exact KD teacher and ``ce_weight: 0``: A = the CE gradient computed
  anyway, B = skipped (``ce_grad=False``).

Random weights and rows (time does not depend on their values); one thread; the table gives medians and the ratio.

    python -m benchmarks.fused_head [--rows 512] [--pairs 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any, Callable

import torch

from benchmarks.common import write_result
from shards.head import HeadSpec
from train.drafters.common.chunks import map_row_chunks
from train.drafters.common.divergences import kl_tv_full
from train.drafters.common.losses import row_losses, trained_head_losses
from train.drafters.common.teacher import ExactTeacher

V, H = 49_152, 576


def _inputs(rows: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {"x": torch.randn(rows, H, generator=g), "W": torch.randn(V, H, generator=g) * 0.05,
            "Wt": torch.randn(V, H, generator=g) * 0.05, "th": torch.randn(rows, H, generator=g),
            "nw": torch.ones(H), "y": torch.randint(0, V, (rows,), generator=g)}


def eagle3_checkpointed(a: dict[str, Any], chunk: int) -> None:
    x, W = a["x"].clone().requires_grad_(True), a["W"].clone().requires_grad_(True)
    teacher = ExactTeacher(a["th"], a["nw"], a["Wt"], HeadSpec())

    def div(xc, tc):
        z = xc @ W.T
        return kl_tv_full(ExactTeacher(tc, a["nw"], a["Wt"], HeadSpec()).logits(), z)

    kl, tv = map_row_chunks(div, [x, teacher.hidden_RH], chunk)
    kl.sum().backward()


def eagle3_fused(a: dict[str, Any], chunk: int) -> None:
    x, W = a["x"].clone().requires_grad_(True), a["W"].clone().requires_grad_(True)
    teacher = ExactTeacher(a["th"], a["nw"], a["Wt"], HeadSpec())
    loss, _, _, _ = trained_head_losses(x, W, torch.ones(x.shape[0]), teacher=teacher, chunk_rows=chunk)
    loss.backward()


def dflash_ce0(ce_grad: bool) -> Callable[[dict[str, Any], int], None]:
    def run(a: dict[str, Any], chunk: int) -> None:
        x = a["x"].clone().requires_grad_(True)
        teacher = ExactTeacher(a["th"], a["nw"], a["W"], HeadSpec())
        ce, _, kd = row_losses(x, a["y"], a["W"], chunk_rows=chunk, teacher=teacher, ce_grad=ce_grad)
        (0.0 * ce.sum() + kd.sum()).backward()
    return run


CASES = {
    "eagle3_kl": ("checkpointed autograd + TV", eagle3_checkpointed, "fused", eagle3_fused),
    "dflash_ce0": ("CE gradient computed", dflash_ce0(True), "skipped (ce_weight 0)", dflash_ce0(False)),
}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--pairs", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    a = _inputs(args.rows)
    out = []
    for name, (a_name, fa, b_name, fb) in CASES.items():
        times: dict[str, list[float]] = {"A": [], "B": []}
        loads = []
        fa(a, args.chunk), fb(a, args.chunk)  # warm
        for _ in range(args.pairs):
            loads.append(os.getloadavg()[0])
            for side, f in (("A", fa), ("B", fb)):
                t0 = time.perf_counter()
                f(a, args.chunk)
                times[side].append(time.perf_counter() - t0)
        ma, mb = statistics.median(times["A"]), statistics.median(times["B"])
        out.append({"case": name, "A": a_name, "B": b_name, "A_s": round(ma, 3), "B_s": round(mb, 3),
                    "speedup": round(ma / mb, 2), "times": times, "load_1min": loads})
        print(f"{name:<11} A {a_name}: {ma:.2f} s  B {b_name}: {mb:.2f} s  {ma / mb:.2f}x  (load {loads})", flush=True)
    doc = {"benchmark": "fused_head", "vocab": V, "hidden": H, "rows": args.rows, "chunk_rows": args.chunk,
           "pairs": args.pairs, "results": out}
    write_result("fused_head.json", doc)
    return doc


if __name__ == "__main__":
    main()
