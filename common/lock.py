"""Exclusive locks on output directories: one capture writes a dataset, one training writes a run.

    with exclusive_lock(lock_file, "a capture", guards=out_dir):   # LockedError at once if another process holds it
        ...

The lock file holds JSON {pid, host, what, since} for the message a second writer gets. Exclusion
is a kernel lock (``fcntl.flock``) on that file, so a crashed or killed holder (even ``kill -9``)
releases it with its last file descriptor: a leftover file is a stale lock and is simply taken
over, with no pid guessing and no cleanup step. Where the filesystem has no ``flock`` (some network
mounts), the recorded pid decides instead: a lock of a live process on this host is refused, one of
a dead process is stale and taken over, one from another host is refused with how to clear it.

The file is removed on release, so a finished run leaves nothing that looks like a running job. The
holder unlinks it while still holding the lock; a process that opened the old file just before and
takes its lock after sees that the name no longer leads to the file it locked (inode check) and
retries on the current name, so two holders can never coexist. A killed holder's file stays (stale,
taken over by the next writer).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from tapdraft.common.errors import LockedError

_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def _holder(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text() or "{}")
        return doc if isinstance(doc, dict) else {}
    except (OSError, ValueError):
        return {}


def _describe(doc: dict[str, Any]) -> str:
    return (f"{doc.get('what', 'another run')} (pid {doc.get('pid', '?')} on {doc.get('host', '?')}, "
            f"since {doc.get('since', '?')})")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _refuse(guards: str, doc: dict[str, Any], hint: str) -> LockedError:
    return LockedError(f"{guards} is in use by {_describe(doc)}: {hint}")


@contextmanager
def exclusive_lock(path: str | os.PathLike, what: str, *, guards: str | os.PathLike | None = None) -> Iterator[None]:
    """Hold ``path`` (a lock file, created if missing) exclusively for the body; LockedError when taken.

    ``what`` names the holder in a refusal ("a capture (rank 0)"); ``guards`` the directory it protects
    (default: the lock file's directory)."""
    path = Path(path)
    where = str(guards if guards is not None else path.parent)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = _acquire(path, where)
    try:
        me = {"pid": os.getpid(), "host": socket.gethostname(), "what": what,
              "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        yield
    finally:
        try:
            if _same_file(fd, path):
                path.unlink()  # while still held: see the module docstring
        finally:
            os.close(fd)  # releases the flock


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _acquire(path: Path, where: str) -> int:
    """An open descriptor of ``path`` holding its lock (retried when a releasing holder removed the name
    between our open and our lock)."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise _refuse(where, _holder(path), "wait for it to finish or stop it; one writer per directory") \
                    from None
            except OSError as e:
                if e.errno not in _NO_FLOCK:
                    raise
                _check_pid_lock(path, where)
                return fd
            if _same_file(fd, path):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def _check_pid_lock(path: Path, where: str) -> None:
    """Fallback without flock: refuse a live holder on this host or any holder on another host."""
    doc = _holder(path)
    pid, host = doc.get("pid"), doc.get("host")
    if not isinstance(pid, int) or pid == os.getpid():
        return
    if host == socket.gethostname():
        if _alive(pid):
            raise _refuse(where, doc, "wait for it to finish or stop it; one writer per directory")
        return  # stale: its process is gone
    raise _refuse(where, doc, f"if nothing runs there any more, delete {path} and rerun")
