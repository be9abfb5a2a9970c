"""Arrow IPC, read from the message flatbuffers before Arrow allocates anything: every body buffer a record batch
declares must lie inside its body, and a compressed buffer's declared size within the zstd bound of
``shards.limits`` (a crafted length prefix of 2**40 bytes otherwise ends in ArrowMemoryError, smaller claims in a
reservation that size). Field numbers follow Arrow's Message.fbs.
"""

from __future__ import annotations

import struct
from typing import Any

from tapdraft.common.errors import CorruptShardError
from tapdraft.shards.limits import MAX_RATIO, RATIO_FLOOR

_RECORD_BATCH = 3
"""``MessageHeader.RecordBatch`` (Message.fbs)."""


def _u32(buf: bytes, at: int) -> int:
    return struct.unpack_from("<I", buf, at)[0]


def _field(buf: bytes, table: int, i: int) -> int | None:
    """Position of field ``i`` of the flatbuffer table at ``table`` (None when absent)."""
    vtable = table - struct.unpack_from("<i", buf, table)[0]
    vsize = struct.unpack_from("<H", buf, vtable)[0]
    if 4 + 2 * i + 2 > vsize:
        return None
    off = struct.unpack_from("<H", buf, vtable + 4 + 2 * i)[0]
    return table + off if off else None


def arrow_buffers(metadata: bytes) -> tuple[list[tuple[int, int]], bool] | None:
    """(offset, length) of every body buffer a record batch message declares, and whether they are compressed
    (the ``compression`` field); None for another message type. Any flatbuffer position outside the metadata
    is a struct.error or IndexError, which the caller reports as corrupt."""
    root = _u32(metadata, 0)
    kind_at = _field(metadata, root, 1)
    if kind_at is None or metadata[kind_at] != _RECORD_BATCH:
        return None
    header_at = _field(metadata, root, 2)
    batch = header_at + _u32(metadata, header_at)
    buffers_at = _field(metadata, batch, 2)
    out = []
    if buffers_at is not None:
        vec = buffers_at + _u32(metadata, buffers_at)
        for k in range(_u32(metadata, vec)):
            out.append(struct.unpack_from("<qq", metadata, vec + 4 + 16 * k))
    return out, _field(metadata, batch, 3) is not None


def check_arrow_stream(src: Any) -> None:
    """Every record batch message of the Arrow IPC stream ``src`` declares buffers inside its body, and every
    compressed buffer a decompressed size within the zstd members' bound (``max(MAX_RATIO x compressed size,
    RATIO_FLOOR)``); otherwise CorruptShardError, before Arrow allocates what a crafted length prefix claims
    (2**40 bytes ended in ArrowMemoryError, smaller claims in a reservation that size)."""
    import pyarrow as pa

    for msg in pa.ipc.MessageReader.open_stream(src):
        meta, body = msg.metadata.to_pybytes(), msg.body
        body_len = 0 if body is None else body.size
        try:
            found = arrow_buffers(meta)
        except (struct.error, IndexError, TypeError) as e:
            raise CorruptShardError(f"an Arrow message's metadata is malformed ({e}); the shard is damaged or "
                                    "crafted") from None
        if found is None:
            continue
        buffers, compressed = found
        for off, length in buffers:
            if off < 0 or length < 0 or off + length > body_len:
                raise CorruptShardError(f"an Arrow record batch declares a buffer at {off}..{off + length}, outside "
                                        f"its {body_len}-byte body; the shard is damaged or crafted")
            if compressed and length >= 8:
                declared = struct.unpack_from("<q", body, off)[0] if body is not None else -1
                if declared > max(MAX_RATIO * length, RATIO_FLOOR):
                    raise CorruptShardError(f"an Arrow buffer declares {declared} bytes decompressed from {length}, "
                                            "more than the bound: refusing to allocate it (the shard is damaged or "
                                            "crafted)")
