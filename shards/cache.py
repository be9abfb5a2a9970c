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
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import xxhash


# ---- the cache -------------------------------------------------------------------------------

def _digest(data: Any) -> str:
    return xxhash.xxh3_64_hexdigest(memoryview(data))


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

    def path(self, key: str, size: int) -> str | None:
        """A whole-object entry as a local file path (its digest checked once per process), or None."""
        data_path, ok_path = self._paths(key)
        meta = self._meta(ok_path, size)
        if meta is None or not data_path.is_file() or data_path.stat().st_size != size:
            return None
        if key not in self._verified:
            h = xxhash.xxh3_64()
            with open(data_path, "rb") as f:
                while chunk := f.read(8 << 20):
                    h.update(chunk)
            if h.hexdigest() != meta["xxh3"]:
                self.drop(key)
                return None
            self._verified.add(key)
        self._touch(data_path)
        return str(data_path)

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

    def put_file(self, key: str, fill: Callable[[str], None]) -> str:
        """Commit the file ``fill(tmp_path)`` writes (its digest computed here) and return its path."""
        data_path, _ = self._paths(key)
        data_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = data_path.with_name(f"{data_path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            fill(str(tmp))
            h = xxhash.xxh3_64()
            with open(tmp, "rb") as f:
                while chunk := f.read(8 << 20):
                    h.update(chunk)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self._commit(key, tmp, tmp.stat().st_size, h.hexdigest())
        self._verified.add(key)
        return str(data_path)

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
        return sum(p.stat().st_size for p in self.root.glob("*/*.bin")) if self.root.exists() else 0


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
