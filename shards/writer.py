"""Sharded, resumable dataset writer and the finalize step that publishes a dataset.

    w = DatasetWriter(out_dir, ShardConfig(), layout, split="train", rank=0)
    for index in range(w.next_index, n_inputs):   # this rank's deterministic input order
        w.write(sample, index)  # or w.skip(index, sample_id, reason)
    w.close()
    finalize_dataset(out_dir, layout=layout, fingerprint=fp, capture_config={...})   # once, after all ranks

Each rank writes its own shards ``data/<split>-rank<r>-<seq>.<ext>``; a shard is written under
``<name>.tmp`` (sha256 and size computed while streaming) and renamed once complete, then the
rank's partial index ``_parts/<split>-rank<r>.json`` is rewritten atomically. That index is the
only truth on resume: reopening picks up its shards, deletes a leftover ``.tmp`` (and any shard
renamed but not yet indexed), and ``next_index`` says where to continue. Shards roll when their
size reaches ``shard_bytes`` (they overshoot by at most one record batch / one sample).

``finalize_dataset`` checks every rank closed with the same config, layout and fingerprint and that
every split holds at least one sample (a split whose every input was skipped is refused, naming the
first reasons, and no manifest is written), removes ``manifest.json``, records each shard's final
name ``data/<split>-00000-of-00012.<ext>`` ((rank, seq) order) in the partial indexes (the journal),
renames the shards, writes the card, then ``manifest.json`` last. Every step is idempotent and the
journal is written before any rename, so a finalize killed at any instant is finished by running it
again (the capture's rerun does).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import warnings
from dataclasses import dataclass
from typing import Any

import fsspec
import pyarrow as pa

from shards import manifest as mf
from shards.arrow_io import arrow_schema, make_batch, shard_metadata
from shards.atomic import commit, temp_name, write_bytes_atomic, write_json_atomic
from shards.bundle import stored_fingerprint
from shards.codec import BF16_LAYOUTS, FP8_LAYOUTS, LEGACY_FP8_LAYOUT, FieldMeta, encode_fields
from shards.integrity import INTEGRITY, BlockHasher, digest
from shards.schema import SCHEMA_VERSION, Layout, check_schema_version, validate_sample
from shards.wds_io import TarShardWriter, sample_key

PART_VERSION = 1
LEGACY_SHARD_FIELDS = {"fp8_layout": LEGACY_FP8_LAYOUT}
"""What a shard config recorded before a field existed used for it (fp8 taps were one byte a value)."""
FORMATS = ("arrow", "wds")


@dataclass(frozen=True)
class ShardConfig:
    """How samples become files."""

    format: str = "arrow"
    """'arrow' (IPC stream, zstd buffers, random access) or 'wds' (WebDataset tar, zstd per member)."""
    shard_bytes: int = 1 << 30
    """Roll to a new shard once a shard reaches this many bytes on disk."""
    zstd_level: int = 1
    """zstd level for Arrow buffers / tar members. 1 beats 3 on bf16 activations in size AND speed
    (benchmarks/storage.py: 0.699 vs 0.714 of the .pt bytes; ~5x faster to compress). 0 = Arrow shards
    without compression: the fastest read (with bf16_layout 'raw' a record batch's taps become tensors
    without a decode pass), at about the .pt baseline's bytes (benchmarks/read.py, storage.py)."""
    bf16_layout: str = "planes"
    """'planes' (high bytes then low bytes, compresses better) or 'raw' (uint16 words); both lossless."""
    batch_bytes: int = 1 << 20
    """Arrow: uncompressed bytes per record batch at most (the unit of compression and of random access); a
    sample that would take the batch past it starts the next one, and a sample larger than it is a batch of
    its own. 1 MiB: random access to a small sample decompresses about its own bytes (64 tokens at hidden
    1024 with six taps: 3.5 -> 1.7 ms with 4 -> 1 MiB under load; sizes equal to 0.02%), and long
    conversations at real widths are one batch each whatever the setting."""
    fp8_layout: str = "packed"
    """fp8 taps only: 'packed' (sign+exponent plane + 3-bit mantissas, 0.83x the bytes of 'bytes' after
    zstd on a trained decoder) or 'bytes' (one e4m3 byte per value); recorded in the shards' metadata."""

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"ShardConfig.format must be one of {FORMATS}, got {self.format!r}")
        if self.shard_bytes < 1:
            raise ValueError(f"ShardConfig.shard_bytes must be positive, got {self.shard_bytes}")
        if not 0 <= self.zstd_level <= 22:
            raise ValueError(f"ShardConfig.zstd_level must be in [0, 22] (0: uncompressed), got {self.zstd_level}")
        if self.zstd_level == 0 and self.format != "arrow":
            raise ValueError("ShardConfig.zstd_level 0 (uncompressed) is for Arrow shards: WebDataset members are zstd "
                             "frames; use format 'arrow' or a level in [1, 22]")
        if self.bf16_layout not in BF16_LAYOUTS:
            raise ValueError(f"ShardConfig.bf16_layout must be one of {BF16_LAYOUTS}, got {self.bf16_layout!r}")
        if self.batch_bytes < 1:
            raise ValueError(f"ShardConfig.batch_bytes must be positive, got {self.batch_bytes}")
        if self.fp8_layout not in FP8_LAYOUTS:
            raise ValueError(f"ShardConfig.fp8_layout must be one of {FP8_LAYOUTS}, got {self.fp8_layout!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ShardConfig":
        """A stored shard config; one written before ``fp8_layout`` existed wrote fp8 taps as 'bytes'."""
        return cls(**{**LEGACY_SHARD_FIELDS, **d})

    def field_meta(self, layout: Layout) -> FieldMeta:
        """How this config encodes samples of ``layout``."""
        return FieldMeta(layout, self.bf16_layout, self.fp8_layout)


class _HashingSink:
    """File-like wrapper: counts and hashes every byte on its way to the underlying file.

    ``sha``: the whole file (manifest ``sha256``, checked by ``verify``); ``blocks``: consecutive
    blocks cut by the shard (record batches); ``prefix``: the first bytes, for the head checksum.
    """

    PREFIX = 1 << 16

    def __init__(self, f: Any) -> None:
        self.f = f
        self.sha = hashlib.sha256()
        self.blocks = BlockHasher()
        self.prefix = bytearray()
        self.n = 0
        self.closed = False

    def write(self, data: Any) -> int:
        mv = memoryview(data).cast("B")
        self.sha.update(mv)
        self.blocks.update(mv)
        if len(self.prefix) < self.PREFIX:
            self.prefix += mv[: self.PREFIX - len(self.prefix)]
        self.n += mv.nbytes
        self.f.write(mv)
        return mv.nbytes

    def head(self, n: int) -> list[Any]:
        """[n, checksum of bytes [0, n)] for the manifest."""
        assert 0 < n <= len(self.prefix), f"shard head of {n} bytes is not in the kept prefix"
        return [n, digest(bytes(self.prefix[:n]))]

    def tell(self) -> int:
        return self.n

    def flush(self) -> None:
        self.f.flush()

    def close(self) -> None:
        self.closed = True


class _Shard:
    """One shard being written under its temp name."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str, cfg: ShardConfig, meta: FieldMeta,
                 fingerprint: str | None, rank: int, name: str, lineage: str | None) -> None:
        self.name = name
        self.fs, self.path, self.cfg, self.meta, self.rank = fs, path, cfg, meta, rank
        self.tmp = temp_name(path)
        self.file = fs.open(self.tmp, "wb")
        self.sink = _HashingSink(self.file)
        self.stats = {"samples": 0, "tokens": 0, "supervised_tokens": 0, "audio_seconds": 0.0}
        self.indices: list[int] = []
        self.batches: list[list[int]] = []
        self._pending: list[tuple[dict[str, Any], dict[str, bytes]]] = []
        self._pending_bytes = 0
        self._scratch: dict[str, Any] = {}  # column buffers reused batch after batch
        if cfg.format == "arrow":
            self.schema = arrow_schema(meta, fingerprint, lineage)
            codec = pa.Codec("zstd", compression_level=cfg.zstd_level) if cfg.zstd_level else None
            opts = pa.ipc.IpcWriteOptions(compression=codec)
            self._writer = pa.ipc.new_stream(self.sink, self.schema, options=opts)
        else:
            self._writer = TarShardWriter(self.sink, meta, cfg.zstd_level, fingerprint, lineage)

    def add(self, sample: dict[str, Any], index: int) -> None:
        enc = encode_fields(sample, self.meta)
        scalars = {"sample_id": sample["sample_id"], "source": str(sample["source"]),
                   "audio_seconds": float(sample["audio_seconds"])}
        self.stats["samples"] += 1
        self.stats["tokens"] += int(sample["input_ids"].shape[0])
        self.stats["supervised_tokens"] += int(sample["loss_mask"].sum())
        self.stats["audio_seconds"] += scalars["audio_seconds"]
        self.indices.append(index)
        if self.cfg.format == "wds":
            self._writer.add(sample_key(self.rank, index), scalars, enc)
            return
        nbytes = sum(len(b) for b in enc.values())
        room = max(self.cfg.shard_bytes - self.sink.n, 1)  # uncompressed >= compressed: never overshoots much
        limit = min(self.cfg.batch_bytes, room)
        if self._pending and self._pending_bytes + nbytes > limit:
            self._flush_batch()  # a batch never grows past the limit, so random access reads about one sample's bytes
        self._pending.append((scalars, enc))
        self._pending_bytes += nbytes
        if self._pending_bytes >= limit:
            self._flush_batch()

    def _flush_batch(self) -> None:
        if not self._pending:
            return
        self.sink.blocks.cut()
        self._writer.write_batch(make_batch(self.schema, self._pending, self._scratch))
        start, end, h = self.sink.blocks.cut()
        self.batches.append([start, end, len(self._pending), h])
        self._pending, self._pending_bytes = [], 0

    @property
    def full(self) -> bool:
        return self.sink.n >= self.cfg.shard_bytes

    def finish(self) -> dict[str, Any]:
        """Close, rename into place, return the shard's index entry."""
        self._flush_batch()
        self._writer.close()
        self.file.close()
        commit(self.fs, self.tmp, self.path)
        entry = {"bytes": self.sink.n, "sha256": self.sink.sha.hexdigest(), **self.stats,
                 "indices": _to_ranges(self.indices)}
        if self.cfg.format == "arrow":
            entry["batches"] = self.batches
            entry["head"] = self.sink.head(len(self.schema.serialize()))
            entry["tail"] = list(self.sink.blocks.cut())
        else:
            entry["head"] = self.sink.head(self._writer.head_bytes)
        return entry

    def abort(self) -> None:
        try:
            self.file.close()
        finally:
            if self.fs.exists(self.tmp):
                self.fs.rm(self.tmp)


def _to_ranges(indices: list[int]) -> list[list[int]]:
    """Sorted, merged half-open [start, end) ranges."""
    out: list[list[int]] = []
    for i in sorted(set(indices)):
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return out


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
        self.fingerprint = fingerprint if fingerprint is not None else stored_fingerprint(self.fs, mf.join(self.root, mf.TARGET_DIR))
        self.meta = config.field_meta(layout)
        self.lineage = lineage
        self._part_path = mf.join(self.root, mf.part_name(split, rank))
        self.fs.makedirs(mf.join(self.root, mf.DATA_DIR), exist_ok=True)
        self.fs.makedirs(mf.join(self.root, mf.PARTS_DIR), exist_ok=True)
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
        self._pending_skips: list[dict[str, Any]] = []
        self._pending_idx: set[int] = set()
        self._shard: _Shard | None = None
        self._closed = False
        self._warned_dup = False

    def _resume(self) -> None:
        with self.fs.open(self._part_path, "rb") as f:
            part = json.loads(f.read())
        mine = {"shard_config": self.config.to_dict(), "layout": self.layout.to_dict()}
        part = {**part, "shard_config": ShardConfig.from_dict(part["shard_config"]).to_dict()}
        if self.layout.taps_codec != "fp8":  # the fp8 byte layout does not touch bf16 taps
            part["shard_config"]["fp8_layout"] = mine["shard_config"]["fp8_layout"]
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
        if "lineage" in part and part["lineage"] != self.lineage:  # parts of older writers have none
            raise ValueError(f"{self._part_path} holds shards made from other inputs (lineage "
                             f"{str(part.get('lineage'))[:12]}, this writer's {str(self.lineage)[:12]}): resume with "
                             "the original inputs, or write to a new directory")
        self._shards, self._skipped = part["shards"], part["skipped"]

    def _clean_leftovers(self) -> None:
        """Delete this rank's temp shards and shards not in its index (renamed just before a crash).

        A shard that an older finalize left under ``<name>.finalizing`` is indexed: it is kept, and
        the next finalize moves it on (``_locate``)."""
        prefix = f"{self.split}-rank{self.rank:05d}-"
        known = {n for e in self._shards for n in (e["name"], e["name"] + _LEGACY_MOVING)}
        data = mf.join(self.root, mf.DATA_DIR)
        for path in self.fs.ls(data, detail=False):
            name = path.rstrip("/").split("/")[-1]
            if name.startswith(prefix) and f"{mf.DATA_DIR}/{name}" not in known:
                self.fs.rm(path)

    @property
    def next_index(self) -> int:
        """First input index not yet in a finished shard (or recorded skip); resume from here."""
        i = 0
        while i in self._done:
            i += 1
        return i

    @property
    def num_done(self) -> int:
        """Inputs already in finished shards or recorded skips."""
        return len(self._done)

    def is_done(self, index: int) -> bool:
        """Whether ``index`` is already in a finished shard or a recorded skip (a resume need not redo it)."""
        return index in self._done

    def _check_index(self, index: int) -> bool:
        if self._closed:
            raise ValueError(f"writer for {self.split} rank {self.rank} is closed; open a new DatasetWriter to resume")
        if index < 0:
            raise ValueError(f"input index must be >= 0, got {index}")
        if index in self._pending_idx:
            raise ValueError(f"input index {index} was already written to the open shard ({self.split} rank {self.rank})")
        if index in self._done:
            if not self._warned_dup:
                warnings.warn(f"input index {index} is already in a finished shard; ignoring it (resume overlap)",
                              stacklevel=3)
                self._warned_dup = True
            return False
        return True

    def write(self, sample: dict[str, Any], index: int) -> bool:
        """Validate and append one sample; returns False when ``index`` was already finished (ignored)."""
        if not self._check_index(index):
            return False
        try:
            validate_sample(sample, self.layout)
        except ValueError as e:
            raise type(e)(f"{e} (input index {index}, split {self.split}, rank {self.rank})") from e
        if self._shard is None:
            name = mf.rank_shard_name(self.split, self.rank, len(self._shards), self.config.format)
            self._shard = _Shard(self.fs, mf.join(self.root, name), self.config, self.meta, self.fingerprint,
                                 self.rank, name, self.lineage)
        self._shard.add(sample, index)
        self._pending_idx.add(index)
        if self._shard.full:
            self._finish_shard()
        return True

    def skip(self, index: int, sample_id: str, reason: str) -> None:
        """Record an input that is not written (bad, too long); a resume will not redo it."""
        if not self._check_index(index):
            return
        self._pending_skips.append({"index": int(index), "sample_id": str(sample_id), "reason": str(reason),
                                    "rank": self.rank})
        self._pending_idx.add(index)

    def _finish_shard(self) -> None:
        if self._shard is not None:
            entry = self._shard.finish()
            entry["name"] = self._shard.name
            self._shards.append(entry)
            self._shard = None
        self._skipped.extend(self._pending_skips)
        self._done.update(self._pending_idx)
        self._pending_skips, self._pending_idx = [], set()
        self._write_part(closed=False)

    def _write_part(self, closed: bool) -> None:
        doc = {"version": PART_VERSION, "split": self.split, "rank": self.rank, "schema_version": SCHEMA_VERSION,
               "shard_config": self.config.to_dict(), "layout": self.layout.to_dict(),
               "fingerprint": self.fingerprint, "lineage": self.lineage, "shards": self._shards,
               "skipped": self._skipped, "closed": closed}
        write_json_atomic(self.fs, self._part_path, doc)

    def close(self) -> None:
        """Finish the last shard and mark this rank's partial index closed."""
        if self._closed:
            return
        self._finish_shard()
        self._write_part(closed=True)
        self._closed = True

    def abort(self) -> None:
        """Drop the open shard (its samples will be redone on resume)."""
        if self._shard is not None:
            self._shard.abort()
            self._shard = None
        self._closed = True

    def __enter__(self) -> "DatasetWriter":
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _load_parts(fs: fsspec.AbstractFileSystem, root: str) -> list[tuple[str, dict[str, Any]]]:
    pdir = mf.join(root, mf.PARTS_DIR)
    paths = sorted(p for p in fs.ls(pdir, detail=False) if p.endswith(".json")) if fs.exists(pdir) else []
    if not paths:
        raise FileNotFoundError(f"no partial indexes under {pdir}: nothing was written to {root} by DatasetWriter")
    parts = []
    for p in paths:
        with fs.open(p, "rb") as f:
            parts.append((p, json.loads(f.read())))
    return parts


def _check_parts(parts: list[tuple[str, dict[str, Any]]], root: str, layout: Layout, fingerprint: str) -> None:
    """Every rank closed, with the same shard config, layout, target and a known schema major."""
    problems = []
    cfg0 = parts[0][1]["shard_config"]
    for path, part in parts:
        if not part["closed"]:
            problems.append(f"{path}: rank {part['rank']} of split {part['split']} was not closed (still running or "
                            "crashed); rerun that rank's capture to resume it")
        if part["shard_config"] != cfg0:
            problems.append(f"{path}: shard config {part['shard_config']} differs from {parts[0][0]}'s {cfg0}")
        if part["layout"] != layout.to_dict():
            problems.append(f"{path}: layout {part['layout']} differs from the dataset's {layout.to_dict()}")
        if part.get("fingerprint") not in (None, fingerprint):
            problems.append(f"{path}: shards carry target fingerprint {part['fingerprint'][:12]}, the dataset's is "
                            f"{fingerprint[:12]}; captures of different targets cannot be merged")
        try:
            check_schema_version(part.get("schema_version"), path)
        except ValueError as e:
            problems.append(str(e))
    if problems:
        raise ValueError("cannot finalize " + root + ":\n  " + "\n  ".join(problems))


def _check_not_empty(by_split: dict[str, list[tuple[str, dict[str, Any]]]], root: str) -> None:
    """A split in which no sample was written is not a dataset: refuse it, naming the first skip reasons."""
    problems = []
    for split, sparts in by_split.items():
        if any(e["samples"] for _, part in sparts for e in part["shards"]):
            continue
        skips = sorted((s for _, part in sparts for s in part["skipped"]), key=lambda s: (s["rank"], s["index"]))
        first = "; ".join(f"{s['sample_id']!r}: {s['reason']}" for s in skips[:3])
        problems.append(f"split {split!r} has no samples: all {len(skips)} input(s) were skipped (first: {first})"
                        if skips else f"split {split!r} has no samples: its input held none")
    if problems:
        raise ValueError(f"cannot finalize {root}: " + "; ".join(problems) + ". Fix the inputs or the target's chat "
                         "template, then capture into a new --out directory")


_LEGACY_MOVING = ".finalizing"
"""Older finalizes moved a shard to ``<name>.finalizing`` between its two names; such files are found and moved on."""


def _plan_final_names(split: str, entries: list[dict[str, Any]], fmt: str) -> None:
    """Record each shard's final name (``final``) in list order: the journal a restarted finalize replays.

    Final names (``<split>-00003-of-00012``) and rank names (``<split>-rank00000-00003``) never
    collide, and a name that two finalizes plan alike holds the same shard, so one rename per shard
    suffices; an earlier final name (a finalize of fewer shards) is kept as ``was`` to be found again.
    """
    n = len(entries)
    for i, e in enumerate(entries):
        final = mf.final_shard_name(split, i, n, fmt)
        if e.get("final") not in (None, final):
            e["was"] = e["final"]
        e["final"] = final


def _locate(fs: fsspec.AbstractFileSystem, root: str, e: dict[str, Any]) -> str | None:
    """Where the shard of ``e`` is now, None when it is already at its final name."""
    if fs.exists(mf.join(root, e["final"])):
        return None
    names = [x for x in (e["name"], e.get("was"), e["final"]) if x]
    for cand in names[:-1] + [x + _LEGACY_MOVING for x in names]:
        if fs.exists(mf.join(root, cand)):
            return cand
    raise FileNotFoundError(f"{mf.join(root, e['name'])} is listed in a partial index but missing (nor is it at "
                            f"{e['final']}); re-run the capture for its rank")


def _move_to_final(fs: fsspec.AbstractFileSystem, root: str, entries: list[dict[str, Any]]) -> None:
    """Replay the journal: every shard not yet at its ``final`` name is renamed there (idempotent)."""
    for e in entries:
        cur = _locate(fs, root, e)
        if cur is not None:
            commit(fs, mf.join(root, cur), mf.join(root, e["final"]))
        for old in (e["name"], e.get("was")):  # an object store's mv may leave the source behind
            if old and old != e["final"] and fs.exists(mf.join(root, old)):
                fs.rm(mf.join(root, old))


def _split_summary(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """A split's manifest entry: totals plus each shard's final name, size, checksum, counts and batches."""
    shards_out = []
    for e in entries:
        s = {k: e[k] for k in ("bytes", "sha256", "samples", "tokens", "supervised_tokens", "audio_seconds")}
        s["name"] = e["final"]
        for key in ("batches", "head", "tail"):
            if key in e:
                s[key] = e[key]
        shards_out.append(s)
    tot = {k: sum(s[k] for s in shards_out) for k in ("samples", "tokens", "supervised_tokens", "audio_seconds",
                                                     "bytes")}
    return {**tot, "shards": shards_out}


def _build_manifest(config: ShardConfig, layout: Layout, fingerprint: str, capture_config: dict[str, Any],
                    extra: dict[str, Any] | None, splits: dict[str, Any],
                    skipped: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    fm = shard_metadata(config.field_meta(layout), fingerprint)
    fp8 = {"fp8_layout": config.fp8_layout} if layout.taps_codec == "fp8" else {}
    return {
        "schema_version": SCHEMA_VERSION,
        "format": config.format,
        "complete": True,
        "code_version": mf.code_version(),
        "fingerprint": fingerprint,
        "layout": layout.to_dict(),
        "taps": {"hf": list(layout.tap_ids), "vllm": layout.vllm_tap_ids, "convention": mf.TAP_CONVENTION},
        "top_k": {"k": layout.top_k, "rows": mf.TOPK_ROWS},
        "dtypes": fm["dtypes"],
        "codec": {"container": ("arrow-ipc-stream" + ("+zstd" if config.zstd_level else "") if config.format == "arrow"
                                else "webdataset-tar+zstd"),
                  "zstd_level": config.zstd_level, "bf16_layout": config.bf16_layout,
                  "taps_codec": layout.taps_codec, "lossy": layout.taps_codec != "bf16", **fp8},
        "field_meta": fm,
        "integrity": INTEGRITY,
        "shard_config": config.to_dict(),
        "capture_config": capture_config,
        "extra": extra or {},
        "splits": splits,
        "skipped": skipped,
    }


def finalize_dataset(out_dir: str, *, layout: Layout, fingerprint: str, capture_config: dict[str, Any],
                     extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Merge all ranks' partial indexes, give shards final names, write README.md, then manifest.json."""
    fs, root = fsspec.core.url_to_fs(str(out_dir))
    parts = _load_parts(fs, root)
    _check_parts(parts, root, layout, fingerprint)
    config = ShardConfig.from_dict(parts[0][1]["shard_config"])
    man_path = mf.join(root, mf.MANIFEST)
    if fs.exists(man_path):
        fs.rm(man_path)  # the directory is not a dataset while shards move

    by_split: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for path, part in sorted(parts, key=lambda p: (p[1]["split"], p[1]["rank"])):
        by_split.setdefault(part["split"], []).append((path, part))
    _check_not_empty(by_split, root)
    splits: dict[str, Any] = {}
    skipped: dict[str, list[dict[str, Any]]] = {}
    for split, sparts in by_split.items():  # journal first: every part records its shards' final names
        _plan_final_names(split, [e for _, part in sparts for e in part["shards"]], config.format)
        for path, part in sparts:
            write_json_atomic(fs, path, part)
    for split, sparts in by_split.items():
        entries = [e for _, part in sparts for e in part["shards"]]
        _move_to_final(fs, root, entries)
        splits[split] = _split_summary(entries)
        skipped[split] = sorted((s for _, part in sparts for s in part["skipped"]), key=lambda s: (s["rank"], s["index"]))

    manifest = _build_manifest(config, layout, fingerprint, capture_config, extra, splits, skipped)
    write_bytes_atomic(fs, mf.join(root, mf.CARD), mf.render_card(manifest).encode())
    write_json_atomic(fs, man_path, manifest)
    return manifest
