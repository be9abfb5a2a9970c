"""Progress of long work, one way for every command: a rich bar on a terminal, plain lines in logs.

    with Progress("capture train", total=n, done=k) as bar:
        bar.update(done, "12.3 samples/s")     # or bar.advance(n_bytes)

On a terminal (stderr is a TTY) it is a rich bar. Anywhere else (a log file, CI, ``nohup``) a bar
is cut to the log's width and redrawn as garbage (``1200… 0:00:…``), so it prints one plain line
every ``every_s`` seconds and one at the end instead:

    capture train: 1200/5000 (24%) 0:01:13 12.3 samples/s

Lives in shards/ because every package imports shards (it knows no model code). Progress goes to
stderr, so stdout carries only a command's summary.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class Progress:
    """One task's progress; disabled -> silent. ``tty`` (default: whether ``stream`` is a terminal) picks
    the rich bar or plain lines."""

    def __init__(self, label: str, total: float | None, *, done: float = 0, enabled: bool = True,
                 every_s: float = 30.0, stream: TextIO | None = None, tty: bool | None = None,
                 transient: bool = False, fmt_count: Any = None) -> None:
        self.label, self.total, self.done, self.info = label, total, done, ""
        self.enabled, self.every_s = enabled, every_s
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)()) if tty is None else tty
        self.fmt_count = fmt_count or (lambda x: f"{int(x)}")
        self.t0 = time.perf_counter()
        self._last = self.t0
        self._bar = None
        if enabled and self.tty:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                     TextColumn("{task.fields[info]}"), console=Console(file=self.stream),
                                     transient=transient)
            self._bar.start()
            self._task = self._bar.add_task(label, total=total, completed=done, info="")

    def update(self, done: float, info: str | None = None) -> None:
        """Set the amount done (and the trailing info text, when given)."""
        self.done = done
        if info is not None:
            self.info = info
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(self._task, completed=done, info=self.info)
            return
        now = time.perf_counter()
        if now - self._last >= self.every_s:
            self._last = now
            self._line()

    def advance(self, n: float, info: str | None = None) -> None:
        self.update(self.done + n, info)

    def _line(self) -> None:
        total = f"/{self.fmt_count(self.total)}" if self.total else ""
        pct = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        info = f" {self.info}" if self.info else ""
        print(f"{self.label}: {self.fmt_count(self.done)}{total}{pct} {_clock(time.perf_counter() - self.t0)}{info}",
              file=self.stream, flush=True)

    def close(self, final_line: bool = True) -> None:
        """Stop the bar, or print the final plain line (not when the work failed: its error says enough)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        elif final_line:
            self._line()
        self.enabled = False

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self.close(final_line=exc_type is None)
