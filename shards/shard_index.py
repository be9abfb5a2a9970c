"""A shard's own index: where its record batches lie and what they hash to, in a small file beside it.

    data/train-00003-of-00012.arrow         the shard, exactly what stock Arrow / webdataset read
    index/train-00003-of-00012.arrow.json   its index (``index_name``), written when the shard is finished

Why a sidecar file, not a footer inside the shard: an Arrow IPC *stream* ends at its end-of-stream
marker and ``datasets.Dataset.from_file`` reads only streams, and a tar member named like an index
would come out of ``webdataset.WebDataset`` as one more sample; bytes appended to either would make
the stock libraries read something else than today, and bytes prepended would move every offset.
A sidecar leaves every shard byte-identical to what the stock libraries read, is one small range
read (no seek to a footer whose size must be read first), and is written after the shard is
complete, when the whole file's checksum is known. A separate ``index/`` folder keeps the listing
of ``data/`` (what opening a dataset reads) and the stock libraries' ``data/*.arrow`` globs as they were.

Index document (JSON, sorted keys; ~60 bytes a record batch, so ~60 KB for a 1 GiB shard of
1 MiB batches, parsed in about a millisecond; JSON so that ``tapdraft`` is not needed to read it):

    {"version": 1, "format": <format name>, "bytes": <shard bytes>, "samples": <rows>,
     "head": [n, h],                                 bytes [0, n) of the shard (schema message /
                                                     first tar member) hash to h
     "batches": [[start, end, rows, h], ...],        a format with record batches (Arrow): each batch's
                                                     byte range and hash
     "tail": [start, end, h]}                        with batches: the end of the file (Arrow's
                                                     end-of-stream marker)

The manifest records per shard only ``index: [bytes, h]`` of this file, so opening a dataset is
O(shards); a reader fetches, checks and parses a shard's index the first time it reads that shard
(``load_index``) and keeps the last few (``IndexCache``). Datasets of schema 1 carried the same
entries inline in the manifest; ``migrate_inline_index`` reads them as an index.
"""

from __future__ import annotations

import bisect
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import fsspec

from tapdraft.common.atomic import write_bytes_atomic
from tapdraft.common.errors import CorruptShardError
from tapdraft.shards.integrity import check_block, digest
from tapdraft.shards.limits import MAX_INDEX_BYTES, check_size, parse_json

INDEX_DIR = "index"
INDEX_VERSION = 1
INLINE_KEY = "inline_index"
"""Key under which ``migrate_inline_index`` keeps a schema-1 shard's inline entries in the migrated manifest."""


def index_name(shard_name: str) -> str:
    """Where the index of the shard ``data/<file>`` lives: ``index/<file>.json`` (the one naming rule)."""
    return f"{INDEX_DIR}/{shard_name.rsplit('/', 1)[-1]}.json"


def index_doc(fmt: str, nbytes: int, samples: int, head: list[Any], batches: list[list[Any]] | None = None,
              tail: list[Any] | None = None) -> dict[str, Any]:
    """The index document of a shard of format ``fmt``; ``batches`` (and ``tail``) only for a format that has them."""
    doc: dict[str, Any] = {"version": INDEX_VERSION, "format": fmt, "bytes": nbytes, "samples": samples, "head": head}
    if batches is not None:
        doc["batches"], doc["tail"] = batches, tail
    return doc


def write_index(fs: fsspec.AbstractFileSystem, path: str, doc: dict[str, Any]) -> list[Any]:
    """Write ``doc`` atomically at ``path``; returns the manifest's ``[bytes, hash]`` of the file."""
    data = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    write_bytes_atomic(fs, path, data)
    return [len(data), digest(data)]


@dataclass
class ShardIndex:
    """A shard's checked index: record batches (Arrow), head, tail, and each batch's first row."""

    head: list[Any] | None
    batches: list[list[Any]]
    tail: list[Any] | None
    bounds: list[int]
    """Row of each batch's first sample, plus the total: batch b holds rows [bounds[b], bounds[b + 1])."""

    def batch_of(self, row: int) -> int:
        return bisect.bisect_right(self.bounds, row) - 1


def checked_index(doc: Any, shard: dict[str, Any], fmt: str, where: str, batches: bool) -> ShardIndex:
    """Validate an index document against its manifest entry (bytes, samples, format) and against itself:
    batch ranges ascending, inside the shard, never overlapping, rows adding up (to the shard's samples when
    the format ``batches`` its shards); otherwise CorruptShardError.
    So no offset or size read from it can make a reader allocate past the shard's (bounded) size."""
    def bad(what: str) -> CorruptShardError:
        return CorruptShardError(f"{where}: {what}; the index is damaged or belongs to another shard: re-copy the "
                                 "dataset (or re-capture the shard)")

    if not isinstance(doc, dict):
        raise bad("not a JSON object")
    size, samples = shard["bytes"], shard["samples"]
    if doc.get("format", fmt) != fmt or doc.get("bytes", size) != size or doc.get("samples", samples) != samples:
        raise bad(f"it describes a {doc.get('format')} shard of {doc.get('bytes')} bytes and {doc.get('samples')} "
                  f"samples, the manifest a {fmt} shard of {size} bytes and {samples} samples")
    head, tail, ranges = doc.get("head"), doc.get("tail"), doc.get("batches") or []
    if head is not None and not (isinstance(head, list) and len(head) == 2 and isinstance(head[0], int)
                                 and 0 < head[0] <= size):
        raise bad(f"head {head!r} is not inside the shard")
    if not isinstance(ranges, list):
        raise bad("batches is not a list")
    end, bounds = 0, [0]
    for b, bt in enumerate(ranges):
        if not (isinstance(bt, list) and len(bt) >= 3 and all(isinstance(x, int) and not isinstance(x, bool)
                                                               for x in bt[:3])):
            raise bad(f"record batch {b} entry {bt!r} is malformed")
        start, stop, rows = bt[:3]
        if not (end <= start < stop <= size and rows >= 1):
            raise bad(f"record batch {b} range {start}..{stop} ({rows} rows) is not after {end} inside {size} bytes")
        end = stop
        bounds.append(bounds[-1] + rows)
    if batches and bounds[-1] != samples:
        raise bad(f"its record batches hold {bounds[-1]} rows, the manifest says {samples} samples")
    if tail is not None and not (isinstance(tail, list) and len(tail) == 3 and end <= tail[0] <= tail[1] <= size):
        raise bad(f"end-of-stream range {tail!r} is not after the last record batch inside the shard")
    return ShardIndex(head=head, batches=ranges, tail=tail, bounds=bounds)


def migrate_inline_index(shard: dict[str, Any]) -> dict[str, Any]:
    """Schema 1 -> 2: a manifest shard entry with ``batches``/``head``/``tail`` inline becomes an entry with
    those under ``inline_index`` (read by ``load_index`` without a file; a WebDataset shard of schema 1.0 had none
of them: an empty one); entries with an ``index`` record are returned as they are."""
    if "index" in shard or INLINE_KEY in shard:
        return shard
    inline = {k: shard[k] for k in ("batches", "head", "tail") if k in shard}
    return {**{k: v for k, v in shard.items() if k not in inline}, INLINE_KEY: inline}


def load_index(fs: fsspec.AbstractFileSystem, root: str, shard: dict[str, Any], fmt: str, batches: bool) -> ShardIndex:
    """The checked index of one manifest shard entry of format ``fmt`` (``batches``: its shards are record batches
    that the index lists): its ``index`` file (size and hash against the manifest's ``[bytes, h]``), or the
    inline entries of a migrated schema-1 manifest."""
    def join(rel: str) -> str:
        return root.rstrip("/") + "/" + rel

    if INLINE_KEY in shard:
        return checked_index(shard[INLINE_KEY], shard, fmt, f"{join(shard['name'])} (manifest entries)", batches)
    path = join(index_name(shard["name"]))
    rec = shard.get("index")
    if not (isinstance(rec, list) and len(rec) == 2):
        raise CorruptShardError(f"{path}: the manifest's entry for {shard['name']} has no index record; "
                                "re-run finalize")
    n = check_size(rec[0], MAX_INDEX_BYTES, f"the manifest's index record of {shard['name']}")
    try:
        data = fs.cat_file(path, start=0, end=n + 1)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{path} is missing: the index of {shard['name']}; re-copy the dataset's "
                                f"{INDEX_DIR}/ folder") from e
    if len(data) != n:
        raise CorruptShardError(f"{path} has {len(data) if len(data) <= n else 'more than ' + str(n)} bytes, the "
                                f"manifest says {n}: re-copy it")
    check_block(data, rec[1], path)
    doc = parse_json(data, path)  # bad JSON or nesting that exhausts the parser: corrupt, never a traceback
    if not isinstance(doc, dict):
        raise CorruptShardError(f"{path} is a JSON {type(doc).__name__}, not an index object: re-copy it")
    if doc.get("version") != INDEX_VERSION:
        raise CorruptShardError(f"{path} has index version {doc.get('version')!r}, this tapdraft reads "
                                f"{INDEX_VERSION}: use a matching release")
    return checked_index(doc, shard, fmt, path, batches)


class IndexCache:
    """The last ``size`` shards' indexes, loaded on first use (a rank streams a few shards at a time; an index
    of a 1 GiB shard is ~0.5 MB of Python objects, so holding every shard's would undo O(shards) opening)."""

    def __init__(self, load: Callable[[dict[str, Any]], ShardIndex], size: int = 64) -> None:
        self._load, self._size = load, size
        self._items: OrderedDict[str, ShardIndex] = OrderedDict()

    def get(self, shard: dict[str, Any]) -> ShardIndex:
        name = shard["name"]
        if name in self._items:
            self._items.move_to_end(name)
            return self._items[name]
        idx = self._load(shard)
        self._items[name] = idx
        while len(self._items) > self._size:
            self._items.popitem(last=False)
        return idx
