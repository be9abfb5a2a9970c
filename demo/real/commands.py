"""The real chains' steps as a user runs them: ``tapdraft`` commands in a subprocess of this interpreter, and the
JSONL inputs they read (written atomically). demo.real.speedup, demo.real.broad and the benchmarks share them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Callable

from tapdraft.common.atomic import staged

Log = Callable[[str], None]


def write_jsonl(path: Path, records: list[dict]) -> None:
    with staged(path) as tmp:
        tmp.write_text("".join(json.dumps(r) + "\n" for r in records))


def run_cli(*args: str, log: Log = print) -> None:
    """``tapdraft ARGS`` (this interpreter's tapdraft: a checkout's, a worktree's or the installed one)."""
    log("+ tapdraft " + " ".join(args[:12]))
    subprocess.run([sys.executable, "-m", "tapdraft.cli", *args], check=True)
