"""One shard file being written: how samples become its bytes, and what is recorded about them.

``ShardConfig`` says how samples become files; ``_Shard`` writes one shard under ``<name>.tmp``
through ``_HashingSink``, which hashes every byte on its way (whole-file sha256, one block hash per
record batch, the head's checksum), renames it into place once complete and writes its index file
(``shards.shard_index``: batch ranges and hashes, kept out of the manifest). The bytes themselves are
the format's writer's (``shards.formats``: Arrow gathers samples into record batches of at most
``batch_bytes``, WebDataset writes them straight to the tar). ``DatasetWriter`` (``shards.writer``)
rolls shards and keeps the rank's index.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Any

import fsspec

from tapdraft.common.atomic import commit, temp_name
from tapdraft.shards.codec import BF16_LAYOUTS, FP8_LAYOUTS, LEGACY_FP8_LAYOUT, FieldMeta, encode_fields
from tapdraft.shards.formats import DEFAULT_FORMAT, FORMATS
from tapdraft.shards.integrity import BlockHasher, digest
from tapdraft.shards.limits import MAX_SHARD_BYTES
from tapdraft.shards.schema import Layout
from tapdraft.shards.shard_index import index_name, write_index

LEGACY_SHARD_FIELDS = {"fp8_layout": LEGACY_FP8_LAYOUT, "writers": 1}
"""What a shard config recorded before a field existed used for it (fp8 taps were one byte a value, one writer)."""


@dataclass(frozen=True)
class ShardConfig:
    """How samples become files."""

    format: str = DEFAULT_FORMAT
    """A name in ``shards.formats.FORMATS``: 'arrow' (IPC stream, zstd buffers, random access) or 'wds'
    (WebDataset tar, zstd per member)."""
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
    writers: int | None = 1
    """Writer lanes per rank, each on its own thread with its own shards (input i goes to lane i % writers).
    Encoding, zstd and hashing are a writer's CPU; lanes share nothing, so the rate scales with the cores given
    (benchmarks/write.py: what one lane does a core at a real width, and two lanes). A resume keeps the count.
    None: the capture decides when it starts, from its device and cores (``capture.config.pin_writers``); a
    writer needs a count."""

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"ShardConfig.format must be one of {tuple(FORMATS)}, got {self.format!r}")
        if not 1 <= self.shard_bytes <= MAX_SHARD_BYTES:
            raise ValueError(f"ShardConfig.shard_bytes must be in [1, {MAX_SHARD_BYTES}] (readers refuse larger "
                             f"shards), got {self.shard_bytes}")
        if not 0 <= self.zstd_level <= 22:
            raise ValueError(f"ShardConfig.zstd_level must be in [0, 22] (0: uncompressed), got {self.zstd_level}")
        FORMATS[self.format].writer.check_config(self)
        if self.bf16_layout not in BF16_LAYOUTS:
            raise ValueError(f"ShardConfig.bf16_layout must be one of {BF16_LAYOUTS}, got {self.bf16_layout!r}")
        if self.batch_bytes < 1:
            raise ValueError(f"ShardConfig.batch_bytes must be positive, got {self.batch_bytes}")
        if self.fp8_layout not in FP8_LAYOUTS:
            raise ValueError(f"ShardConfig.fp8_layout must be one of {FP8_LAYOUTS}, got {self.fp8_layout!r}")
        if self.writers is not None and not 1 <= self.writers <= 64:
            raise ValueError(f"ShardConfig.writers must be in [1, 64] (writer threads per rank), got {self.writers}")

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
        self._writer = FORMATS[cfg.format].writer(self.sink, cfg, meta, fingerprint, lineage, rank)

    def add(self, sample: dict[str, Any], index: int) -> None:
        enc = encode_fields(sample, self.meta)
        scalars = {"sample_id": sample["sample_id"], "source": str(sample["source"]),
                   "audio_seconds": float(sample["audio_seconds"])}
        self.stats["samples"] += 1
        self.stats["tokens"] += int(sample["input_ids"].shape[0])
        self.stats["supervised_tokens"] += int(sample["loss_mask"].sum())
        self.stats["audio_seconds"] += scalars["audio_seconds"]
        self.indices.append(index)
        self._writer.add(index, scalars, enc)

    @property
    def full(self) -> bool:
        return self.sink.n >= self.cfg.shard_bytes

    def finish(self) -> dict[str, Any]:
        """Close, rename into place, write the shard's index file (shards.shard_index), return the rank index's
        entry: the shard's size, sha256, counts, input indices and the index file's [bytes, hash]."""
        self._writer.close()
        self.file.close()
        commit(self.fs, self.tmp, self.path)
        doc = self._writer.index_doc(self.stats["samples"])
        root = self.path[: -len(self.name)]
        return {"bytes": self.sink.n, "sha256": self.sink.sha.hexdigest(), **self.stats,
                "indices": _to_ranges(self.indices), "index": write_index(self.fs, root + index_name(self.name), doc)}

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
