"""The checkpoint store of a run directory: ``checkpoints/step-NNNNNNN/state.pt``.

A checkpoint directory is written under a temp name and swapped in (``shards.atomic.staged``), so a
crash leaves the old checkpoint or the new one, never neither; ``latest_checkpoint`` reads only
finished ``step-N`` directories and repairs a swap a crash interrupted.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import torch

from shards.atomic import recover_dir, staged

CKPT_DIR = "checkpoints"
STATE_FILE = "state.pt"
CKPT_NAME = re.compile(r"step-\d+")
CKPT_VERSION = 1


def _checkpoints(root: Path) -> list[Path]:
    """Finished checkpoint directories (``step-NNNNNNN``, never a ``.tmp``/``.old`` leftover), oldest first."""
    return sorted(p for p in root.glob("step-*") if CKPT_NAME.fullmatch(p.name) and (p / STATE_FILE).is_file())


def latest_checkpoint(out: str | Path) -> Path | None:
    root = Path(out) / CKPT_DIR
    if not root.is_dir():
        return None
    for old in root.glob("step-*.old"):
        recover_dir(old.with_suffix(""))  # a directory swap a crash interrupted
    cands = _checkpoints(root)
    return cands[-1] if cands else None


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    state = torch.load(Path(path) / STATE_FILE, map_location=map_location, weights_only=False)
    if state.get("version") != CKPT_VERSION:
        raise ValueError(f"checkpoint {path} has version {state.get('version')}, this trainer reads {CKPT_VERSION}")
    return state


def save_checkpoint(out: Path, step: int, payload: dict[str, Any], keep: int) -> Path:
    """Write ``checkpoints/step-N/state.pt`` atomically (``shards.atomic.staged``), keep the newest ``keep``."""
    root = out / CKPT_DIR
    final = root / f"step-{step:07d}"
    with staged(final) as tmp:
        tmp.mkdir()
        torch.save(payload, tmp / STATE_FILE)
    olds = [p for p in _checkpoints(root) if p != final]
    for p in olds[: max(len(olds) - (keep - 1), 0)]:
        shutil.rmtree(p, ignore_errors=True)
    return final
