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

An object store has no kernel lock, so ``store_lock`` keeps the same record as an object in the store itself
(beside what it guards, where every writer of that destination looks), with an ``owner`` id and a ``beat``
time its holder refreshes every ``HEARTBEAT_S``:

    with store_lock(fs, "bucket/ds/_parts/rank00000.lock", "a push", guards="s3://bucket/ds") as confirm:
        ...; confirm(); commit    # confirm: LockedError unless the lock is still this holder's

On S3 (and its clones) the lock is taken with a conditional create (``PutObject`` with ``If-None-Match: *``):
of two writers exactly one creates it, the store decides, and the heartbeat, a takeover and the release are
conditional on the ETag the holder last wrote (``If-Match``), so a holder taken over as stale can never write over
its successor. A store that ignores the condition (a second conditional create of the lock succeeds: probed once
per acquisition) and a filesystem without one (gcsfs, adlfs, memory) get a best-effort marker instead: the lock is
written when absent or stale, read back after ``SETTLE_S``, and kept only if it is still this holder's; ``confirm``
(before a commit) and every heartbeat read it again, so of two writers that raced, the one overwritten stops
before it commits. A lock is stale when its holder is a dead process of this host, or its ``beat`` is older than
``STALE_S`` (hosts' clocks must agree within that); a killed holder's lock is taken over after it, or deleted by
hand as the refusal says.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

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


# ---- a lock kept in an object store -----------------------------------------------------------------

_HELD: set[str] = set()
"""Owner ids of the store locks this process holds now."""

HEARTBEAT_S = 30.0
"""Seconds between two refreshes of a store lock by its holder."""
STALE_S = 600.0
"""A store lock not refreshed for this long is a killed holder's and is taken over (20 missed heartbeats: a slow
store or a paused laptop is not taken over by mistake)."""
SETTLE_S = 2.0
"""Seconds a best-effort lock is left before it is read back (a racing writer's write lands within them)."""


def _precondition_failed(e: BaseException) -> bool:
    """Whether a store refused a conditional request (HTTP 412, or S3's 409 for two conditional writes at once)."""
    cause = e.__cause__ if e.__cause__ is not None else e
    err = (getattr(cause, "response", None) or {}).get("Error", {})
    return isinstance(e, FileExistsError) or err.get("Code") in ("PreconditionFailed", "ConditionalRequestConflict")


class _StoreLock:
    """The lock object ``path`` of an fsspec filesystem (see the module docstring)."""

    def __init__(self, fs: Any, path: str, what: str, guards: str) -> None:
        self.fs, self.path, self.guards = fs, path, guards
        self.me = {"pid": os.getpid(), "host": socket.gethostname(), "what": what,
                   "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "owner": uuid.uuid4().hex}
        self.conditional = hasattr(fs, "call_s3")
        self.etag: str | None = None
        self.lost: str | None = None
        self._stop = threading.Event()
        self._beats = threading.Thread(target=self._beat_loop, name="tapdraft-lock", daemon=True)

    # the store's side
    def _body(self) -> bytes:
        return json.dumps({**self.me, "beat": time.time()}).encode()

    def _split(self) -> tuple[str, str]:
        bucket, key, _ = self.fs.split_path(self.path)
        return bucket, key

    def _put(self, **cond: str) -> bool:
        """Write the record (conditionally on S3); False when the store refused the condition."""
        if not self.conditional:
            self.fs.pipe_file(self.path, self._body())
            return True
        bucket, key = self._split()
        try:
            self.etag = self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=self._body(), **cond)["ETag"]
        except OSError as e:
            if _precondition_failed(e):
                return False
            raise
        return True

    def _read(self) -> tuple[dict[str, Any], str | None] | None:
        """(the record, its ETag on S3), or None when there is no lock. The ETag is asked first: a record replaced
        in between is read newer than its ETag, and a write conditional on that ETag is then refused, never wrong."""
        etag = None
        try:
            if self.conditional:
                bucket, key = self._split()
                etag = self.fs.call_s3("head_object", Bucket=bucket, Key=key)["ETag"]
            raw = self.fs.cat_file(self.path)
        except FileNotFoundError:
            return None
        try:
            doc = json.loads(raw or b"{}")
        except ValueError:
            doc = {}
        return (doc if isinstance(doc, dict) else {}), etag

    def _delete(self, etag: str | None) -> None:
        if self.conditional and etag is not None:
            bucket, key = self._split()
            try:
                self.fs.call_s3("delete_object", Bucket=bucket, Key=key, IfMatch=etag)
            except OSError as e:
                if not _precondition_failed(e):
                    raise
        else:
            self.fs.rm_file(self.path)

    # the rules
    def _stale(self, doc: dict[str, Any]) -> bool:
        pid, host, beat = doc.get("pid"), doc.get("host"), doc.get("beat")
        if host == socket.gethostname() and isinstance(pid, int):
            if pid == os.getpid():
                return doc.get("owner") not in _HELD  # a holder of this process that ended (its release failed)
            if not _alive(pid):
                return True  # its process is gone
        return not isinstance(beat, (int, float)) or time.time() - beat > STALE_S

    def _refusal(self, doc: dict[str, Any]) -> LockedError:
        beat = doc.get("beat")
        ago = f"{time.time() - beat:.0f} s ago" if isinstance(beat, (int, float)) else "never"
        if doc.get("host") == socket.gethostname():
            return _refuse(self.guards, doc, "wait for it to finish or stop it; one writer per destination")
        return _refuse(self.guards, doc, f"wait for it to finish; if nothing runs there any more, the lock (last "
                                         f"refreshed {ago}) is taken over {STALE_S:.0f} s after its last refresh, "
                                         f"or delete {self.path} and rerun")

    def acquire(self) -> None:
        _HELD.add(self.me["owner"])  # before the first write: this process's other lockers see a live holder
        try:
            self._acquire()
        except BaseException:
            _HELD.discard(self.me["owner"])
            raise

    def _acquire(self) -> None:
        for _ in range(8):  # each turn: the lock vanished or went stale between two requests
            found = self._read()
            if found is not None and not self._stale(found[0]) and found[0].get("owner") != self.me["owner"]:
                raise self._refusal(found[0])
            if self.conditional:
                taken = self._put(IfNoneMatch="*") if found is None else self._put(IfMatch=found[1])
                if not taken:
                    continue  # another writer got there first: read who
                if self._put(IfNoneMatch="*"):  # the store ignored the condition: a best-effort marker then
                    self.conditional = False
                else:
                    break
            else:
                self._put()
            time.sleep(SETTLE_S)
            again = self._read()
            if again is None or again[0].get("owner") != self.me["owner"]:
                if again is not None:
                    raise self._refusal(again[0])
                continue
            break
        else:
            raise LockedError(f"{self.guards}: its lock {self.path} changed hands 8 times while it was taken; "
                              "another writer is starting there: wait for it, then rerun")
        self._beats.start()

    def confirm(self) -> None:
        """LockedError unless the lock is still this holder's (a holder taken over as stale stops here)."""
        found = self._read()
        if self.lost is None and (found is None or found[0].get("owner") != self.me["owner"]):
            self.lost = "someone removed or took over its lock" if found is None else \
                f"its lock was taken over by {_describe(found[0])}"
        if self.lost is not None:
            raise LockedError(f"{self.guards}: {self.lost} (this holder's heartbeat stopped for over "
                              f"{STALE_S:.0f} s?); nothing was committed: check what writes there, then rerun")

    def _beat_loop(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if self.conditional:
                    if not self._put(IfMatch=self.etag):
                        self.lost = "its lock was taken over while it ran"
                        return
                else:
                    found = self._read()
                    if found is None or found[0].get("owner") != self.me["owner"]:
                        self.lost = "its lock was taken over while it ran"
                        return
                    self._put()
            except Exception:  # noqa: BLE001 (a store that does not answer now: the next beat tries again)
                continue

    def release(self) -> None:
        self._stop.set()
        if self._beats.is_alive():
            self._beats.join()
        try:
            if self.lost is None:  # else not ours any more: never remove a successor's lock
                found = self._read()
                if found is not None and found[0].get("owner") == self.me["owner"]:
                    self._delete(found[1])
        except Exception:  # noqa: BLE001 (left behind: stale after STALE_S, at once for this host)
            pass
        finally:
            _HELD.discard(self.me["owner"])


@contextmanager
def store_lock(fs: Any, path: str, what: str, *, guards: str) -> Iterator[Callable[[], None]]:
    """Hold the lock object ``path`` of the fsspec filesystem ``fs`` (an object store) for the body; LockedError at
    once when another live writer holds it. Yields ``confirm``: call it just before committing (it raises
    LockedError unless the lock is still this holder's). ``what`` names the holder, ``guards`` the destination."""
    lock = _StoreLock(fs, path, what, guards)
    lock.acquire()
    try:
        yield lock.confirm
    finally:
        lock.release()
