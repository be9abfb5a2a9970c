"""Atomic writes: a crash between any two steps leaves the old or the new file/directory, never neither."""

from __future__ import annotations

import json
from pathlib import Path

import fsspec
import pytest

from tapdraft.common import atomic


class Crash(RuntimeError):
    pass


def _crash_on_step(monkeypatch, n: int, *, exchange: bool = True) -> list[str]:
    """Make the n-th filesystem step (rename, exchange, remove) raise before it runs."""
    steps: list[str] = []
    real = {"_rename": atomic._rename, "_remove": atomic._remove, "_exchange": atomic._exchange}

    def wrap(name):
        def fn(*a):
            steps.append(name)
            if len(steps) == n:
                raise Crash(name)
            if name == "_exchange" and not exchange:
                return False
            return real[name](*a)

        return fn

    for name in real:
        monkeypatch.setattr(atomic, name, wrap(name))
    return steps


def _write_dir(d: Path, tag: str) -> None:
    d.mkdir()
    (d / "a.json").write_text(json.dumps({"tag": tag}))
    (d / "sub").mkdir()
    (d / "sub" / "b.bin").write_bytes(tag.encode() * 100)


def _dir_state(d: Path) -> str | None:
    """'old' or 'new' when d holds exactly one complete version, else None."""
    if not d.is_dir():
        return None
    try:
        tag = json.loads((d / "a.json").read_text())["tag"]
        ok = (d / "sub" / "b.bin").read_bytes() == tag.encode() * 100
    except (OSError, ValueError):
        return None
    files = sorted(str(p.relative_to(d)) for p in d.rglob("*"))
    return tag if ok and files == ["a.json", "sub", "sub/b.bin"] else None


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "rename-aside"])
def test_directory_replace_survives_a_crash_at_every_step(tmp_path, monkeypatch, exchange):
    seen, n = set(), 0
    while True:
        n += 1
        root = tmp_path / f"run{n}"
        root.mkdir()
        dest = root / "target"
        _write_dir(dest, "old")
        with monkeypatch.context() as m:
            steps = _crash_on_step(m, n, exchange=exchange)
            try:
                with atomic.staged(dest) as tmp:
                    _write_dir(tmp, "new")
                crashed = False
            except Crash:
                crashed = True
        if exchange:  # the swap is one step: no recovery needed at any instant
            assert _dir_state(dest) in ("old", "new"), (n, steps)
        atomic.recover_dir(dest)  # what the next writer does first (a reader never writes)
        state = _dir_state(dest)
        assert state in ("old", "new"), (n, steps)
        seen.add(state)
        if not crashed:
            assert state == "new"
            break
        assert n < 20
    assert seen == {"old", "new"}  # some crash points come after the switch
    assert n >= 3


def test_staged_directory_onto_a_free_name_and_rewrite(tmp_path):
    dest = tmp_path / "x" / "target"
    with atomic.staged(dest) as tmp:
        _write_dir(tmp, "old")
    assert _dir_state(dest) == "old"
    with atomic.staged(dest) as tmp:
        _write_dir(tmp, "new")
    assert _dir_state(dest) == "new"
    assert sorted(p.name for p in dest.parent.iterdir()) == ["target"]


def test_failed_body_leaves_old_and_no_temp(tmp_path):
    dest = tmp_path / "f.json"
    dest.write_text("old")
    with pytest.raises(Crash):
        with atomic.staged(dest) as tmp:
            tmp.write_text("half")
            raise Crash("body")
    assert dest.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]


OUT_OF_FDS = """
import errno, os, resource, sys
from pathlib import Path
from tapdraft.common import atomic
dest = Path(sys.argv[1])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
held = []
try:
    with atomic.staged(dest) as tmp:
        (tmp / "sub").mkdir(parents=True)
        for i in range(3):
            (tmp / "sub" / f"f{i}").write_bytes(b"x")
        while True:  # a step saving a checkpoint while the process is out of descriptors
            held.append(os.open(os.devnull, os.O_RDONLY))
except OSError as e:
    print("errno", e.errno)
"""


def test_a_write_out_of_file_descriptors_leaves_no_temp(tmp_path):
    """ulimit -n: the failed write's temp directory is removed on the reserved descriptors (it was left behind,
    rmtree itself needing descriptors) and the EMFILE is what is raised."""
    import subprocess
    import sys

    dest = tmp_path / "step-0000002"
    done = subprocess.run([sys.executable, "-c", OUT_OF_FDS, str(dest)], capture_output=True, text=True,
                          cwd=Path(__file__).parents[2], timeout=120)
    assert done.stdout.split() == ["errno", "24"], done.stdout + done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [], list(tmp_path.iterdir())


def test_file_write_never_leaves_no_file(tmp_path, monkeypatch):
    fs = fsspec.filesystem("file")
    path = str(tmp_path / "manifest.json")
    atomic.write_json_atomic(fs, path, {"v": "old"})

    def check(*a):  # at every rename the destination still exists (nothing deletes it first)
        assert Path(path).is_file()
        real(*a)

    real = atomic._rename
    monkeypatch.setattr(atomic, "_rename", check)
    atomic.write_json_atomic(fs, path, {"v": "new"})
    assert json.loads(Path(path).read_text()) == {"v": "new"}

    for n in (1,):
        with monkeypatch.context() as m:
            _crash_on_step(m, n)
            with pytest.raises(Crash):
                atomic.write_json_atomic(fs, path, {"v": "newer"})
        assert json.loads(Path(path).read_text()) == {"v": "new"}


def test_memory_filesystem_commit():
    fs = fsspec.filesystem("memory")
    atomic.write_bytes_atomic(fs, "/atomic-test/a.bin", b"1")
    atomic.write_bytes_atomic(fs, "/atomic-test/a.bin", b"2")
    assert fs.cat_file("/atomic-test/a.bin") == b"2"
    assert not fs.exists(atomic.temp_name("/atomic-test/a.bin"))
    fs.rm("/atomic-test", recursive=True)


def test_staged_file_gets_the_ordinary_mode(tmp_path):
    import os

    from tapdraft.common.atomic import staged

    dest = tmp_path / "w.bin"
    with staged(dest) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT, 0o600)  # as safetensors creates its files
        os.write(fd, b"x")
        os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    assert dest.stat().st_mode & 0o777 == 0o666 & ~umask


def test_every_file_of_a_bundle_gets_the_ordinary_mode(tmp_path):
    """A capture's target/weights.safetensors was 0600 (safetensors' own mode) while every other file was 0644."""
    import os

    from tests.shards.synthetic import tiny_bundle, tiny_layout

    tiny_bundle(str(tmp_path / "target"), tiny_layout())
    umask = os.umask(0)
    os.umask(umask)
    files = [p for p in (tmp_path / "target").rglob("*") if p.is_file()]
    assert len(files) >= 2 and {p.name: p.stat().st_mode & 0o777 for p in files} == {
        p.name: 0o666 & ~umask for p in files}


def _record_syncs(monkeypatch) -> list[tuple[str, str]]:
    """Every fsync and rename as ("fsync"|"rename", path), in order (an fd's path read back from /proc)."""
    import os

    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        real_replace(src, dst)
        events.append(("rename", str(dst)))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events


def test_a_committed_file_is_synced_before_its_rename_and_its_directory_after(tmp_path, monkeypatch):
    """A power cut after the rename must not find the new name with the old (or no) bytes: the file's fsync comes
    before the rename that publishes it, the directory's after (the rename itself reaches the disk)."""
    events = _record_syncs(monkeypatch)
    dest = tmp_path / "manifest.json"
    with atomic.staged(dest) as tmp:
        tmp.write_text("{}")
    assert events == [("fsync", str(tmp)), ("rename", str(dest)), ("fsync", str(tmp_path))]
    events.clear()
    fs = fsspec.filesystem("file")
    atomic.write_bytes_atomic(fs, str(tmp_path / "shard.arrow"), b"bytes")  # the streamed shards' commit
    assert events == [("fsync", str(tmp_path / "shard.arrow.tmp")), ("rename", str(tmp_path / "shard.arrow")),
                      ("fsync", str(tmp_path))]


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "rename-aside"])
def test_a_committed_directory_is_synced_whole_before_the_swap(tmp_path, monkeypatch, exchange):
    """A checkpoint or bundle directory: every file in it and every directory of it before the swap, the parent
    after each rename (the swap, or both renames of the fallback)."""
    dest = tmp_path / "step-0000002"
    _write_dir(dest, "old")
    if not exchange:
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    events = _record_syncs(monkeypatch)
    with atomic.staged(dest) as tmp:
        _write_dir(tmp, "new")
    first_publish = next(i for i, e in enumerate(events) if e[0] == "rename" or e[1] == str(tmp_path))
    synced = {p for kind, p in events[:first_publish]}
    assert synced == {str(tmp / "a.json"), str(tmp / "sub" / "b.bin"), str(tmp / "sub"), str(tmp)}, events
    renames = [i for i, e in enumerate(events) if e[0] == "rename"]
    assert len(renames) == (0 if exchange else 2)
    for i in renames:
        assert events[i + 1] == ("fsync", str(tmp_path)), events
    assert events[-1] == ("fsync", str(tmp_path)) and _dir_state(dest) == "new"


def test_durable_off_syncs_nothing(tmp_path, monkeypatch):
    """What ``benchmarks.durable`` compares against: the same commits without a single fsync."""
    events = _record_syncs(monkeypatch)
    monkeypatch.setattr(atomic, "DURABLE", False)
    with atomic.staged(tmp_path / "x") as tmp:
        tmp.write_text("1")
    assert [e[0] for e in events] == ["rename"] and (tmp_path / "x").read_text() == "1"


def test_a_pulled_dataset_syncs_each_file_before_its_rename_and_the_manifest_last(tmp_path, monkeypatch):
    """pull renames each finished ``.part`` onto its name, then the manifest: every one synced before its rename,
    its directory after, so a power cut never leaves a manifest over shards that did not reach the disk."""
    from tapdraft.shards.shard_file import ShardConfig
    from tapdraft.shards.transfer import pull
    from tests.shards.synthetic import tiny_layout, write_dataset

    store = tmp_path / "store"
    write_dataset(str(store), tiny_layout(), ShardConfig(shard_bytes=2500, batch_bytes=700), [4, 5, 6])
    events = _record_syncs(monkeypatch)
    copy = tmp_path / "copy"
    pull(str(store), str(copy), progress=False)
    renames = [i for i, e in enumerate(events) if e[0] == "rename"]
    assert len(renames) >= 4 and events[renames[-1]] == ("rename", str(copy / "manifest.json")), events
    for i in renames:
        dst = Path(events[i][1])
        assert events[i - 1][0] == "fsync" and events[i - 1][1].startswith(str(dst)), events[i - 1:i + 2]
        assert events[i + 1] == ("fsync", str(dst.parent)), events[i - 1:i + 2]
