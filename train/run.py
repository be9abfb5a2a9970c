"""A training run on disk: its directory and the drafter loaded from it.

The one home of "load a trained run": the training loop writes through it, and evaluation, export,
MTP's sampled acceptance and live speculative decoding read through it. The data a run trains on is
``train.source``; its checkpoints are ``train.checkpoints``.

Run directory:
    config.json                  resolved RunConfig (the resume check compares against it)
    metrics.jsonl                one line per log step: loss terms, acc@k, alpha@k, tau, lr, throughput
                                 (a resume drops lines past its checkpoint: no step is logged twice)
    checkpoints/step-000100/     state.pt (draft, optimizer, scheduler, step, data states, config)
    summary.json                 the final summary (also returned; ``format_summary`` renders it)
    tensorboard/, curves.png     the curves of metrics.jsonl (``train.curves``)
    train-rank00000.lock         held by the training writing the run (one per rank; ``run_lock``)
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tapdraft.common.atomic import staged
from tapdraft.common.lock import exclusive_lock
from tapdraft.shards.reader import open_dataset
from tapdraft.common.template import check_template
from tapdraft.train.checkpoints import Checkpoint, check_finite, latest_checkpoint, load_latest
from tapdraft.train.config import RunConfig
from tapdraft.train.data import derive_seed
from tapdraft.train.drafters.base import Drafter, get_family
from tapdraft.train.source import DataRef, DataSource, check_trained_template, open_source

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
EVAL_SPLITS = ("validation", "test", "eval")


def build_drafter(run: RunConfig, src: DataSource) -> Drafter:
    _, cls = get_family(run.family)
    torch.manual_seed(derive_seed(run.train.seed, "init"))
    return cls.build(run.drafter, src.bundle, src.layout)


def run_lock(out: str | Path, rank: int):
    """Context manager: rank ``rank``'s exclusive lock on run directory ``out`` (created if missing); a second
    training on the same directory is refused at once with ``common.lock.LockedError`` on every rank."""
    out = Path(out)
    return exclusive_lock(out / f"train-rank{rank:05d}.lock", f"a training (rank {rank})", guards=out)


def trim_metrics(out: Path, step: int) -> None:
    """Drop metrics.jsonl lines logged after ``step`` (a resume from that step recomputes them)."""
    path = out / METRICS_FILE
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    keep = [ln for ln in lines if ln.strip() and json.loads(ln).get("step", 0) <= step]
    if len(keep) != len(lines):
        with staged(path) as tmp:
            tmp.write_text("".join(keep))


def finished_summary(out: Path, step: int, *, complete: bool) -> dict[str, Any]:
    """The summary of a run whose checkpoint is already at its last step, marked ``already_complete``;
    nothing is rewritten. Without summary.json (a crash after the last checkpoint) it is rebuilt from
    metrics.jsonl and written."""
    path = out / SUMMARY_FILE
    if path.is_file():
        summary = json.loads(path.read_text())
    else:
        recs = [json.loads(ln) for ln in (out / METRICS_FILE).read_text().splitlines() if ln.strip()] \
            if (out / METRICS_FILE).is_file() else []
        recs = [r for r in recs if "loss" in r]  # held-out lines ({"step", "eval"}) are not log steps
        last = recs[-1] if recs else {}
        summary = {"steps": step, "first_loss": recs[0].get("loss") if recs else None, "final_loss": last.get("loss"),
                   "final_tau_train": last.get("tau"), "final_alpha_train": last.get("alpha"),
                   "checkpoint": str(latest_checkpoint(out)), "run_dir": str(out)}
        if complete:
            path.write_text(json.dumps(summary, indent=2))
    return {**summary, "already_complete": complete, "stopped_at_step": step}


def format_summary(s: dict[str, Any]) -> str:
    """One readable screen for ``tapdraft train`` (``--json`` prints the dict itself)."""
    if s.get("already_complete"):
        head = f"already complete: {s.get('run_dir')} is at step {s.get('stopped_at_step')}; nothing to do"
    else:
        resumed = f", resumed from step {s['resumed_from_step']}" if s.get("resumed_from_step") else ""
        head = (f"trained {s.get('family', 'drafter')} to step {s.get('steps')} of {s.get('max_steps')}{resumed} in "
                f"{s.get('train_seconds', 0):.1f}s ({s.get('tokens_per_s') or 0:,.0f} tokens/s, "
                f"{s.get('trainable_params') or 0:,} trainable parameters, {s.get('device')})")
    lines = [head]
    if s.get("final_loss") is not None:
        first = f"{s['first_loss']:.4f} -> " if s.get("first_loss") is not None else ""
        lines.append(f"  loss {first}{s['final_loss']:.4f}")
    if s.get("final_tau_train") is not None:
        alpha = " ".join(f"{a:.3f}" for a in s.get("final_alpha_train") or [])
        lines.append(f"  teacher-forced tau on training batches {s['final_tau_train']:.3f} (alpha by position: "
                     f"{alpha}); `tapdraft eval` gives the held-out replayed tau, the serving prediction")
    if s.get("draft_vocab"):
        dv = s["draft_vocab"]
        lines.append(f"  draft vocabulary {dv['size']:,} tokens, holding {100 * dv['coverage']:.2f}% of the training "
                     "split's supervised tokens (the rest can never be drafted)")
    if s.get("held_out"):
        h = s["held_out"]
        rep = "-" if h.get("tau_replayed") is None else f"{h['tau_replayed']:.3f}"
        lines.append(f"  held-out tau {rep} replayed (teacher-forced {h['tau']:.3f}) at step {h['step']} on "
                     f"{h['samples']} {h['split']} samples")
    lines.append(f"  checkpoint {s.get('checkpoint')}")
    if s.get("curves") or s.get("tensorboard"):
        lines.append(f"  curves {s.get('curves', '-')}; metrics {s.get('metrics')}; TensorBoard: tensorboard --logdir "
                     f"{shlex.quote(str(s.get('tensorboard')))}")  # a command to paste: quoted for the shell
    return "\n".join(lines)


@dataclass
class Trained:
    """A run's latest checkpoint loaded onto a drafter, with the data source it was checked against."""

    model: Drafter
    src: DataSource
    run: RunConfig
    state: Checkpoint
    checkpoint: Path
    split: str


def pick_split(src_splits: list[str], train_split: str, *, any_split: bool = False) -> str:
    """The evaluation split: validation, test or eval when the dataset has one, else the training split. With
    ``any_split`` (a caller that only needs the dataset's bundle and layout and finds its samples by id in every
    split: ``speculate``), a dataset that has neither gives its first split rather than a refusal."""
    for s in EVAL_SPLITS:
        if s in src_splits:
            return s
    return src_splits[0] if any_split and train_split not in src_splits and src_splits else train_split


def load_run(run_dir: str | Path) -> tuple[RunConfig, Path, Checkpoint]:
    """(config, latest checkpoint path, its state) of a run directory; FileNotFoundError when it has none."""
    run_dir = Path(run_dir)
    cfg_path = run_dir / CONFIG_FILE
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path} not found: {run_dir} is not a training run directory")
    run = RunConfig.load(cfg_path)
    found = load_latest(run_dir)
    if found is None:
        raise FileNotFoundError(f"{run_dir} has no checkpoint yet; train first")
    return run, *found


def load_trained(run_dir: str | Path, data: DataRef, *, split: str | None = None, device: str = "cpu",
                 template: str | None = None, template_kwargs: dict[str, Any] | None = None,
                 any_split: bool = False) -> Trained:
    """Load the latest checkpoint of ``run_dir`` for ``data`` (an evaluation split by default).

    Refuses a directory that is not a run, a run with no checkpoint, a dataset of another target or with
    other chat-template settings than the draft was trained with, and one that differs from the given
    ``template`` text / ``template_kwargs`` (None: no expectation). ``any_split``: see :func:`pick_split`.
    """
    run, ck, state = load_run(run_dir)
    check_finite(state.draft, str(ck), "evaluated")
    ds = open_dataset(str(data)) if isinstance(data, (str, os.PathLike)) else data
    src = open_source(ds, split or pick_split(list(ds.splits), run.train.split, any_split=any_split))
    check_trained_template(state, src, run_dir)
    check_template(src.bundle.template_settings, template=template, kwargs=template_kwargs,
                   where=f"dataset {src.where}", given_by="the settings given (--chat-template/--template-kwarg)")
    if state.fingerprint not in (None, src.fingerprint):
        raise ValueError(
            f"the draft in {run_dir} was trained for target {state.fingerprint[:12]}, but {src.where} was "
            f"captured from {src.fingerprint[:12]}; use a dataset of the same target"
        )
    model = build_drafter(run, src).to(device)
    model.load_state_dict(state.draft)
    model.eval()
    return Trained(model, src, run, state, ck, src.split)
