"""WebDataset tar shards: one zstd-compressed member per field, plus a small JSON member per sample.

    <key>.meta.json          {"sample_id", "source", "audio_seconds", "field_meta", "fingerprint",
                              "lineage" (optional), "checksums": {member: xxh3},
                              "content_checksums": {member: xxh3 of its decompressed bytes}, "checksum"}
                             (plain JSON; shards.integrity)
    <key>.<field>.zst        zstd(encoded bytes of shards.codec) for every stored field

``key`` is ``r<rank>-<input index>`` (no dots, as webdataset splits keys at the first dot). Each
sample is self-describing (``field_meta`` carries the layout and byte layout), so
``webdataset.WebDataset(urls).map(decode_wds_sample)`` needs nothing else. Member headers have
fixed mtime/owner so that the same samples always give the same bytes.

``decode_wds_sample`` checks every member against ``checksums`` and the meta document against its
own ``checksum``. A sample holds those members only: tapdraft's reader refuses one the schema does not
declare and ``verify`` reports it (``member_problem``, the rule of Arrow's extra columns).
``iter_tar_samples`` (tapdraft's reader and ``verify``) also checks the framing
that a member checksum cannot see: each header's tar checksum, zero padding, and zero end blocks
with nothing after them, so a flip anywhere in the file is an error. The writer emits the tar
bytes itself (USTAR headers from ``tarfile.TarInfo``, the same bytes ``tarfile`` writes) so that it
knows where the first member ends: that head is what the shard's index hashes for the open-time check.

``TarShardWriter`` and ``TarShardReader`` are the format's registry entry (``shards.formats``). A tar has
no index of its samples, so its order unit is the whole shard and one sample is read by reading the
shard up to it (fine for a look, slow as a training access path).
"""

from __future__ import annotations

import json
import tarfile
from typing import TYPE_CHECKING, Any, BinaryIO, Callable, Iterator

import zstandard

from tapdraft.shards.codec import FieldMeta, decode_fields, stored_fields
from tapdraft.common.errors import CorruptShardError
from tapdraft.shards.formats.base import Format, ShardReader, ShardSettings, ShardWriter, Sink
from tapdraft.shards.integrity import check_block, check_sealed, digest, seal_doc
from tapdraft.shards.limits import decompress_bounded
from tapdraft.shards.schema import undeclared_problem
from tapdraft.shards.shard_index import index_doc, load_index

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

NAME = "wds"

META_MEMBER = "meta.json"
META_KEYS = {"sample_id", "source", "audio_seconds", "field_meta", "fingerprint"}
"""Keys of a meta.json written before checksums (schema 1.0); today's add ``checksums`` and ``checksum``."""
_BLOCK = tarfile.BLOCKSIZE
_RECORD = tarfile.RECORDSIZE


def sample_key(rank: int, index: int) -> str:
    return f"r{rank:05d}-{index:012d}"


class TarShardWriter(ShardWriter):
    """Appends samples to the sink as tar members (streaming, no seeks): ``<key>.meta.json``, then one
    ``<key>.<field>.zst`` per stored field."""

    def __init__(self, sink: Sink, cfg: ShardSettings, meta: FieldMeta, fingerprint: str | None = None,
                 lineage: str | None = None, rank: int = 0) -> None:
        super().__init__(sink, cfg, meta, fingerprint, lineage, rank)
        self._offset = 0
        self._zstd = zstandard.ZstdCompressor(level=cfg.zstd_level)
        self.head_bytes: int | None = None
        """Where the first member (the first sample's meta.json) ends: the index hashes [0, head_bytes)."""

    @classmethod
    def check_config(cls, cfg: ShardSettings) -> None:
        if cfg.zstd_level == 0:
            raise ValueError("ShardConfig.zstd_level 0 (uncompressed) is for Arrow shards: WebDataset members are "
                             "zstd frames; use format 'arrow' or a level in [1, 22]")

    @classmethod
    def container(cls, zstd_level: int) -> str:
        return "webdataset-tar+zstd"

    def _add(self, name: str, data: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        info.mtime = 0
        info.mode = 0o644
        pad = -len(data) % _BLOCK
        for chunk in (info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape"), data, b"\0" * pad):
            self.sink.write(chunk)
            self._offset += len(chunk)

    def add(self, index: int, scalars: dict[str, Any], fields: dict[str, Any]) -> None:
        key = sample_key(self.rank, index)
        members = {f"{name}.zst": self._zstd.compress(fields[name]) for name in stored_fields(self.meta)}
        meta = {k: scalars[k] for k in ("sample_id", "source", "audio_seconds")}
        meta["field_meta"] = self.meta.to_dict()
        meta["fingerprint"] = self.fingerprint
        if self.lineage is not None:
            meta["lineage"] = self.lineage
        meta["checksums"] = {m: digest(b) for m, b in members.items()}
        meta["content_checksums"] = {f"{name}.zst": digest(fields[name]) for name in stored_fields(self.meta)}
        self._add(f"{key}.{META_MEMBER}", json.dumps(seal_doc(meta), sort_keys=True).encode())
        if self.head_bytes is None:
            self.head_bytes = self._offset
        for m, blob in members.items():
            self._add(f"{key}.{m}", blob)

    def close(self) -> None:
        """Two zero blocks, then zeros up to a whole record, as tarfile ends an archive."""
        end = self._offset + 2 * _BLOCK
        self.sink.write(b"\0" * (2 * _BLOCK + (-end % _RECORD)))

    def index_doc(self, samples: int) -> dict[str, Any]:
        """Head: the first sample's meta.json; no record batches."""
        return index_doc(NAME, self.sink.n, samples, self.sink.head(self.head_bytes))


def decode_wds_sample(sample: dict[str, Any], *, decompressed: bool = False) -> dict[str, Any]:
    """Decoder for ``webdataset.WebDataset(urls).map(decode_wds_sample)``: raw members -> sample dict.

    Checks the meta document and every member against their checksums (CorruptShardError naming
    the shard, from webdataset's ``__url__``); a meta.json of schema 1.0 has none and is not checked.
    A member whose zstd frame declares more than a bounded size is refused before allocating it
    (``shards.limits.decompress_bounded``).

    ``decompressed``: the members were already decompressed by the loader (the ``datasets`` webdataset
    builder undoes the ``.zst`` suffix itself); they are then checked against ``content_checksums``, the
    hashes of the uncompressed member bytes (schema 2.0 writes them; older shards are refused this way).
    """
    where = f"{sample.get('__url__', '<tar>')}: sample {sample.get('__key__')!r}"
    if META_MEMBER not in sample:
        raise CorruptShardError(f"{where} has no {META_MEMBER}; not a tapdraft shard, or a damaged member name")
    meta_doc = sample[META_MEMBER]
    try:
        meta_doc = json.loads(meta_doc) if isinstance(meta_doc, (bytes, str)) else meta_doc
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptShardError(f"{where}: {META_MEMBER} is not valid JSON ({e}); the shard is damaged") from e
    if not isinstance(meta_doc, dict):
        raise CorruptShardError(f"{where}: {META_MEMBER} is not a JSON object; the shard is damaged")
    sums = meta_doc.get("checksums")
    if sums is not None or "checksum" in meta_doc:
        check_sealed(meta_doc, where)
    elif set(meta_doc) != META_KEYS:
        raise CorruptShardError(f"{where}: {META_MEMBER} has keys {sorted(meta_doc)}; the shard is damaged")
    fm = FieldMeta.from_dict(meta_doc["field_meta"])
    if decompressed:
        content = meta_doc.get("content_checksums")
        if not isinstance(content, dict):
            raise CorruptShardError(f"{where}: its meta.json has no content_checksums (written before schema 2.0), "
                                    "so members decompressed by the loader cannot be checked; read the tar with "
                                    "webdataset.WebDataset(...).map(decode_wds_sample)")
    fields = {}
    for name in stored_fields(fm):
        blob = sample.get(f"{name}.zst")
        if blob is None:
            raise CorruptShardError(f"{where} lacks member {name}.zst; the shard is damaged")
        if decompressed:
            check_block(blob, content.get(f"{name}.zst", ""), f"{where} member {name}.zst (decompressed)")
            fields[name] = blob
            continue
        if sums is not None:
            check_block(blob, sums.get(f"{name}.zst", ""), f"{where} member {name}.zst")
        fields[name] = decompress_bounded(blob, f"{where}: member {name}.zst")
    return decode_fields(fields, meta_doc, fm)


def member_problem(raw: dict[str, Any], meta: FieldMeta, version: Any) -> str | None:
    """A problem line naming the members of a raw tar sample (``iter_tar_samples``) that its layout does not declare
    (``<key>.meta.json`` and one ``<key>.<field>.zst`` a stored field), or None: the rule of Arrow's extra columns
    (``shards.schema.undeclared_problem``: refused, unless the dataset is of a later minor of this schema)."""
    declared = {META_MEMBER} | {f"{name}.zst" for name in stored_fields(meta)}
    key = raw["__key__"]
    extra = [f"{key}.{ext}" for ext in raw if not ext.startswith("__") and ext not in declared]
    return undeclared_problem(f"{raw['__url__']}: sample {key!r}", "member(s)", extra, version)


def _zero(data: bytes) -> bool:
    return not data.strip(b"\0")


def iter_tar_samples(fileobj: BinaryIO, where: str = "<tar>",
                     odd: Callable[[str], None] | None = None) -> Iterator[dict[str, Any]]:
    """Group a tar stream's members by key into raw webdataset-style dicts (no webdataset needed).

    Strict: every header's tar checksum, zero padding after each member, and an end of two or more
    zero blocks with only zeros after them; anything else raises CorruptShardError naming ``where``.
    A member that is not a regular file (a symlink, a hard link, a directory, a device) is never followed and
    is skipped; ``odd`` (verify's problem list) is told of each, naming it: a tapdraft tar holds none.
    """
    def damaged(what: str) -> CorruptShardError:
        return CorruptShardError(f"{where}: {what}; the shard is truncated or damaged: re-copy or re-capture it "
                                 "(`tapdraft verify` lists every damaged shard)")

    current: dict[str, Any] | None = None
    offset = 0
    while True:
        header = fileobj.read(_BLOCK)
        if len(header) < _BLOCK:
            raise damaged(f"ends at byte {offset + len(header)} without the tar end blocks")
        if _zero(header):
            rest = fileobj.read()
            if not _zero(rest):
                raise damaged(f"non-zero bytes after the tar end block at {offset}")
            break
        try:
            info = tarfile.TarInfo.frombuf(header, "utf-8", "surrogateescape")
        except tarfile.HeaderError as e:
            raise damaged(f"tar header at byte {offset} is invalid ({e})") from e
        pad = -info.size % _BLOCK
        data = fileobj.read(info.size + pad)
        if len(data) != info.size + pad:
            raise damaged(f"member {info.name} is truncated")
        if pad and not _zero(data[info.size:]):
            raise damaged(f"padding after member {info.name} is not zero")
        offset += _BLOCK + info.size + pad
        if not info.isfile():
            if odd is not None:
                kind = "a symlink" if info.issym() else "a hard link" if info.islnk() else \
                    "a directory" if info.isdir() else "a special file"
                to = f" to {info.linkname!r}" if info.issym() or info.islnk() else ""
                odd(f"{where}: member {info.name!r} is {kind}{to}, which a tapdraft tar never holds (readers skip it, "
                    "never follow it): the shard was edited or written by another tool; re-copy it (or re-capture it)")
            continue
        key, _, ext = info.name.partition(".")
        if current is not None and current["__key__"] != key:
            yield current
            current = None
        if current is None:
            current = {"__key__": key, "__url__": where}
        current[ext] = data[: info.size]
    if current is not None:
        yield current


class TarShardReader(ShardReader):
    """Reads a tar shard from its start, checking its framing, every member (none the schema does not declare) and each
    sample's fingerprint."""

    def read_rows(self, shard: dict[str, Any], rows: list[int]) -> Iterator[dict[str, Any]]:
        ds = self.ds
        ds.shard_index(shard)  # the head (first meta.json) against its hash
        path = ds.shard_path(shard)
        size = ds.fs.size(path)
        if size != shard["bytes"]:
            raise ValueError(f"{path} has {size} bytes, the manifest says {shard['bytes']} (truncated or replaced); "
                             "run `tapdraft verify` and re-copy or re-capture the shard")
        wanted = set(rows)
        seen = 0
        with ds.fs.open(path, "rb") as f:
            for r, raw in enumerate(iter_tar_samples(f, path)):
                seen = r + 1
                if r > rows[-1]:
                    break
                extra = member_problem(raw, ds.field_meta, ds.manifest.get("schema_version"))
                if extra:
                    raise CorruptShardError(extra)
                if r in wanted:
                    try:
                        sample = decode_wds_sample(raw)
                    except CorruptShardError:
                        raise  # names the shard (iter_tar_samples sets __url__)
                    except (ValueError, KeyError) as e:
                        raise ValueError(f"{path}: sample {r} is unreadable ({e}); run `tapdraft verify`") from e
                    meta = json.loads(raw["meta.json"])
                    if meta.get("fingerprint") not in (None, ds.fingerprint):
                        raise ValueError(f"{path}: sample {sample['sample_id']!r} has target fingerprint "
                                         f"{meta['fingerprint'][:12]}, the manifest {ds.fingerprint[:12]}")
                    yield sample
        if seen <= rows[-1]:
            raise CorruptShardError(f"{path} holds {seen} samples, the manifest says {shard['samples']}: re-copy or "
                                    "re-capture it")

    def prefetch(self, shard: dict[str, Any]) -> None:
        """The whole tar: a stream reads it from its start."""
        self.ds.fs.prefetch(self.ds.fs.local_copy, self.ds.shard_path(shard))

    @classmethod
    def verify_shard(cls, fs: AbstractFileSystem, root: str, path: str, m: dict[str, Any], meta: FieldMeta,
                     sh: dict[str, Any], problem: Callable[[str], None]) -> Iterator[dict[str, Any]]:
        """The head against the index, the tar framing (a member that is no regular file is a problem, and one the
        schema does not declare), every member and each sample's fingerprint."""
        fp = m["fingerprint"]
        try:
            head = load_index(fs, root, sh, NAME, batches=False).head
            if head is not None:
                check_block(fs.cat_file(path, start=0, end=head[0]), head[1], f"{path} head")
        except (CorruptShardError, FileNotFoundError) as e:
            problem(str(e))
        with fs.open(path, "rb") as f:
            for raw in iter_tar_samples(f, path, problem):
                extra = member_problem(raw, meta, m.get("schema_version"))
                if extra:
                    problem(extra)
                doc = json.loads(raw.get("meta.json", b"{}"))
                if doc.get("fingerprint") not in (None, fp):
                    problem(f"{path}: sample {raw['__key__']} has fingerprint {doc['fingerprint'][:12]}, the manifest "
                            f"{fp[:12]}; re-capture this shard")
                yield decode_wds_sample(raw)

    @classmethod
    def stock_snippet(cls, first: str) -> str:
        return f"""```python
import glob, webdataset as wds
from tapdraft.shards.formats.wds import decode_wds_sample
DATASET = "path/to/this/directory"
ds = wds.WebDataset(sorted(glob.glob(f"{{DATASET}}/data/{first}-*.tar")), shardshuffle=False).map(decode_wds_sample)
sample = next(iter(ds))   # each sample's meta.json carries what the decoder needs
# or with datasets (webdataset builder, every split from the front matter above):
# (it decompresses the .zst members itself): row = datasets.load_dataset(DATASET)["{first}"][0]
# sample = decode_wds_sample(row, decompressed=True)
```"""


FORMAT = Format(NAME, "tar", TarShardWriter, TarShardReader,
                help="WebDataset tar shards: streamed whole by `webdataset`")
