"""WebDataset tar shards: one zstd-compressed member per field, plus a small JSON member per sample.

    <key>.meta.json          {"sample_id", "source", "audio_seconds", "field_meta", "fingerprint"} (plain JSON)
    <key>.<field>.zst        zstd(encoded bytes of shards.codec) for every stored field

``key`` is ``r<rank>-<input index>`` (no dots, as webdataset splits keys at the first dot). Each
sample is self-describing (``field_meta`` carries the layout and byte layout), so
``webdataset.WebDataset(urls).map(decode_wds_sample)`` needs nothing else. Member headers have
fixed mtime/owner so that the same samples always give the same bytes.
"""

from __future__ import annotations

import io
import json
import tarfile
from typing import Any, BinaryIO, Iterator

import zstandard

from shards.codec import FieldMeta, decode_fields, stored_fields

META_MEMBER = "meta.json"


def sample_key(rank: int, index: int) -> str:
    return f"r{rank:05d}-{index:012d}"


class TarShardWriter:
    """Appends samples to an open binary stream as tar members (streaming, no seeks)."""

    def __init__(self, sink: BinaryIO, meta: FieldMeta, zstd_level: int, fingerprint: str | None = None) -> None:
        self._fingerprint = fingerprint
        self._tar = tarfile.open(fileobj=sink, mode="w|", format=tarfile.USTAR_FORMAT)
        self._meta = meta
        self._zstd = zstandard.ZstdCompressor(level=zstd_level)

    def _add(self, name: str, data: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        info.mtime = 0
        info.mode = 0o644
        self._tar.addfile(info, io.BytesIO(data))

    def add(self, key: str, scalars: dict[str, Any], fields: dict[str, bytes]) -> None:
        meta = {k: scalars[k] for k in ("sample_id", "source", "audio_seconds")}
        meta["field_meta"] = self._meta.to_dict()
        meta["fingerprint"] = self._fingerprint
        self._add(f"{key}.{META_MEMBER}", json.dumps(meta, sort_keys=True).encode())
        for name in stored_fields(self._meta.layout):
            self._add(f"{key}.{name}.zst", self._zstd.compress(fields[name]))

    def close(self) -> None:
        self._tar.close()


def decode_wds_sample(sample: dict[str, Any]) -> dict[str, Any]:
    """Decoder for ``webdataset.WebDataset(urls).map(decode_wds_sample)``: raw members -> sample dict."""
    if META_MEMBER not in sample:
        raise ValueError(f"webdataset sample {sample.get('__key__')!r} has no {META_MEMBER}; not a tapdraft shard")
    meta_doc = sample[META_MEMBER]
    meta_doc = json.loads(meta_doc) if isinstance(meta_doc, (bytes, str)) else meta_doc
    fm = FieldMeta.from_dict(meta_doc["field_meta"])
    dz = zstandard.ZstdDecompressor()
    fields = {}
    for name in stored_fields(fm.layout):
        blob = sample.get(f"{name}.zst")
        if blob is None:
            raise ValueError(f"webdataset sample {sample.get('__key__')!r} lacks member {name}.zst")
        try:
            fields[name] = dz.decompress(blob)
        except zstandard.ZstdError as e:
            raise ValueError(f"webdataset sample {sample.get('__key__')!r}: member {name}.zst is corrupted ({e})") from e
    return decode_fields(fields, meta_doc, fm)


def iter_tar_samples(fileobj: BinaryIO, where: str = "<tar>") -> Iterator[dict[str, Any]]:
    """Group a tar stream's members by key into raw webdataset-style dicts (no webdataset needed)."""
    current: dict[str, Any] | None = None
    try:
        with tarfile.open(fileobj=fileobj, mode="r|") as tar:
            for info in tar:
                if not info.isfile():
                    continue
                key, _, ext = info.name.partition(".")
                f = tar.extractfile(info)
                data = f.read() if f is not None else b""
                if len(data) != info.size:
                    raise ValueError(f"{where}: member {info.name} is truncated")
                if current is not None and current["__key__"] != key:
                    yield current
                    current = None
                if current is None:
                    current = {"__key__": key}
                current[ext] = data
    except tarfile.ReadError as e:
        raise ValueError(f"{where} is not a readable tar ({e}); it is probably truncated or corrupted: "
                         "run `tapdraft verify` and re-capture the shard") from e
    if current is not None:
        yield current
