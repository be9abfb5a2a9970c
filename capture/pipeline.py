"""The capture pipeline: inputs -> frozen target -> shards, resumable and multi-rank.

A chain of small stages, composed once in :func:`capture_split`:

    numbered(read_inputs)      (global index, Conversation | BadInput), first max_samples
    rank_slice                 this rank's deterministic slice (global i with i % world == rank),
                               renumbered 0.. in the rank's order ("local index", the writer's index)
    windows                    consecutive runs of ``window`` local indices
    prepare (prefetch thread)  tokenize + decode audio for the NEXT window while this one computes
    plan_window                bad inputs and too-long samples first (index order), then length
                               buckets: sorted by length, longest batches first, <= batch_tokens
                               padded tokens and <= max_batch_size samples
    run_batch (forward.py)     one forward per bucket, taps by hooks, teacher top-k
    to_host                    device-to-host copies into pinned memory (non_blocking) + an event,
                               so the next forward starts while the copy runs
    writer thread              bounded queue; waits for each batch's event, then
                               DatasetWriter.write / skip (validation, compression, shard files)

Determinism and resume: the sequence of writer calls is a pure function of the inputs and the
config (window composition never depends on where a run started), and a forward on the same batch
gives the same bits. A rerun opens the writer, whose ``next_index`` is the first local index not in
a finished shard; the run restarts at that index's window and recomputes every batch that holds an
unfinished index (whole, so its padding and bits are as before); finished indices are not written
or counted again. The resumed dataset equals an uninterrupted run sample by sample.

The dataset directory's layout is shards' business: the bundle is written or checked with
``shards.manifest.write_or_check_bundle``, a finished dataset is recognised with ``complete_manifest``.

Multi-rank: under torchrun (RANK, WORLD_SIZE, LOCAL_RANK set) each rank writes its own shards and
partial index; after a gloo barrier rank 0 merges them (``finalize_dataset``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import queue
import shutil
import threading
import time
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from itertools import islice
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from tapdraft.capture.config import (INPUTS_KEY, PLACEMENT_FIELDS, RUNTIME_FIELDS, CaptureConfig, check_resume, pin_threads,
                            pin_writers, portable_path, rank_cores)
from tapdraft.capture.engines import ENGINES
from tapdraft.capture.forward import SampleSpec, run_batch
from tapdraft.capture.inputs import BadInput, check_input, header_seconds, input_digest, read_inputs, stored_source
from tapdraft.capture.provenance import check_target, read_provenance, replies_from_target, sidecar_path, target_fingerprint
from tapdraft.capture.replies.fused import fused_window
from tapdraft.capture.replies.regenerate import RegenerateConfig, regenerate
from tapdraft.capture.replies.windows import REPLY_DROP_REASONS
from tapdraft.capture.stages import barrier as _barrier
from tapdraft.capture.stages import Skip, bucket, numbered, rank_slice, resolve_device, resolve_dtype, windows
from tapdraft.capture.stages import dist_env as _dist_env
from tapdraft.capture.targets.base import Prepared, Target
from tapdraft.capture.targets.load import load_target
from tapdraft.capture.vllm.engine import VLLMEngine, vllm_batches
from tapdraft.common.atomic import staged
from tapdraft.common.errors import CaptureError, Interrupted
from tapdraft.shards.manifest import (complete_manifest, dataset_fingerprint, discard_dataset,
                             foreign_directory, write_or_check_bundle, writer_lock)
from tapdraft.common.progress import Progress
from tapdraft.shards.schema import Layout, NonFiniteError
from tapdraft.shards.taps import capture_tap_ids
from tapdraft.common.template import read_template_file, template_sha
from tapdraft.shards.transfer import StagedUpload, is_remote_url, staging_dir
from tapdraft.shards.finalize import finalize_dataset
from tapdraft.shards.writer import DatasetWriter

CONFIG_FILE = "capture_config.json"


# ------------------------------------------------------------------------------------------ stages
@dataclass
class WindowPlan:
    """What one window turns into: skips first (index order), then forward batches."""

    skips: list[Skip] = field(default_factory=list)
    batches: list[list[Prepared]] = field(default_factory=list)


HEADER_MARGIN = 2.0
"""A sample is skipped as too long from its audio headers, before decoding, when its audio alone is more than this
many times the positions that fit (at the target's nominal seconds a frame): sure to be too long whatever an encoder's
rounding, so nothing that fits is skipped; anything closer is decoded and measured exactly (``plan_window``)."""


def _too_long_unheard(target: Target, item: Any, limit: tuple[int, str] | None) -> str | None:
    """Why ``item`` is too long, told from its audio headers alone (None when they do not tell)."""
    frame_s = target.audio_bundle().get("frame_seconds") if limit is not None and item.audios else None
    if not frame_s:
        return None
    seconds = [header_seconds(a) for a in item.audios]
    if any(s is None for s in seconds) or sum(seconds) / frame_s <= HEADER_MARGIN * limit[0]:
        return None
    return (f"too long: {sum(seconds):.1f}s of audio (from its header, not decoded) is about "
            f"{int(sum(seconds) / frame_s)} positions > {limit[1]} {limit[0]}")


def prepare_window(target: Target, chunk: list[tuple[int, Any]], *, max_length: int | None = None,
                   max_positions: int | None = None) -> list[Prepared | Skip]:
    """Each input prepared for the forward (audio decoded), or a Skip: a bad input, or one whose audio headers
    already show it too long for ``max_length`` / the target's ``max_positions`` (never decoded)."""
    limits = [(n, what) for n, what in ((max_length, "max_length"), (max_positions, "the target's "
              "max_position_embeddings")) if n is not None]
    limit = min(limits) if limits else None
    out: list[Prepared | Skip] = []
    for idx, item in chunk:
        if isinstance(item, BadInput):
            out.append(Skip(idx, item.sample_id, item.reason, "error", item.line, item.source))
            continue
        why = _too_long_unheard(target, item, limit)
        if why is not None:
            out.append(Skip(idx, item.sample_id, why, "too_long", item.line, item.source))
            continue
        try:
            out.append(target.prepare(item, idx))
        except (ValueError, OSError) as e:
            out.append(Skip(idx, item.sample_id, str(e), "error", item.line, item.source))
    return out


def plan_window(prepared: list[Prepared | Skip], *, max_length: int | None, batch_tokens: int, max_batch_size: int,
                max_positions: int | None = None) -> WindowPlan:
    """Skips (bad inputs; samples longer than ``max_length`` or the target's ``max_positions``, whose states
    past that length the target was never trained for) and length-bucketed batches (``stages.bucket``)."""
    plan = WindowPlan()
    ok: dict[int, Prepared] = {}
    for p in prepared:
        if isinstance(p, Skip):
            plan.skips.append(p)
        elif max_length is not None and p.length > max_length:
            plan.skips.append(Skip(p.index, p.sample_id, f"too long: {p.length} positions > max_length "
                                   f"{max_length}", "too_long", p.line, p.source))
        elif max_positions is not None and p.length > max_positions:
            plan.skips.append(Skip(p.index, p.sample_id, f"too long: {p.length} positions > the target's "
                                   f"max_position_embeddings {max_positions}", "too_long", p.line, p.source))
        else:
            ok[p.index] = p
    plan.skips.sort(key=lambda s: s.index)
    groups = bucket({i: p.length for i, p in ok.items()}, batch_tokens=batch_tokens, max_batch_size=max_batch_size)
    plan.batches = [[ok[i] for i in g] for g in groups]
    return plan


_COPY_STREAMS: dict[Any, Any] = {}


def to_host(samples: list[Any]) -> tuple[list[Any], Any]:
    """Start device-to-host copies; returns the host dicts and an event the writer waits on.

    On CUDA the copies run on a side stream into pinned buffers (``non_blocking``), so they overlap
    the next batch's forward on the compute stream; ``record_stream`` keeps the allocator from
    reusing the source memory early.
    """
    tensors = [t for s in samples if isinstance(s, dict) for t in s.values()]
    if all(t.device.type == "cpu" for t in tensors):
        return samples, None
    dev = tensors[0].device
    stream = _COPY_STREAMS.setdefault(dev, torch.cuda.Stream(device=dev))
    stream.wait_stream(torch.cuda.current_stream(dev))
    host: list[Any] = []
    with torch.cuda.stream(stream):
        for s in samples:
            if not isinstance(s, dict):
                host.append(s)
                continue
            h = {}
            for k, t in s.items():
                if t.device.type == "cpu":  # a row already on the host (ids, masks) is kept as it is
                    h[k] = t
                    continue
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                buf.copy_(t, non_blocking=True)
                t.record_stream(stream)
                h[k] = buf
            host.append(h)
        ev = torch.cuda.Event()
        ev.record(stream)
    return host, ev


# ------------------------------------------------------------------------------------------ writer thread
@dataclass
class Stats:
    written: int = 0
    tokens: int = 0
    supervised: int = 0
    audio_seconds: float = 0.0
    raw_bytes: int = 0
    supervised_unk: int = 0
    skipped: Counter = field(default_factory=Counter)
    seconds: float = 0.0
    unsupervised_turns: int = 0
    """Assistant turns of written samples that the chat template leaves unsupervised (capture.template)."""


class _WriterThread:
    """Consumes (kind, payload) items in order from a bounded queue and drives the DatasetWriter."""

    def __init__(self, writer: DatasetWriter, stats: Stats, *, on_error: str, queue_size: int,
                 unk_token_id: int | None = None):
        self.writer, self.stats, self.on_error = writer, stats, on_error
        self.unk_token_id = unk_token_id
        self.q: queue.Queue = queue.Queue(maxsize=queue_size)
        self.error: BaseException | None = None
        self.failed_on: Skip | None = None
        self.thread = threading.Thread(target=self._run, name="capture-writer", daemon=True)
        self.thread.start()

    def put(self, item: Any) -> None:
        while True:
            if not self.thread.is_alive():
                return
            try:
                self.q.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def _skip(self, s: Skip) -> None:
        if self.writer.is_done(s.index) or self._after_failure(s.index):
            return
        if s.kind == "error" and self.on_error == "fail":
            self.failed_on = s  # keep writing the window's earlier indices, stop at its end
            return
        self.writer.skip(s.index, s.sample_id, s.reason)
        self.stats.skipped[s.kind] += 1

    def _after_failure(self, index: int) -> bool:
        return self.failed_on is not None and index > self.failed_on.index

    def _run(self) -> None:
        try:
            while True:
                item = self.q.get()
                if item is None:
                    return
                kind, payload = item
                if kind == "end":  # end of a window
                    if self.failed_on is not None:
                        return
                    continue
                if kind == "skips":
                    for s in payload:
                        self._skip(s)
                    continue
                batch, results, event = payload
                if event is not None:
                    event.synchronize()
                for p, res in zip(batch, results):
                    if self.writer.is_done(p.index) or self._after_failure(p.index):
                        continue
                    sample = {"sample_id": p.sample_id, "source": stored_source(p.source, p.line),
                              "audio_seconds": float(p.audio_seconds), **res}
                    try:
                        if not self.writer.write(sample, p.index):
                            continue
                    except NonFiniteError as e:
                        self._skip(Skip(p.index, p.sample_id, f"the target produced NaN/Inf: {e}", "error", p.line,
                                        p.source))
                        continue
                    st = self.stats
                    st.written += 1
                    st.tokens += int(res["input_ids"].shape[0])
                    st.supervised += int(res["loss_mask"].sum())
                    if self.unk_token_id is not None:
                        st.supervised_unk += int((res["input_ids"][res["loss_mask"]] == self.unk_token_id).sum())
                    st.audio_seconds += p.audio_seconds
                    st.unsupervised_turns += p.unsupervised_turns
                    st.raw_bytes += sum(t.numel() * t.element_size() for t in res.values())
        except BaseException as e:  # surfaced by the main thread
            self.error = e

    def finish(self) -> None:
        if self.thread.is_alive():
            self.put(None)
        self.thread.join()


# ------------------------------------------------------------------------------------------ orchestration
def make_layout(cfg: CaptureConfig, target: Target) -> Layout:
    L = target.num_layers
    taps = list(cfg.taps) if cfg.taps is not None else capture_tap_ids(L, cfg.draft_layers)
    if any(t < 0 or t >= L for t in taps):
        raise ValueError(f"--taps {taps} out of range: the target has {L} decoder layers (ids 0..{L - 1})")
    vocab = int(target.lm.get_output_embeddings().weight.shape[0])
    top_k = min(cfg.top_k, vocab)
    if top_k < cfg.top_k:
        warnings.warn(f"--top-k {cfg.top_k} exceeds the target's vocabulary of {vocab}: storing the whole "
                      f"distribution (k = {vocab}, recorded in the manifest's top_k)", stacklevel=2)
    return Layout(hidden_size=target.hidden_size, num_layers=L, tap_ids=tuple(taps), top_k=top_k,
                  audio_token_id=target.audio_token_id, has_final_hidden=cfg.final_hidden,
                  has_audio_embeds=cfg.audio_embeds, taps_codec=cfg.codec)


def _rates(stats: Stats, t0: float) -> str:
    dt = max(time.perf_counter() - t0, 1e-9)
    return (f"{stats.written / dt:.1f} samples/s  {stats.tokens / dt:,.0f} tok/s  "
            f"{stats.raw_bytes / dt / 1e6:.1f} MB/s written")


def _run_window(target: Target, engine: VLLMEngine | None, spec: SampleSpec, plan: WindowPlan,
                writer: DatasetWriter, wt: "_WriterThread", report: Callable[[int], None], done: int, *,
                on_error: str) -> tuple[int, bool]:
    """Queue one window's skips and forward its batches; returns the updated count of finished inputs and
    whether the capture stops after this window (a bad input under on_error='fail').

    Finished indices need not be a prefix (bucketing: a shard can hold index 5 while 3 was lost), and a
    batch is recomputed whole (its padding shapes the bits) unless all of it is done. With
    on_error='fail' nothing after the window's first bad input is computed.
    """
    skips = [s for s in plan.skips if not writer.is_done(s.index)]
    errors = [s.index for s in skips if s.kind == "error"]
    fail_at = min(errors) if errors and on_error == "fail" else None
    wt.put(("skips", skips))
    done += len(skips)
    batches = [b for b in plan.batches if fail_at is None or b[0].index <= fail_at]
    todo = [sum(1 for p in b if not writer.is_done(p.index)) for b in batches]
    counts = {b[0].index: n for b, n in zip(batches, todo)}
    for batch, results in _forward(target, engine, batches, todo, spec):
        if wt.error is not None or not wt.thread.is_alive():
            break
        wt.put(("batch", (batch, *to_host(results))))
        done += counts[batch[0].index]
        report(done)
    return done, fail_at is not None


def _forward(target: Target, engine: VLLMEngine | None, batches: list[list[Prepared]], todo: list[int],
             spec: SampleSpec) -> Iterator[tuple[list[Prepared], list[dict[str, torch.Tensor]]]]:
    """(batch, stored fields) for each batch with unfinished samples, in plan order: one padded forward a batch
    in-process, or the whole window through vLLM (capture.vllm.engine) when any of it is unfinished."""
    if engine is not None:
        if any(todo):
            yield from vllm_batches(engine, target, batches, [n > 0 for n in todo], spec)
        return
    for batch, n in zip(batches, todo):
        if n:
            yield batch, run_batch(target, batch, spec)


def _run_fused_window(target: Target, cfg: CaptureConfig, spec: SampleSpec, chunk: list[tuple[int, Any]],
                      writer: DatasetWriter, wt: "_WriterThread", report: Callable[[int], None], done: int) -> int:
    """One window of ``capture --regenerate``: regenerate with states kept, queue skips and samples.

    The whole window is recomputed unless every index is done (its batches shape the bits); the
    writer thread leaves finished indices alone.
    """
    todo = sum(1 for li, _ in chunk if not writer.is_done(li))
    if not todo:
        return done
    assert cfg.replies is not None
    skips, batch, results = fused_window(
        target, cfg.replies, chunk, spec, batch_tokens=cfg.batch_tokens,
        max_batch_size=cfg.max_batch_size, max_length=cfg.max_length, on_error=cfg.on_error)
    wt.put(("skips", skips))
    if batch:
        wt.put(("batch", (batch, *to_host(results))))
    done += todo
    report(done)
    return done


def _raise_if_failed(wt: "_WriterThread") -> None:
    if wt.error is not None:
        raise wt.error
    if wt.failed_on is not None:
        s = wt.failed_on
        raise CaptureError(
            f"bad input {s.sample_id!r} ({s.source}, line {s.line}): {s.reason}. Everything before it is saved; "
            "fix the input and rerun with --restart (the capture starts over), or rerun the same command with "
            "--on-error skip to record and skip bad inputs."
        )


def rank_items(target: Target, spec: str, rank: int, world_size: int, max_samples: int | None = None,
               allow_outside_paths: bool = False) -> Iterator[tuple[int, Any]]:
    """This rank's (local index, Conversation | BadInput) of one split's first ``max_samples`` inputs."""
    placeholder = target.input_placeholder
    items = read_inputs(spec, placeholder=placeholder, allow_outside_paths=allow_outside_paths)
    return rank_slice(numbered(items, max_samples), rank, world_size)


def capture_split(
    target: Target, cfg: CaptureConfig, layout: Layout, split: str, spec: str, *, rank: int, world_size: int,
    fingerprint: str, lineage: str | None = None, engine: VLLMEngine | None = None,
) -> Stats:
    """Capture one split for this rank into ``cfg.out``; resumes what an earlier run left."""
    writer = DatasetWriter(cfg.out, cfg.shard, layout, split=split, rank=rank, fingerprint=fingerprint,
                           lineage=lineage)
    stats = Stats()
    items = partial(rank_items, target, spec, rank, world_size, cfg.max_samples, cfg.allow_outside_paths)
    total = sum(1 for _ in items())
    wins = islice(windows(items(), cfg.window), writer.next_index // cfg.window, None)
    wt = _WriterThread(writer, stats, on_error=cfg.on_error, queue_size=cfg.queue_size,
                       unk_token_id=getattr(target.tokenizer, "unk_token_id", None))
    sample_spec = SampleSpec.of(layout, cfg.row_chunk)
    prepare = partial(prepare_window, max_length=cfg.max_length, max_positions=target.max_positions)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="capture-prepare")
    t0 = time.perf_counter()
    done = min(writer.num_done, total)
    try:
        with Progress(f"capture {split}", total, done=done, enabled=cfg.progress) as bar:
            report = lambda n: bar.update(n, _rates(stats, t0))  # noqa: E731
            if cfg.replies is not None:  # fused: generation is the forward; nothing to prefetch
                for chunk in wins:
                    done = _run_fused_window(target, cfg, sample_spec, chunk, writer, wt, report, done)
                    wt.put(("end", None))
                    if wt.error is not None or not wt.thread.is_alive():
                        break
                nxt, fut = None, None
            else:
                nxt = next(wins, None)
                fut = pool.submit(prepare, target, nxt) if nxt is not None else None
            while fut is not None:
                prepared = fut.result()
                nxt = next(wins, None)
                fut = pool.submit(prepare, target, nxt) if nxt is not None else None
                plan = plan_window(prepared, max_length=cfg.max_length, batch_tokens=cfg.batch_tokens,
                                   max_batch_size=cfg.max_batch_size, max_positions=target.max_positions)
                done, stop = _run_window(target, engine, sample_spec, plan, writer, wt, report, done,
                                         on_error=cfg.on_error)
                wt.put(("end", None))
                if stop or wt.error is not None or not wt.thread.is_alive():
                    break
            wt.finish()
            _close_or_abort(writer, wt)
            bar.update(done, _rates(stats, t0))
            bar.close(final_line=wt.error is None and wt.failed_on is None)  # a failure's error line says enough
    except BaseException as e:
        wt.finish()
        pool.shutdown(wait=True, cancel_futures=True)
        _close_or_abort(writer, wt)
        if isinstance(e, KeyboardInterrupt):
            raise Interrupted(
                f"capture interrupted: split {split!r} has {writer.num_done} of {total} inputs done and kept in "
                f"finished shards of {cfg.out} ({stats.written} written by this run); rerun the same command to resume"
            ) from None
        raise
    pool.shutdown(wait=True)
    _raise_if_failed(wt)
    stats.seconds = time.perf_counter() - t0
    return stats


def _close_or_abort(writer: DatasetWriter, wt: "_WriterThread") -> None:
    """Keep what the writer holds (close: its open shard becomes a finished one), unless writing itself
    failed (a full disk): then drop the open shard's temp file, which a resume would redo anyway.
    A second call does nothing (the writer is closed either way)."""
    if wt.error is None:
        try:
            writer.close()
            return
        except OSError:
            writer.abort()
            raise
    writer.abort()



def lineage(record: dict[str, Any], split: str) -> str:
    """What a split's shards are made from: the capture's settings (less those a resume may change and those that
    only place samples) and the input's hash."""
    ident = {k: v for k, v in record.items() if k not in RUNTIME_FIELDS + PLACEMENT_FIELDS and k != INPUTS_KEY}
    doc = {"capture": ident, "split": split, "input": record[INPUTS_KEY][split]}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def capture(cfg: CaptureConfig, *, target: Target | None = None, restart: bool = False) -> dict[str, Any]:
    """Run (or resume) a capture; returns the final manifest plus this run's ``run_stats``.

    Ctrl-C is ``common.errors.Interrupted`` saying what was kept: inside a split's sample loop the open
    shard is finished and counted; elsewhere (loading, finalizing) finished shards are kept as they are.
    This rank holds its exclusive lock on ``cfg.out`` throughout (a second capture is refused).

    Every input, the device and the target path are checked before anything is created (:func:`check_inputs`);
    a failure before the capture's record is written removes the ``--out`` this run created, so a corrected
    command starts clean. ``restart`` discards an earlier capture in ``cfg.out`` (a changed input or setting
    is then accepted) and starts over.
    """
    try:
        if is_remote_url(cfg.out):
            return _capture_to_store(cfg, target, restart)
        return _capture_local(cfg, target, restart)
    except KeyboardInterrupt:
        raise Interrupted(f"capture interrupted outside its sample loop (loading the target or finalizing): the "
                          f"finished shards in {cfg.out} are kept; rerun the same command to resume") from None


def _capture_local(cfg: CaptureConfig, target: Target | None, restart: bool) -> dict[str, Any]:
    """A capture into the local directory ``cfg.out``."""
    rank, world = _dist_env()
    out = Path(cfg.out)
    if foreign_directory(str(out), own=(CONFIG_FILE,)):
        raise ValueError(f"--out {out} is a non-empty directory that is not a tapdraft dataset; capture into a new "
                         "or empty directory (nothing in it was changed)")
    check_inputs(cfg)
    resolve_device(cfg.device)
    if target is None and not Path(cfg.target).exists():
        raise FileNotFoundError(f"target {Path(cfg.target).absolute()} does not exist; check the --target path")
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        with writer_lock(str(out), rank):
            return _capture_locked(cfg, target, out, rank, world, restart)
    except BaseException:
        if created and rank == 0 and not (out / CONFIG_FILE).exists():
            shutil.rmtree(out, ignore_errors=True)  # nothing of this run is worth resuming
        raise


def _capture_to_store(cfg: CaptureConfig, target: Target | None, restart: bool) -> dict[str, Any]:
    """Capture into the local stage while finished shards upload in the background; rank 0 then pushes the
    finalized dataset (manifest last). A rerun resumes the stage, then the upload."""
    rank, _ = _dist_env()
    stage = cfg.stage or staging_dir(cfg.out)
    with StagedUpload(stage, cfg.out, rank) as up:
        manifest = _capture_local(dataclasses.replace(cfg, out=stage), target, restart)
    if rank == 0:
        upload = {**up.finish(), "stage": stage, "background": len(up.sent), "background_errors": up.errors,
                  "last_error": up.last_error}
        manifest["run_stats"] = {**manifest.get("run_stats", {}), "upload": upload}
        manifest["url"] = cfg.out
    return manifest


def _requests_of(spec: str) -> dict[str, Any]:
    """``{"requests": ...}`` when the input's requests were the target's own (``tapdraft requests``, carried by
    regenerate's sidecar): the dataset records how its data was made."""
    doc = read_provenance(spec)
    return {"requests": doc["requests"]} if doc is not None and "requests" in doc else {}


def check_inputs(cfg: CaptureConfig) -> None:
    """Refuse a missing or empty input before anything is written; an empty regenerate output is named with
    the counts of its sidecar (why its conversations were dropped)."""
    for split, spec in cfg.data:
        if check_input(spec) != "empty":
            continue
        doc = read_provenance(spec)
        why = ""
        if doc is not None:
            c = doc.get("counts", {})
            why = (f": it is a regenerate output that kept {c.get('written')} of {c.get('conversations')} "
                   f"conversations (dropped {c.get('dropped')}; see {sidecar_path(spec)}); rerun regenerate with "
                   "settings that keep replies (a larger --max-new-tokens, a target that ends its turns)")
        raise ValueError(f"input {Path(spec).absolute()} (split {split}) holds no conversations{why}")


def discard_capture(out: Path) -> None:
    """``capture --restart``: remove what an earlier capture wrote into ``out`` and nothing else
    (``shards.manifest.discard_dataset``), keeping the lock files of the ranks running now."""
    discard_dataset(out, own=(CONFIG_FILE,))


def _capture_locked(cfg: CaptureConfig, target: Target | None, out: Path, rank: int, world: int,
                    restart: bool = False) -> dict[str, Any]:
    if restart:
        if rank == 0:
            discard_capture(out)
        _barrier(world)
    specs = [spec for _, spec in cfg.data]
    if cfg.responses_from_target is None:
        derived = cfg.replies.from_target if cfg.replies is not None else replies_from_target(specs)
        cfg = dataclasses.replace(cfg, responses_from_target=derived)
    cfg = pin_threads(cfg, out / CONFIG_FILE, torch.get_num_threads())  # recorded below: a resume computes alike
    cfg = pin_writers(cfg, out / CONFIG_FILE, resolve_device(cfg.device).type, rank_cores())  # likewise
    inputs = {split: {"input": portable_path(spec), "sha256": input_digest(spec),
                      **_requests_of(spec)} for split, spec in cfg.data}
    record = {**cfg.to_dict(), "world_size": world, INPUTS_KEY: inputs}
    cfg_path = out / CONFIG_FILE
    check_resume(cfg_path, record, given=dict(cfg.data))
    done = complete_manifest(str(out))
    if done is not None:
        return {**done, "run_stats": {"already_complete": True}}
    engine_kind = ENGINES[cfg.engine]
    engine_kind.preflight(cfg)  # before anything is loaded or written
    device = resolve_device(cfg.device)
    template = None if cfg.chat_template is None else read_template_file(cfg.chat_template)
    if target is None:
        target = load_target(cfg.target, dtype=resolve_dtype(cfg.dtype, device), device=str(device),
                             llm_config=cfg.llm_config, template=template, template_kwargs=dict(cfg.template_kwargs),
                             head_only=not engine_kind.loads_decoder)  # vLLM's runs elsewhere: only the head here
    elif template is not None or cfg.template_kwargs:
        target.use_template(template, dict(cfg.template_kwargs))
    if not target.kind:  # before anything is written: the manifest records it
        raise ValueError(f"{type(target).__name__} declares no kind; set ``kind`` in its class body (the manifest's "
                         "target_kind, capture/targets/base.py)")
    engine_kind.check_target(target, audio_embeds=cfg.audio_embeds)
    if cfg.replies is None and any(read_provenance(s) is not None for s in specs):
        check_target(specs, target_fingerprint(target))
    layout = make_layout(cfg, target)
    if rank == 0:
        fingerprint = write_or_check_bundle(str(out), fingerprint=lambda: target_fingerprint(target),
                                           **target.bundle_parts())
        if not cfg_path.is_file():
            with staged(cfg_path) as tmp:
                tmp.write_text(json.dumps(record, indent=2, sort_keys=True))
    _barrier(world)
    if rank != 0:
        fingerprint = dataset_fingerprint(str(out))
    run_stats: dict[str, Any] = {}
    t0 = time.perf_counter()
    with engine_kind.capture_session(cfg, target, layout) as engine, torch.inference_mode():
        for split, spec in cfg.data:
            if cfg.replies is not None and not cfg.fused:  # two passes: regenerate the text, capture it as input
                spec = _regenerate_split(target, cfg, split, spec)
                # its own first pass's output: the input's audio paths were checked as that pass read them
                cfg_split = dataclasses.replace(cfg, replies=None, max_samples=None, allow_outside_paths=True)
            else:
                cfg_split = cfg
            st = capture_split(target, cfg_split, layout, split, spec, rank=rank, world_size=world,
                               fingerprint=fingerprint, lineage=lineage(record, split), engine=engine)
            run_stats[split] = {"written": st.written, "tokens": st.tokens, "supervised_tokens": st.supervised,
                                "audio_seconds": round(st.audio_seconds, 3), "raw_bytes": st.raw_bytes,
                                "supervised_unk": st.supervised_unk,
                                "skipped": dict(st.skipped), "seconds": round(st.seconds, 3),
                                "unsupervised_turns": st.unsupervised_turns}
        if engine is not None:
            run_stats["engine"] = {"name": cfg.engine, "version": engine.version,
                                   "startup_s": round(engine.startup_s, 3)}
    _barrier(world)
    if rank != 0:
        return {"run_stats": run_stats, "rank": rank}
    manifest = finalize_dataset(
        str(out), layout=layout, fingerprint=fingerprint, capture_config=record,
        extra={"audio_token_id": layout.audio_token_id, "placeholder": target.placeholder,
               "target_kind": target.kind, "chat_template": template_record(target)},
    )
    manifest["run_stats"] = {**run_stats, "seconds": round(time.perf_counter() - t0, 3)}
    return manifest


def template_record(target: Target) -> dict[str, Any]:
    """The manifest's note on how conversations became tokens (the text itself is in the bundle)."""
    t = target.template
    return {"sha256": template_sha(t.text), "kwargs": t.kwargs, "assistant_mask": t.mask_source}


SHARED_WITH_REGENERATE = tuple(sorted(
    {f.name for f in dataclasses.fields(RegenerateConfig)} & {f.name for f in dataclasses.fields(CaptureConfig)}
    - {"data", "out"}))
"""The settings a two-pass ``capture --regenerate`` hands to its regenerate pass: every field the two configs
share by name (a field of the same name means the same in both), less the input and output."""


def regenerate_config(cfg: CaptureConfig, split: str, spec: str) -> RegenerateConfig:
    """The two-pass path's first pass for one split: ``spec`` regenerated into ``OUT.regenerated/SPLIT.jsonl``."""
    assert cfg.replies is not None
    out = Path(str(cfg.out).rstrip("/") + ".regenerated") / f"{split}.jsonl"
    return RegenerateConfig(data=spec, out=str(out), **{k: getattr(cfg, k) for k in SHARED_WITH_REGENERATE})


def _regenerate_split(target: Target, cfg: CaptureConfig, split: str, spec: str) -> str:
    """Run the first pass (resumed or reused like any regenerate); returns its output, the second pass's input."""
    rcfg = regenerate_config(cfg, split, spec)
    regenerate(rcfg, target=target)
    return rcfg.out


def _skip_kind(reason: str) -> str:
    head = reason.split(":", 1)[0]
    return "too long" if reason.startswith("too long") else head if head in REPLY_DROP_REASONS else "bad input"


def summary(manifest: dict[str, Any]) -> str:
    """One screen: per split counts, skips, bytes and this run's rates."""
    rs = manifest.get("run_stats", {})
    if rs.get("already_complete"):
        return "dataset already complete; nothing to do"
    lines = []
    for split, s in manifest.get("splits", {}).items():
        r = rs.get(split, {})
        secs = r.get("seconds") or 0.0
        rate = (f"  this run: {r.get('written', 0)} samples in {secs:.1f}s = {r.get('written', 0) / secs:.1f} "
                f"samples/s, {r.get('tokens', 0) / secs:,.0f} tok/s, {r.get('raw_bytes', 0) / secs / 1e6:.1f} MB/s"
                if secs else "")
        skipped = manifest.get("skipped", {}).get(split, [])
        reasons = Counter(_skip_kind(x["reason"]) for x in skipped)
        turns = (f"\n  {r['unsupervised_turns']} assistant turn(s) left unsupervised: rendered as the last turn they "
                 "differ from the conversation's tokens (capture/template.py says why)"
                 if r.get("unsupervised_turns") else "")
        lines.append(
            f"{split}: {s['samples']} samples, {s['tokens']:,} tokens ({s['supervised_tokens']:,} supervised), "
            f"{s['audio_seconds']:.1f}s audio, {len(s['shards'])} shard(s), {s['bytes'] / 1e6:.2f} MB"
            f"; skipped {dict(reasons) or 0}\n{rate}{turns}"
        )
        if r.get("supervised_unk"):
            lines.append(f"  WARNING: {r['supervised_unk']:,} supervised tokens are <unk> (this run): the tokenizer "
                         "cannot encode part of the replies, and drafters will learn to predict <unk>")
    up = rs.get("upload")
    if up:
        lines.append(f"uploaded to {manifest.get('url', 'the store')}: up to date" if up.get("up_to_date") else
                     f"uploaded: {up['background']} shard(s) while capturing, {up['uploaded']} file(s) after "
                     f"({up['bytes_sent']:,} bytes), {up['copied']} renamed on the store; manifest written last "
                     f"(staged in {up['stage']})")
    return "\n".join(lines)
