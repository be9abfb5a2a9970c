"""One writer per destination: two pushes to one place (the first paused mid-copy) left one's manifest over the
other's shards, each deleting the other's files as leftovers, and both exited 0. Now the second is refused at once
naming the first, on a local destination (the kernel lock capture, derive and pull take) and in a store without
conditional writes (``common.lock.store_lock``'s best-effort marker, here on fsspec's memory filesystem); on a real
S3 server (a conditional create) in test_s3.py. Pull and derive hold their destination's lock the same way and look
at the destination again once they hold it."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import fsspec
import pytest

from tapdraft.common import lock as lk
from tapdraft.common.errors import LockedError
from tapdraft.shards import transfer
from tapdraft.shards.reader import open_dataset
from tapdraft.shards.shard_file import ShardConfig
from tapdraft.shards.transfer import pull, push
from tapdraft.shards.verify import verify_dataset
from tests.shards.synthetic import tiny_layout, write_dataset


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """Two different datasets (other samples, other shard counts): a mix of them is caught by verify."""
    root = tmp_path_factory.mktemp("two")
    cfg = ShardConfig(shard_bytes=16 << 10, batch_bytes=4 << 10)
    write_dataset(str(root / "a"), tiny_layout(), cfg, [24, 40, 33, 17] * 4, seed=1)
    write_dataset(str(root / "b"), tiny_layout(), cfg, [30, 20] * 5, seed=2)
    return str(root / "a"), str(root / "b")


def manifest(ds: str) -> bytes:
    return (Path(ds) / "manifest.json").read_bytes()


def two_at_once(monkeypatch, first, second, *, paused_in: str = "_upload"):
    """Run ``first()`` in a thread, paused inside its second call of ``transfer.<paused_in>`` (a file already
    copied), then ``second()`` here, then let the first go on. Returns (first's outcome, second's outcome), each
    a result or the exception raised."""
    real = getattr(transfer, paused_in)
    started, go, calls = threading.Event(), threading.Event(), []

    def paused(*a, **kw):
        if threading.current_thread().name == "first":
            calls.append(1)
            if len(calls) == 2:
                started.set()
                assert go.wait(120), "the test never let the first writer go on"
        return real(*a, **kw)

    monkeypatch.setattr(transfer, paused_in, paused)
    out: dict[str, object] = {}

    def run_first():
        try:
            out["first"] = first()
        except BaseException as e:  # noqa: BLE001 (handed to the test)
            out["first"] = e
        finally:
            started.set()

    t = threading.Thread(target=run_first, name="first", daemon=True)
    t.start()
    assert started.wait(120), "the first writer never reached its copy"
    try:
        second_out = second()
    except Exception as e:  # noqa: BLE001 (handed to the test)
        second_out = e
    go.set()
    t.join(120)
    assert not t.is_alive(), "the first writer did not finish"
    return out["first"], second_out


def assert_refused_naming_the_first(second_out, what: str) -> None:
    assert isinstance(second_out, LockedError), f"the second writer was not refused: {second_out!r}"
    msg = str(second_out)
    assert f"is in use by {what} (rank 0) (pid " in msg and "\n" not in msg, msg


def test_two_pushes_to_one_directory_at_once_the_second_is_refused_naming_the_first(two, tmp_path, monkeypatch):
    a, b = two
    dest = tmp_path / "dest"
    first, second = two_at_once(monkeypatch, lambda: push(a, str(dest), progress=False),
                                lambda: push(b, str(dest), progress=False))
    assert not isinstance(first, BaseException), first
    rep = verify_dataset(str(dest), progress=False)
    assert rep.ok and manifest(str(dest)) == manifest(a), rep.problems[:3]
    assert_refused_naming_the_first(second, "a push")
    assert not (dest / "_parts").exists()  # the lock is gone with its push
    with pytest.raises(ValueError, match="already holds another dataset"):
        push(b, str(dest), progress=False)


def test_two_pushes_to_a_store_without_conditional_writes_the_second_is_refused(two, monkeypatch):
    """fsspec's memory filesystem has no conditional create: the lock is a best-effort marker, read back after
    ``SETTLE_S`` and confirmed before the manifest."""
    monkeypatch.setattr(lk, "SETTLE_S", 0.05)
    a, b = two
    url = f"memory://dest-{uuid.uuid4().hex}"
    first, second = two_at_once(monkeypatch, lambda: push(a, url, progress=False),
                                lambda: push(b, url, progress=False))
    assert not isinstance(first, BaseException), first
    assert_refused_naming_the_first(second, "a push")
    fs = fsspec.filesystem("memory")
    assert fs.cat_file(url + "/manifest.json") == manifest(a) and not fs.exists(url + "/_parts/rank00000.lock")
    ds, local = open_dataset(url), open_dataset(a)
    assert [s["sample_id"] for s in ds.stream("train", seed=0, shuffle=False)] == \
        [s["sample_id"] for s in local.stream("train", seed=0, shuffle=False)]


def test_a_push_that_finished_while_the_second_waited_for_the_lock_is_seen(two, tmp_path, monkeypatch):
    """The destination is looked at again under the lock: a push that committed between the second's first look
    and its lock makes the second refuse ("another dataset"), not delete the first's files as leftovers."""
    a, b = two
    dest = tmp_path / "dest"
    real, ran = transfer.destination_lock, []

    def late(fs, root, url, what):
        if not ran:
            ran.append(1)
            push(a, str(dest), progress=False)  # the first push runs whole after the second looked
        return real(fs, root, url, what)

    monkeypatch.setattr(transfer, "destination_lock", late)
    with pytest.raises(ValueError, match="already holds another dataset"):
        push(b, str(dest), progress=False)
    assert verify_dataset(str(dest), progress=False).ok and manifest(str(dest)) == manifest(a)


def test_two_pulls_into_one_folder_at_once_the_second_is_refused(two, tmp_path, monkeypatch):
    a, b = two
    dest = tmp_path / "shared"
    first, second = two_at_once(monkeypatch, lambda: pull(a, str(dest), progress=False),
                                lambda: pull(b, str(dest), progress=False), paused_in="_download")
    assert not isinstance(first, BaseException), first
    assert_refused_naming_the_first(second, "a pull")
    assert verify_dataset(str(dest), progress=False).ok and manifest(str(dest)) == manifest(a)


def test_a_pull_that_finished_while_the_second_waited_for_the_lock_is_seen(two, tmp_path, monkeypatch):
    """A pull of another dataset that takes the lock after the first finished refuses; it deleted the first's
    manifest and fetched over its files."""
    a, b = two
    dest = tmp_path / "shared"
    real, ran = transfer.destination_lock, []

    def late(fs, root, url, what):
        if not ran:
            ran.append(1)
            pull(a, str(dest), progress=False)
        return real(fs, root, url, what)

    monkeypatch.setattr(transfer, "destination_lock", late)
    with pytest.raises(ValueError, match="already holds another dataset"):
        pull(b, str(dest), progress=False)
    assert verify_dataset(str(dest), progress=False).ok and manifest(str(dest)) == manifest(a)


def test_two_derives_into_one_output_the_second_sees_the_first(two, tmp_path, monkeypatch):
    """A derive into an output another derive (other settings) finished while it waited is refused, not
    finalized over it."""
    from tapdraft.shards import derive as dv
    from tapdraft.shards import manifest as mf

    a, _ = two
    out = tmp_path / "derived"
    real = mf.writer_lock

    def late(url, rank, what="a capture"):
        if not (out / "manifest.json").exists():
            monkeypatch.setattr(mf, "writer_lock", real)
            dv.derive_dataset(dv.DeriveConfig(src=a, out=str(out), max_samples=4, progress=False))
        return real(url, rank, what)

    monkeypatch.setattr(mf, "writer_lock", late)
    with pytest.raises(ValueError, match="finished dataset made otherwise"):
        dv.derive_dataset(dv.DeriveConfig(src=a, out=str(out), max_samples=6, progress=False))
    assert verify_dataset(str(out), progress=False).ok
    assert sum(d["samples"] for d in dv.open_dataset(str(out)).manifest["splits"].values()) == 4


# ---- the store lock itself (best-effort mode, on the memory filesystem) ------------------------------------------

def lock_path() -> str:
    return f"memory://locks-{uuid.uuid4().hex}/_parts/rank00000.lock"


def test_a_store_lock_of_a_dead_process_or_a_stale_heartbeat_is_taken_over(monkeypatch):
    import json
    import socket
    import subprocess
    import sys

    monkeypatch.setattr(lk, "SETTLE_S", 0.01)
    fs, path = fsspec.filesystem("memory"), lock_path()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    rec = {"pid": int(dead), "host": socket.gethostname(), "what": "a push (rank 0)", "since": "x", "owner": "o",
           "beat": time.time()}
    fs.pipe_file(path, json.dumps(rec).encode())
    with lk.store_lock(fs, path, "a push", guards="memory://d") as confirm:  # its process is gone
        confirm()
    assert not fs.exists(path)
    fs.pipe_file(path, json.dumps({**rec, "host": "elsewhere", "beat": time.time()}).encode())
    with pytest.raises(LockedError, match=r"memory://d is in use by a push \(rank 0\) \(pid \d+ on elsewhere.*"
                                          r"taken over 600 s after its last refresh, or delete .*rank00000.lock"):
        with lk.store_lock(fs, path, "a push", guards="memory://d"):
            pass
    fs.pipe_file(path, json.dumps({**rec, "host": "elsewhere", "beat": time.time() - lk.STALE_S - 1}).encode())
    with lk.store_lock(fs, path, "a push", guards="memory://d"):
        assert json.loads(fs.cat_file(path))["pid"] != int(dead)


def test_a_holder_whose_lock_was_taken_over_stops_before_it_commits(monkeypatch):
    """A heartbeat that finds another owner, or ``confirm`` before the commit, stops the holder; its release never
    removes its successor's lock."""
    import json

    monkeypatch.setattr(lk, "SETTLE_S", 0.01)
    fs, path = fsspec.filesystem("memory"), lock_path()
    with pytest.raises(LockedError, match="its lock was taken over by a push .*nothing was committed"):
        with lk.store_lock(fs, path, "a push", guards="memory://d") as confirm:
            rec = json.loads(fs.cat_file(path))
            fs.pipe_file(path, json.dumps({**rec, "owner": "someone else", "pid": 1}).encode())
            confirm()
    assert json.loads(fs.cat_file(path))["owner"] == "someone else"


def test_two_store_lockers_racing_one_wins(monkeypatch):
    """Two writers that both found no lock and wrote theirs: the one overwritten sees it when reading back."""
    monkeypatch.setattr(lk, "SETTLE_S", 0.3)
    fs, path = fsspec.filesystem("memory"), lock_path()
    barrier, got = threading.Barrier(2), []

    def take():
        barrier.wait()
        try:
            with lk.store_lock(fs, path, "a push", guards="memory://d") as confirm:
                time.sleep(0.5)
                confirm()
                got.append("held")
        except LockedError as e:
            got.append(str(e))

    ts = [threading.Thread(target=take) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert sorted(g == "held" for g in got) == [False, True], got
