"""Fused vs two-pass capture on the trained demo target: how far apart the taps are, and offline tau.

The demo's dataset is the two-pass path (``tapdraft regenerate`` wrote ``data/SPLIT.jsonl`` from
``data/SPLIT.templated.jsonl``, then ``capture`` ran a second forward over it). This script captures
the same templated conversations with ``capture --regenerate`` (fused: states from the generation
pass) into ``WORKDIR/dataset-fused`` and reports

    taps      max |fused - two-pass| over every stored tap value, on the positions both rows hold
              (a fused row ends at the reply's end-of-turn token), and the count of differing values
    teacher   how many stored top-1 teacher ids differ
    tau       the demo drafter (trained on the two-pass dataset) evaluated offline on both
              validation splits: the effect of the fused states on the acceptance estimate

    python -m benchmarks.fused_taps [--workdir DIR]      (after `tapdraft demo --workdir DIR`)
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import write_result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "tapdraft-demo"))
    args = ap.parse_args()

    from tapdraft.capture.config import CaptureConfig
    from tapdraft.capture.pipeline import capture
    from tapdraft.capture.generation import GenerationConfig, ReplyConfig
    from tapdraft.demo.data import prepare_demo
    from tapdraft.demo.target import FULL
    from tapdraft.shards.reader import open_dataset
    from tapdraft.train.evaluate import evaluate

    root = Path(args.workdir)
    paths = prepare_demo(root, progress=False)
    run = root / "runs" / "dflash"
    if not run.is_dir():
        raise FileNotFoundError(f"{run} is missing: run `tapdraft demo --workdir {root}` first")
    fused_dir = root / "dataset-fused"
    torch.set_num_threads(1)
    if fused_dir.exists():
        shutil.rmtree(fused_dir)  # always a fresh capture, so its time is this run's
    t0 = time.perf_counter()
    capture(CaptureConfig(
        target=str(paths.target.resolve()), out=str(fused_dir),
        data=(("train", str((paths.data / "train.templated.jsonl").resolve())),
              ("validation", str((paths.data / "validation.templated.jsonl").resolve()))),
        draft_layers=2, top_k=32, batch_tokens=4096, window=256, progress=False,
        replies=ReplyConfig(generation=GenerationConfig(max_new_tokens=FULL.max_new_tokens)),
    ))
    fused_s = time.perf_counter() - t0
    a, b = open_dataset(str(fused_dir)), open_dataset(str(paths.dataset))
    doc: dict = {"workdir": str(root), "fused_capture_seconds": round(fused_s, 1), "splits": {}}
    for split in ("train", "validation"):
        worst, differing, values, top1_diff, rows, n = 0.0, 0, 0, 0, 0, a.num_samples(split)
        assert n == b.num_samples(split), "both paths must keep the same conversations"
        where = {b.sample(split, j)["sample_id"]: j for j in range(n)}  # rows are in write order, not input order
        for i in range(n):
            x = a.sample(split, i)
            y = b.sample(split, where[x["sample_id"]])
            T = len(x["input_ids"])
            assert (x["input_ids"] == y["input_ids"][:T]).all()
            d = (torch.as_tensor(x["taps"]).float() - torch.as_tensor(y["taps"][:T]).float()).abs()
            worst, differing, values = max(worst, float(d.max())), differing + int((d > 0).sum()), values + d.numel()
            R = len(x["topk_rows"])
            top1_diff += int((torch.as_tensor(x["topk_ids"][:, 0]) != torch.as_tensor(y["topk_ids"][:R, 0])).sum())
            rows += R
        doc["splits"][split] = {"samples": n, "taps_max_abs": worst, "taps_values_differing": differing,
                                "taps_values": values, "teacher_rows": rows, "top1_differing": top1_diff}
    ev_two = evaluate(run, str(paths.dataset), split="validation", plot=False,
                      out_dir=root / "runs" / "dflash" / "eval-two-pass")
    ev_fused = evaluate(run, str(fused_dir), split="validation", plot=False,
                        out_dir=root / "runs" / "dflash" / "eval-fused")
    doc["tau"] = {"two_pass": ev_two["tau"], "fused": ev_fused["tau"],
                  "two_pass_replayed": ev_two.get("tau_replayed"), "fused_replayed": ev_fused.get("tau_replayed")}
    print(doc)
    write_result("fused_taps.json", {**doc, "machine_extra": {"threads": 1, "device": "cpu", "dtype": "float32"}})


if __name__ == "__main__":
    main()
