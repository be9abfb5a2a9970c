"""The loss levers of issue 29 at SmolLM2's head (V = 49,152, H = 576), each A vs B interleaved on the same rows.

- ``eagle3_kl``: EAGLE-3's KL loss forward + backward on R rows through its trained head and the exact teacher:
  A = autograd through activation-checkpointed chunks with TV (the path ``lk`` keeps), B = the fused
  ``train.drafters.common.losses.trained_head_losses`` (gradients for rows and head in the forward).
- ``dflash_ce0``: DFlash's fused loss with the exact KD teacher and ``ce_weight: 0``: A = the CE gradient computed
  anyway, B = skipped (``ce_grad=False``).
- ``dspark``: DSpark's CE + L1 on the Markov-corrected logits (rank 256) against a stored top-64 teacher, at its
  weights 0.1 / 0.9: A = autograd through activation-checkpointed chunks (DSpark's loss before), B = the fused
  ``train.drafters.dspark.loss.dspark_row_losses`` (one gradient a chunk for rows, Markov embeddings and markov_w2).

Random weights and rows (time does not depend on their values); one thread; the table gives medians and the ratio.

    python -m benchmarks.fused_head [--rows 512] [--pairs 3] [--cases dspark]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any, Callable

import torch

from benchmarks.common import write_result
from tapdraft.shards.head import HeadSpec
from tapdraft.train.drafters.common.chunks import map_row_chunks
from tapdraft.shards.head import project
from tapdraft.train.drafters.common.divergences import kl_tv_full, kl_tv_topk
from tapdraft.train.drafters.common.losses import row_losses, trained_head_losses
from tapdraft.train.drafters.common.teacher import ExactTeacher, TopKTeacher
from tapdraft.train.drafters.dspark.loss import dspark_row_losses

V, H = 49_152, 576


RANK, TOPK = 256, 64


def _inputs(rows: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    lp = torch.log_softmax(torch.randn(rows, V, generator=g), -1)
    ids = lp.topk(TOPK, -1).indices
    return {"x": torch.randn(rows, H, generator=g), "W": torch.randn(V, H, generator=g) * 0.05,
            "Wt": torch.randn(V, H, generator=g) * 0.05, "th": torch.randn(rows, H, generator=g),
            "nw": torch.ones(H), "y": torch.randint(0, V, (rows,), generator=g),
            "e": torch.randn(rows, RANK, generator=g), "W2": torch.randn(V, RANK, generator=g) * 0.02,
            "topk": TopKTeacher(ids, lp.gather(-1, ids)), "w": torch.rand(rows, generator=g)}


def dspark_checkpointed(a: dict[str, Any], chunk: int) -> None:
    x, e, W2 = (a[k].clone().requires_grad_(True) for k in ("x", "e", "W2"))
    t = a["topk"]

    def rows(xc, ec, yc, ic, lc):
        z = project(xc, a["W"], HeadSpec()) + ec @ W2.T
        return torch.nn.functional.cross_entropy(z.float(), yc, reduction="none"), 2.0 * kl_tv_topk(ic, lc, z)[1]

    ce, l1 = map_row_chunks(rows, [x, e, a["y"], t.ids_Rk, t.logprobs_Rk], chunk)
    w = a["w"]
    (0.1 * (w * ce).sum() / w.sum() + 0.9 * (w * l1).sum() / w.sum()).backward()


def dspark_fused(a: dict[str, Any], chunk: int) -> None:
    x, e, W2 = (a[k].clone().requires_grad_(True) for k in ("x", "e", "W2"))
    w = a["w"]
    ce, l1, _, _, _ = dspark_row_losses(x, e, W2, a["W"], a["y"], w, w, a["topk"], chunk_rows=chunk,
                                        weights=(0.1, 0.9))
    (0.1 * ce / w.sum() + 0.9 * l1 / w.sum()).backward()


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
    "dspark": ("checkpointed autograd", dspark_checkpointed, "fused", dspark_fused),
}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--name", default="fused_head.json")
    args = ap.parse_args(argv)
    cases = args.cases.split(",")
    if unknown := set(cases) - set(CASES):
        ap.error(f"unknown case(s) {sorted(unknown)}; choose from {', '.join(CASES)}")
    torch.set_num_threads(1)
    a = _inputs(args.rows)
    out = []
    for name in cases:
        a_name, fa, b_name, fb = CASES[name]
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
    write_result(args.name, doc)
    return doc


if __name__ == "__main__":
    main()
