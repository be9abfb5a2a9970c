"""The project's error types and exit codes, defined once.

Every package imports ``shards``, so its error types live here; ``cli.main`` turns any of them (and
the standard user-error types below) into ONE line ``error: <what happened and what to do>`` and
the exit code the type carries. ``tapdraft --debug COMMAND ...`` prints the traceback as well.

Exit codes (the README's table repeats them):

    0    success
    1    ``verify`` found problems; or an unexpected internal error (full traceback: a bug to report)
    2    a user's mistake or an environment problem the user fixes: bad input or option, missing or
         foreign files, a full disk, a read-only output or an unreadable input (the message names the file,
         whether it was being read or written, and what to do)
    130  interrupted (Ctrl-C / SIGTERM) after saving what could be saved (the message says what)

User errors raised as plain ``ValueError`` / ``FileNotFoundError`` (the house convention for a bad
setting or a missing file) map to exit 2 as well; :func:`classify` is the one mapping.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import threading
from typing import Any

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_USER = 2
EXIT_INTERRUPTED = 130

_DISK_ERRNOS = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
                errno.EROFS: "the filesystem is read-only", errno.EACCES: "permission denied",
                errno.EPERM: "operation not permitted"}


class TapdraftError(Exception):
    """Base of the project's own errors: a message that says what to do, and an exit code."""

    exit_code = EXIT_USER


class InputError(TapdraftError, ValueError):
    """A conversation or its audio cannot be used; carries where it came from."""

    def __init__(self, reason: str, *, sample_id: str = "", line: int | None = None, source: str = ""):
        self.reason, self.sample_id, self.line, self.source = reason, sample_id, line, source
        where = f"{source}:{line}" if line is not None else source
        super().__init__(f"sample {sample_id!r} ({where}): {reason}")


class CaptureError(TapdraftError, ValueError):
    """A capture stopped on a bad input (on_error='fail'); the dataset directory stays resumable."""


class SampleIndexError(TapdraftError, IndexError):
    """A sample index outside a split (``inspect --sample``, ``Dataset.sample``)."""


class CorruptShardError(TapdraftError, ValueError):
    """Stored bytes do not match their checksum (``shards.integrity``): a shard is damaged or not this dataset's."""


class LockedError(TapdraftError, ValueError):
    """Another live process holds an output directory's lock (``common.lock``): one writer per directory."""


class RemoteError(TapdraftError, OSError):
    """An object store did not answer after the retries (``shards.remote``): endpoint, network or credentials."""


class InputChangedError(TapdraftError, ValueError):
    """A resumed capture's input no longer has the content the capture started from."""


class DivergedError(TapdraftError, ValueError):
    """Training went non-finite (a loss, a gradient norm or a weight): such a step is never applied, a checkpoint
    of such weights is never saved, and they are never exported."""


class Interrupted(TapdraftError):
    """Ctrl-C or SIGTERM stopped a command after it saved what it could; the message says what was kept."""

    exit_code = EXIT_INTERRUPTED


class StopSignals:
    """While active, SIGINT and SIGTERM ask the work to stop at its next safe point instead of killing it
    mid-write: ``requested`` turns true (and ``signal_name`` says which). A second signal raises
    KeyboardInterrupt (the user insists). Handlers are installed only in the main thread and restored
    on exit.

        with StopSignals() as stop:
            for step in ...:
                ...
                if stop.requested: save, then raise Interrupted(...)
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""
        self._old: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self.signal_name = signal.Signals(signum).name

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old = {}


def classify(exc: BaseException) -> tuple[int, str] | None:
    """(exit code, one-line message) for an error a user can act on; None for a bug (show the traceback).

    A disk error counts wherever it surfaces: an ``OSError`` carrying one of the errnos above (its path decoded when
    a library hands it as bytes, as TensorBoard's writer does; the destination when a copy names both files), one
    found in the exception's ``__cause__`` (``raise ... from``), a ``shutil.Error`` of ``copytree`` (a list of
    ``[Errno N]`` strings), and a library error that hides the errno in its message (safetensors' ``Os { code:
    N``): see :func:`disk_errno`. A resource limit (memory, open files, name length) is one line too
    (:func:`_resource_limit`)."""
    if isinstance(exc, TapdraftError):
        return exc.exit_code, _one_line(str(exc))
    disk = _disk_error(exc)
    if disk is not None:
        code, filename = disk
        what = _DISK_ERRNOS[code]
        if code in (errno.EACCES, errno.EPERM) and _unreadable(filename):
            return EXIT_USER, (f"{what} reading {filename}; ask its owner for read access, or copy it where you "
                               "can read it")
        where = f" writing {filename}" if filename else ""
        todo = ("free space (or raise the quota) and rerun the same command: finished work is kept and resumed"
                if code in (errno.ENOSPC, errno.EDQUOT) else "choose a writable location, or fix its permissions")
        return EXIT_USER, f"{what}{where}; {todo}"
    limit = _resource_limit(exc)
    if limit is not None:
        return EXIT_USER, limit
    if isinstance(exc, (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError)):
        return EXIT_USER, _one_line(str(exc))
    return None


_OUT_OF_MEMORY = ("std::bad_alloc", "can't allocate memory", "CUDA out of memory")


def _resource_limit(exc: BaseException) -> str | None:
    """The line for a resource limit the user can raise (memory: ``ulimit -v`` or the machine's; open files:
    ``ulimit -n``; a name the filesystem cannot hold), wherever the library underneath surfaced it: a MemoryError
    (Arrow's ArrowMemoryError is one), torch's or C++'s allocation failure in a RuntimeError's text, or the errno
    of an OSError; searched through ``raise ... from`` as disk errors are."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, MemoryError) or (isinstance(e, RuntimeError) and any(t in str(e) for t in _OUT_OF_MEMORY)) \
                or (isinstance(e, OSError) and e.errno == errno.ENOMEM):
            return ("out of memory (the machine's, or a limit such as ulimit -v); raise the limit or use a smaller "
                    "batch (train: --set max_tokens=N; capture: --batch-tokens N), then rerun the same command: "
                    "finished work is kept")
        if isinstance(e, OSError) and e.errno in (errno.EMFILE, errno.ENFILE):
            try:
                import resource

                now = f" (now {resource.getrlimit(resource.RLIMIT_NOFILE)[0]})"
            except (ImportError, OSError, ValueError):
                now = ""
            return (f"too many open files{now}; raise the limit (e.g. ulimit -n 4096) and rerun the same command: "
                    "finished work is kept")
        if isinstance(e, OSError) and e.errno == errno.ENAMETOOLONG:
            name = _text(e.filename)
            return (f"file name too long{' for ' + name[:80] + '...' if name else ''} (at most 255 bytes a name, "
                    "4096 a path); choose a shorter path")
        e = e.__cause__
    return None


_ERRNO_IN_TEXT = re.compile(r"\[Errno (\d+)\][^:]*(?::\s*'(.*)')?|Os \{ code: (\d+)")
_TORCH_WRITE_FAILED = ("unexpected pos", "file write failed", "PytorchStreamWriter failed writing")


def disk_errno(exc: BaseException) -> int | None:
    """The disk errno (one of the classified ones) an exception that is not an ``OSError`` hides in its text:
    safetensors' ``SafetensorError: ... IoError(Os { code: 28, ... })``, or a ``shutil.Error``'s ``[Errno 28]``;
    None when it names none. torch's writer names no errno at all (``unexpected pos``, ``file write failed``):
    :func:`torch_write_failed` recognises it, and ``common.atomic.staged``, which knows the path, asks the
    filesystem why."""
    for m in _ERRNO_IN_TEXT.finditer(str(exc)):
        code = int(m.group(1) or m.group(3))
        if code in _DISK_ERRNOS:
            return code
    return None


def torch_write_failed(exc: BaseException) -> bool:
    """Whether ``exc`` is torch's writer failing to write (it reports a full disk as ``RuntimeError: ... unexpected
    pos N vs M`` or ``file write failed``, without the errno)."""
    return isinstance(exc, RuntimeError) and any(t in str(exc) for t in _TORCH_WRITE_FAILED)


def _disk_error(exc: BaseException) -> tuple[int, str] | None:
    """(errno, path as text) of the disk error ``exc`` is or carries; None when it is none."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:  # the exception, then what it was raised from (never an implicit
        # context: a bug raised while handling a full disk stays a bug with its traceback)
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _DISK_ERRNOS:
            name = e.filename
            if e.errno not in (errno.EACCES, errno.EPERM) and e.filename2:
                name = e.filename2  # shutil.copyfile names (source, destination); a full disk is the destination's
            return e.errno, _text(name)
        if isinstance(e, shutil.Error) and e.args and isinstance(e.args[0], list):
            for entry in e.args[0]:
                m = _ERRNO_IN_TEXT.search(str(entry[-1]) if isinstance(entry, tuple) else str(entry))
                if m and m.group(1) and int(m.group(1)) in _DISK_ERRNOS:
                    dst = m.group(2) or (entry[1] if isinstance(entry, tuple) and len(entry) == 3 else "")
                    return int(m.group(1)), _text(dst)
        elif not isinstance(e, (OSError, ValueError)):  # a ValueError's own message says more than its text's errno
            code = disk_errno(e)
            if code is not None:
                return code, ""
        e = e.__cause__
    return None


def _text(filename: Any) -> str:
    """A path as text: libraries hand some as bytes (TensorBoard), which must not print as ``b'...'``."""
    if filename is None:
        return ""
    if isinstance(filename, bytes):
        return os.fsdecode(filename)
    return str(filename)


def _unreadable(filename: Any) -> bool:
    """Whether a permission error was about reading: the file is there and this process may not read it (a file
    that is absent, or readable, was being created or written)."""
    try:
        return bool(filename) and os.path.exists(filename) and not os.access(filename, os.R_OK)
    except (TypeError, ValueError, OSError):
        return False


def _one_line(msg: str) -> str:
    """Messages with several problems (one per line) are joined with '; ' so the contract stays one line."""
    parts = [p.strip() for p in msg.strip().splitlines() if p.strip()]
    if not parts:
        return "(no message)"
    out = parts[0]
    for p in parts[1:]:
        out += (" " if out.endswith(":") else "; ") + p
    return out
