"""Datasets on object stores (``s3://``, ``gs://``, any fsspec URL): retries, a local cache, prefetch.

    fs, root = open_url("s3://bucket/ds")            # a local path comes back as fsspec's local filesystem
    fs.read_range(path, start, end, check=check)     # bytes through the cache; ``check`` raises on bad bytes
    with fs.open_local(path) as f: ...               # the whole object as an open local file (cached)
    fs.prefetch(fn, *args)                           # run a read in the background (the reader's own order)

``RemoteFS`` stands in for the fsspec filesystem of a remote URL wherever shards/ reads one: every
method it does not define is the inner filesystem's, retried with exponential backoff on transient
errors (connection refused or reset, timeouts, 5xx, throttling; never a missing object or a refused
credential); after ``retries`` failures it raises ``RemoteError``, one line saying what to check.

The cache (``shards.cache``) keeps checked byte ranges of object versions on the local disk; see there.
A whole object comes back as an open file, never as a path into the cache: another process of the
machine may evict the entry at any moment, and an open file survives that (``shards.cache`` says why).
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable

import fsspec
import numpy as np
from fsspec.implementations.local import LocalFileSystem

from tapdraft.shards.cache import Cache
from tapdraft.common.errors import CorruptShardError, RemoteError


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


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
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
        size = self.size(path)  # a range past the end is cut there, as fsspec's own cat_file does
        start = 0 if start is None else (start + size if start < 0 else start)
        end = size if end is None else (end + size if end < 0 else end)
        return bytes(self.read_range(path, start, min(end, size)))

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

    def open_local(self, path: str) -> BinaryIO:
        """The whole object ``path`` as a local file opened for reading, from the cache (downloaded once, resumably,
        by one process of the machine at a time). The caller closes it; an eviction meanwhile does not disturb it."""
        size = self.size(path)
        if self.cache is None:
            raise ValueError(f"{path}: reading a whole remote object needs the local cache (cache_bytes > 0)")
        key = self._key(path, 0, -1)
        f = self.cache.open(key, size)
        if f is not None:
            return f
        with self.cache.lock(key):  # threads of this process too: each takes the lock through its own descriptor
            f = self.cache.open(key, size)  # another filled it meanwhile
            return f if f is not None else self.cache.put_file(key, lambda tmp: self.download(path, tmp, size))

    def local_copy(self, path: str) -> None:
        """Bring the whole object ``path`` into the cache (what a prefetch of a whole shard runs)."""
        with self.open_local(path):
            pass

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
            return self.open_local(path)
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
            self._copy_out(f, dest)

    def get_file(self, rpath: str, lpath: str, **kwargs: Any) -> None:
        """Copy one remote file to ``lpath`` through the cache (the target bundle's download)."""
        if self.cache is None:
            return retry(self.inner.get_file, self.config, "read")(rpath, lpath, **kwargs)
        self._copy_out(rpath, Path(lpath))

    def _copy_out(self, rpath: str, dest: Path) -> None:
        with self.open_local(rpath) as src, open(dest, "wb") as out:
            shutil.copyfileobj(src, out, 8 << 20)

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
