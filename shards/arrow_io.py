"""Arrow IPC STREAM shards: declared schema, zstd buffer compression (or none: ``zstd_level`` 0, the
fastest read), record batches of about 1 MiB (one batch per sample when samples are larger).

Why the stream format (not the IPC file format): ``datasets.Dataset.from_file`` memory-maps only
streams, and ``datasets.load_dataset("arrow", data_files=...)`` reads both. Random access does not
need the file footer: the writer records each record batch's byte range in the manifest, and a
reader seeks there and parses one message.

One row = one sample. Columns, all declared (never inferred):

    sample_id string | source string | audio_seconds float64 | num_tokens int32
    <one binary column per encoded field of shards.codec, in stored_fields(meta) order>
    checksum uint64   shards.integrity.row_checksum of the row (schema >= 1.1)

The schema metadata carries, under the key ``tapdraft``, JSON with the schema version, the layout
(tap ids HF + vLLM, shapes, codec), dtypes, the bf16 byte layout and the target fingerprint.
``datasets`` replaces schema metadata with its own, so ``decode_row`` takes that JSON explicitly
(``read_shard_metadata`` or the manifest's ``field_meta``). ``decode_row`` checks each row against
its ``checksum``; tapdraft's own reader checks whole record batches instead (shards.integrity).

Reading is copy-lean: cells are sliced out of a column's data buffer by its offsets, and a streamed
one-sample batch becomes tensors that view the bytes read (uncompressed shards with bf16_layout "raw":
no decode pass at all; benchmarks/read.py). With zstd, decompressing the high byte plane (~1.2 GB/s
a core here) costs more than ``torch.load`` of the uncompressed bytes does in all.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

import numpy as np
import pyarrow as pa

from shards.codec import FieldMeta, decode_fields, stored_fields
from shards.errors import CorruptShardError
from shards.integrity import ROW_COLUMN, check_row, row_checksum
from shards.limits import check_arrow_stream
from shards.schema import SCHEMA_VERSION, field_specs, has_checksums

META_KEY = b"tapdraft"
SCALAR_COLUMNS = (("sample_id", pa.string()), ("source", pa.string()), ("audio_seconds", pa.float64()),
                  ("num_tokens", pa.int32()))


def shard_metadata(meta: FieldMeta, fingerprint: str | None, lineage: str | None = None) -> dict[str, Any]:
    """The JSON stored under ``tapdraft`` in every shard's schema (and, without ``lineage``, in the manifest)."""
    dtypes = {name: str(dt).replace("torch.", "") for name, (dt, _) in field_specs(meta.layout).items()}
    shapes = {name: list(shape) for name, (_, shape) in field_specs(meta.layout).items()}
    if meta.layout.taps_codec == "fp8":
        dtypes["taps_stored"] = "float8_e4m3fn"
        dtypes["taps_scale"] = "float32"
        shapes["taps_scale"] = ["T", meta.layout.n_taps]
        if meta.fp8_layout == "packed":  # the e4m3 values split into two fields (shards.codec)
            dtypes["taps_exponent"] = "uint8 (e4m3 sign+exponent: byte >> 3)"
            dtypes["taps_mantissa"] = "uint3, 8 per 3 bytes"
            shapes["taps_exponent"] = shapes["taps_mantissa"] = shapes["taps"]
    out = {"schema_version": SCHEMA_VERSION, **meta.to_dict(), "dtypes": dtypes, "shapes": shapes,
           "fingerprint": fingerprint}
    if lineage is not None:
        out["lineage"] = lineage
    return out


def arrow_schema(meta: FieldMeta, fingerprint: str | None, lineage: str | None = None) -> pa.Schema:
    fields = [pa.field(n, t, nullable=False) for n, t in SCALAR_COLUMNS]
    fields += [pa.field(n, pa.binary(), nullable=False) for n in stored_fields(meta)]
    fields.append(pa.field(ROW_COLUMN, pa.uint64(), nullable=False))
    meta_json = json.dumps(shard_metadata(meta, fingerprint, lineage), sort_keys=True)
    return pa.schema(fields, metadata={META_KEY: meta_json})


def make_batch(schema: pa.Schema, rows: list[tuple[dict[str, Any], dict[str, Any]]],
               scratch: dict[str, np.ndarray] | None = None) -> pa.RecordBatch:
    """rows: (sample scalars, encoded fields) -> one record batch with the declared schema.

    Each binary column is laid out once, straight into one data buffer (``scratch`` keeps those
    buffers between calls: the IPC writer has compressed a batch by the time ``write_batch``
    returns, so the memory is reused instead of freshly faulted in for every batch), and wrapped
    without a copy; ``pa.array`` of the cells would copy every cell through a growing builder.
    """
    cols = []
    names = [f.name for f in schema if f.type == pa.binary()]  # the encoded fields, in stored order
    for f in schema:
        if f.name == ROW_COLUMN:
            cols.append(pa.array([row_checksum(s, enc, names) for s, enc in rows], pa.uint64()))
        elif f.name == "num_tokens":
            cols.append(pa.array([len(enc["input_ids"]) // 4 for _, enc in rows], pa.int32()))
        elif f.name in ("sample_id", "source", "audio_seconds"):
            cols.append(pa.array([s[f.name] for s, _ in rows], f.type))
        else:
            cols.append(_binary_column([enc[f.name] for _, enc in rows], f.name, {} if scratch is None else scratch))
    return pa.RecordBatch.from_arrays(cols, schema=schema)


def _binary_column(cells: list[Any], name: str, scratch: dict[str, np.ndarray]) -> pa.Array:
    views = [np.frombuffer(c, dtype=np.uint8) for c in cells]
    offsets = np.zeros(len(views) + 1, dtype=np.int64)
    np.cumsum([v.size for v in views], out=offsets[1:])
    total = int(offsets[-1])
    if total >= 1 << 31:
        raise ValueError(f"column {name!r} of one record batch holds {total} bytes; Arrow binary columns stop at "
                         "2 GiB: capture shorter sequences or fewer taps")
    if len(views) == 1:  # a sample of its own batch (real widths): its cell is the column, no copy
        return pa.BinaryArray.from_buffers(pa.binary(), 1, [None, pa.py_buffer(offsets.astype(np.int32)),
                                                            pa.py_buffer(views[0])])
    buf = scratch.get(name)
    if buf is None or buf.size < total:
        buf = scratch[name] = np.empty(total, dtype=np.uint8)
    for v, start in zip(views, offsets[:-1]):
        buf[start : start + v.size] = v
    return pa.BinaryArray.from_buffers(pa.binary(), len(views),
                                       [None, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(buf[:total])])


def schema_meta(schema: pa.Schema, where: str) -> dict[str, Any]:
    md = schema.metadata or {}
    if META_KEY not in md:
        raise ValueError(f"{where}: Arrow schema has no '{META_KEY.decode()}' metadata; not a tapdraft shard")
    return json.loads(md[META_KEY])


def read_schema(data: bytes | pa.Buffer) -> pa.Schema:
    """Schema from the head of a stream (the first message)."""
    return pa.ipc.open_stream(pa.py_buffer(data) if isinstance(data, bytes) else data).schema


_READ_OPTIONS = pa.ipc.IpcReadOptions(use_threads=False)


def read_batch(data: Any) -> pa.RecordBatch:
    """The first record batch of ``data``: a stream's schema message, then the batch's message.

    Buffers are decompressed on the calling thread: handing a batch's ~20 buffers to Arrow's pool cost the
    batch of a 64-token sample at hidden 1024 0.60 vs 0.49 ms of CPU and 0.92 vs 0.72 ms of wall time, and
    the taps column is one buffer, so the pool has nothing to do in parallel anyway.
    """
    src = pa.py_buffer(data) if not isinstance(data, pa.Buffer) else data
    check_arrow_stream(src)  # declared buffer sizes bounded before Arrow allocates them (shards.limits)
    try:
        return pa.ipc.open_stream(src, options=_READ_OPTIONS).read_next_batch()
    except StopIteration:
        raise ValueError("byte range holds no record batch") from None


def iter_batches(source: Any) -> Iterator[pa.RecordBatch]:
    """All record batches of a whole shard (bytes, buffer or a readable file)."""
    src = pa.py_buffer(source) if isinstance(source, bytes) else source
    if isinstance(src, pa.Buffer):  # a file is checked batch by batch by its reader (read_batch)
        check_arrow_stream(src)
    yield from pa.ipc.open_stream(src)


def decode_row(row: dict[str, Any], field_meta: dict[str, Any] | FieldMeta) -> dict[str, Any]:
    """One row as ``datasets`` (or ``RecordBatch.to_pylist``) returns it -> a tapdraft sample dict.

    ``field_meta``: the shard's ``tapdraft`` schema metadata (``read_shard_metadata``) or the
    manifest's ``field_meta``.
    The row is checked against its ``checksum`` column (CorruptShardError on a mismatch); a row
    without one is refused unless ``field_meta`` is a dict of schema 1.0 (written before checksums).
    """
    meta = field_meta if isinstance(field_meta, FieldMeta) else FieldMeta.from_dict(field_meta)
    names = stored_fields(meta)
    fields = {n: row[n] for n in names}
    if row.get(ROW_COLUMN) is not None:
        check_row(row, fields, names, row[ROW_COLUMN], "decode_row")
    elif isinstance(field_meta, FieldMeta) or has_checksums(field_meta.get("schema_version")):
        raise CorruptShardError(f"row {row.get('sample_id')!r} has no {ROW_COLUMN!r} column but its dataset "
                                "stores one: the shard is damaged or not read whole; pass every column to decode_row")
    return decode_fields(fields, row, meta)


def _cells(col: pa.Array) -> tuple[np.ndarray, memoryview]:
    """(offsets, data) of a binary column: cell i is data[offsets[i]:offsets[i + 1]], sliced without a copy
    (``BinaryScalar.as_buffer`` copies the cell: 1.7 ms for a 12 MB cell at hidden 1024)."""
    _, offsets, data = col.buffers()
    off = np.frombuffer(offsets, dtype=np.int32, count=len(col) + 1, offset=4 * col.offset)
    return off, memoryview(b"") if data is None else _writable_view(data)


def _writable_view(buf: pa.Buffer) -> memoryview:
    """``buf``'s bytes, writable when the memory is: Arrow marks the slices that an IPC reader cuts out of a
    writable buffer (the reader's own read buffer) read-only, and torch refuses to view read-only memory."""
    root = buf
    while not root.is_mutable and root.parent is not None:
        root = root.parent
    if not root.is_mutable:
        return memoryview(buf)
    start = buf.address - root.address
    return memoryview(root)[start : start + buf.size]


def decode_batch(batch: pa.RecordBatch, meta: FieldMeta, rows: range | list[int] | None = None, *,
                 check_rows: str | None = None, share: bool = False) -> list[dict[str, Any]]:
    """Decode selected rows of a record batch without copying the binary columns to Python lists.

    ``check_rows``: a place name (the shard) to check each row against its ``checksum`` column;
    None when the batch's stored bytes were already checked as a block.
    ``share``: the caller hands the batch over (nothing else keeps it: a cached batch would change under a
    caller's in-place edit), so a one-row batch's tensors may view its buffers (``codec.decode_fields``).
    A row of a batch of several is copied: a view would keep its neighbours' bytes alive (a shuffle buffer
    of small samples would hold a whole record batch per sample).
    """
    share = share and batch.num_rows == 1
    names = stored_fields(meta)
    cols = {n: _cells(batch.column(n)) for n in names}
    sid, src, secs = batch.column("sample_id"), batch.column("source"), batch.column("audio_seconds")
    sums = batch.column(ROW_COLUMN) if check_rows is not None and ROW_COLUMN in batch.schema.names else None
    out = []
    for i in rows if rows is not None else range(batch.num_rows):
        fields = {n: data[off[i]:off[i + 1]] for n, (off, data) in cols.items()}
        scalars = {"sample_id": sid[i].as_py(), "source": src[i].as_py(), "audio_seconds": secs[i].as_py()}
        if sums is not None:
            check_row(scalars, fields, names, sums[i].as_py(), check_rows)
        out.append(decode_fields(fields, scalars, meta, share=share))
    return out


def read_shard_metadata(path: str) -> dict[str, Any]:
    """The ``tapdraft`` JSON of one shard (local path or fsspec URL): feed it to ``decode_row``."""
    import fsspec

    with fsspec.open(path, "rb") as f:
        return schema_meta(pa.ipc.open_stream(f).schema, path)
