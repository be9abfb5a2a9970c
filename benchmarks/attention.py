"""Draft attention: dense SDPA bool mask vs FlexAttention BlockMask, forward on CPU.

One DFlash draft attention layer (context K/V prepended, the visibility rule of ``train.drafters.common.mask``)
at DFlash shapes: batch 1, context T, N blocks of B = 16, hidden 256 (4 heads x 64, 2 K/V heads).
Each variant times mask construction + forward (no grad), interleaved dense/flex, median of
``--pairs`` pairs after one warm-up each; ratio = flex / dense (below 1: flex faster). Also the
mask's memory: dense bool [1, 1, Q, T + Q] bytes vs the BlockMask's index tensors.

On CPU FlexAttention runs its unfused eager path (it materialises the scores), so this measures
the CPU fallback; the fused kernel (and the backward) needs a GPU, where the block sparsity pays.
Writes benchmarks/results/attention.json.    Run: python -m benchmarks.attention
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from benchmarks.common import write_result
from tapdraft.train.drafters.common.layers import Attention, RotaryEmbedding
from tapdraft.train.drafters.common.mask import dense_mask, flex_block_mask


def setup(T: int, N: int, B: int = 16, H: int = 256, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    att = Attention(H, 4, 2, 64).eval()
    rot = RotaryEmbedding(64, 1e6)
    anchors = torch.randperm(T - 1, generator=g)[:N].sort().values[None] + 1
    x = torch.randn(1, N * B, H, generator=g)
    ctx = torch.randn(1, T, H, generator=g)
    pos = (anchors[:, :, None] + torch.arange(B)).view(1, N * B)
    return att, rot, anchors, x, ctx, pos


def run(variant: str, att, rot, anchors, x, ctx, pos, T: int, B: int = 16) -> torch.Tensor:
    with torch.no_grad():
        mask = dense_mask(anchors, T, B) if variant == "dense" else flex_block_mask(anchors, T, B, 128)
        pre = att.project_kv(ctx, rot(torch.arange(T)[None]))
        return att(x, rot(pos), mask=mask, kv_prefix=pre)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
    rows = []
    for T, N in [(512, 32), (2048, 64), (2048, 128)]:
        case = setup(T, N)
        a, b = run("dense", *case, T), run("flex", *case, T)
        err = float((a - b).abs().max())
        times = {"dense": [], "flex": []}
        for _ in range(args.pairs):
            for v in ("dense", "flex"):
                t0 = time.perf_counter()
                run(v, *case, T)
                times[v].append(time.perf_counter() - t0)
        Q = N * 16
        bm = flex_block_mask(case[2], T, 16, 128)
        bm_bytes = sum(t.numel() * t.element_size() for t in (bm.kv_num_blocks, bm.kv_indices) if t is not None)
        if bm.full_kv_indices is not None:
            bm_bytes += bm.full_kv_indices.numel() * bm.full_kv_indices.element_size()
        row = {
            "T": T, "blocks": N, "block_size": 16, "Q": Q,
            "forward_s_median": {k: round(statistics.median(v), 5) for k, v in times.items()},
            "time_ratio_flex_over_dense": round(
                statistics.median([f / d for d, f in zip(times["dense"], times["flex"])]), 4),
            "mask_bytes": {"dense": Q * (T + Q), "flex_blockmask_approx": bm_bytes},
            "max_abs_diff": err,
            "pairs": args.pairs,
        }
        rows.append(row)
        print(f"T={T:5d} N={N:4d}  dense {row['forward_s_median']['dense']:.4f}s  flex "
              f"{row['forward_s_median']['flex']:.4f}s  flex/dense {row['time_ratio_flex_over_dense']:.3f}  "
              f"mask bytes dense {Q * (T + Q)} vs blockmask {bm_bytes}  max|diff| {err:.1e}", flush=True)
    write_result("attention.json", {
        "benchmark": "attention",
        "what": "DFlash draft attention forward (mask build + layer), dense SDPA vs FlexAttention eager, CPU",
        "results": rows,
        "config": vars(args),
        "machine_extra": {"threads": 1, "device": "cpu"},
    })


if __name__ == "__main__":
    main()
