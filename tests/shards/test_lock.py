"""Exclusive locks: a second holder is refused in one line; a dead holder's lock is taken over."""

import errno
import json
import os
import socket
import subprocess
import sys

import pytest

import shards.lock as lk
from shards.errors import LockedError
from shards.lock import exclusive_lock


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
