"""Atomic replacement of files and directories: a reader sees the old content or the new, never neither.

Every write that must not be seen half-done goes through here (manifest, partial indexes, shards,
the target bundle, the capture config, checkpoints and exports):

    with staged(dest) as tmp:        # tmp = "<dest>.tmp", a fresh path; write a file or a directory there
        save_file(tensors, tmp)
    write_bytes_atomic(fs, url, data)  # any fsspec filesystem
    commit(fs, tmp, url)             # a file written under temp_name(url) by hand (streamed shards)

Files: the temp file is renamed over the destination, which POSIX rename does atomically; the old
file is never deleted first. A staged file gets the ordinary mode of a new file (0666 less the
umask) whatever wrote it: safetensors creates its files 0600, which made exported weights and the
bundle unreadable to the team they are shared with. A failed write removes its temp file (a full
disk must not stay full of temp files). Directories cannot be renamed over a non-empty directory, so a
directory that already exists is swapped with the new one in one step (Linux ``renameat2`` with
``RENAME_EXCHANGE``) and the old content, now under the temp name, is deleted afterwards. Where the
exchange is unavailable the old directory is first renamed aside to ``<dest>.old``; ``recover_dir``
(called by every ``staged``, so by writers only: a reader never writes) renames it back if a crash fell
between the two renames, so no sequence of crashes loses both versions.

Durable: a rename is atomic for processes, not for a power cut: the kernel may write the rename to disk before
the file's bytes, so a manifest could survive a power cut that its shards did not. So every commit fsyncs the
new file (a staged directory: every file and directory in it) before its rename, and the directory that holds
it after (what SQLite and LMDB do). It is on always (``DURABLE`` exists for ``python -m benchmarks.durable``):
measured 2026-12-01 on ext4, 1.4% of a capture's time (qwen3-256x4) and 4% of the writer's alone at hidden 4096
(its worst case) were spent inside fsync; the wall-clock ratios, 0.98 and 1.13, were within the shared machine's
noise (docs/reliability.md).

A write that fails inside ``staged`` because the process ran out of file descriptors (``ulimit -n``) still removes
its temp path: removing a directory needs descriptors of its own, so a few are held in reserve (``_SPARE``) and
given up for that removal only.

A write that fails inside ``staged`` names its destination: an ``OSError`` without a path gets ``dest`` (one inside a
staged directory the name it would have had there), and a
library that hides the errno (torch's writer: ``RuntimeError: ... unexpected pos``; safetensors: ``Os { code:
28``) is raised again as the ``OSError`` it was (``common.errors.disk_errno``), so ``classify`` prints one line.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import fsspec

from tapdraft.common.errors import disk_errno, torch_write_failed

TMP_SUFFIX = ".tmp"
OLD_SUFFIX = ".old"
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_NEARLY_FULL = 64 << 20

DURABLE = True
"""fsync before and after each commit's rename; only ``benchmarks.durable`` turns it off, to measure its cost."""


def temp_name(path: str) -> str:
    """Where a file or directory is written before ``commit`` moves it to ``path``."""
    return str(path) + TMP_SUFFIX


def _rename(src: Path | str, dst: Path | str) -> None:
    os.replace(src, dst)
    _fsync(Path(dst).parent, directory=True)  # the rename itself reaches the disk


def _fsync(path: Path | str, *, directory: bool = False) -> None:
    """Flush one file's (or directory's entries') bytes to the disk; a filesystem that cannot fsync a directory
    (some network ones answer EINVAL) is not an error."""
    if not DURABLE:
        return
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    except OSError as e:
        if not directory or e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _sync_new(tmp: Path) -> None:
    """Before a commit's rename: the new file's bytes, or every file and directory of a new directory."""
    if not DURABLE:
        return
    if not tmp.is_dir():
        _fsync(tmp)
        return
    for root, dirs, files in os.walk(tmp, topdown=False):
        for name in files:
            if not os.path.islink(os.path.join(root, name)):
                _fsync(os.path.join(root, name))
        _fsync(root, directory=True)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


SPARE_FDS = 4
"""Descriptors held in reserve for removing a temp path after EMFILE (rmtree holds about two a directory level)."""
_SPARE: list[int] = []


def _reserve_fds() -> None:
    try:
        while len(_SPARE) < SPARE_FDS:
            _SPARE.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
    except OSError:
        pass  # fewer in reserve: the removal below is then best effort, as it was


def _remove_after_failure(path: Path) -> None:
    """Remove a failed write's temp path, if need be on the reserved descriptors; a removal that fails all the same
    leaves the path (readers skip temp names, the next ``staged`` of that destination removes it) and never hides
    the failure that is being raised."""
    try:
        _remove(path)
        return
    except OSError as e:
        if e.errno != errno.EMFILE or not _SPARE:
            return
    while _SPARE:
        os.close(_SPARE.pop())
    try:
        _remove(path)
    except OSError:
        pass
    finally:
        _reserve_fds()


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths atomically; False when the platform or filesystem cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: not supported here
        return False
    raise OSError(err, os.strerror(err), str(b))


def recover_dir(dest: str | os.PathLike) -> None:
    """Undo a directory swap that stopped between its two renames (fallback path only)."""
    dest = Path(dest)
    old = Path(str(dest) + OLD_SUFFIX)
    if old.exists() and not dest.exists():
        _rename(old, dest)
    elif old.exists():
        _remove(old)


def _umask() -> int:
    """The process umask, read without changing it (Linux /proc); 0o022 where it cannot be read."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def _commit_local(tmp: Path, dest: Path) -> None:
    if tmp.is_file():
        os.chmod(tmp, 0o666 & ~_umask())
    _sync_new(tmp)
    if not tmp.is_dir() or not dest.exists():
        _rename(tmp, dest)  # a file over a file, or a directory onto a free name: one atomic rename
        return
    if _exchange(tmp, dest):
        _fsync(dest.parent, directory=True)
        _remove(tmp)  # now holds the old content
        return
    old = Path(str(dest) + OLD_SUFFIX)
    _rename(dest, old)
    _rename(tmp, dest)
    _remove(old)


@contextmanager
def staged(dest: str | os.PathLike) -> Iterator[Path]:
    """Yield a fresh local temp path beside ``dest``; on success it replaces ``dest`` atomically.

    Write either a file or a directory at the yielded path. On an exception the temp path is
    removed and ``dest`` is left as it was.
    """
    dest = Path(dest)
    recover_dir(dest)
    tmp = Path(temp_name(str(dest)))
    _remove(tmp)
    dest.parent.mkdir(parents=True, exist_ok=True)
    _reserve_fds()
    try:
        yield tmp
    except BaseException as e:
        named = _named(e, tmp, dest)
        _remove_after_failure(tmp)
        if named is not None:
            raise named from e
        raise
    _commit_local(tmp, dest)


def _named(exc: BaseException, tmp: Path, dest: Path) -> OSError | None:
    """The ``OSError`` a failed write inside ``staged`` was, naming ``dest`` (module docstring); None to re-raise
    ``exc`` as it is. Asked before the temp file is removed: a disk torch filled is still full then."""
    if isinstance(exc, OSError):
        if exc.errno is not None and not exc.filename:
            exc.filename = str(dest)  # a write through a file object (torch.save(obj, f)) names no path
        elif isinstance(exc.filename, str) and exc.filename.startswith(str(tmp) + os.sep):
            exc.filename = str(dest) + exc.filename[len(str(tmp)):]  # a file of a staged directory: its final name
        return None
    code = disk_errno(exc)
    if code is None and torch_write_failed(exc):
        code = _why_unwritable(tmp.parent)
    return OSError(code, os.strerror(code), str(dest)) if code is not None else None


def _why_unwritable(folder: Path) -> int | None:
    """EROFS or ENOSPC when the filesystem holding ``folder`` is read-only or (nearly) full; None when neither."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    if st.f_flag & os.ST_RDONLY:
        return errno.EROFS
    if st.f_bavail * st.f_frsize < _NEARLY_FULL:
        return errno.ENOSPC
    return None


def replace(tmp: str | os.PathLike, path: str | os.PathLike) -> None:
    """``os.replace`` made durable: ``tmp``'s bytes reach the disk before the rename, the rename after (a local
    file finished elsewhere: a pulled shard's ``.part``, the pulled manifest)."""
    _sync_new(Path(tmp))
    _rename(tmp, path)


def commit(fs: fsspec.AbstractFileSystem, tmp: str, path: str) -> None:
    """Move a finished temp file onto ``path``, replacing any old file without deleting it first."""
    if is_local(fs):
        replace(fs._strip_protocol(tmp), fs._strip_protocol(path))
    else:
        fs.mv(tmp, path)  # object stores: the new object becomes visible whole


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def write_bytes_atomic(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` on any fsspec filesystem: temp name, then ``commit``."""
    tmp = temp_name(path)
    try:
        with fs.open(tmp, "wb") as f:
            f.write(data)
    except BaseException:
        if fs.exists(tmp):
            fs.rm(tmp)
        raise
    commit(fs, tmp, path)


def write_json_atomic(fs: fsspec.AbstractFileSystem, path: str, doc: Any, *, indent: int | None = 1) -> None:
    """``doc`` as key-sorted JSON (indented unless ``indent`` is None), written atomically. Indented JSON goes
    through Python's pure-Python encoder, ~10x slower than the compact one: large documents pass None."""
    write_bytes_atomic(fs, path, json.dumps(doc, indent=indent, sort_keys=True, default=str).encode())
