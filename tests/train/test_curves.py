"""Training curves: TensorBoard events and a PNG for every run, and held-out acceptance every N steps that
equals what ``tapdraft eval`` measures on the same samples."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from dflash_fixtures import tiny_dataset
from tapdraft.train.config import load_run_config
from tapdraft.train.curves import eval_batches, held_out_acceptance
from tapdraft.train.evaluate import evaluate
from tapdraft.train.loop import train
from tapdraft.train.run import format_summary, load_trained

FAST = ["max_tokens=160", "max_batch_size=4", "warmup_steps=2", "progress=false", "log_every=1", "lr=3e-3",
        "num_anchors=8", "max_total_anchors=24"]


@pytest.fixture(scope="module")
def mem(tmp_path_factory):
    return tiny_dataset(tmp_path_factory.mktemp("mem"), n=16, min_len=16, max_len=32)


def _events(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_a_run_writes_tensorboard_events_a_png_and_held_out_acceptance(tmp_path, mem):
    run = load_run_config("dflash_b8", overrides=FAST + ["max_steps=4", "eval_every=2", "eval_samples=6"])
    with pytest.warns(UserWarning, match="no validation, test or eval split.*training split 'train' \\(not held out"):
        s = train(run, mem.path, tmp_path / "r")
    out = tmp_path / "r"
    recs = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in recs if "eval" in r]
    assert [r["step"] for r in evals] == [2, 4] and all(r["eval"]["samples"] >= 6 for r in evals)
    ev = _events(out)
    losses = [r["loss"] for r in recs if "loss" in r]
    assert [step for step, _ in ev["train/loss"]] == [1, 2, 3, 4]
    assert [v for _, v in ev["train/loss"]] == pytest.approx(losses, rel=1e-6)
    assert [v for _, v in ev["eval/tau_replayed"]] == pytest.approx([r["eval"]["tau_replayed"] for r in evals])
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and s["curves"] == str(out / "curves.png")
    text = format_summary(s)
    assert f"held-out tau {evals[-1]['eval']['tau_replayed']:.3f} replayed" in text and "tensorboard --logdir" in text
    # the figure at the last step is what an offline evaluation of the final checkpoint measures on those samples
    loaded = load_trained(out, mem.path, split="train")
    again = held_out_acceptance(loaded.model, eval_batches(loaded.src, loaded.run.train), torch.device("cpu"))
    assert again["tau_replayed"] == pytest.approx(evals[-1]["eval"]["tau_replayed"], rel=1e-6)
    full = evaluate(out, mem.path, split="train", max_samples=again["samples"], plot=False)
    assert full["samples"] == again["samples"] and full["tau_replayed"] == pytest.approx(again["tau_replayed"])


def test_a_resume_shows_no_step_twice_in_tensorboard(tmp_path, mem):
    run = load_run_config("dflash_b8", overrides=FAST + ["max_steps=4", "ckpt_every=2"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(run, mem.path, tmp_path / "r", stop_at=3)  # checkpoint at 2 and 3
        (tmp_path / "r" / "checkpoints" / "step-0000003").rename(tmp_path / "r" / "gone")  # resume from step 2
        train(run, mem.path, tmp_path / "r")
    steps = [step for step, _ in _events(tmp_path / "r")["train/loss"]]
    assert steps == [1, 2, 3, 4]
