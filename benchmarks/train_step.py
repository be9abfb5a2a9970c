"""DFlash training-step time against loss rows at a real vocabulary (V = 151,936, H = 1024).

At a real vocabulary the loss, not the draft, is the step: every loss row (a block slot that
predicts a supervised token) costs a [V, H] lm_head matmul forward and one backward, 4 * V * H
FLOPs = 0.62 GFLOP at Qwen3-0.6B's widths, while a 1-layer draft costs about 0.08 GFLOP per
block token. So step time is near-linear in the loss rows, and ``max_loss_rows`` (the recipe's
budget per micro-batch, ``train.drafters.dflash.loss``) is what keeps a step's cost bounded.

Content: a tiny synthetic dataset at the ``qwen3-1024x8`` shape (benchmarks/shapes.py): a target
bundle with random bf16 embedding and lm_head of 151,936 x 1024, and a few samples of 512-2048
tokens whose taps are the DFlash tap rule's for a 1-layer draft plus the last layer, half of
each sample supervised. Random activations are fine here: time does not depend on their values.

One step = drafter forward (anchors, context, blocks, fused chunked lm_head + CE) + backward +
AdamW step, on one fixed micro-batch, with the default recipe (``dflash``) and one thread. For
each loss-row budget, A = frozen head in fp32 (the CPU default) and B = in bf16 (``head_dtype``)
are timed interleaved A B A B; the table gives the medians, their ratio and a least-squares fit
time = a + b * rows per head dtype (b: seconds per loss row; a: the rest of the step).

    python -m benchmarks.train_step [--rows 30 120 240] [--pairs 5] [--workdir /tmp/tapdraft-train-step]
    python -m benchmarks.train_step --shape llama-576x8 --rows 960 --name train_step_smollm2.json   # SmolLM2's widths

``--draft-vocab N`` compares instead A = the full vocabulary and B = a reduced draft vocabulary of N
tokens (``train.drafters.common.draft_vocab``; both with the fp32 head), interleaved, and writes
``train_step_draft_vocab.json``. The synthetic samples' labels are few (a few thousand distinct ids), so
the subset holds every one of them (coverage 1.0 is checked and recorded): both sides train on the same
loss rows and the ratio is the vocabulary's cost alone.

    python -m benchmarks.train_step --draft-vocab 32768 --rows 120 480
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from benchmarks.common import write_result
from benchmarks.shapes import SHAPES, shape_facts, synthetic_dataset

if TYPE_CHECKING:
    from tapdraft.train.drafters.base import LossOutput

SHAPE = "qwen3-1024x8"


def build_dataset(root: Path, *, samples: int = 4, seed: int = 0, shape: str = SHAPE) -> Path:
    """The synthetic dataset at ``shape``, 512-2048 tokens a sample (built once; later runs reuse ``root``)."""
    return synthetic_dataset(root, shape, samples=samples, tokens=(512, 2048), tag="train_step", seed=seed)


class Stepper:
    """One drafter + optimizer on one fixed micro-batch, for a given loss-row budget and head dtype."""

    def __init__(self, data: Path, rows: int, head: str, draft_vocab: int | None = None) -> None:
        from tapdraft.train.drafters.common import draft_vocab as dv
        from tapdraft.train.config import load_run_config
        from tapdraft.train.data import BatchStream
        from tapdraft.train.drafters.base import combine_terms
        from tapdraft.train.fit import head_dtype
        from tapdraft.train.loop import make_optimizer
        from tapdraft.train.run import build_drafter
        from tapdraft.train.source import open_source

        run = load_run_config("dflash", overrides=[f"max_loss_rows={rows}", f"head_dtype={head}",
                                                   f"draft_vocab={'null' if draft_vocab is None else draft_vocab}"])
        src = open_source(str(data))
        self.model = build_drafter(run, src)
        self.model.target.to_dtype(head_dtype(torch.device("cpu"), run.train.head_dtype))
        self.vocab = dv.setup(self.model, src, None)  # what the training loop does before its first step
        self.opt, _ = make_optimizer(self.model, run.train)
        stream = BatchStream(src.opener(seed=0, rank=0, world_size=1), max_tokens=run.train.max_tokens,
                             max_batch_size=run.train.max_batch_size)
        self.batch = next(stream)
        self.combine = combine_terms
        self.rows = 0

    def step(self) -> float:
        t0 = time.perf_counter()
        lo = self.model(self.batch, torch.Generator().manual_seed(0))
        loss, _ = self.combine(lo.terms)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.rows = _rows(lo)
        self.loss = float(loss.detach())
        return time.perf_counter() - t0


def _rows(lo: LossOutput) -> int:
    """Loss rows of a step: the sum over slots of each slot's valid count."""
    return int(sum(float(c) for k, (_, c) in lo.metrics.items() if k.startswith("acc@")))


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(sum((x - mx) ** 2 for x in xs), 1e-12)
    return my - b * mx, b


def interleaved(make: dict[str, Any], budgets: list[int], pairs: int, speedup_key: str,
                check: Any = None) -> tuple[list[dict[str, Any]], dict[str, dict[str, float]]]:
    """Time two step variants A/B in interleaved pairs per loss-row budget; fit step = a + b x rows for each.

    ``make`` maps the two variant names to ``budget -> Stepper``; ``check(steppers)`` runs before timing.
    Records keep the names: ``{A}_s``, ``{A}_runs``, ``loss_{A}``, ... and ``speedup_key`` = median A/B."""
    a, b = make
    out = []
    for budget in budgets:
        steppers = {k: f(budget) for k, f in make.items()}
        extra = check(steppers) if check else {}
        for s in steppers.values():
            s.step()  # warm-up (allocator, oneDNN kernels)
        times: dict[str, list[float]] = {a: [], b: []}
        loads = []
        for _ in range(pairs):
            for k in (a, b):
                times[k].append(steppers[k].step())
            loads.append(os.getloadavg()[0])
        assert steppers[a].rows == steppers[b].rows
        rec = {"max_loss_rows": budget, "loss_rows": steppers[a].rows,
               "tokens": int(steppers[a].batch["lengths"].sum()),
               f"{a}_s": statistics.median(times[a]), f"{b}_s": statistics.median(times[b]),
               f"{a}_runs": times[a], f"{b}_runs": times[b],
               speedup_key: statistics.median(x / y for x, y in zip(times[a], times[b])),
               f"loss_{a}": steppers[a].loss, f"loss_{b}": steppers[b].loss, **extra, "load_avg_1m": loads}
        out.append(rec)
        print(f"rows {rec['loss_rows']:>6}  {a} {rec[f'{a}_s']:7.2f} s  {b} {rec[f'{b}_s']:7.2f} s  "
              f"{speedup_key} {rec[speedup_key]:.2f}  load {max(loads):.1f}")
    fits = {}
    for k in (a, b):
        fixed, per_row = _fit([r["loss_rows"] for r in out], [r[f"{k}_s"] for r in out])
        fits[k] = {"fixed_s": fixed, "s_per_row": per_row}
        print(f"{k}: step = {fixed:.2f} s + {per_row * 1000:.1f} ms x rows")
    return out, fits


def _command(argv: list[str] | None) -> str:
    return "python -m benchmarks.train_step " + " ".join(argv if argv is not None else sys.argv[1:])


def compare_draft_vocab(data: Path, n: int, budgets: list[int], pairs: int, argv: list[str] | None,
                        shape: str = SHAPE) -> dict[str, Any]:
    """A = full vocabulary, B = an N-token draft vocabulary, fp32 head, interleaved per loss-row budget."""
    def same_rows(steppers: dict[str, Stepper]) -> dict[str, float]:
        cover = steppers["draft"].vocab["coverage"]
        if cover != 1.0:
            raise ValueError(f"the {n}-token draft vocabulary covers {cover:.3f} of the labels: the sides would train "
                             "different loss rows; raise --draft-vocab")
        return {"coverage": cover}

    make = {"full": lambda budget: Stepper(data, budget, "fp32"),
            "draft": lambda budget: Stepper(data, budget, "fp32", n)}
    out, fits = interleaved(make, budgets, pairs, "speedup", same_rows)
    doc = {"benchmark": "train_step_draft_vocab", "shape": shape, **shape_facts(shape), "recipe": "dflash",
           "draft_vocab": n, "head_dtype": "fp32", "command": _command(argv),
           "threads": 1, "rows": out, "fit": fits,
           "predicted_s": {f"{k}@{r}": fits[k]["fixed_s"] + fits[k]["s_per_row"] * r for k in fits for r in (8192,)}}
    write_result("train_step_draft_vocab.json", doc)
    return doc


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[30, 120, 240], help="loss-row budgets (max_loss_rows)")
    ap.add_argument("--pairs", type=int, default=5, help="interleaved A/B pairs per budget")
    ap.add_argument("--workdir", default="/tmp/tapdraft-train-step", help="where the synthetic dataset is cached")
    ap.add_argument("--shape", default=SHAPE, choices=sorted(SHAPES), help="the target's shape (benchmarks/shapes.py)")
    ap.add_argument("--name", default="train_step.json", help="result file in benchmarks/results/ (fp32 vs bf16)")
    ap.add_argument("--draft-vocab", type=int, default=None,
                    help="compare the full vocabulary with a draft vocabulary of this many tokens (fp32 head) "
                         "instead of the fp32 and bf16 heads")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    data = build_dataset(Path(args.workdir) / f"dataset-{args.shape}", shape=args.shape)
    if args.draft_vocab is not None:
        return compare_draft_vocab(data, args.draft_vocab, args.rows, args.pairs, argv, args.shape)
    make = {h: (lambda budget, h=h: Stepper(data, budget, h)) for h in ("fp32", "bf16")}
    out, fits = interleaved(make, args.rows, args.pairs, "bf16_speedup")
    flops_row = 4 * SHAPES[args.shape].vocab * SHAPES[args.shape].hidden
    doc = {"benchmark": "train_step", "shape": args.shape, **shape_facts(args.shape), "recipe": "dflash",
           "command": _command(argv),
           "threads": 1, "lm_head_flops_per_row": flops_row, "rows": out, "fit": fits,
           "predicted_s": {f"{h}@{n}": fits[h]["fixed_s"] + fits[h]["s_per_row"] * n
                           for h in fits for n in (8192, 26_700)}}
    write_result(args.name, doc)
    return doc


if __name__ == "__main__":
    main()
