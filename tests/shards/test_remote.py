"""The remote read layer without a server: the cache's checks, LRU bound, concurrent fills, kills, retries.

``RemoteFS`` wraps any fsspec filesystem, so these wrap the local one and count what reaches it."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import fsspec
import pytest

from tapdraft.common.errors import CorruptShardError, RemoteError
from tapdraft.shards.reader import open_dataset
from tapdraft.shards.remote import RemoteConfig, RemoteFS, transient
from tapdraft.shards.shard_file import ShardConfig
from tests.shards.synthetic import tiny_layout, write_dataset


class Counting:
    """A local filesystem that counts data reads and can fail the next ``fail`` calls."""

    def __init__(self, fail: int = 0, error: type[Exception] = ConnectionResetError) -> None:
        self.fs, self.reads, self.fail, self.error = fsspec.filesystem("file"), 0, fail, error

    def __getattr__(self, name):
        return getattr(self.fs, name)

    def cat_file(self, path, start=None, end=None, **kw):
        if self.fail:
            self.fail -= 1
            raise self.error("connection reset by peer")
        self.reads += 1
        return self.fs.cat_file(path, start=start, end=end)


def remote(tmp_path, inner=None, **kw) -> RemoteFS:
    kw.setdefault("backoff_s", 0.01)
    kw.setdefault("max_backoff_s", 0.02)
    return RemoteFS(inner or Counting(), RemoteConfig(cache_dir=str(tmp_path / "cache"), **kw))


@pytest.fixture
def blob(tmp_path) -> str:
    p = tmp_path / "blob.bin"
    p.write_bytes(os.urandom(1 << 16))
    return str(p)


def test_a_range_is_fetched_once_and_checked_before_it_is_kept(tmp_path, blob):
    fs = remote(tmp_path)
    want = Path(blob).read_bytes()[100:5000]
    assert bytes(fs.read_range(blob, 100, 5000)) == want and fs.inner.reads == 1
    assert bytes(fs.read_range(blob, 100, 5000)) == want and fs.inner.reads == 1  # from the cache

    def refuse(data):
        raise CorruptShardError("bad")

    with pytest.raises(CorruptShardError):
        fs.read_range(blob, 0, 10, check=refuse)
    assert fs.inner.reads == 3  # fetched twice (once more in case of transit damage), never cached
    assert fs.cache.get(fs._key(blob, 0, 10), 10) is None


def test_a_damaged_or_half_written_entry_is_a_miss(tmp_path, blob):
    fs = remote(tmp_path)
    fs.read_range(blob, 0, 4096)
    key = fs._key(blob, 0, 4096)
    data_path, ok_path = fs.cache._paths(key)
    raw = bytearray(data_path.read_bytes())
    raw[7] ^= 1
    data_path.write_bytes(bytes(raw))  # rot on the local disk
    assert bytes(fs.read_range(blob, 0, 4096)) == Path(blob).read_bytes()[:4096] and fs.inner.reads == 2
    ok_path.unlink()  # a kill between the data rename and its sidecar
    assert bytes(fs.read_range(blob, 0, 4096)) == Path(blob).read_bytes()[:4096] and fs.inner.reads == 3


def test_a_replaced_object_is_never_served_from_the_old_entry(tmp_path, blob):
    fs = remote(tmp_path)
    fs.read_range(blob, 0, 64)
    time.sleep(0.01)
    Path(blob).write_bytes(os.urandom(1 << 16))  # same size, new mtime: a new version
    fresh = RemoteFS(fs.inner, fs.config)  # the next process (versions are looked up once per process)
    assert bytes(fresh.read_range(blob, 0, 64)) == Path(blob).read_bytes()[:64]


def test_lru_keeps_the_cache_near_its_bound(tmp_path, blob):
    fs = remote(tmp_path, cache_bytes=16 << 10)
    for i in range(16):
        fs.read_range(blob, i * 4096, (i + 1) * 4096)
        assert fs.cache.total_bytes() <= (16 << 10) * (1 + 1 / 16) + 4096
    assert fs.cache.total_bytes() >= 8 << 10
    fs.read_range(blob, 15 * 4096, 16 * 4096)
    assert fs.inner.reads == 16  # the most recent entry survived eviction


def _fill(cache_dir: str, blob: str, q) -> None:
    fs = RemoteFS(Counting(), RemoteConfig(cache_dir=cache_dir))
    inner = fs.inner
    slow = inner.cat_file

    def slow_read(*a, **kw):
        time.sleep(0.3)
        return slow(*a, **kw)

    inner.cat_file = slow_read
    fs.read_range(blob, 0, 8192)
    q.put(inner.reads)


def test_concurrent_processes_fetch_a_range_once(tmp_path, blob):
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_fill, args=(str(tmp_path / "cache"), blob, q)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert sorted(q.get() for _ in procs) == [0, 0, 1]  # one fetched; the others waited on its lock, then hit


def _killed_filler(cache_dir: str, blob: str) -> None:
    fs = RemoteFS(Counting(), RemoteConfig(cache_dir=cache_dir))
    fs.cache.put_file(fs._key(blob, 0, -1), lambda tmp: (Path(tmp).write_bytes(b"half"), os.kill(os.getpid(),
                                                                                               signal.SIGKILL)))


def test_a_filler_killed_mid_write_leaves_no_entry(tmp_path, blob):
    p = mp.get_context("fork").Process(target=_killed_filler, args=(str(tmp_path / "cache"), blob))
    p.start()
    p.join(30)
    assert p.exitcode == -signal.SIGKILL
    fs = remote(tmp_path)
    with fs.open_local(blob) as f:
        assert f.read() == Path(blob).read_bytes()  # the temp file is not an entry
    leftovers = list((tmp_path / "cache").glob("*/*.tmp"))
    assert len(leftovers) == 1
    os.utime(leftovers[0], (time.time() - 3600,) * 2)
    fs.cache.evict()
    assert not list((tmp_path / "cache").glob("*/*.tmp"))  # swept once stale


def test_an_open_entry_survives_its_eviction(tmp_path, blob):
    """The cache hands out open files, not paths: eviction frees the name, the reader keeps the bytes. A budget
    below the object's size evicts it in its own commit, and the filler still reads it."""
    want = Path(blob).read_bytes()
    fs = remote(tmp_path)
    held = fs.open_local(blob)
    fs.cache.evict(target=0)
    assert fs.cache.total_bytes() == 0 and held.read() == want
    held.close()
    tiny = remote(tmp_path / "tiny", cache_bytes=1024)
    with tiny.open_local(blob) as f:
        assert tiny.cache.total_bytes() == 0 and f.read() == want
    tiny.get_file(blob, str(tmp_path / "copy.bin"))
    assert (tmp_path / "copy.bin").read_bytes() == want and tiny.inner.reads == 2


def test_transient_errors_are_retried_and_permanent_ones_are_not(tmp_path, blob):
    fs = remote(tmp_path, inner=Counting(fail=3), retries=3)
    assert len(fs.read_range(blob, 0, 100)) == 100
    fs = remote(tmp_path / "b", inner=Counting(fail=5), retries=3)
    with pytest.raises(RemoteError, match="did not answer after 4 tries"):
        fs.read_range(blob, 0, 100)
    fs = remote(tmp_path / "c", inner=Counting(fail=1, error=PermissionError))
    with pytest.raises(PermissionError):
        fs.read_range(blob, 0, 100)
    assert transient(TimeoutError()) and not transient(FileNotFoundError()) and not transient(ValueError())


def test_a_dataset_read_through_the_layer_equals_the_direct_read(tmp_path):
    """memory:// stands for a store: the stream, random access and the bundle come through the cache, and a
    second open is served from it."""
    url = "memory://remote-layer-test/ds"
    write_dataset(url, tiny_layout(), ShardConfig(shard_bytes=16 << 10, batch_bytes=4 << 10), [20, 31, 12] * 4)
    cfg = RemoteConfig(cache_dir=str(tmp_path / "cache"), prefetch=4)
    ds = open_dataset(url, cfg)
    assert isinstance(ds.fs, RemoteFS) and ds.prefetch_depth == 4
    got = [s["sample_id"] for s in ds.stream("train", seed=2, shuffle_buffer=4)]
    direct = open_dataset(url, RemoteConfig(cache_dir=str(tmp_path / "other"), cache_bytes=0, prefetch=0))
    assert got == [s["sample_id"] for s in direct.stream("train", seed=2, shuffle_buffer=4)]
    assert ds.bundle().fingerprint == ds.fingerprint
    filled = ds.fs.cache.total_bytes()
    again = open_dataset(url, cfg)
    assert [s["sample_id"] for s in again.stream("train", seed=2, shuffle_buffer=4)] == got
    assert again.fs.cache.total_bytes() == filled  # nothing new fetched
    fsspec.filesystem("memory").rm("/remote-layer-test", recursive=True)
