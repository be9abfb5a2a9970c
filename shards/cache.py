"""The local cache of remote reads: checked entries, one lock each, size-bounded LRU (``shards.remote`` uses it).

A directory of entries, one per byte range of one object VERSION (path, size
and ETag / generation / mtime, whatever the store reports), so a replaced object is never served
from an old entry. An entry is committed only whole and only after the caller's check (a record
batch's checksum, a shard's sha256) passed on the fetched bytes: filled under a temp name, then
renamed; its ``.ok`` sidecar (size + xxh3 of the bytes) is written after it, and a read checks both,
so a half-written or rotted entry is a miss, never data. One lock file per entry (``flock``) makes
concurrent ranks on one node fetch a range once; a killed filler leaves only a temp file that the
next eviction sweeps. Size-bounded LRU: a hit touches the entry's mtime; once this process has
added 1/16 of ``max_bytes``, one process at a time (a non-blocking lock) deletes the least recently
used entries down to 90%. The bound is therefore approximate (+1/16 per process filling at once).

Any number of processes may read through one directory while others evict. The cache never hands out a
path, only bytes (``get``: a range copied into a fresh buffer) or an OPEN file (``open``, ``put_file``):
the entry's file is opened before its sidecar is read, and on POSIX an unlinked file stays readable
through a descriptor opened before the unlink, so an eviction after the lookup frees the name but
cannot take the bytes from a reader (the disk space comes back when the last reader closes). A
lookup that loses the race (the name gone before ``open``) is a plain miss: the caller fetches again.
Of the three designs that work here this is the simplest: retrying on ``FileNotFoundError`` alone
can lose forever to an eviction when the budget is smaller than the object (the filler's own commit
evicts it), and pinning with ``flock(LOCK_SH)`` needs a lock per read plus an evictor that skips
pinned entries, so a slow reader could hold the cache above its bound. The cost: up to one unlinked
object per open reader may occupy disk beyond ``max_bytes`` until it is closed. An entry's name is
its content's identity (object version + range), so whichever complete file the name held when it
was opened has the right bytes; the digest check (once per process and entry) catches rot.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO, Callable

import numpy as np
import xxhash


# ---- the cache -------------------------------------------------------------------------------

def _digest(data: Any) -> str:
    return xxhash.xxh3_64_hexdigest(memoryview(data))


def _file_digest(f: BinaryIO) -> str:
    h = xxhash.xxh3_64()
    while chunk := f.read(8 << 20):
        h.update(chunk)
    return h.hexdigest()


class Cache:
    """Entries under ``root/<2 hex>/<key>.bin`` with a ``<key>.ok`` sidecar; see the module docstring."""

    def __init__(self, root: str, max_bytes: int) -> None:
        self.root, self.max_bytes = Path(root), int(max_bytes)
        self._added = 0
        self._verified: set[str] = set()

    def _paths(self, key: str) -> tuple[Path, Path]:
        d = self.root / key[:2]
        return d / f"{key}.bin", d / f"{key}.ok"

    def get(self, key: str, size: int, prefix: Any = b"", verify: bool = True) -> np.ndarray | None:
        """``prefix`` + the entry's bytes in one fresh writable buffer, or None when missing, incomplete or (with
        ``verify``: its digest checked) damaged. A caller that checks the bytes itself passes ``verify=False``."""
        data_path, ok_path = self._paths(key)
        meta = self._meta(ok_path, size)
        if meta is None:
            return None
        k = len(prefix)
        buf = np.empty(k + size, dtype=np.uint8)
        buf[:k] = np.frombuffer(prefix, dtype=np.uint8)
        try:
            with open(data_path, "rb", buffering=0) as f:
                n = f.readinto(memoryview(buf)[k:])
        except OSError:
            return None
        if n != size or (verify and _digest(buf[k:]) != meta["xxh3"]):
            self.drop(key)
            return None
        self._touch(data_path)
        return buf

    def open(self, key: str, size: int) -> BinaryIO | None:
        """A whole-object entry as a file opened for reading at its start (its digest checked once per process), or
        None when missing, incomplete or damaged. The caller closes it; an eviction meanwhile does not disturb it."""
        data_path, ok_path = self._paths(key)
        try:
            f = open(data_path, "rb")  # before the sidecar: what is checked below is what the caller reads
        except OSError:
            return None
        try:
            meta = self._meta(ok_path, size)
            if meta is None or os.fstat(f.fileno()).st_size != size:
                f.close()
                return None
            if key not in self._verified:
                if _file_digest(f) != meta["xxh3"]:
                    f.close()
                    self.drop(key)
                    return None
                self._verified.add(key)
            f.seek(0)
        except BaseException:
            f.close()
            raise
        self._touch(data_path)
        return f

    @staticmethod
    def _meta(ok_path: Path, size: int) -> dict[str, Any] | None:
        try:
            meta = json.loads(ok_path.read_bytes())
        except (OSError, ValueError):
            return None
        return meta if isinstance(meta, dict) and meta.get("size") == size and "xxh3" in meta else None

    @staticmethod
    def _touch(path: Path) -> None:
        try:
            os.utime(path)
        except OSError:
            pass

    def lock(self, key: str) -> "_EntryLock":
        return _EntryLock(self._paths(key)[0].with_suffix(".lock"))

    def put_bytes(self, key: str, data: Any) -> None:
        data_path, _ = self._paths(key)
        data_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = data_path.with_name(f"{data_path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        with open(tmp, "wb") as f:
            f.write(memoryview(data))
        self._commit(key, tmp, len(memoryview(data).cast("B")), _digest(data))

    def put_file(self, key: str, fill: Callable[[str], None]) -> BinaryIO:
        """Commit the file ``fill(tmp_path)`` writes (its digest computed here); returns it opened for reading at its
        start, so the caller reads it even when the commit's own eviction (a budget below its size) removed it."""
        data_path, _ = self._paths(key)
        data_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = data_path.with_name(f"{data_path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        f = None
        try:
            fill(str(tmp))
            f = open(tmp, "rb")
            digest = _file_digest(f)
            f.seek(0)
            self._commit(key, tmp, os.fstat(f.fileno()).st_size, digest)
        except BaseException:
            if f is not None:
                f.close()
            tmp.unlink(missing_ok=True)
            raise
        self._verified.add(key)
        return f

    def _commit(self, key: str, tmp: Path, size: int, digest: str) -> None:
        data_path, ok_path = self._paths(key)
        ok_path.unlink(missing_ok=True)  # never an old sidecar beside new bytes
        os.replace(tmp, data_path)
        ok_tmp = tmp.with_suffix(".oktmp")
        ok_tmp.write_text(json.dumps({"size": size, "xxh3": digest}))
        os.replace(ok_tmp, ok_path)
        self._added += size
        if self._added > self.max_bytes // 16:
            self._added = 0
            self.evict()

    def drop(self, key: str) -> None:
        for p in reversed(self._paths(key)):
            p.unlink(missing_ok=True)
        self._verified.discard(key)

    def evict(self, target: float = 0.9) -> int:
        """Delete least recently used entries until the cache holds <= ``target`` x ``max_bytes``; returns the
        bytes freed. Skipped when another process is evicting. Temp files older than 10 minutes (a killed
        filler's) go too."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / ".evict.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return 0
            entries, total, now = [], 0, time.time()
            for sub in os.scandir(self.root):
                if not sub.is_dir():
                    continue
                for e in os.scandir(sub.path):
                    try:
                        st = e.stat()
                    except FileNotFoundError:
                        continue
                    if e.name.endswith((".tmp", ".oktmp")) and now - st.st_mtime > 600:
                        Path(e.path).unlink(missing_ok=True)
                    elif e.name.endswith(".bin"):
                        entries.append((st.st_mtime, st.st_size, e.name[:-4]))
                        total += st.st_size
            freed = 0
            for _, size, key in sorted(entries):
                if total - freed <= target * self.max_bytes:
                    break
                self.drop(key)
                freed += size
            return freed
        finally:
            os.close(fd)

    def total_bytes(self) -> int:
        total = 0
        for p in self.root.glob("*/*.bin") if self.root.exists() else ():
            try:
                total += p.stat().st_size
            except FileNotFoundError:  # evicted since the listing
                pass
        return total


class _EntryLock:
    """Blocking ``flock`` on an entry's lock file: concurrent processes fetch one range once."""

    def __init__(self, path: Path) -> None:
        self.path, self.fd = path, -1

    def __enter__(self) -> "_EntryLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except OSError as e:  # a filesystem without flock: fetching twice is only slower
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
        return self

    def __exit__(self, *exc: Any) -> None:
        os.close(self.fd)
