"""Open a finished dataset (local path or fsspec URL): random access and resumable streaming.

    ds = open_dataset("s3://bucket/ds")     # refuses missing/incomplete manifest, unknown schema major
    ds.sample("train", 17)                   # Arrow: seeks to one record batch (byte range in the shard's index);
                                             # WebDataset: reads its tar shard up to the sample
    it = ds.stream("train", seed=0, epoch=0, rank=r, world_size=w, worker_id=i, num_workers=n,
                   shuffle_buffer=1024)
    ...; state = it.state_dict()             # a few scalars + version
    it = ds.stream("train", ..., state=state)  # continues exactly where it stopped

Remote URLs (shards.remote): ``open_dataset(url, remote=RemoteConfig(...))``; reads go through a
checked local cache with retries, and a stream starts the next reads of its own order in the
background (``RemoteConfig.prefetch``). A local path is read directly (``os.preadv``), as before.

Integrity (shards.integrity): opening checks every shard's size against the manifest (one listing),
so a missing or truncated shard is refused before the first sample; the first read of a shard
fetches its index (shards.shard_index, checked against the manifest's hash) and checks the shard's
head (target fingerprint, layout), so a foreign shard is refused before any of its samples; each
record batch (Arrow) or tar member (WebDataset) is checked against its checksum as it is decoded.
Opening reads only the manifest: memory and time are O(shards), never O(record batches). How a shard's
bytes are read is its format's (``shards.formats``: ``Dataset.reader``); this module is the same for all.

Order: see shards.order (a pure function of seed, epoch, world_size, num_workers, and for Arrow of the
sample count, token count and layout width, not of record-batch boundaries; every rank gets
N // world_size samples per epoch). Streaming reads each order unit's samples block by block (an
Arrow unit of ``order_unit`` samples spans one or a few record batches, each read once for it; a
tar shard is its own unit), decoding only the rows this worker needs; the shuffle buffer holds at
most ``shuffle_buffer`` decoded samples.
"""

from __future__ import annotations

import bisect
import os
import warnings
from typing import Any, Iterator

import numpy as np
from fsspec.implementations.local import LocalFileSystem

from tapdraft.shards import manifest as mf
from tapdraft.shards.bundle import TargetBundle, open_bundle
from tapdraft.shards.codec import FieldMeta
from tapdraft.common.errors import CorruptShardError, SampleIndexError
from tapdraft.shards.formats import get_format
from tapdraft.shards.formats.base import ShardReader
from tapdraft.shards.integrity import check_block
from tapdraft.shards.members import refuse_links
from tapdraft.shards.remote import RemoteConfig, is_local, open_url
from tapdraft.shards.order import block_order, epoch_rng, order_unit, shuffle_order, worker_range
from tapdraft.shards.schema import Layout
from tapdraft.shards.shard_index import IndexCache, ShardIndex, load_index

STATE_VERSION = 2
"""2: Arrow order units are ``order_unit`` samples, no longer record batches (a version-1 position names
another sample)."""


class Dataset:
    """A finished tapdraft dataset; see the module docstring."""

    def __init__(self, url: str, remote: RemoteConfig | None = None) -> None:
        self.url = str(url)
        self.remote = remote or RemoteConfig()
        self.fs, self.root = open_url(self.url, self.remote)
        self.prefetch_depth = 0 if is_local(self.fs) else self.remote.prefetch
        self.manifest: dict[str, Any] = mf.read_manifest(self.fs, self.root)
        self.layout: Layout = Layout.from_dict(self.manifest["layout"])
        self.fingerprint: str = self.manifest["fingerprint"]
        self.format: str = self.manifest["format"]
        self.reader: ShardReader = get_format(self.format, mf.join(self.root, mf.MANIFEST)).reader(self)
        """Reads this dataset's shards (its format's class, shards.formats)."""
        self.field_meta = FieldMeta.from_dict(self.manifest["field_meta"])
        self._cum = {s: np.cumsum([0] + [sh["samples"] for sh in d["shards"]]).tolist()
                     for s, d in self.manifest["splits"].items()}
        self._indexes = IndexCache(self._load_index)
        self._bundle: TargetBundle | None = None
        self.integrity: dict[str, Any] = self.manifest["integrity"]
        if not self.integrity["blocks"]:
            warnings.warn(f"{self.url} was written before checksums (schema {self.manifest['schema_version']}): its "
                          "shards' sizes and target fingerprints are checked, their bytes are not; run "
                          "`tapdraft verify` once (sha256 of every shard) after copying it", stacklevel=3)
        refuse_links(self.fs, self.root, self.manifest)  # a link inside a dataset is refused, never followed
        self.check_shards()

    def check_shards(self) -> None:
        """Every shard present with the manifest's size: one listing of each shard directory, no read of any
        shard (O(shards) and no request per shard: 30k shards of a 30 TB dataset open in well under a second,
        benchmarks/metadata.py). Raises naming the first bad shard. A shard's head (target fingerprint,
        layout) and its index are checked when the shard is first read (``shard_index``)."""
        by_parent: dict[str, list[tuple[str, dict[str, Any]]]] = {}
        for d in self.manifest["splits"].values():
            for sh in d["shards"]:
                parent, base = self.shard_path(sh).rsplit("/", 1)
                by_parent.setdefault(parent, []).append((base, sh))
        for parent, items in sorted(by_parent.items()):  # names compared by their last part: no per-name parsing
            listing = self.fs.ls(parent, detail=True) if self.fs.exists(parent) else []
            sizes = {e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e["size"]) for e in listing}
            self._check_sizes(parent, items, sizes)

    def _check_sizes(self, parent: str, items: list[tuple[str, dict[str, Any]]], sizes: dict[str, int]) -> None:
        for base, sh in items:
            path = f"{parent}/{base}"
            size = sizes.get(base)
            if size is None:
                raise FileNotFoundError(f"{path} is listed in the manifest but missing: re-copy the dataset "
                                        "(or re-capture it)")
            if size != sh["bytes"]:
                raise CorruptShardError(f"{path} has {size} bytes, the manifest says {sh['bytes']}: it is truncated "
                                        "or not this dataset's shard; re-copy it (or re-capture it)")

    def shard_index(self, shard: dict[str, Any]) -> ShardIndex:
        """The shard's checked index (shards.shard_index), read on first use and cached for the last few shards;
        its head is checked then too (by the format's reader: an Arrow schema carries the target fingerprint)."""
        return self._indexes.get(shard)

    def _load_index(self, shard: dict[str, Any]) -> ShardIndex:
        idx = load_index(self.fs, self.root, shard, self.format, self.reader.random_access)
        if idx.head is not None:
            path = self.shard_path(shard)
            head = self.fs.cat_file(path, start=0, end=idx.head[0])
            check_block(head, idx.head[1], f"{path} (head)")
            self.reader.check_head(shard, head, path)
        return idx

    @property
    def splits(self) -> list[str]:
        return list(self.manifest["splits"])

    def _split(self, split: str) -> dict[str, Any]:
        if split not in self.manifest["splits"]:
            raise ValueError(f"{self.url} has no split {split!r}; it has {self.splits}")
        return self.manifest["splits"][split]

    def num_samples(self, split: str) -> int:
        return int(self._split(split)["samples"])

    def shard_path(self, shard: dict[str, Any]) -> str:
        return mf.join(self.root, shard["name"])

    def bundle(self) -> TargetBundle:
        """The target bundle in ``target/`` (copied to a local temp dir first for remote URLs)."""
        if self._bundle is None:
            tdir = mf.join(self.root, mf.TARGET_DIR)
            b = open_bundle(self.fs, tdir, expect=self.manifest.get(mf.BUNDLE_KEY))  # bundle.json as finalized
            if b.fingerprint != self.fingerprint:
                raise ValueError(f"{tdir} has fingerprint {b.fingerprint[:12]} but the manifest says "
                                 f"{self.fingerprint[:12]}: the bundle does not belong to these shards")
            self._bundle = b
        return self._bundle

    def read_range(self, path: str, start: int, end: int, prefix: Any = b"", check: Any = None) -> Any:
        """``prefix`` + bytes [start, end) of a shard, after ``check(bytes)`` (raises on bad bytes) passed. A local
        file is read with one ``os.preadv`` into a fresh writable buffer after the prefix (no fsspec file
        object, no concatenation, and tensors of an uncompressed batch may view it without a copy); a remote
        one through the checked cache (``RemoteFS.read_range``). Never a memory map: a shard copied over in
        place would turn a kept tensor's pages into SIGBUS, not a checksum error."""
        if not isinstance(self.fs, LocalFileSystem) or not hasattr(os, "preadv"):
            if hasattr(self.fs, "read_range"):
                return self.fs.read_range(path, start, end, check, prefix)
            data = self.fs.cat_file(path, start=start, end=end)
            if check is not None:
                check(data)
            return np.concatenate([np.frombuffer(prefix, dtype=np.uint8), np.frombuffer(data, dtype=np.uint8)]) \
                if len(prefix) else data
        k = len(prefix)
        buf = np.empty(k + max(end - start, 0), dtype=np.uint8)
        buf[:k] = np.frombuffer(prefix, dtype=np.uint8)
        fd = os.open(path, os.O_RDONLY)
        try:
            n = k
            while n < buf.size:  # one call unless the range passes a single read's 2 GiB limit
                got = os.preadv(fd, [buf[n:]], start + n - k)
                if got == 0:
                    break  # end of file: the caller reports the truncation
                n += got
        finally:
            os.close(fd)
        if check is not None:
            check(buf[k:n])
        return buf[:n]

    def locate(self, split: str, i: int) -> tuple[int, int]:
        """(shard index, row in that shard) of sample ``i`` of ``split``; SampleIndexError outside the split."""
        n = self.num_samples(split)
        if not 0 <= i < n:
            raise SampleIndexError(f"sample {i} is out of range: split {split!r} of {self.url} has {n} samples "
                                   f"(indices 0..{n - 1})")
        s = bisect.bisect_right(self._cum[split], i) - 1
        return s, i - self._cum[split][s]

    def sample(self, split: str, i: int) -> dict[str, Any]:
        """Sample ``i`` of ``split`` in file order. Arrow seeks to its record batch; a WebDataset tar has no
        index, so its shard is read up to the sample (fine for a look, slow as a training access path)."""
        s, row = self.locate(split, i)
        return self.reader.sample(self._split(split)["shards"][s], row, (split, s), i)

    def prefetch(self, split: str, block: tuple[int, int, int]) -> None:
        """Start reading one streaming block in the background (remote datasets; a no-op for a local path)."""
        if not self.prefetch_depth:
            return
        s, _, _ = block
        self.reader.prefetch(self._split(split)["shards"][s])

    # ---- streaming -------------------------------------------------------------------------
    def blocks(self, split: str) -> list[tuple[int, int, int]]:
        """Streaming units of a split in file order: (shard index, -1, samples), one per non-empty shard (a
        shard's record batches are found in its index when the shard is read, so listing them is O(shards))."""
        return [(s, -1, shard["samples"]) for s, shard in enumerate(self._split(split)["shards"]) if shard["samples"]]

    def read_block_rows(self, split: str, block: tuple[int, int, int], rows: list[int]) -> Iterator[dict[str, Any]]:
        """Decode the given (ascending) rows of one shard; Arrow reads each record batch that holds some of them
        once, in order."""
        return self.reader.read_rows(self._split(split)["shards"][block[0]], rows)

    def stream(self, split: str, *, seed: int, epoch: int = 0, rank: int = 0, world_size: int = 1,
               worker_id: int = 0, num_workers: int = 1, shuffle_buffer: int = 0, shuffle: bool = True,
               order_unit: int | None = None, state: dict[str, Any] | None = None) -> "SampleStream":
        """One epoch of this (rank, worker)'s samples; see shards.order. ``shuffle=False`` keeps file order.
        ``order_unit``: Arrow samples per permuted unit (None: :meth:`order_unit`)."""
        return SampleStream(self, split, seed=seed, epoch=epoch, rank=rank, world_size=world_size,
                            worker_id=worker_id, num_workers=num_workers, shuffle_buffer=shuffle_buffer,
                            shuffle=shuffle, order_unit=order_unit, state=state)

    def order_unit(self, split: str) -> int:
        """Samples per Arrow order unit of ``split`` (shards.order.order_unit): from the manifest's sample and
        token counts and the layout's width, the same for every codec and record-batch size."""
        d = self._split(split)
        return order_unit(int(d["samples"]), int(d.get("tokens", 0)), self.layout.n_taps * self.layout.hidden_size * 2)


class SampleStream:
    """Iterator over sample dicts with an exact, tiny ``state_dict``."""

    def __init__(self, ds: Dataset, split: str, *, seed: int, epoch: int, rank: int, world_size: int,
                 worker_id: int, num_workers: int, shuffle_buffer: int, shuffle: bool, order_unit: int | None,
                 state: dict[str, Any] | None) -> None:
        self.ds, self.split = ds, split
        if ds.reader.random_access:
            unit = ds.order_unit(split) if order_unit is None else int(order_unit)
            if unit < 1:
                raise ValueError(f"order_unit must be >= 1 sample, got {unit}")
        elif order_unit is not None:
            raise ValueError("order_unit applies to Arrow datasets; a WebDataset's order unit is its tar shard "
                             "(it has no index to seek inside one): leave order_unit unset")
        else:
            unit = 0  # WebDataset: the tar shard
        self.params = {"split": split, "seed": int(seed), "epoch": int(epoch), "rank": int(rank),
                       "world_size": int(world_size), "worker_id": int(worker_id), "num_workers": int(num_workers),
                       "shuffle_buffer": int(shuffle_buffer), "shuffle": bool(shuffle), "order_unit": unit}
        self.yielded = 0
        if state is not None:
            if state.get("version") != STATE_VERSION:
                raise ValueError(f"stream state version {state.get('version')!r} is not {STATE_VERSION}; "
                                 "start the epoch afresh")
            diff = {k: (state.get(k), v) for k, v in self.params.items() if state.get(k) != v}
            if diff:
                raise ValueError(f"stream state was saved with different settings {diff} (saved, now); "
                                 "rebuild the stream with the saved settings")
            self.yielded = int(state["yielded"])
        self._blocks = ds.blocks(split)  # file order: one per shard
        self._file_starts = np.cumsum([0] + [b[2] for b in self._blocks]).tolist()
        n_file = self._file_starts[-1]
        # units as int64 arrays, not Python tuples: 3M one-sample units cost 48 MB, not ~0.5 GB
        edges = np.append(np.arange(0, n_file, unit, dtype=np.int64), n_file) if unit else \
            np.asarray(self._file_starts, dtype=np.int64)
        lengths = np.diff(edges)
        keep = np.flatnonzero(lengths > 0)  # [file start, file stop) of each non-empty unit
        perm = keep[block_order(len(keep), seed, epoch, shuffle)]
        self._unit_first = edges[perm]
        self._starts = np.concatenate([[0], np.cumsum(lengths[perm])])
        self._lo, hi = worker_range(int(self._starts[-1]), rank, world_size, worker_id, num_workers)
        self.n = hi - self._lo
        self._order = shuffle_order(self.n, shuffle_buffer, epoch_rng(seed, epoch, rank, worker_id, 1))
        self._cache: dict[int, dict[str, Any]] = {}
        self._reader: Iterator[tuple[int, dict[str, Any]]] | None = None

    def __len__(self) -> int:
        return self.n

    def state_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, **self.params, "yielded": self.yielded}

    def __iter__(self) -> "SampleStream":
        return self

    def _read(self, first: int, skip: set[int]) -> Iterator[tuple[int, dict[str, Any]]]:
        """(local position, sample) for positions >= first not in ``skip``, in ascending order: each unit's
        wanted samples read block by block (the blocks a unit overlaps, each once)."""
        g0, g1 = self._lo + first, self._lo + self.n
        u = int(np.searchsorted(self._starts, g0, side="right")) - 1
        ahead, pulled, reads = self._block_seq(u, g1) if self.ds.prefetch_depth else None, 0, 0
        while u < len(self._unit_first) and self._starts[u] < g1:
            start, f0 = int(self._starts[u]), int(self._unit_first[u])
            stop = int(self._starts[u + 1])
            pos = [g for g in range(max(g0, start), min(g1, stop)) if g - self._lo not in skip]
            while pos:
                b = bisect.bisect_right(self._file_starts, f0 + pos[0] - start) - 1
                reads += 1
                while ahead is not None and pulled < reads + self.ds.prefetch_depth:  # keep `depth` reads ahead
                    nb = next(ahead, None)
                    if nb is None:
                        ahead = None
                    else:
                        pulled += 1
                        self.ds.prefetch(self.split, self._blocks[nb])
                end = self._file_starts[b + 1] - f0 + start  # first position past block b
                here, pos = [g for g in pos if g < end], [g for g in pos if g >= end]
                rows = [f0 + g - start - self._file_starts[b] for g in here]
                for g, sample in zip(here, self.ds.read_block_rows(self.split, self._blocks[b], rows)):
                    yield g - self._lo, sample
            u += 1

    def _block_seq(self, u: int, g1: int) -> Iterator[int]:
        """The blocks this stream reads from unit ``u`` on, in its order (what prefetch starts ahead)."""
        while u < len(self._unit_first) and self._starts[u] < g1:
            f0 = int(self._unit_first[u])
            f1 = f0 + int(self._starts[u + 1] - self._starts[u])
            yield from range(bisect.bisect_right(self._file_starts, f0) - 1, bisect.bisect_left(self._file_starts, f1))
            u += 1

    def __next__(self) -> dict[str, Any]:
        if self.yielded >= self.n:
            raise StopIteration
        want = int(self._order[self.yielded])
        if self._reader is None:
            rest = self._order[self.yielded:]
            first = int(rest.min())
            done = set(int(p) for p in self._order[: self.yielded] if p >= first)
            self._reader = self._read(first, done)
        while want not in self._cache:
            pos, sample = next(self._reader)
            self._cache[pos] = sample
        self.yielded += 1
        return self._cache.pop(want)


def open_dataset(path_or_url: str, remote: RemoteConfig | None = None) -> Dataset:
    """Open a finished dataset; FileNotFoundError/ValueError name the file and what to do. ``remote``: cache,
    prefetch and retry settings for a remote URL (defaults: ``shards.remote.RemoteConfig``)."""
    return Dataset(path_or_url, remote)
