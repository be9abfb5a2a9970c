"""Training curves: what a run looked like over its steps, in the places people look.

Every log line the loop writes to ``metrics.jsonl`` also goes to TensorBoard event files in
``RUN/tensorboard/`` (``torch.utils.tensorboard``, which writes them through the ``tensorboard``
package without TensorFlow; ``tensorboard --logdir RUN/tensorboard``), and at the end of ``train``
``RUN/curves.png`` plots loss, training-batch tau and, with ``--set eval_every=N``, the held-out
tau measured every N steps (:func:`held_out_acceptance`: the replayed tau, the serving prediction,
and the teacher-forced one over the first ``eval_samples`` samples of the held-out split).

A resume purges the events past its checkpoint step (``purge_step``), as ``metrics.jsonl`` drops
its lines past it, so no step is shown twice.

Records (one JSON line each in metrics.jsonl): a log step ``{"step", "loss", "tau", "alpha", ...}``;
a held-out measurement ``{"step", "eval": {"split", "samples", "tau_replayed", "tau", "alpha"}}``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

import torch

from tapdraft.train.acceptance import AcceptanceCounts, tau_from_alpha
from tapdraft.train.config import TrainConfig
from tapdraft.train.data import BatchStream, to_device
from tapdraft.train.drafters.base import Drafter
from tapdraft.train.source import DataSource

TB_DIR = "tensorboard"
PNG = "curves.png"
_NOT_CURVES = ("step", "elapsed_s")


class CurveLog:
    """TensorBoard scalars for one rank-0 run directory (``add`` a metrics record, ``close`` at the end)."""

    def __init__(self, out: Path, start_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # events of steps after the checkpoint (logged by the run that stopped) are hidden: they are recomputed
        self.writer = SummaryWriter(str(out / TB_DIR), purge_step=start_step + 1 if start_step else None)

    def add(self, rec: dict[str, Any]) -> None:
        step = int(rec["step"])
        if "eval" in rec:
            ev = rec["eval"]
            for key in ("tau_replayed", "tau"):
                if ev.get(key) is not None:
                    self.writer.add_scalar(f"eval/{key}", ev[key], step)
            for k, a in enumerate(ev.get("alpha") or [], start=1):
                self.writer.add_scalar(f"eval/alpha@{k}", a, step)
            return
        for key, v in rec.items():  # loss and its terms, lr, grad_norm, tau, acc@k, throughput
            if key not in _NOT_CURVES and isinstance(v, (int, float)) and not isinstance(v, bool):
                self.writer.add_scalar(f"train/{key}", v, step)
        for k, a in enumerate(rec.get("alpha") or [], start=1):
            self.writer.add_scalar(f"train/alpha@{k}", a, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def eval_batches(src: DataSource, tc: TrainConfig) -> list[dict[str, Any]]:
    """The first ``tc.eval_samples`` samples of ``src``'s split as batches, in file order (read once, kept)."""
    stream = BatchStream(src.opener(seed=tc.seed, rank=0, world_size=1, shuffle=False), max_tokens=tc.max_tokens,
                         max_batch_size=tc.max_batch_size, max_seq_len=tc.max_seq_len, max_epochs=1)
    out, n = [], 0
    for batch in stream:
        if n >= tc.eval_samples:
            break
        out.append(batch)
        n += len(batch["sample_id"])
    return out


def held_out_acceptance(model: Drafter, batches: Iterable[dict[str, Any]], device: torch.device) -> dict[str, Any]:
    """Greedy acceptance of ``model`` over ``batches``: replayed tau, teacher-forced tau and alpha by position."""
    total: AcceptanceCounts | None = None
    n = 0
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for batch in batches:
            acc = model.acceptance(to_device(batch, device))
            acc = AcceptanceCounts(acc.accepted.cpu(), acc.reached.cpu(), acc.correct.cpu(), acc.valid.cpu(),
                                   acc.blocks, acc.round_tokens, acc.rounds)
            total = acc if total is None else total + acc
            n += len(batch["sample_id"])
    model.train(was_training)
    if total is None:
        return {"samples": 0, "tau_replayed": None, "tau": None, "alpha": []}
    alpha = [float(a / r) if r > 0 else 0.0 for a, r in zip(total.accepted, total.reached)]
    return {"samples": n, "tau_replayed": total.round_tokens / total.rounds if total.rounds else None,
            "tau": tau_from_alpha(alpha), "alpha": alpha}


def plot_curves(metrics: Path, png: Path) -> Path | None:
    """Loss and tau over the steps of ``metrics`` (a metrics.jsonl) as a PNG; None when it holds no step."""
    recs = [json.loads(ln) for ln in metrics.read_text().splitlines() if ln.strip()] if metrics.is_file() else []
    steps = [r for r in recs if "loss" in r]
    evals = [r for r in recs if "eval" in r]
    if not steps:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_tau) = plt.subplots(1, 2, figsize=(10, 3.6), dpi=100)
    ax_loss.plot([r["step"] for r in steps], [r["loss"] for r in steps], color="#4C72B0")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss")
    ax_loss.set_title("training loss")
    tau = [(r["step"], r["tau"]) for r in steps if r.get("tau") is not None]
    if tau:
        ax_tau.plot(*zip(*tau), color="#999999", label="teacher-forced, training batches")
    for key, color, label in (("tau_replayed", "#C44E52", "replayed, held out (serving prediction)"),
                              ("tau", "#DD8452", "teacher-forced, held out")):
        pts = [(r["step"], r["eval"][key]) for r in evals if r["eval"].get(key) is not None]
        if pts:
            ax_tau.plot(*zip(*pts), "o-", color=color, label=label)
    ax_tau.set_xlabel("step")
    ax_tau.set_ylabel("tau (tokens per target forward)")
    ax_tau.set_title("acceptance length")
    if tau or evals:
        ax_tau.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)
    return png
