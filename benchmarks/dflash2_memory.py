"""DFlash2's training step at a real vocabulary: peak memory with dense [rows, V] logits vs vocabulary-sized chunks.

DFlash2's loss reads every loss row's full draft logits (CE, KD and the path selector's top-16). The
``dflash2`` recipe's anchor budget (4096 anchors x 15 slots = 61,440 rows) at V = 151,936 would hold
61,440 x 151,936 x 4 B = 37.3 GB per float32 [rows, V] tensor. The step now builds them one
checkpointed chunk of rows at a time, the chunk sized from the vocabulary (``logits_budget_mib``).

Both variants run the SAME step (DFlash2 forward -> the loss-normalisation rule -> backward) on the
same synthetic batch: ``dense`` = one chunk (the old behaviour), ``chunked`` = the recipe's default
sizing. Shape: V = 151,936 (Qwen3), tiny H (default 64), one sequence of T = 1024, B = 16, anchors
N in {16, 64} (R = 15 N rows), float32 CPU, 1 thread. Peak memory: each variant runs once in a forked
child; the figure is the child's peak RSS minus its RSS just before the step. Time: one step per
variant, interleaved, median of ``--pairs``. Ratio = chunked / dense. Writes
benchmarks/results/dflash2_memory.json.

    python -m benchmarks.dflash2_memory
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from benchmarks.common import peak_memory_growth, write_result
from tapdraft.shards.bundle import TargetBundle
from tapdraft.shards.schema import Layout
from tapdraft.train.drafters.base import combine_terms
from tapdraft.train.drafters.dflash2.config import DFlash2Config
from tapdraft.train.drafters.dflash2.model import DFlash2Drafter

V = 151_936


def make(H: int, T: int, anchors: int, chunk: int, budget: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    cfg = {"model_type": "qwen3", "hidden_size": H, "num_hidden_layers": 4, "vocab_size": V, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": H // 4, "intermediate_size": 2 * H, "rope_theta": 1e6,
           "rms_norm_eps": 1e-6, "logits_scaling": 1.0, "bos_token_id": None, "eos_token_id": 1, "pad_token_id": 0}
    bundle = TargetBundle(config=cfg, audio={}, chat_template=None, embed_tokens=torch.randn(V, H, generator=g) * 0.02,
                          norm_weight=torch.ones(H), lm_head=torch.randn(V, H, generator=g) * 0.02)
    layout = Layout(hidden_size=H, num_layers=4, tap_ids=(1, 2), top_k=0, audio_token_id=3)
    torch.manual_seed(seed)
    model = DFlash2Drafter.build(DFlash2Config(num_layers=1, block_size=16, target_layer_ids=(1, 2),
                                               num_anchors=anchors, max_total_anchors=anchors, chunk_rows=chunk,
                                               logits_budget_mib=budget), bundle, layout)
    batch = {"input_ids": torch.randint(8, V, (1, T), generator=g), "loss_mask": torch.ones(1, T, dtype=torch.bool),
             "is_audio": torch.zeros(1, T, dtype=torch.bool), "lengths": torch.tensor([T]),
             "taps": torch.randn(1, T, 2, H, generator=g)}
    return model, batch


def step(model, batch) -> float:
    model.zero_grad(set_to_none=True)
    loss, values = combine_terms(model(batch, torch.Generator().manual_seed(1)).terms)
    loss.backward()
    return float(loss.detach())


def peak_memory(args) -> int:
    return peak_memory_growth(lambda: make(*args), lambda mb: step(*mb), f"child {args}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--anchors", default="16,64")
    ap.add_argument("--budget", type=int, default=1024, help="logits_budget_mib of the chunked variant (recipe: 1024)")
    ap.add_argument("--pairs", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for N in [int(a) for a in args.anchors.split(",")]:
        variants = {"dense": (args.hidden, args.seq, N, 1 << 30, args.budget),
                    "chunked": (args.hidden, args.seq, N, 0, args.budget)}
        built = {k: make(*v) for k, v in variants.items()}
        losses = {k: step(*built[k]) for k in variants}
        assert abs(losses["dense"] - losses["chunked"]) < 1e-4 * max(1.0, abs(losses["dense"])), losses
        mem = {k: peak_memory(v) for k, v in variants.items()}
        times = {k: [] for k in variants}
        for _ in range(args.pairs):
            for k in variants:
                t0 = time.perf_counter()
                step(*built[k])
                times[k].append(time.perf_counter() - t0)
        R = N * 15
        row = {"V": V, "H": args.hidden, "T": args.seq, "anchors": N, "rows": R,
               "chunk_rows": built["chunked"][0].logits_chunk_rows(),
               "dense_logits_MiB_per_copy": round(R * V * 4 / 2**20, 1),
               "peak_mem_MiB": {k: round(v / 2**20, 1) for k, v in mem.items()},
               "mem_ratio": round(mem["chunked"] / mem["dense"], 4),
               "step_s_median": {k: round(statistics.median(v), 3) for k, v in times.items()},
               "time_ratio_median": round(statistics.median(
                   c / d for c, d in zip(times["chunked"], times["dense"])), 3),
               "loss": round(losses["dense"], 6), "pairs": args.pairs, "load_avg": os.getloadavg()[0]}
        rows.append(row)
        print(f"N={N:4d} R={R:5d}  peak dense {row['peak_mem_MiB']['dense']:8.1f} MiB  chunked "
              f"{row['peak_mem_MiB']['chunked']:8.1f} MiB  ratio {row['mem_ratio']:.3f}   step dense "
              f"{row['step_s_median']['dense']:.2f}s chunked {row['step_s_median']['chunked']:.2f}s  load "
              f"{row['load_avg']:.1f}", flush=True)
        del built
    recipe_rows = 4096 * 15
    write_result("dflash2_memory.json", {
        "benchmark": "dflash2_memory",
        "what": "DFlash2 training step at V=151,936: dense [rows, V] logits (one chunk) vs vocabulary-sized chunks",
        "recipe_dense_logits_GB_per_copy": round(recipe_rows * V * 4 / 1e9, 1),
        "results": rows,
        "config": vars(args),
        "machine_extra": {"threads": 1, "device": "cpu"},
    })


if __name__ == "__main__":
    main()
