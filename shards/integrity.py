"""Checksums that every reader verifies: the one home of what is hashed and how (the error,
``CorruptShardError``, lives with the project's others in ``common.errors``).

Every byte a reader decodes is covered by a checksum written beside it, so a flipped bit on a disk,
a bad copy or a foreign file is an error naming the shard, never different activations:

    Arrow shards   manifest, per shard: ``head`` [n, h] = the schema message [0, n) (read when the
                   dataset is opened); each ``batches`` entry [start, end, rows, h] = that record
                   batch's stored bytes; ``tail`` [start, end, h] = the end-of-stream marker.
                   In the file: a ``checksum`` uint64 column, one per row, over the row's decoded
                   content (``row_checksum``), so the stock ``datasets`` path (``decode_row``)
                   verifies too.
    WebDataset     in each sample's ``meta.json``: ``checksums`` {member: h} of every ``.zst``
                   member's stored bytes, and ``checksum``, a hash of the meta document itself; the
                   tar framing (headers, padding, end blocks) is checked by ``shards.formats.wds``.
                   Manifest, per shard: ``head`` [n, h] = the first tar member (its meta.json).

When a dataset is opened every shard is checked cheaply: its size against the manifest (one
listing of ``data/``) and its head against the manifest's hash. The head carries the target
fingerprint and the layout, so a shard of another dataset is refused before any step; the full
sha256 stays with ``tapdraft verify`` (reading terabytes on every open is not cheap). The data
bytes are checked block by block as they are decoded.

Hash: xxh3-64 (xxhash), ~6 GB/s on this machine vs ~1.3 GB/s for zlib.crc32 and ~3 GB/s for
zstd decompression, which the reader does anyway; benchmarks/read.py measures the cost.

Whole small files the manifest covers (the card, ``target/bundle.json``) are recorded as {bytes, sha256}
(``file_record``) and checked whole where they are read (``matches_record``).

Datasets of schema 1.0 carry none of this: ``shards.manifest.migrate_manifest`` marks them
``integrity: none`` and readers warn that their bytes are checked only by ``tapdraft verify``.
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any, Iterable

import xxhash

from tapdraft.common.errors import CorruptShardError

HASH_NAME = "xxh3_64"
INTEGRITY = {"hash": HASH_NAME, "blocks": True, "rows": True}
"""The manifest's ``integrity`` entry for datasets written by this code."""
NO_INTEGRITY = {"hash": None, "blocks": False, "rows": False}
"""What ``migrate_manifest`` records for datasets written before checksums (schema 1.0)."""
ROW_COLUMN = "checksum"
"""Arrow column holding ``row_checksum`` of each row."""


def digest(data: Any) -> str:
    """Hex xxh3-64 of a bytes-like object."""
    return xxhash.xxh3_64_hexdigest(data)


def file_record(data: bytes) -> dict[str, Any]:
    """The manifest's record of a whole small file it covers (the card, target/bundle.json): {bytes, sha256}."""
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def matches_record(data: bytes, record: Any) -> bool:
    """Whether ``data`` is the file ``record`` (a ``file_record``) describes."""
    return (isinstance(record, dict) and len(data) == record.get("bytes")
            and hashlib.sha256(data).hexdigest() == record.get("sha256"))


def check_block(data: Any, want: str, where: str) -> None:
    """Raise CorruptShardError naming ``where`` when ``data`` does not hash to ``want``."""
    got = digest(data)
    if got != want:
        raise CorruptShardError(
            f"{where}: checksum {got} differs from the recorded {want}: the bytes are damaged or the file was "
            "replaced. Re-copy the shard (or re-capture it); `tapdraft verify` lists every damaged shard"
        )


class BlockHasher:
    """Hashes a byte stream in consecutive blocks; ``cut()`` closes the current block."""

    def __init__(self) -> None:
        self._h = xxhash.xxh3_64()
        self.start = 0
        self.n = 0

    def update(self, data: Any) -> None:
        self._h.update(data)
        self.n += memoryview(data).nbytes

    def cut(self) -> tuple[int, int, str]:
        """(start, end, hex digest) of the bytes since the last cut; starts a new block."""
        out = (self.start, self.n, self._h.hexdigest())
        self._h.reset()
        self.start = self.n
        return out


def row_checksum(scalars: dict[str, Any], fields: dict[str, Any], names: Iterable[str]) -> int:
    """xxh3-64 (as an unsigned int) of one sample's scalars and encoded fields in ``names`` order."""
    h = xxhash.xxh3_64()
    for key in ("sample_id", "source"):
        b = str(scalars[key]).encode()
        h.update(struct.pack("<Q", len(b)))
        h.update(b)
    h.update(struct.pack("<d", float(scalars["audio_seconds"])))
    for name in names:
        data = fields[name]
        h.update(struct.pack("<Q", memoryview(data).nbytes))
        h.update(data)
    return h.intdigest()


def check_row(scalars: dict[str, Any], fields: dict[str, Any], names: Iterable[str], want: int, where: str) -> None:
    if row_checksum(scalars, fields, names) != int(want):
        raise CorruptShardError(
            f"{where}: sample {scalars.get('sample_id')!r} does not match its stored checksum: the shard is damaged. "
            "Re-copy the shard (or re-capture it); `tapdraft verify` lists every damaged shard"
        )


def seal_doc(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` plus ``checksum``: a hash of its canonical JSON (sorted keys), so the document checks itself."""
    return {**doc, "checksum": digest(json.dumps(doc, sort_keys=True).encode())}


def check_sealed(doc: dict[str, Any], where: str) -> None:
    """Raise CorruptShardError when a ``seal_doc`` document no longer hashes to its ``checksum``."""
    body = {k: v for k, v in doc.items() if k != "checksum"}
    want = doc.get("checksum")
    if not isinstance(want, str) or digest(json.dumps(body, sort_keys=True).encode()) != want:
        raise CorruptShardError(f"{where}: the sample's meta.json does not match its checksum: the shard is damaged. "
                                "Re-copy the shard (or re-capture it)")
