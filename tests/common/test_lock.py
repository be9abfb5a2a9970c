"""Exclusive locks: a second holder is refused in one line; a dead holder's lock is taken over."""

import errno
import json
import os
import socket
import subprocess
import sys

import pytest

import tapdraft.common.lock as lk
from tapdraft.common.errors import LockedError
from tapdraft.common.lock import exclusive_lock


def test_second_holder_is_refused_and_release_frees_it(tmp_path):
    path = tmp_path / "run" / "x.lock"
    with exclusive_lock(path, "a training", guards=tmp_path / "run"):
        assert json.loads(path.read_text())["pid"] == os.getpid()
        with pytest.raises(LockedError, match=rf"run is in use by a training \(pid {os.getpid()} on ") as e:
            with exclusive_lock(path, "a training"):
                pass
        assert "\n" not in str(e.value)
    with exclusive_lock(path, "a training"):  # released: free again
        pass


def _no_flock(monkeypatch):
    def flock(fd, op):
        raise OSError(errno.ENOLCK, "no locks")

    monkeypatch.setattr(lk.fcntl, "flock", flock)


def test_without_flock_the_recorded_pid_decides(tmp_path, monkeypatch):
    _no_flock(monkeypatch)
    path = tmp_path / "x.lock"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        path.write_text(json.dumps({"pid": live.pid, "host": socket.gethostname(), "what": "a capture"}))
        with pytest.raises(LockedError, match=f"pid {live.pid}"):
            with exclusive_lock(path, "a capture"):
                pass
    finally:
        live.kill()
        live.wait()
    with exclusive_lock(path, "a capture"):  # its process is gone: a stale lock, taken over
        assert json.loads(path.read_text())["pid"] == os.getpid()
    path.write_text(json.dumps({"pid": 1, "host": "elsewhere", "what": "a capture"}))
    with pytest.raises(LockedError, match=f"on elsewhere.*delete {path}"):
        with exclusive_lock(path, "a capture"):
            pass


def test_the_lock_file_is_removed_on_release_and_a_killed_holders_file_is_taken_over(tmp_path):
    path = tmp_path / "x.lock"
    with exclusive_lock(path, "a capture"):
        assert path.is_file()
    assert not path.exists()  # a finished run leaves nothing that looks like a running job
    with pytest.raises(ValueError, match="boom"):
        with exclusive_lock(path, "a capture"):
            raise ValueError("boom")
    assert not path.exists()
    held = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.path.insert(0, '.');"
                             "from tapdraft.common.lock import exclusive_lock\n"
                             f"with exclusive_lock({str(path)!r}, 'a capture'):\n"
                             "    print('held', flush=True); time.sleep(60)"],
                            stdout=subprocess.PIPE, text=True, cwd=lk.Path(lk.__file__).parents[1])
    try:
        assert held.stdout.readline().strip() == "held"
        with pytest.raises(LockedError):
            with exclusive_lock(path, "a capture"):
                pass
    finally:
        held.kill()
        held.wait()
    assert path.is_file()  # kill -9 leaves the file: a stale lock
    with exclusive_lock(path, "a capture"):
        assert json.loads(path.read_text())["pid"] == os.getpid()
    assert not path.exists()


def test_a_lock_taken_on_a_name_its_holder_removed_is_retried(tmp_path, monkeypatch):
    """The race removal opens: B opened the file just before A released (and unlinked) it, then locks the
    unlinked file. B must notice and lock the current name instead, or a third writer could coexist."""
    path = tmp_path / "x.lock"
    real_flock, calls = lk.fcntl.flock, []

    def flock(fd, op):
        if not calls:  # between B's open and B's lock, A releases: its name is removed
            calls.append(fd)
            path.unlink()
            path.write_text("")  # and C creates the name anew
        return real_flock(fd, op)

    monkeypatch.setattr(lk.fcntl, "flock", flock)
    with exclusive_lock(path, "a training"):
        assert len(calls) == 1 and json.loads(path.read_text())["pid"] == os.getpid()  # locked the live name
        monkeypatch.setattr(lk.fcntl, "flock", real_flock)
        with pytest.raises(LockedError):
            with exclusive_lock(path, "a training"):
                pass
