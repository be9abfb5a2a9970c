"""``common.errors.classify``, the one mapping from an exception to one ``error:`` line and an exit code: a disk
error is recognised however a library reports it, and names the file written (or read) as text."""

from __future__ import annotations

import errno
import os
import shutil

import pytest

from tapdraft.cli import main
from tapdraft.common.errors import classify
from tapdraft.shards.shard_file import ShardConfig
from tests.shards.synthetic import tiny_layout, write_dataset

FULL = "no space left on the device writing "


@pytest.mark.parametrize("exc, line", [
    (OSError(errno.ENOSPC, "No space left on device", "/d/x.arrow.tmp"), FULL + "/d/x.arrow.tmp; free space"),
    # TensorBoard's event writer opens its file by a bytes path
    (OSError(errno.ENOSPC, "No space left on device", b"/run/tensorboard/events.out"),
     FULL + "/run/tensorboard/events.out; free space"),
    # shutil.copytree collects each file's error as text
    (shutil.Error([("/s/w.bin", "/o/w.bin", "[Errno 28] No space left on device: '/o/w.bin'")]), FULL + "/o/w.bin;"),
    (shutil.Error([("/s/w.bin", "/o/w.bin", "[Errno 30] Read-only file system: '/o/w.bin'")]),
     "the filesystem is read-only writing /o/w.bin; choose a writable location"),
    # safetensors reports Rust's io::Error in its message
    (RuntimeError('Error while serializing: IoError(Os { code: 122, kind: FilesystemQuotaExceeded, message: "Disk '
                  'quota exceeded" })'), "disk quota exceeded; free space (or raise the quota)"),
    (OSError(errno.EROFS, "Read-only file system", "/ro/run/config.json"),
     "the filesystem is read-only writing /ro/run/config.json; choose a writable location"),
])
def test_a_disk_error_is_one_line_however_it_is_reported(exc, line):
    code, msg = classify(exc)
    assert code == 2 and msg.startswith(line) and "\n" not in msg and "b'" not in msg, msg


def test_a_copy_names_the_file_written_not_the_one_read():
    """shutil.copyfile (sendfile) names (source, destination); a full disk is the destination's."""
    e = OSError(errno.ENOSPC, "No space left on device")
    e.filename, e.filename2 = "/src/weights.safetensors", "/out/weights.safetensors"
    assert classify(e)[1].startswith(FULL + "/out/weights.safetensors;")


def test_a_disk_error_raised_from_is_found_and_a_bug_during_one_stays_a_bug():
    full = OSError(errno.ENOSPC, "No space left on device", "/d/f")
    try:
        raise RuntimeError("saving failed") from full
    except RuntimeError as e:
        assert classify(e)[1].startswith(FULL + "/d/f;")
    try:
        try:
            raise full
        except OSError:
            raise TypeError("a bug in the cleanup")
    except TypeError as e:
        assert classify(e) is None  # its traceback is shown: it is no disk problem to fix
    assert classify(RuntimeError("unexpected pos 10 vs 4")) is None  # torch's: only staged can ask the disk
    msg = "--out x: its last run failed with [Errno 28]; choose another"
    assert classify(ValueError(msg)) == (2, msg)  # a user error's own message is kept whole


def test_permission_said_reading_or_writing(tmp_path):
    there = tmp_path / "weights.bin"
    there.write_bytes(b"x")
    os.chmod(there, 0)
    if os.access(there, os.R_OK):
        pytest.skip("running as root: every file is readable")
    assert classify(PermissionError(errno.EACCES, "Permission denied", str(there)))[1].startswith(
        f"permission denied reading {there}")


def test_derive_out_of_disk_in_its_copy_is_one_line(tmp_path, capsys, monkeypatch):
    """derive copies the target bundle with shutil.copyfile, whose sendfile error names the source first."""
    src = tmp_path / "src"
    write_dataset(str(src), tiny_layout(), ShardConfig(shard_bytes=2500, batch_bytes=700), [4, 5])

    def full(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "sendfile", full)
    monkeypatch.setattr(shutil, "_USE_CP_SENDFILE", True)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        main(["derive", str(src), "--out", str(out), "--taps", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith(f"error: {FULL}{out}/target"), err
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]


@pytest.mark.parametrize("exc, line", [
    (MemoryError(), "out of memory"),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried to "
                  "allocate 3400000000 bytes"), "out of memory"),
    (RuntimeError("std::bad_alloc"), "out of memory"),
    (OSError(errno.EMFILE, "Too many open files", "/d/data/x.arrow"), "too many open files (now "),
    (OSError(errno.ENAMETOOLONG, "File name too long", "/d/" + "x" * 300), "file name too long for /d/xxx"),
])
def test_a_resource_limit_is_one_line(exc, line):
    """ulimit -v, ulimit -n and an over-long --out were tracebacks (exit 1): one line now, exit 2."""
    code, msg = classify(exc)
    assert code == 2 and msg.startswith(line) and "\n" not in msg, msg
    wrapped = ValueError("decoding failed")
    wrapped.__cause__ = exc  # raised from the limit: found as a disk error is
    assert classify(wrapped)[1].startswith(line)
    assert classify(RuntimeError("while writing")) is None  # a bug stays a traceback


def test_arrows_memory_error_and_an_over_long_out_are_one_line(tmp_path, capsys):
    import pyarrow as pa

    assert classify(pa.lib.ArrowMemoryError("malloc of size 4400000000 failed"))[1].startswith("out of memory")
    src = tmp_path / "ds"
    write_dataset(str(src), tiny_layout(), ShardConfig(shard_bytes=2500), [3, 4])
    for args in (["derive", src, "--out", tmp_path / ("x" * 300)], ["pull", src, tmp_path / ("y" * 300)]):
        with pytest.raises(SystemExit) as e:
            main([str(a) for a in args])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and err.startswith("error: file name too long") and "\n" not in err, err
