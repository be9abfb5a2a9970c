"""Sharded, resumable dataset writer; ``finalize_dataset`` (``shards.finalize``) publishes the dataset.

    w = DatasetWriter(out_dir, ShardConfig(), layout, split="train", rank=0)
    for index in range(w.next_index, n_inputs):   # this rank's deterministic input order
        w.write(sample, index)  # or w.skip(index, sample_id, reason)
    w.close()
    finalize_dataset(out_dir, layout=layout, fingerprint=fp, capture_config={...})   # once, after all ranks

Each rank writes its own shards ``data/<split>-rank<r>-<seq>.<ext>`` through ``ShardConfig.writers``
lanes: input index i goes to lane i % writers, lane j's k-th shard is seq k * writers + j, and with more
than one lane each lane encodes, compresses and hashes its shards on its own thread (compression is most
of a writer's CPU; benchmarks/write.py), so a lane's shards are a pure function of its inputs whatever
the timing. A shard is written under
``<name>.tmp`` (sha256 and size computed while streaming) and renamed once complete, then the
shard's own index ``index/<split>-rank<r>-<seq>.<ext>.json`` is written (shards.shard_index) and the
rank's partial index ``_parts/<split>-rank<r>.json`` is rewritten atomically. That index is the
only truth on resume: reopening picks up its shards, deletes a leftover ``.tmp`` (and any shard
renamed but not yet indexed), and ``next_index`` says where to continue. Shards roll when their
size reaches ``shard_bytes`` (they overshoot by at most one record batch / one sample).
``ShardConfig`` lives in ``shards.shard_file``, ``finalize_dataset`` in ``shards.finalize``.
"""

from __future__ import annotations

import json
import queue
import re
import threading
import warnings
from typing import Any

import fsspec

from tapdraft.shards import manifest as mf
from tapdraft.common.atomic import write_json_atomic
from tapdraft.shards.bundle import stored_fingerprint
from tapdraft.shards.schema import SCHEMA_VERSION, Layout, validate_sample
from tapdraft.shards.shard_file import ShardConfig, _Shard
from tapdraft.shards.shard_index import INDEX_DIR, index_name
from tapdraft.shards.taps import foreign_layout_fields

PART_VERSION = 2
"""2: a shard entry records its index file (``index``) instead of its record batches (version 1, written
before schema 2.0, is refused: resume or finalize it with the release that began it)."""


def check_part_version(part: dict[str, Any], path: str) -> None:
    """ValueError unless the partial index ``part`` (read from ``path``) is of ``PART_VERSION``."""
    if part.get("version") != PART_VERSION:
        raise ValueError(f"{path} is a partial index of version {part.get('version')!r}, this tapdraft reads "
                         f"{PART_VERSION}: finish that capture with the release that began it, or capture into a new "
                         "--out directory")


class DatasetWriter:
    """Writes one (split, rank)'s samples into shards; reopening the same directory resumes.

    ``fingerprint``: the target fingerprint stamped into every shard; by default read from
    ``out_dir/target/bundle.json`` when the bundle is already there (write it first).
    ``lineage``: what the samples were made from (capture: a hash of its settings and its inputs'
    content), stamped into every shard's head so that a shard of another capture is refused when
    a dataset is opened; a resume with another lineage is refused.
    """

    def __init__(self, out_dir: str, config: ShardConfig, layout: Layout, split: str = "train", rank: int = 0,
                 *, fingerprint: str | None = None, lineage: str | None = None) -> None:
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        self.config, self.layout, self.split, self.rank = config, layout, mf.check_split(split), rank
        self.fs, self.root = fsspec.core.url_to_fs(str(out_dir))
        if fingerprint is None:
            fingerprint = stored_fingerprint(self.fs, mf.join(self.root, mf.TARGET_DIR))
        self.fingerprint = fingerprint
        self.meta = config.field_meta(layout)
        self.lineage = lineage
        self._part_path = mf.join(self.root, mf.part_name(split, rank))
        self.fs.makedirs(mf.join(self.root, mf.DATA_DIR), exist_ok=True)
        self.fs.makedirs(mf.join(self.root, mf.PARTS_DIR), exist_ok=True)
        self.fs.makedirs(mf.join(self.root, INDEX_DIR), exist_ok=True)
        self._shards: list[dict[str, Any]] = []
        self._skipped: list[dict[str, Any]] = []
        if self.fs.exists(self._part_path):
            self._resume()
        self._clean_leftovers()
        self._done: set[int] = set()
        for entry in self._shards:
            for a, b in entry["indices"]:
                self._done.update(range(a, b))
        self._done.update(s["index"] for s in self._skipped)
        self._pending_idx: set[int] = set()  # indices in open shards or unrecorded skips, over all lanes
        self._lock = threading.Lock()  # lanes' threads finish shards while the caller asks is_done
        n = config.writers
        if n is None:
            raise ValueError("ShardConfig.writers is None (decided at the capture's start): give the writer a lane "
                             "count, or pass the config through capture.config.pin_writers first")
        seqs = [_seq(e["name"]) for e in self._shards]
        self._lanes = [_Lane(j, sum(1 for q in seqs if q % n == j)) for j in range(n)]
        self._closed = False
        self._warned_dup = False
        if n > 1:
            for lane in self._lanes:
                lane.start(self._run_lane)

    def _resume(self) -> None:
        with self.fs.open(self._part_path, "rb") as f:
            part = json.loads(f.read())
        check_part_version(part, self._part_path)
        mine = {"shard_config": self.config.to_dict(), "layout": self.layout.to_dict()}
        part = {**part, "shard_config": ShardConfig.from_dict(part["shard_config"]).to_dict()}
        for name in foreign_layout_fields(self.layout.taps_codec):  # another codec's layout: fp8's for bf16 taps
            part["shard_config"][name] = mine["shard_config"][name]
        for key, want in mine.items():
            if part[key] != want:
                raise ValueError(
                    f"{self._part_path} was written with {key}={part[key]}, now {want}. Resume with the same "
                    "settings, or write to a new directory."
                )
        if self.fingerprint is not None and part.get("fingerprint") not in (None, self.fingerprint):
            raise ValueError(f"{self._part_path} holds shards of target {part['fingerprint'][:12]}, this writer's "
                             f"target is {self.fingerprint[:12]}: write to a new directory")
        self.fingerprint = self.fingerprint or part.get("fingerprint")
        if part.get("lineage") != self.lineage:
            raise ValueError(f"{self._part_path} holds shards made from other inputs (lineage "
                             f"{str(part.get('lineage'))[:12]}, this writer's {str(self.lineage)[:12]}): resume with "
                             "the original inputs, or write to a new directory")
        self._shards, self._skipped = part["shards"], part["skipped"]

    def _clean_leftovers(self) -> None:
        """Delete this rank's temp shards and shards not in its index (renamed just before a crash)."""
        prefix = f"{self.split}-rank{self.rank:05d}-"
        known = {n for e in self._shards for n in (e["name"], index_name(e["name"]))}
        for folder in (mf.DATA_DIR, INDEX_DIR):
            for path in self.fs.ls(mf.join(self.root, folder), detail=False):
                name = path.rstrip("/").split("/")[-1]
                if name.startswith(prefix) and f"{folder}/{name}" not in known:
                    self.fs.rm(path)

    @property
    def next_index(self) -> int:
        """First input index not yet in a finished shard (or recorded skip); resume from here."""
        with self._lock:
            i = 0
            while i in self._done:
                i += 1
            return i

    @property
    def num_done(self) -> int:
        """Inputs already in finished shards or recorded skips."""
        with self._lock:
            return len(self._done)

    def is_done(self, index: int) -> bool:
        """Whether ``index`` is already in a finished shard or a recorded skip (a resume need not redo it)."""
        with self._lock:
            return index in self._done

    def _check_index(self, index: int) -> bool:
        if self._closed:
            raise ValueError(f"writer for {self.split} rank {self.rank} is closed; open a new DatasetWriter to resume")
        if index < 0:
            raise ValueError(f"input index must be >= 0, got {index}")
        self._raise_lane_error()
        with self._lock:
            pending, done = index in self._pending_idx, index in self._done
        if pending:
            raise ValueError(f"input index {index} was already written to the open shard "
                             f"({self.split} rank {self.rank})")
        if done:
            if not self._warned_dup:
                warnings.warn(f"input index {index} is already in a finished shard; ignoring it (resume overlap)",
                              stacklevel=3)
                self._warned_dup = True
            return False
        return True

    def write(self, sample: dict[str, Any], index: int) -> bool:
        """Validate and append one sample; returns False when ``index`` was already finished (ignored).

        With more than one writer lane the sample is encoded on its lane's thread after this returns: hand over
        tensors nothing writes to afterwards (capture's are fresh host copies of each batch)."""
        if not self._check_index(index):
            return False
        try:
            validate_sample(sample, self.layout)
        except ValueError as e:
            raise type(e)(f"{e} (input index {index}, split {self.split}, rank {self.rank})") from e
        self._submit(("write", sample, index), index)
        return True

    def skip(self, index: int, sample_id: str, reason: str) -> None:
        """Record an input that is not written (bad, too long); a resume will not redo it."""
        if not self._check_index(index):
            return
        self._submit(("skip", {"index": int(index), "sample_id": str(sample_id), "reason": str(reason),
                               "rank": self.rank}, index), index)

    def _submit(self, item: tuple[str, Any, int], index: int) -> None:
        """Hand a write or a skip to its lane: at once with one lane, else through the lane's queue (in order)."""
        with self._lock:
            self._pending_idx.add(index)
        lane = self._lanes[index % len(self._lanes)]
        if lane.thread is None:
            self._handle(lane, item)
        else:
            lane.put(item)

    def _handle(self, lane: "_Lane", item: tuple[str, Any, int]) -> None:
        kind, payload, index = item
        lane.indices.add(index)
        if kind == "skip":
            lane.skips.append(payload)
            return
        if lane.shard is None:
            name = mf.rank_shard_name(self.split, self.rank, lane.next_seq(len(self._lanes)), self.config.format)
            lane.shard = _Shard(self.fs, mf.join(self.root, name), self.config, self.meta, self.fingerprint,
                                self.rank, name, self.lineage)
        lane.shard.add(payload, index)
        if lane.shard.full:
            self._finish_shard(lane)

    def _run_lane(self, lane: "_Lane") -> None:
        """A lane's thread: writes and skips in order; at the end (None) finishes its open shard."""
        try:
            while True:
                item = lane.q.get()
                if lane.stop.is_set():
                    return
                if item is None:
                    self._finish_shard(lane)
                    return
                self._handle(lane, item)
        except BaseException as e:  # surfaced on the caller's next write or at close
            lane.error = e

    def _raise_lane_error(self) -> None:
        for lane in self._lanes:
            if lane.error is not None:
                raise lane.error

    def _finish_shard(self, lane: "_Lane") -> None:
        """Close the lane's open shard (if any) and record it with the lane's skips: its indices are done."""
        entry = None
        if lane.shard is not None:
            entry = lane.shard.finish()
            entry["name"] = lane.shard.name
            lane.shard = None
        with self._lock:
            if entry is not None:
                self._shards.append(entry)
                self._shards.sort(key=lambda e: _seq(e["name"]))  # lanes finish in any order; the index does not
            self._skipped.extend(lane.skips)
            self._skipped.sort(key=lambda s: s["index"])
            self._done.update(lane.indices)
            self._pending_idx.difference_update(lane.indices)
            lane.skips, lane.indices = [], set()
            self._write_part(closed=False)

    def _write_part(self, closed: bool) -> None:
        doc = {"version": PART_VERSION, "split": self.split, "rank": self.rank, "schema_version": SCHEMA_VERSION,
               "shard_config": self.config.to_dict(), "layout": self.layout.to_dict(),
               "fingerprint": self.fingerprint, "lineage": self.lineage, "shards": self._shards,
               "skipped": self._skipped, "closed": closed}
        write_json_atomic(self.fs, self._part_path, doc)

    def close(self) -> None:
        """Finish every lane's last shard and mark this rank's partial index closed."""
        if self._closed:
            return
        for lane in self._lanes:
            if lane.thread is None:
                self._finish_shard(lane)
            else:
                lane.put(None)
        for lane in self._lanes:
            lane.join()
        if any(lane.error is not None for lane in self._lanes):
            self.abort()
            self._raise_lane_error()
        self._write_part(closed=True)
        self._closed = True

    def abort(self) -> None:
        """Drop the open shards (their samples will be redone on resume)."""
        for lane in self._lanes:
            lane.halt()
        for lane in self._lanes:
            if lane.shard is not None:
                lane.shard.abort()
                lane.shard = None
        self._closed = True

    def __enter__(self) -> "DatasetWriter":
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


_SEQ_RE = re.compile(r"-(\d+)\.[a-z.]+$")


def _seq(name: str) -> int:
    """The sequence number of a rank shard's name (``data/train-rank00000-00003.arrow`` -> 3)."""
    m = _SEQ_RE.search(name)
    assert m is not None, f"not a rank shard name: {name}"
    return int(m.group(1))


class _Lane:
    """One of a rank's writers: its open shard, the inputs it holds, and with more than one lane its thread."""

    QUEUE = 2
    """Samples waiting per lane: enough to keep its thread busy, few enough to bound memory at real widths."""

    def __init__(self, j: int, finished: int) -> None:
        self.j, self.finished = j, finished
        self.shard: _Shard | None = None
        self.indices: set[int] = set()  # written to the open shard or skipped, not yet recorded
        self.skips: list[dict[str, Any]] = []
        self.q: queue.Queue = queue.Queue(maxsize=self.QUEUE)
        self.thread: threading.Thread | None = None
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def next_seq(self, lanes: int) -> int:
        """Lane j's k-th shard is seq k * lanes + j: names depend on the lane's inputs only."""
        seq = self.finished * lanes + self.j
        self.finished += 1
        return seq

    def start(self, run: Any) -> None:
        self.thread = threading.Thread(target=run, args=(self,), name=f"shard-writer-{self.j}", daemon=True)
        self.thread.start()

    def put(self, item: Any) -> None:
        while self.thread is not None and self.thread.is_alive():
            try:
                self.q.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()

    def halt(self) -> None:
        """Stop the thread without finishing its shard (abort)."""
        if self.thread is not None and self.thread.is_alive():
            self.stop.set()
            try:
                self.q.put_nowait(None)
            except queue.Full:
                pass
            self.thread.join()
