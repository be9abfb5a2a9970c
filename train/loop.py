"""The training loop: ``train(config, data, out) -> summary``.

One loop for every drafter family. It opens the data (a dataset path/URL or an opened dataset,
through ``train.source.DataSource``), refuses bad input before any step (target fingerprint, tap ids
and hidden size via the drafter's ``resolve``/``check_dataset``, no supervised tokens, resume from
a checkpoint of another config), then runs AdamW with linear warmup + cosine decay, gradient
clipping, bf16 autocast on GPU and gradient accumulation; DDP when launched by torchrun (gloo on
CPU, nccl on GPU).

Loss normalisation is ``train.drafters.base.combine_terms`` (each term over its own DP-global count).
Anchor sampling draws from a generator seeded by ``derive_seed(seed, "anchors", step, micro, rank)``,
so a run is a pure function of its config and data, and resume is exact: a checkpoint holds the
draft, optimizer, scheduler, step and every rank's reader state.

Interrupts: SIGINT/SIGTERM stop the run after the current optimizer step (every rank at the same
step), write a checkpoint, and raise ``common.errors.Interrupted`` saying where it was saved (a
second signal aborts at once). A rerun prints "resuming from step N" before anything else and
drops metrics.jsonl lines past that step (they are recomputed); a finished run returns its summary
marked ``already_complete`` and rewrites nothing.

Curves: every log line also goes to TensorBoard (``RUN/tensorboard/``), ``RUN/curves.png`` is drawn at
the end, and ``train.eval_every`` measures held-out acceptance every N steps (``train.curves``).

The run directory's layout lives in ``train.run``, checkpoint I/O in ``train.checkpoints``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LambdaLR

from tapdraft.common.errors import DivergedError, Interrupted, StopSignals
from tapdraft.common.progress import Progress
from tapdraft.train.drafters.common import draft_vocab
from tapdraft.train.acceptance import tau_from_alpha
from tapdraft.train.checkpoints import Checkpoint, latest_checkpoint, load_checkpoint, save_checkpoint
from tapdraft.train.config import RESUME_MUTABLE, RunConfig, TrainConfig, migrate_run_config
from tapdraft.train.curves import PNG as CURVES_PNG
from tapdraft.train.curves import TB_DIR, CurveLog, eval_batches, held_out_acceptance, plot_curves
from tapdraft.train.data import BatchStream, WorkerBatchStream, derive_seed, to_device
from tapdraft.train.drafters.base import Drafter, combine_terms, reduce_metrics
from tapdraft.train.fit import fit_to_device, head_dtype
from tapdraft.train.run import (CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, build_drafter, finished_summary, pick_split, run_lock,
                       trim_metrics)
from tapdraft.train.source import DataRef, DataSource, check_data, check_trained_template, open_source, template_state


def lr_lambda(tc: TrainConfig):
    def f(step: int) -> float:
        if step < tc.warmup_steps:
            return (step + 1) / max(tc.warmup_steps, 1)
        span = max(tc.max_steps - tc.warmup_steps, 1)
        prog = min((step - tc.warmup_steps) / span, 1.0)
        return tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * prog))

    return f


def make_optimizer(model: torch.nn.Module, tc: TrainConfig) -> tuple[torch.optim.Optimizer, LambdaLR]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 else decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": tc.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=tc.lr, betas=(tc.beta1, tc.beta2),
    )
    # the schedule is a pure function of the step; rebuilt (not unpickled) on resume
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(tc))
    return opt, sched


def _dist_setup(tc: TrainConfig) -> tuple[int, int, torch.device, bool]:
    """(rank, world, device, we_initialised) from torchrun's launch environment."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    want_cuda = tc.device.startswith("cuda") or (tc.device == "auto" and torch.cuda.is_available())
    if tc.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"train.device={tc.device} but no CUDA device is available; use device=cpu or auto")
    init = False
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if want_cuda else "gloo")
        init = True
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if want_cuda:
        first = int(tc.device.split(":")[1]) if tc.device.startswith("cuda:") else 0
        local = first + int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    return rank, world, device, init


SHOWN_DIFFS = 4
"""Differing settings a refused resume names (the rest are counted)."""


def _config_diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    diffs = []
    if a.get("family") != b.get("family"):  # another recipe: its drafter fields are not comparable
        diffs.append(f"family: {a.get('family')} vs {b.get('family')}")
    for section in ("drafter", "train") if not diffs else ("train",):
        sa, sb = a.get(section, {}), b.get(section, {})
        for k in sorted(set(sa) | set(sb)):
            if section == "train" and k in RESUME_MUTABLE:
                continue
            if sa.get(k) != sb.get(k):
                diffs.append(f"{section}.{k}: {sa.get(k)!r} vs {sb.get(k)!r}")
    return diffs


def _autocast(device: torch.device, precision: str):
    bf16 = precision == "bfloat16" or (precision == "auto" and device.type == "cuda")
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()


def _log_line(step: int, vals: dict[str, float], mets: dict[str, tuple[float, float]], extra: dict[str, Any]) -> dict:
    rec: dict[str, Any] = {"step": step, **extra}
    rec.update({k: v for k, v in vals.items()})
    rec["loss"] = vals.get("loss", float("nan"))
    alpha = []
    k = 1
    while f"alpha@{k}" in mets:
        s, c = mets[f"alpha@{k}"]
        alpha.append(s / c if c > 0 else 0.0)
        a_s, a_c = mets[f"acc@{k}"]
        rec[f"acc@{k}"] = a_s / a_c if a_c > 0 else None
        k += 1
    if alpha:
        rec["alpha"] = alpha
        rec["tau"] = tau_from_alpha(alpha)
    for name, (s, c) in mets.items():
        if not (name.startswith("acc@") or name.startswith("alpha@")):
            rec[name] = s / c if c > 0 else None
    return rec


def train(run: RunConfig, data: DataRef, out: str | Path, *, resume: bool = True,
          stop_at: int | None = None) -> dict[str, Any]:
    """Train a drafter on ``data`` into run directory ``out``; resumes from its latest checkpoint.

    ``data``: a dataset path/URL or an opened ``shards.reader`` dataset.
    ``stop_at``: stop after that step (with a checkpoint) as if interrupted; the schedule still
    follows ``max_steps``, so a later call resumes exactly. Returns the summary dict (also written
    to ``out/summary.json``). Each rank holds its lock on ``out`` throughout (``train.run.run_lock``):
    a second training on the same directory is refused before it reads a checkpoint.
    """
    tc = run.train
    if tc.num_threads:
        torch.set_num_threads(tc.num_threads)
    out = Path(out)
    src = open_source(data, tc.split)
    check_data(run, src)
    rank, world, device, we_init = _dist_setup(tc)
    run, fit_line = fit_to_device(run, src.bundle, device)  # before the resume check: a checkpoint holds fitted values
    try:
        with run_lock(out, rank):
            ckpt = _resumable_checkpoint(run, src, out) if resume else None
            end = tc.max_steps if stop_at is None else min(stop_at, tc.max_steps)
            if ckpt is not None and int(ckpt.step) >= end:
                return finished_summary(out, int(ckpt.step), complete=end == tc.max_steps)
            if ckpt is not None and rank == 0:
                print(f"resuming from step {int(ckpt.step)} of {tc.max_steps} ({latest_checkpoint(out)})",
                      file=sys.stderr, flush=True)
            if fit_line and rank == 0:
                print(fit_line, file=sys.stderr, flush=True)
            weights = src.bundle.lm_head.numel()
            if rank == 0 and tc.head_dtype == "auto" and device.type == "cpu" and \
                    head_dtype(device, "auto", weights) == torch.bfloat16:
                print(f"frozen head: bf16 (auto: this CPU has bf16 instructions and the lm_head {weights:,} weights); "
                      "set train.head_dtype=fp32 to keep it fp32", file=sys.stderr, flush=True)
            return _train(run, src, out, ckpt, rank, world, device, end)
    finally:
        if we_init:
            dist.destroy_process_group()


def _resumable_checkpoint(run: RunConfig, src: DataSource, out: Path) -> Checkpoint | None:
    """The latest checkpoint in ``out`` (None: start fresh); refused when another config or target wrote it."""
    ckpt_path = latest_checkpoint(out)
    if ckpt_path is None:
        return None
    ckpt = load_checkpoint(ckpt_path)
    diffs = _config_diff(migrate_run_config(ckpt.config), run.to_dict())
    if diffs:
        shown = "; ".join(diffs[:SHOWN_DIFFS]) + (f"; and {len(diffs) - SHOWN_DIFFS} more" if len(diffs) > SHOWN_DIFFS
                                                 else "")
        raise ValueError(
            f"{out} holds a run with another config ({len(diffs)} setting(s) differ, checkpoint vs now: {shown}); "
            f"rerun with the recipe and --set values it was started with ({out / CONFIG_FILE}), or use a new --out "
            "directory"
        )
    was = ckpt.config.get("train", {}).get("max_steps")
    if was is not None and was != run.train.max_steps:
        warnings.warn(f"max_steps changed from {was} to {run.train.max_steps} on resume from step {ckpt.step}: the "
                      f"learning-rate schedule (warmup, then cosine decay to step max_steps) now ends at step "
                      f"{run.train.max_steps}, so the remaining steps follow another curve than the run started with",
                      stacklevel=3)
    check_trained_template(ckpt, src, out)
    if ckpt.fingerprint not in (None, src.fingerprint):
        raise ValueError(f"{ckpt_path} was trained on target {ckpt.fingerprint[:12]}, the dataset is "
                         f"{src.fingerprint[:12]}; resume with the dataset it was trained on")
    if ckpt.dataset is not None and ckpt.dataset != src.identity():
        raise ValueError(f"{src.where} is not the dataset {ckpt_path} was trained on (split {src.split!r} now holds "
                         f"other shards: sha256 {src.identity()['sha256'][:12]}, trained on "
                         f"{ckpt.dataset.get('sha256', '?')[:12]}); resume with the dataset the run was trained on, or "
                         "start a new --out directory")
    return ckpt


@dataclass
class _Trainer:
    """The pieces one rank trains with (built by :func:`_setup`)."""

    model: Drafter
    ddp: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: LambdaLR
    stream: BatchStream | WorkerBatchStream
    start: int
    draft_vocab: dict[str, Any] | None = None


def _setup(run: RunConfig, src: DataSource, ckpt: Checkpoint | None, rank: int, world: int,
           device: torch.device) -> _Trainer:
    """Drafter (restored from ``ckpt``), its DDP wrapper, optimizer + schedule, and the batch stream."""
    tc = run.train
    model = build_drafter(run, src).to(device)
    model.target.to_dtype(head_dtype(device, tc.head_dtype, model.target.lm_head.numel()))
    # a reduced draft vocabulary, fitted on (or checked against) the split
    vocab = draft_vocab.setup(model, src, None if ckpt is None else ckpt.draft)
    if ckpt is not None:
        model.load_state_dict(ckpt.draft)
    ddp = model
    if world > 1:
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False
        )
    opt, sched = make_optimizer(model, tc)
    start, data_state = 0, None
    if ckpt is not None:
        opt.load_state_dict(ckpt.optimizer)
        sched.load_state_dict(ckpt.scheduler)
        # max_steps may change on resume; the rule is code, not state
        sched.lr_lambdas = [lr_lambda(tc)] * len(opt.param_groups)
        start = int(ckpt.step)
        states = ckpt.data_states
        if len(states) != world:
            raise ValueError(f"checkpoint was written by {len(states)} ranks; resume with the same world size")
        data_state = states[rank]
    return _Trainer(model, ddp, opt, sched, _batch_stream(src, tc, rank, world, data_state), start, vocab)


def _batch_stream(src: DataSource, tc: TrainConfig, rank: int, world: int,
                  data_state: dict[str, Any] | None) -> BatchStream | WorkerBatchStream:
    """This rank's endless batch stream (in-process, or over ``num_workers`` loader processes)."""
    sizes = {"max_tokens": tc.max_tokens, "max_batch_size": tc.max_batch_size, "max_seq_len": tc.max_seq_len}
    if tc.num_workers > 0:
        return WorkerBatchStream(
            src.worker_opener(seed=tc.seed, rank=rank, world_size=world, shuffle_buffer=tc.shuffle_buffer),
            num_workers=tc.num_workers, state=data_state, **sizes,
        )
    return BatchStream(src.opener(seed=tc.seed, rank=rank, world_size=world, shuffle_buffer=tc.shuffle_buffer),
                       state=data_state, **sizes)


class _Window:
    """Loss values and metric (sum, count) pairs accumulated over the steps since the last log line."""

    def __init__(self) -> None:
        self.vals: dict[str, float] = {}
        self.mets: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.steps = 0

    def add_metrics(self, metrics: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        for n, (s, c) in metrics.items():
            ps, pc = self.mets.get(n, (0.0, 0.0))
            self.mets[n] = (ps + s.detach().float().cpu(), pc + c.detach().float().cpu())

    def add_step(self, step_vals: dict[str, float]) -> None:
        for n, v in step_vals.items():
            self.vals[n] = self.vals.get(n, 0.0) + v
        self.steps += 1

    def record(self, done: int, extra: dict[str, Any]) -> dict[str, Any]:
        """The log line over this window (metrics reduced over ranks)."""
        mets = reduce_metrics({k: (torch.as_tensor(s), torch.as_tensor(c)) for k, (s, c) in self.mets.items()})
        return _log_line(done, {k: v / self.steps for k, v in self.vals.items()}, mets, extra)


def _optimizer_step(t: _Trainer, tc: TrainConfig, step: int, rank: int, world: int, device: torch.device,
                    window: _Window, limit: float = math.inf) -> tuple[dict[str, float], int, torch.Tensor]:
    """One optimizer step over ``grad_accum`` micro-batches -> (loss values, tokens read, grad norm); a loss over
    ``limit`` or a non-finite loss or gradient raises ``DivergedError`` before the step is applied."""
    t.model.train()
    step_vals: dict[str, float] = {}
    tokens = 0
    for micro in range(tc.grad_accum):
        batch = to_device(next(t.stream), device)
        tokens += int(batch["lengths"].sum())
        gen = torch.Generator().manual_seed(derive_seed(tc.seed, "anchors", step, micro, rank))
        sync = world > 1 and micro < tc.grad_accum - 1
        with (t.ddp.no_sync() if sync else nullcontext()):
            with _autocast(device, tc.precision):
                lo = t.ddp(batch, gen)
            loss, vals = combine_terms(lo.terms, ddp_averages=world > 1)
            (loss / tc.grad_accum).backward()
        total = sum(float(lo.terms[n][2]) * v for n, v in vals.items())
        step_vals["loss"] = step_vals.get("loss", 0.0) + total / tc.grad_accum
        for n, v in vals.items():
            step_vals[n] = step_vals.get(n, 0.0) + v / tc.grad_accum
        window.add_metrics(lo.metrics)
    gnorm = torch.nn.utils.clip_grad_norm_(t.model.parameters(), tc.grad_clip if tc.grad_clip > 0 else float("inf"))
    why = _divergence(step_vals["loss"], gnorm, limit, world, device)
    if why is not None:
        t.opt.zero_grad(set_to_none=True)
        raise DivergedError(f"training diverged at step {step + 1}: loss {step_vals['loss']:.4g}, gradient norm "
                            f"{float(gnorm):.4g} ({why}); the step was not applied")
    t.opt.step()
    t.sched.step()
    t.opt.zero_grad(set_to_none=True)
    return step_vals, tokens, gnorm


def _divergence(loss: float, gnorm: torch.Tensor, limit: float, world: int, device: torch.device) -> str | None:
    """Why a step diverged (its loss or gradient norm not finite, or its loss over ``limit``), on any rank; None when
    it did not. One all-reduce under DDP, so every rank stops at the same step."""
    why = None
    if not (math.isfinite(loss) and math.isfinite(float(gnorm))):
        why = "not finite"
    elif loss > limit:
        why = f"over {limit:.4g}, train.diverge_ratio times the first step's loss"
    if world == 1:
        return why
    flag = torch.tensor([float(why is not None)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return why or ("on another rank" if flag.item() else None)


def _loss_limit(tc: TrainConfig, first_loss: float | None) -> float:
    """The loss past which a step counts as diverged: ``diverge_ratio`` x max(1, the first step's loss) of this
    process (a resumed run measures from its own first step); infinite before that step or with the ratio 0."""
    if first_loss is None or not tc.diverge_ratio:
        return math.inf
    return tc.diverge_ratio * max(1.0, first_loss)


def _train(run: RunConfig, src: DataSource, out: Path, ckpt: Checkpoint | None, rank: int, world: int,
           device: torch.device, end: int) -> dict[str, Any]:
    tc = run.train
    t = _setup(run, src, ckpt, rank, world, device)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        # the drafter's resolved config (tap ids chosen, sizes from the bundle): what this run trains
        dataclasses.replace(run, drafter=t.model.config).save(out / CONFIG_FILE)
        trim_metrics(out, t.start)
    log_f = open(out / METRICS_FILE, "a") if rank == 0 else None
    curves = CurveLog(out, t.start) if rank == 0 else None
    held = _HeldOut(run, src, device) if tc.eval_every and rank == 0 else None
    progress = Progress("train", tc.max_steps, done=t.start, enabled=tc.progress and rank == 0)
    last: dict[str, Any] = {}
    first_loss = None
    t0 = time.perf_counter()
    tokens = 0
    window = _Window()
    ckpt_dir = None
    stop = StopSignals().__enter__()
    try:
        for step in range(t.start, end):
            try:
                step_vals, n_tok, gnorm = _optimizer_step(t, tc, step, rank, world, device, window,
                                                          _loss_limit(tc, first_loss))
            except DivergedError as e:
                kept = latest_checkpoint(out)
                kept_txt = f"the last good checkpoint {kept} is kept" if kept else "no checkpoint was saved"
                progress.close(final_line=False)
                raise DivergedError(f"{e}; {kept_txt}: train again into a new --out with a lower lr (now {tc.lr:g}) "
                                    f"or more warmup_steps (now {tc.warmup_steps})") from None
            tokens += n_tok
            if first_loss is None:
                first_loss = step_vals["loss"]
            window.add_step(step_vals)
            done = step + 1
            if done % tc.log_every == 0 or done == end:
                elapsed = time.perf_counter() - t0
                last = window.record(done, {
                    "lr": t.sched.get_last_lr()[0], "grad_norm": float(gnorm), "elapsed_s": round(elapsed, 3),
                    "tokens_per_s": round(tokens * world / max(elapsed, 1e-9), 1),
                })
                if log_f is not None:
                    log_f.write(json.dumps(last) + "\n")
                    log_f.flush()
                    curves.add(last)
                tau_txt = f"  tau {last['tau']:.3f}" if last.get("tau") else ""
                progress.update(done, f"loss {last['loss']:.4f}" + tau_txt)
                window = _Window()
            else:
                progress.update(done)
            if held is not None and (done % tc.eval_every == 0 or done == end):
                rec = held.measure(t.model, done)
                log_f.write(json.dumps(rec) + "\n")
                log_f.flush()
                curves.add(rec)
            stopping = _stop_requested(stop, world, device)
            if done % tc.ckpt_every == 0 or done == end or stopping:
                ckpt_dir = _checkpoint(out, done, run, t, src, rank, world)
            if stopping and done < end:
                progress.close(final_line=False)
                raise Interrupted(f"training stopped by {stop.signal_name or 'a signal'} after step {done} of "
                                  f"{tc.max_steps}; checkpoint saved to {ckpt_dir or out}: rerun the same command to "
                                  "resume")
    finally:
        stop.__exit__()
        progress.close()
        if log_f is not None:
            log_f.close()
        if curves is not None:
            curves.close()
    summary = {
        "family": run.family,
        "steps": end,
        "max_steps": tc.max_steps,
        "resumed_from_step": t.start,
        "first_loss": first_loss,
        "final_loss": last.get("loss"),
        "final_tau_train": last.get("tau"),
        "final_alpha_train": last.get("alpha"),
        "train_seconds": round(time.perf_counter() - t0, 3),
        "tokens_per_s": last.get("tokens_per_s"),
        "trainable_params": sum(p.numel() for p in t.model.parameters() if p.requires_grad),
        **({"draft_vocab": t.draft_vocab} if t.draft_vocab else {}),
        "world_size": world,
        "device": str(device),
        "checkpoint": str(ckpt_dir or latest_checkpoint(out)),
        "run_dir": str(out),
    }
    if rank == 0:
        png = plot_curves(out / METRICS_FILE, out / CURVES_PNG)
        summary.update({"metrics": str(out / METRICS_FILE), "tensorboard": str(out / TB_DIR),
                        **({"curves": str(png)} if png else {}),
                        **({"held_out": held.last} if held is not None and held.last else {})})
        (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
    return summary


class _HeldOut:
    """``train.eval_every``: held-out acceptance every N steps over the first ``eval_samples`` samples of the
    evaluation split (validation, test or eval; the training split, with a warning, when there is none)."""

    def __init__(self, run: RunConfig, src: DataSource, device: torch.device) -> None:
        split = pick_split(list(src.data.splits), run.train.split)
        if split == run.train.split:
            warnings.warn(f"train.eval_every: dataset {src.where} has no validation, test or eval split, so the "
                          f"periodic acceptance is measured on the training split {split!r} (not held out); capture "
                          "one with --data validation=FILE", stacklevel=3)
        self.src, self.split, self.device, self.tc = open_source(src.data, split), split, device, run.train
        self.batches: list[dict[str, Any]] | None = None
        self.last: dict[str, Any] | None = None

    def measure(self, model: Drafter, step: int) -> dict[str, Any]:
        if self.batches is None:
            self.batches = eval_batches(self.src, self.tc)
        self.last = {"step": step, "split": self.split, **held_out_acceptance(model, self.batches, self.device)}
        return {"step": step, "eval": {k: v for k, v in self.last.items() if k != "step"}}


def _stop_requested(stop: StopSignals, world: int, device: torch.device) -> bool:
    """Whether any rank was asked to stop (one all-reduce a step under DDP, so all stop at the same step)."""
    if world == 1:
        return stop.requested
    flag = torch.tensor([float(stop.requested)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _checkpoint(out: Path, step: int, run: RunConfig, t: _Trainer, src: DataSource, rank: int,
                world: int) -> Path | None:
    states = [t.stream.state_dict()]
    if world > 1:
        states = [None] * world
        dist.all_gather_object(states, t.stream.state_dict())
    path = None
    if rank == 0:
        ckpt = Checkpoint(step=step, config=run.to_dict(), fingerprint=src.fingerprint, template=template_state(src),
                          dataset=src.identity(),
                          draft={k: v.detach().cpu() for k, v in t.model.state_dict().items()},
                          optimizer=t.opt.state_dict(), scheduler=t.sched.state_dict(), data_states=states,
                          export_config=_export_config(t.model))
        path = save_checkpoint(out, ckpt, run.train.keep_checkpoints)
    if world > 1:
        dist.barrier()
    return path


def _export_config(model: Drafter) -> dict[str, Any] | None:
    try:
        return model.export_config()
    except NotImplementedError:
        return None
