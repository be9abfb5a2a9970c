"""Datasets on object stores (``s3://``, ``gs://``, any fsspec URL): retries, a local cache, prefetch.

    fs, root = open_url("s3://bucket/ds")            # a local path comes back as fsspec's local filesystem
    fs.read_range(path, start, end, check=check)     # bytes through the cache; ``check`` raises on bad bytes
    fs.local_copy(path)                              # the whole object as a local file (cached)
    fs.prefetch(fn, *args)                           # run a read in the background (the reader's own order)

``RemoteFS`` stands in for the fsspec filesystem of a remote URL wherever shards/ reads one: every
method it does not define is the inner filesystem's, retried with exponential backoff on transient
errors (connection refused or reset, timeouts, 5xx, throttling; never a missing object or a refused
credential); after ``retries`` failures it raises ``RemoteError``, one line saying what to check.

The cache (``Cache``): a directory of entries, one per byte range of one object VERSION (path, size
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
import hashlib
import json
import os
import random
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import fsspec
import numpy as np
import xxhash
from fsspec.implementations.local import LocalFileSystem

from shards.errors import CorruptShardError, RemoteError


def _default_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tapdraft", "remote")


@dataclass(frozen=True)
class RemoteConfig:
    """How remote datasets are read: where the local cache lives and how hard to retry."""

    cache_dir: str = field(default_factory=_default_dir)
    """Local cache directory (shared by every process of this machine that reads the same datasets)."""
    cache_bytes: int = 64 << 30
    """Cache size bound in bytes (least recently used entries go first); 0 disables the cache."""
    prefetch: int = 8
    """Reads a stream starts ahead of the one it decodes, in its own order (0: none)."""
    threads: int = 8
    """Background fetches at once per process."""
    retries: int = 8
    """Tries after the first on a transient error (backoff 0.25 s doubling to 8 s: ~37 s in all)."""
    backoff_s: float = 0.25
    """First backoff; doubles each try up to ``max_backoff_s``."""
    max_backoff_s: float = 8.0
    """Longest wait between two tries."""
    storage_options: tuple[tuple[str, Any], ...] = ()
    """Extra fsspec options for the filesystem (credentials, ``client_kwargs`` with an ``endpoint_url``)."""

    def __post_init__(self) -> None:
        if self.cache_bytes < 0 or self.prefetch < 0 or self.retries < 0 or self.threads < 1:
            raise ValueError("cache_bytes, prefetch and retries must be >= 0, threads >= 1")
        if self.backoff_s <= 0 or self.max_backoff_s < self.backoff_s:
            raise ValueError("backoff_s must be > 0 and max_backoff_s >= backoff_s")


def is_local(fs: Any) -> bool:
    return isinstance(fs, LocalFileSystem)


def open_url(url: str, config: RemoteConfig | None = None) -> tuple[Any, str]:
    """(filesystem, root) of a dataset URL: the local filesystem for a path, a ``RemoteFS`` otherwise."""
    config = config or RemoteConfig()
    fs, root = fsspec.core.url_to_fs(str(url), **dict(config.storage_options))
    if is_local(fs):
        return fs, root
    return RemoteFS(fs, config), root


# ---- retries ---------------------------------------------------------------------------------

_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError,
              ValueError, TypeError, KeyError, AttributeError, NotImplementedError)
_PERMANENT_NAMES = ("NoCredentials", "PartialCredentials", "ParamValidation", "InvalidAccessKey", "AccessDenied",
                    "NoSuchBucket", "NoSuchKey", "SignatureDoesNotMatch")
_CLIENT_MODULES = ("botocore", "aiobotocore", "aiohttp", "urllib3", "requests", "google", "gcsfs", "s3fs", "adlfs")


def transient(e: BaseException) -> bool:
    """Whether an error from a store may go away when tried again (network, server restart, throttling)."""
    if isinstance(e, RemoteError) or any(n in type(e).__name__ for n in _PERMANENT_NAMES):
        return False
    if isinstance(e, _PERMANENT):
        return False
    if isinstance(e, (OSError, ConnectionError, TimeoutError)):
        return True
    return type(e).__module__.split(".")[0] in _CLIENT_MODULES


def retry(fn: Callable[..., Any], config: RemoteConfig, what: str) -> Callable[..., Any]:
    """``fn`` tried again on transient errors with exponential backoff and jitter; RemoteError at the end."""

    def call(*args: Any, **kwargs: Any) -> Any:
        delay, t0 = config.backoff_s, time.monotonic()
        for attempt in range(config.retries + 1):
            try:
                return fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 (classified just below)
                if not transient(e):
                    raise
                if attempt == config.retries:
                    raise RemoteError(f"{what} {args[0] if args else ''}: the store did not answer after "
                                      f"{attempt + 1} tries over {time.monotonic() - t0:.0f} s (last error: "
                                      f"{type(e).__name__}: {str(e)[:200]}); check the endpoint, network and "
                                      "credentials, then rerun (what was read stays cached)") from e
                time.sleep(delay * (1 + 0.25 * random.random()))
                delay = min(delay * 2, config.max_backoff_s)

    return call


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


# ---- the filesystem ----------------------------------------------------------------------------

_VERSION_KEYS = ("ETag", "etag", "md5Hash", "generation", "mtime", "LastModified", "last_modified", "created")


class RemoteFS:
    """A remote fsspec filesystem with retries, a checked local cache and background reads."""

    def __init__(self, fs: Any, config: RemoteConfig) -> None:
        self.inner, self.config = fs, config
        self.cache = Cache(config.cache_dir, config.cache_bytes) if config.cache_bytes else None
        self._versions: dict[str, str] = {}
        self._state_pid = -1

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "config") or name.startswith("__"):
            raise AttributeError(name)
        attr = getattr(self.inner, name)
        return retry(attr, self.config, name) if callable(attr) and not name.startswith("_") else attr

    def __getstate__(self) -> dict[str, Any]:
        return {"inner": self.inner, "config": self.config}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["inner"], state["config"])

    def __repr__(self) -> str:
        return f"RemoteFS({type(self.inner).__name__}, cache={self.config.cache_dir})"

    # per-process state: threads and futures do not survive a fork (DataLoader workers)
    def _state(self) -> None:
        if self._state_pid != os.getpid():
            self._state_pid = os.getpid()
            self._lock = threading.Lock()
            self._inflight: dict[str, Future] = {}
            self._pool: ThreadPoolExecutor | None = None

    def _key(self, path: str, start: int, end: int) -> str:
        path = self.inner._strip_protocol(path)
        if path not in self._versions:
            info = retry(self.inner.info, self.config, "info")(path)
            ver = next((str(info[k]) for k in _VERSION_KEYS if info.get(k) is not None), "")
            self._versions[path] = f"{info.get('size')}|{ver}"
        proto = self.inner.protocol if isinstance(self.inner.protocol, str) else self.inner.protocol[0]
        ident = f"{proto}://{path}|{self._versions[path]}|{start}|{end}"
        return hashlib.sha256(ident.encode()).hexdigest()[:40]

    def read_range(self, path: str, start: int, end: int, check: Callable[[Any], None] | None = None,
                   prefix: Any = b"") -> Any:
        """``prefix`` + bytes [start, end) of ``path``. ``check(data)`` raises (CorruptShardError) on bad bytes: they
        are then fetched once more, and never cached while bad. A cache hit with a ``check`` is checked by it
        alone (one hash pass, not two)."""
        k = len(prefix)
        if self.cache is None:
            return _joined(prefix, self._fetch(path, start, end, check))
        key = self._key(path, start, end)
        hit = self.cache.get(key, end - start, prefix, verify=check is None)
        if hit is not None:
            try:
                if check is not None:
                    check(hit[k:])
                return hit
            except CorruptShardError:
                self.cache.drop(key)  # damaged on the local disk: fetch it again
        return _joined(prefix, self._once(key, lambda: self._fill(key, path, start, end, check)))

    def _once(self, key: str, work: Callable[[], Any]) -> Any:
        """One fetch of ``key`` per process at a time: a second reader waits for the first's result."""
        self._state()
        with self._lock:
            fut = self._inflight.get(key)
            mine = fut is None
            if mine:
                fut = self._inflight[key] = Future()
        if not mine:
            return fut.result()
        try:
            out = work()
            fut.set_result(out)
            return out
        except BaseException as e:
            fut.set_exception(e)
            raise
        finally:
            with self._lock:
                self._inflight.pop(key, None)

    def _fill(self, key: str, path: str, start: int, end: int, check: Callable[[Any], None] | None) -> Any:
        with self.cache.lock(key):
            hit = self.cache.get(key, end - start)  # another process may have filled it meanwhile
            if hit is not None and (check is None or _passes(check, hit)):
                return hit
            data = self._fetch(path, start, end, check)
            self.cache.put_bytes(key, data)
            return data

    def _fetch(self, path: str, start: int, end: int, check: Callable[[Any], None] | None) -> Any:
        get = retry(self.inner.cat_file, self.config, "read")
        data = get(path, start=start, end=end)
        if check is not None:
            try:
                check(data)
            except CorruptShardError:
                data = get(path, start=start, end=end)  # damaged in transit? once more, then it is the object
                check(data)
        if len(data) != end - start:
            raise CorruptShardError(f"{path}: asked for bytes {start}..{end}, the store returned {len(data)}: the "
                                    "object is shorter than the manifest says; re-upload the dataset")
        return data

    # fsspec methods the readers use, routed through the cache
    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        if start is None and end is None:
            return bytes(self.read_range(path, 0, self.size(path)))
        size = self.size(path) if start is None or end is None or start < 0 or end < 0 else None
        start = 0 if start is None else (start + size if start < 0 else start)
        end = size if end is None else (end + size if end < 0 else end)
        if size is not None:
            end = min(end, size)
        return bytes(self.read_range(path, start, end))

    def cat_ranges(self, paths: list[str], starts: list[int], ends: list[int], **kwargs: Any) -> list[bytes]:
        """Cached entries from the cache, the rest in one batched (concurrent) request of the inner store."""
        out: list[Any] = [None] * len(paths)
        miss = []
        for i, (p, s, e) in enumerate(zip(paths, starts, ends)):
            hit = self.cache.get(self._key(p, s, e), e - s) if self.cache is not None else None
            if hit is None:
                miss.append(i)
            else:
                out[i] = bytes(hit)
        if miss:
            got = retry(self.inner.cat_ranges, self.config, "read")(
                [paths[i] for i in miss], [starts[i] for i in miss], [ends[i] for i in miss], on_error="raise")
            for i, data in zip(miss, got):
                out[i] = data
                if self.cache is not None and len(data) == ends[i] - starts[i]:
                    self.cache.put_bytes(self._key(paths[i], starts[i], ends[i]), data)
        return out

    def local_copy(self, path: str) -> str:
        """The whole object ``path`` as a local file in the cache (downloaded once, resumably)."""
        size = self.size(path)
        if self.cache is None:
            raise ValueError(f"{path}: reading a whole remote object needs the local cache (cache_bytes > 0)")
        key = self._key(path, 0, -1)
        hit = self.cache.path(key, size)
        if hit is not None:
            return hit

        def fill() -> str:
            with self.cache.lock(key):
                again = self.cache.path(key, size)
                return again if again is not None else self.cache.put_file(key, lambda tmp: self.download(path,
                                                                                                          tmp, size))
        return self._once(key, fill)

    def download(self, path: str, dest: str, size: int | None = None, chunk: int = 16 << 20) -> None:
        """Copy ``path`` to local ``dest`` in ranged chunks; a retry resumes at the last byte written."""
        size = self.size(path) if size is None else size
        get = retry(self.inner.cat_file, self.config, "read")
        with open(dest, "ab") as f:
            f.truncate(0)
            done = 0
            while done < size:
                data = get(path, start=done, end=min(size, done + chunk))
                if not data:
                    raise CorruptShardError(f"{path}: the store returned nothing at byte {done} of {size}")
                f.write(data)
                done += len(data)

    def open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if mode == "rb" and self.cache is not None:
            return open(self.local_copy(path), "rb")
        return self.inner.open(path, mode, **kwargs)

    def get(self, rpath: str, lpath: str, recursive: bool = False, **kwargs: Any) -> None:
        """Copy remote files (a directory with ``recursive``) to ``lpath`` through the cache."""
        if self.cache is None:
            return retry(self.inner.get, self.config, "read")(rpath, lpath, recursive=recursive, **kwargs)
        rpath = self.inner._strip_protocol(rpath).rstrip("/")
        files = retry(self.inner.find, self.config, "list")(rpath) if recursive else [rpath]
        for f in files:
            rel = f[len(rpath):].lstrip("/") if recursive else ""
            dest = Path(lpath) / rel if rel else Path(lpath)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.local_copy(f), dest)

    def prefetch(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` (a read that fills the cache) on a background thread; its errors are left for the
        foreground read of the same bytes to meet (and report) again."""
        if self.cache is None:
            return
        self._state()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.config.threads, thread_name_prefix="tapdraft-prefetch")

        def run() -> None:
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 (the foreground read of the same bytes raises it properly)
                pass

        self._pool.submit(run)


def _joined(prefix: Any, data: Any) -> Any:
    if not len(prefix):
        return data
    return np.concatenate([np.frombuffer(prefix, dtype=np.uint8), np.frombuffer(data, dtype=np.uint8)])


def _passes(check: Callable[[Any], None], data: Any) -> bool:
    try:
        check(data)
        return True
    except CorruptShardError:
        return False
