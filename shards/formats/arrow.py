"""Arrow IPC STREAM shards: declared schema, zstd buffer compression (or none: ``zstd_level`` 0, the
fastest read), record batches of about 1 MiB (one batch per sample when samples are larger).

Why the stream format (not the IPC file format): ``datasets.Dataset.from_file`` memory-maps only
streams, and ``datasets.load_dataset("arrow", data_files=...)`` reads both. Random access does not
need the file footer: the writer records each record batch's byte range in the shard's index file
(shards.shard_index), and a reader seeks there and parses one message.

``ArrowShardWriter`` and ``ArrowShardReader`` are the format's registry entry (``shards.formats``):
samples are gathered into record batches of at most ``ShardConfig.batch_bytes`` uncompressed bytes (cut
smaller as the shard nears ``shard_bytes``), each batch's byte range and hash go to the shard's index, and
the reader reads one record batch per random access (the schema message, kept from the shard's checked
head, goes before it so that the bytes parse as a stream).

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

import bisect
import json
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np
import pyarrow as pa

from tapdraft.shards.codec import FieldMeta, decode_fields, shard_metadata, stored_fields
from tapdraft.common.errors import CorruptShardError
from tapdraft.shards.formats.arrow_ipc import check_arrow_stream
from tapdraft.shards.formats.base import Format, OpenShards, ShardReader, ShardSettings, ShardWriter, Sink
from tapdraft.shards.integrity import ROW_COLUMN, check_block, check_row, row_checksum
from tapdraft.shards.schema import check_schema_version, has_checksums, undeclared_problem
from tapdraft.shards.shard_index import index_doc, load_index

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

NAME = "arrow"
META_KEY = b"tapdraft"
SCALAR_COLUMNS = (("sample_id", pa.string()), ("source", pa.string()), ("audio_seconds", pa.float64()),
                  ("num_tokens", pa.int32()))


def arrow_schema(meta: FieldMeta, fingerprint: str | None, lineage: str | None = None) -> pa.Schema:
    fields = [pa.field(n, t, nullable=False) for n, t in SCALAR_COLUMNS]
    fields += [pa.field(n, pa.binary(), nullable=False) for n in stored_fields(meta)]
    fields.append(pa.field(ROW_COLUMN, pa.uint64(), nullable=False))
    meta_json = json.dumps(shard_metadata(meta, fingerprint, lineage), sort_keys=True)
    return pa.schema(fields, metadata={META_KEY: meta_json})


def column_problems(schema: pa.Schema, meta: FieldMeta, path: str) -> tuple[list[str], list[str]]:
    """Problems (one line each, naming the shard and the column) of a shard whose columns are not the ones its layout
    declares (``arrow_schema``), as (broken, extra): a declared column missing or of another type (its rows cannot
    be decoded), and a column the declaration lacks. Readers refuse the first of either (a missing ``topk_ids`` was a
    KeyError traceback); ``verify`` reports them all. An extra column is refused, not ignored: its bytes are outside
    every row checksum, and ``datasets.load_dataset`` (the card's way to load the dataset) would hand it to a user
    as the dataset's own. Only a shard of a later minor of this schema may carry columns this code does not know, and
    they are ignored (minor additions stay readable): the rule is ``shards.schema.undeclared_problem``, which a tar
    sample's members share. A shard written before checksums (schema 1.0) has no checksum column."""
    version = schema_meta(schema, path).get("schema_version")
    want = arrow_schema(meta, None)
    have = {f.name: f.type for f in schema}
    out = []
    for f in want:
        if f.name not in have:
            if f.name != ROW_COLUMN or has_checksums(version):
                out.append(f"{path}: has no column {f.name!r}, which its layout declares (schema {version}): the "
                           "shard is damaged or not this dataset's; re-copy it (or re-capture it)")
        elif have[f.name] != f.type:
            out.append(f"{path}: column {f.name!r} is {have[f.name]}, its layout declares {f.type}: the shard is "
                       "damaged or not this dataset's; re-copy it (or re-capture it)")
    undeclared = undeclared_problem(path, "column(s)", [n for n in have if n not in want.names], version)
    return out, [undeclared] if undeclared else []


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
    check_arrow_stream(src)  # declared buffer sizes bounded before Arrow allocates them (shards.formats.arrow_ipc)
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


class ArrowShardWriter(ShardWriter):
    """One Arrow IPC stream: samples gathered into record batches, each batch's byte range and hash recorded."""

    def __init__(self, sink: Sink, cfg: ShardSettings, meta: FieldMeta, fingerprint: str | None,
                 lineage: str | None, rank: int) -> None:
        super().__init__(sink, cfg, meta, fingerprint, lineage, rank)
        self.schema = arrow_schema(meta, fingerprint, lineage)
        codec = pa.Codec("zstd", compression_level=cfg.zstd_level) if cfg.zstd_level else None
        self._stream = pa.ipc.new_stream(sink, self.schema, options=pa.ipc.IpcWriteOptions(compression=codec))
        self.batches: list[list[Any]] = []
        self._pending: list[tuple[dict[str, Any], dict[str, Any]]] = []
        self._pending_bytes = 0
        self._scratch: dict[str, Any] = {}  # column buffers reused batch after batch

    @classmethod
    def container(cls, zstd_level: int) -> str:
        return "arrow-ipc-stream" + ("+zstd" if zstd_level else "")

    def add(self, index: int, scalars: dict[str, Any], fields: dict[str, Any]) -> None:
        nbytes = sum(len(b) for b in fields.values())
        room = max(self.cfg.shard_bytes - self.sink.n, 1)  # uncompressed >= compressed: never overshoots much
        limit = min(self.cfg.batch_bytes, room)
        if self._pending and self._pending_bytes + nbytes > limit:
            self._flush_batch()  # a batch never grows past the limit, so random access reads about one sample's bytes
        self._pending.append((scalars, fields))
        self._pending_bytes += nbytes
        if self._pending_bytes >= limit:
            self._flush_batch()

    def _flush_batch(self) -> None:
        if not self._pending:
            return
        self.sink.blocks.cut()
        self._stream.write_batch(make_batch(self.schema, self._pending, self._scratch))
        start, end, h = self.sink.blocks.cut()
        self.batches.append([start, end, len(self._pending), h])
        self._pending, self._pending_bytes = [], 0

    def close(self) -> None:
        self._flush_batch()
        self._stream.close()

    def index_doc(self, samples: int) -> dict[str, Any]:
        """Head: the schema message; batches; tail: the end-of-stream marker (the bytes since the last batch)."""
        return index_doc(NAME, self.sink.n, samples, self.sink.head(len(self.schema.serialize())), self.batches,
                         list(self.sink.blocks.cut()))


class ArrowShardReader(ShardReader):
    """Random access by record batch: each read is one checked byte range (the batch, and the end-of-stream
    marker with the last one); the schema of each shard comes from its checked head."""

    random_access = True

    def __init__(self, ds: OpenShards) -> None:
        super().__init__(ds)
        self._schemas: dict[str, pa.Schema] = {}
        self._batch_cache: tuple[Any, pa.RecordBatch] | None = None

    def check_head(self, shard: dict[str, Any], head: Any, path: str) -> None:
        self._schemas[shard["name"]] = self._checked_schema(head, path)

    def _schema(self, shard: dict[str, Any]) -> pa.Schema:
        name = shard["name"]
        idx = self.ds.shard_index(shard)
        if name not in self._schemas:  # a shard of schema 1.0 has no head: its first range holds the schema
            path = self.ds.shard_path(shard)
            self._schemas[name] = self._checked_schema(self.ds.fs.cat_file(path, start=0, end=idx.batches[0][1]),
                                                       path)
        return self._schemas[name]

    def _checked_schema(self, head: Any, path: str) -> pa.Schema:
        schema = read_schema(head)
        fp = schema_meta(schema, path).get("fingerprint")
        if fp is not None and fp != self.ds.fingerprint:
            raise ValueError(f"{path} holds target fingerprint {fp[:12]}, the manifest "
                             f"{self.ds.fingerprint[:12]}: shards of different targets were mixed; re-capture it")
        broken, extra = column_problems(schema, self.ds.field_meta, path)
        if broken or extra:
            raise CorruptShardError((broken + extra)[0])
        return schema

    def batch_bytes(self, shard: dict[str, Any], b: int, prefix: Any = b"") -> Any:
        """``prefix`` + the stored bytes of record batch ``b``, checked against its checksum (the last batch's
        end-of-stream marker is read with it, checked and cut off)."""
        idx = self.ds.shard_index(shard)
        start, end, n, *h = idx.batches[b]
        path = self.ds.shard_path(shard)
        tail = idx.tail if b == len(idx.batches) - 1 else None
        stop = tail[1] if tail else end

        def check(stored: Any) -> None:
            if len(stored) != stop - start:
                raise CorruptShardError(f"{path} is truncated (batch {b} wants bytes {start}..{end}); "
                                        "run `tapdraft verify`")
            if tail:
                check_block(stored[end - start:], tail[2], f"{path} (end of stream)")
            if h:
                check_block(stored[: end - start], h[0], f"{path} record batch {b}")

        data = self.ds.read_range(path, start, stop, prefix, check)
        return data[: len(prefix) + end - start]

    def read_record_batch(self, shard: dict[str, Any], b: int) -> pa.RecordBatch:
        start, end, n, *h = self.ds.shard_index(shard).batches[b]
        path = self.ds.shard_path(shard)
        schema = self._schema(shard)
        # the schema message goes before the batch (a range that starts at 0 already has it), so that the
        # bytes parse as a stream read on this thread (read_batch)
        head = b"" if start == 0 else schema.serialize()
        data = self.batch_bytes(shard, b, head)
        try:
            batch = read_batch(data)
        except (ValueError, OSError) as e:  # pa.ArrowInvalid is a ValueError
            raise ValueError(f"{path}: record batch {b} is unreadable ({e}); run `tapdraft verify`") from e
        if batch.num_rows != n:
            raise ValueError(f"{path}: record batch {b} has {batch.num_rows} rows, manifest says {n}")
        return batch

    def sample(self, shard: dict[str, Any], row: int, key: Any, i: int) -> dict[str, Any]:
        """Seeks to the row's record batch; the last batch read is kept for the next call."""
        bounds = self.ds.shard_index(shard).bounds
        b = bisect.bisect_right(bounds, row) - 1
        if self._batch_cache is None or self._batch_cache[0] != (key, b):
            self._batch_cache = ((key, b), self.read_record_batch(shard, b))
        try:
            return decode_batch(self._batch_cache[1], self.ds.field_meta, [row - bounds[b]])[0]
        except ValueError as e:
            raise ValueError(f"{self.ds.shard_path(shard)}: sample {i} does not match the manifest layout ({e}); "
                             "run `tapdraft verify`") from e

    def prefetch(self, shard: dict[str, Any]) -> None:
        """A streamed shard's index and first record batch, not all of it."""
        self.ds.fs.prefetch(self.batch_bytes, shard, 0)

    def read_rows(self, shard: dict[str, Any], rows: list[int]) -> Iterator[dict[str, Any]]:
        """Each record batch that holds some of ``rows`` is read once, in order."""
        idx = self.ds.shard_index(shard)
        path = self.ds.shard_path(shard)
        i = 0
        while i < len(rows):
            b = idx.batch_of(rows[i])
            j = bisect.bisect_left(rows, idx.bounds[b + 1], i)
            local = [r - idx.bounds[b] for r in rows[i:j]]
            try:
                decoded = decode_batch(self.read_record_batch(shard, b), self.ds.field_meta, local, share=True)
            except ValueError as e:
                if path in str(e):
                    raise
                raise ValueError(f"{path}: record batch {b} does not match the manifest layout ({e}); "
                                 "run `tapdraft verify`") from e
            yield from decoded
            i = j

    @classmethod
    def verify_shard(cls, fs: AbstractFileSystem, root: str, path: str, m: dict[str, Any], meta: FieldMeta,
                     sh: dict[str, Any], problem: Callable[[str], None]) -> Iterator[dict[str, Any]]:
        """The schema's metadata against the manifest, the index's head, batch and tail hashes, each batch's row
        count and every row's checksum."""
        fp = m["fingerprint"]
        with fs.open(path, "rb") as f:
            data = f.read()
        reader = pa.ipc.open_stream(pa.py_buffer(data))
        smeta = schema_meta(reader.schema, path)
        try:
            check_schema_version(smeta.get("schema_version"), path)
        except ValueError as e:
            problem(str(e))
        if smeta.get("fingerprint") not in (None, fp):
            problem(f"{path}: shard fingerprint {smeta['fingerprint'][:12]} differs from the manifest's {fp[:12]}; "
                    "shards of different targets were mixed, re-capture this one")
        if smeta.get("dtypes") != m["field_meta"].get("dtypes") or smeta.get("layout") != m["field_meta"]["layout"]:
            problem(f"{path}: schema dtypes/layout differ from the manifest's; re-capture the shard")
        broken, extra = column_problems(reader.schema, meta, path)
        for p in extra:
            problem(p)
        try:
            idx = load_index(fs, root, sh, NAME, batches=True)
        except (CorruptShardError, FileNotFoundError) as e:
            problem(str(e))
            return
        batches = idx.batches
        blocks = [(f"record batch {b}", bt[0], bt[1], bt[3]) for b, bt in enumerate(batches) if len(bt) > 3]
        if idx.head is not None:
            blocks.append(("head", 0, idx.head[0], idx.head[1]))
        if idx.tail is not None:
            blocks.append(("end of stream", *idx.tail))
        for what, start, end, h in blocks:
            try:
                check_block(memoryview(data)[start:end], h, f"{path} {what}")
            except CorruptShardError as e:
                problem(str(e))
        for b, batch in enumerate(iter_batches(pa.py_buffer(data))):
            if b < len(batches) and batches[b][2] != batch.num_rows:
                problem(f"{path}: record batch {b} has {batch.num_rows} rows, manifest says {batches[b][2]}")
            if broken:  # its rows cannot be decoded: the shard is unreadable, naming the column
                raise CorruptShardError(broken[0])
            yield from decode_batch(batch, meta, check_rows=path)
        if batches and batches[-1][1] > len(data):
            problem(f"{path}: record batch ranges end at {batches[-1][1]}, the file at {len(data)}")

    @classmethod
    def stock_snippet(cls, first: str) -> str:
        return f"""```python
import datasets, json
from tapdraft.shards.formats.arrow import decode_row
DATASET = "path/to/this/directory"
manifest = json.load(open(f"{{DATASET}}/manifest.json"))
ds = datasets.load_dataset(DATASET)["{first}"]   # every split, named by the front matter above
# or one split by its files:
# ds = datasets.load_dataset("arrow", data_files=f"{{DATASET}}/data/{first}-*.arrow", split="train")
# or, memory-mapped without a copy: datasets.Dataset.from_file(f"{{DATASET}}/data/{first}-00000-of-....arrow")
sample = decode_row(ds[0], manifest["field_meta"])   # bf16 tensors, as tapdraft returns them
```"""


FORMAT = Format(NAME, "arrow", ArrowShardWriter, ArrowShardReader,
                help="Arrow IPC shards: random access, memory-mapped by `datasets`")
