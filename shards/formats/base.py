"""What a storage format is to the rest of shards/: a writer class and a reader class behind one registry entry.

A format (``shards.formats.arrow``, ``shards.formats.wds``) turns encoded samples (``shards.codec``) into
the bytes of one shard file and reads and checks them back. Everything else (the shard's temp name and
rename, its sha256 and head hash, the rank's index, finalize, the manifest, sample order) is the same for
every format and lives outside this package; it asks ``shards.formats.FORMATS[name]`` for the rest and
never names a format. The name is what the manifest records under ``"format"``.

    ShardWriter   one shard being written: samples in, bytes out through a hashing sink, then the
                  shard's index document (shards.shard_index)
    ShardReader   the shards of one open dataset (shards.reader.Dataset): head check, one sample, the
                  rows of one shard, background prefetch; and ``verify_shard`` for ``tapdraft verify``
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterator, Protocol, runtime_checkable

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

    from tapdraft.shards.codec import FieldMeta
    from tapdraft.shards.integrity import BlockHasher
    from tapdraft.shards.shard_index import ShardIndex


# What a format is handed, as protocols: the classes that fill them (shards.shard_file, shards.reader) import this
# registry, so naming them here would close a circle; tests/shards/test_format_handoffs.py checks they fit.
@runtime_checkable
class Sink(Protocol):
    """Where a writer's bytes go (``shards.shard_file``'s hashing sink)."""

    @property
    def n(self) -> int:
        """Bytes written so far."""

    @property
    def blocks(self) -> "BlockHasher":
        """Cuts the bytes written since the last cut into one hashed block: ``cut()`` -> (start, end, hash)."""

    def write(self, data: Any) -> int: ...

    def head(self, n: int) -> list[Any]:
        """[n, checksum of bytes [0, n)] for the index."""


@runtime_checkable
class ShardSettings(Protocol):
    """What a format reads of its shards' settings (``shards.shard_file.ShardConfig``)."""

    @property
    def shard_bytes(self) -> int: ...

    @property
    def batch_bytes(self) -> int: ...

    @property
    def zstd_level(self) -> int: ...


@runtime_checkable
class OpenShards(Protocol):
    """What a reader asks of the dataset it reads (``shards.reader.Dataset``)."""

    @property
    def fs(self) -> "AbstractFileSystem": ...

    @property
    def fingerprint(self) -> str: ...

    @property
    def field_meta(self) -> "FieldMeta": ...

    def shard_index(self, shard: dict[str, Any]) -> "ShardIndex": ...

    def shard_path(self, shard: dict[str, Any]) -> str: ...

    def read_range(self, path: str, start: int, end: int, prefix: Any = b"", check: Any = None) -> Any: ...


class ShardWriter:
    """Writes the samples of one shard to ``sink``."""

    def __init__(self, sink: Sink, cfg: ShardSettings, meta: "FieldMeta", fingerprint: str | None,
                 lineage: str | None, rank: int) -> None:
        self.sink, self.cfg, self.meta, self.rank = sink, cfg, meta, rank
        self.fingerprint, self.lineage = fingerprint, lineage

    @classmethod
    def check_config(cls, cfg: ShardSettings) -> None:
        """Raise ValueError when ``cfg`` (a ShardConfig naming this format) asks for something it cannot store."""

    @classmethod
    def container(cls, zstd_level: int) -> str:
        """The manifest's ``codec.container``: the file container and its compression."""
        raise NotImplementedError

    def add(self, index: int, scalars: dict[str, Any], fields: dict[str, Any]) -> None:
        """One sample: its scalars (sample_id, source, audio_seconds) and encoded fields (``codec.encode_fields``)."""
        raise NotImplementedError

    def close(self) -> None:
        """Write whatever is pending and the end of the file; the sink is closed by the caller."""
        raise NotImplementedError

    def index_doc(self, samples: int) -> dict[str, Any]:
        """The shard's index document (``shards.shard_index.index_doc``), once ``close`` has run."""
        raise NotImplementedError


class ShardReader:
    """Reads the shards of one open dataset ``ds`` (paths, ranges, indexes)."""

    random_access: ClassVar[bool] = False
    """Whether a shard's index lists its record batches, so one sample is read without the rest of its shard:
    streams then permute units of samples, not whole shards (shards.order)."""

    def __init__(self, ds: OpenShards) -> None:
        self.ds = ds

    def check_head(self, shard: dict[str, Any], head: Any, path: str) -> None:
        """Check the shard's head bytes (already hash-checked) against the dataset: target fingerprint, layout."""

    def sample(self, shard: dict[str, Any], row: int, key: Any, i: int) -> dict[str, Any]:
        """Row ``row`` of ``shard``; ``key`` names (split, shard) for a cache of the last block read, ``i`` is the
        sample's index in its split (for messages)."""
        return next(iter(self.read_rows(shard, [row])))

    def read_rows(self, shard: dict[str, Any], rows: list[int]) -> Iterator[dict[str, Any]]:
        """Decode the given ascending rows of one shard, in order."""
        raise NotImplementedError

    def prefetch(self, shard: dict[str, Any]) -> None:
        """Start reading the first bytes a stream needs of ``shard`` (remote datasets only)."""
        raise NotImplementedError

    @classmethod
    def verify_shard(cls, fs: "AbstractFileSystem", root: str, path: str, m: dict[str, Any], meta: "FieldMeta",
                     sh: dict[str, Any], problem: Callable[[str], None]) -> Iterator[dict[str, Any]]:
        """Every sample of the shard at ``path`` read whole and checked (``tapdraft verify``): problems that do not
        stop the read go to ``problem``; ones that do raise (ValueError, KeyError, OSError, ArrowException)."""
        raise NotImplementedError

    @classmethod
    def stock_snippet(cls, first: str) -> str:
        """The dataset card's "Load with the stock libraries" code for split ``first``."""
        raise NotImplementedError


@dataclass(frozen=True)
class Format:
    """A registry entry: the name the manifest records, the shard files' extension, the class pair, and the few
    words ``capture --format``'s help gives it."""

    name: str
    extension: str
    """``data/<split>-00000-of-00012.<extension>``."""
    writer: type[ShardWriter]
    reader: type[ShardReader]
    help: str = ""
