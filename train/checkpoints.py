"""The checkpoint store of a run directory: ``checkpoints/step-NNNNNNN/state.pt``.

A checkpoint directory is written under a temp name and swapped in (``common.atomic.staged``, which fsyncs it
before the swap and its folder after), so a crash or a power cut leaves the old checkpoint or the new one, never
neither; a full disk or a read-only run directory is one ``error:`` line naming the checkpoint. ``latest_checkpoint``
reads only finished ``step-N`` directories and repairs a swap a crash interrupted.

Run directories travel between teams (``eval``, ``speculate``, ``export`` read them), and a pickle can
run any code when it is loaded. So a checkpoint holds only tensors, state dicts and plain types and is
read with ``torch.load(weights_only=True)``: anything else is refused, nothing in it runs. Version 1
checkpoints (written before the rule) already held only those and load through the named migration
:func:`migrate_v1`; one that does not (it needs a full unpickle) is refused with how to convert it
once, for a checkpoint its owner trusts: ``python -m train.checkpoints trust CHECKPOINT_DIR``
(:func:`trust_checkpoint`).

The payload is a :class:`Checkpoint`: the one place that names its keys (the loop writes one, resume, eval,
speculate and export read its fields).
"""

from __future__ import annotations

import dataclasses
import pickle
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tapdraft.common.atomic import recover_dir, staged
from tapdraft.common.errors import DivergedError

CKPT_DIR = "checkpoints"
STATE_FILE = "state.pt"
CKPT_NAME = re.compile(r"step-\d+")
CKPT_VERSION = 3
"""3: records the training data's identity (``dataset``); 2: loadable with ``weights_only=True``; 1: the same payload
as 2, written before that rule was kept. Older versions load through :data:`MIGRATIONS`."""


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint's state, as ``state.pt`` holds it (a dict of these keys, in this order, plain types only)."""

    step: int
    """Optimizer steps done."""
    draft: dict[str, torch.Tensor]
    """The drafter's trainable state dict (no frozen target tensors)."""
    config: dict[str, Any] = field(default_factory=dict)
    """The run config (``RunConfig.to_dict()``) it was trained under; a resume must match it."""
    fingerprint: str | None = None
    """The target's fingerprint (None: not recorded)."""
    template: dict[str, Any] | None = None
    """Chat-template settings ``{text, kwargs}`` of the dataset (None: written before they were recorded)."""
    optimizer: dict[str, Any] | None = None
    """The optimizer's state dict."""
    scheduler: dict[str, Any] | None = None
    """The learning-rate schedule's state dict."""
    data_states: list[dict[str, Any]] = field(default_factory=list)
    """Each rank's batch-stream state (resume continues the same sample order)."""
    export_config: dict[str, Any] | None = None
    """The drafter's ``export_config()``, so export needs no dataset (None: its family cannot be exported)."""
    dataset: dict[str, Any] | None = None
    """The training split's identity (``train.source.DataSource.identity``: the split and a digest of its shards'
    sha256s); a resume must train on the same bytes (None: written before version 3)."""

    ORDER = ("version", "step", "config", "fingerprint", "template", "draft", "optimizer", "scheduler", "data_states",
             "export_config", "dataset")

    def to_payload(self) -> dict[str, Any]:
        """The dict ``state.pt`` holds (keys in :attr:`ORDER`, so the bytes do not depend on field order)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {k: CKPT_VERSION if k == "version" else values[k] for k in self.ORDER}

    @classmethod
    def from_payload(cls, state: dict[str, Any], where: str | Path) -> "Checkpoint":
        """A current-version payload -> Checkpoint (ValueError on a key this trainer does not know)."""
        unknown = sorted(set(state) - set(cls.ORDER))
        if unknown:
            raise ValueError(f"checkpoint {where} has keys this trainer does not know: {unknown}")
        return cls(**{k: v for k, v in state.items() if k != "version"})


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


def load_latest(out: str | Path, map_location: str | torch.device = "cpu") -> tuple[Path, Checkpoint] | None:
    """(path, state) of the latest checkpoint of run ``out`` (None: it has none). A training still running prunes its
    older checkpoints: one deleted between finding it and opening it is followed by the newer one that replaced it,
    never a raw ``[Errno 2] ... state.pt``."""
    while True:
        ck = latest_checkpoint(out)
        if ck is None:
            return None
        try:
            return ck, load_checkpoint(ck, map_location)
        except FileNotFoundError:
            if latest_checkpoint(out) == ck:  # not pruned: gone for another reason
                raise


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> Checkpoint:
    """The checkpoint in directory ``path``, loaded without running any code it holds (ValueError when it holds
    anything but tensors and plain types, or a version this code does not read)."""
    file = Path(path) / STATE_FILE
    try:
        state = torch.load(file, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(
            f"checkpoint {file} holds Python objects other than tensors and plain types ({_first_line(e)}), and "
            "tapdraft never runs code from a checkpoint. If you trust whoever wrote it, convert it once with "
            f"`python -m train.checkpoints trust {Path(path)}`; otherwise ask them for the run again") from None
    if not isinstance(state, dict):
        raise ValueError(f"checkpoint {file} holds a {type(state).__name__}, not a checkpoint's state")
    while state.get("version") in MIGRATIONS:
        state = MIGRATIONS[state["version"]](state)
    if state.get("version") != CKPT_VERSION:
        raise ValueError(f"checkpoint {path} has version {state.get('version')}, this trainer reads {CKPT_VERSION}")
    return Checkpoint.from_payload(state, path)


def migrate_v1(state: dict[str, Any]) -> dict[str, Any]:
    """Version 1 -> 2: the same keys (a v1 state that loaded with ``weights_only=True`` is already plain)."""
    return {**state, "version": 2}


def migrate_v2(state: dict[str, Any]) -> dict[str, Any]:
    """Version 2 -> 3: no dataset identity recorded (a resume then checks the target's fingerprint only)."""
    return {**state, "version": 3, "dataset": None}


MIGRATIONS = {1: migrate_v1, 2: migrate_v2}
"""Version -> the step to the next one (a loaded checkpoint walks them up to :data:`CKPT_VERSION`)."""


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__


def _plain(x: Any, where: str) -> Any:
    """``x`` as tensors, containers and plain scalars only (numpy values become tensors or Python numbers)."""
    import numpy as np

    if isinstance(x, torch.Tensor) or x is None or isinstance(x, (bool, int, float, str, bytes)):
        return x
    if isinstance(x, dict):
        return {k: _plain(v, f"{where}.{k}") for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_plain(v, f"{where}[{i}]") for i, v in enumerate(x))
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x.copy())
    if isinstance(x, np.generic):
        return x.item()
    raise ValueError(f"{where} is a {type(x).__module__}.{type(x).__name__}, which a checkpoint cannot hold")


def trust_checkpoint(path: str | Path) -> Path:
    """Rewrite the checkpoint in directory ``path`` as one ``load_checkpoint`` reads: the one place that fully
    unpickles (runs) a checkpoint, for its owner's own old runs only. Values are made plain (numpy ->
    tensors / numbers); any other object is refused. Written atomically; returns the state file."""
    file = Path(path) / STATE_FILE
    state = torch.load(file, map_location="cpu", weights_only=False)
    if not isinstance(state, dict) or state.get("version") not in (1, CKPT_VERSION):
        raise ValueError(f"{file} is not a tapdraft checkpoint of version 1 or {CKPT_VERSION}")
    plain = _plain({**state, "version": CKPT_VERSION}, "state")
    with staged(file) as tmp:
        _save(plain, tmp)
    load_checkpoint(path)  # proves it now loads safely
    return file


def _save(obj: Any, file: Path) -> None:
    """``torch.save`` through a Python file object: given a path, torch's own writer reports a full disk as
    ``RuntimeError: ... unexpected pos`` with no errno and no path; through ``f.write`` the ``OSError`` itself
    comes out (``staged`` adds the path), so ``train`` says "no space left ... writing ..." in one line."""
    with open(file, "wb") as f:
        torch.save(obj, f)


def nonfinite(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating tensors that hold a NaN or an infinity: weights no checkpoint or export may carry."""
    return [k for k, v in tensors.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]


def check_finite(weights: dict[str, torch.Tensor], where: str, refused: str) -> None:
    """Refuse weights holding a NaN or an infinity (a server loads them and proposes garbage with no warning; an
    evaluation of them reports a tau of 1): ``DivergedError`` saying nothing was ``refused`` (exported, evaluated)."""
    bad = nonfinite(weights)
    if bad:
        raise DivergedError(f"{where} holds {len(bad)} non-finite tensor(s) of {len(weights)} (first: {bad[0]}): the "
                            f"run diverged, so nothing was {refused}; use an earlier checkpoint (export --checkpoint) "
                            "or train again with a lower lr")


def save_checkpoint(out: Path, ckpt: Checkpoint, keep: int) -> Path:
    """Write ``checkpoints/step-N/state.pt`` atomically (``common.atomic.staged``), keep the newest ``keep``.
    Weights that are not finite are refused (``DivergedError``): the older checkpoints stay, none is pruned."""
    root = out / CKPT_DIR
    final = root / f"step-{ckpt.step:07d}"
    bad = nonfinite(ckpt.draft)
    if bad:
        raise DivergedError(f"step {ckpt.step}: {len(bad)} of {len(ckpt.draft)} draft tensors are not finite (first: "
                            f"{bad[0]}), so no checkpoint was saved and those in {root} are kept; train again into a "
                            "new --out with a lower lr")
    with staged(final) as tmp:
        tmp.mkdir()
        _save(ckpt.to_payload(), tmp / STATE_FILE)
    olds = [p for p in _checkpoints(root) if p != final]
    for p in olds[: max(len(olds) - (keep - 1), 0)]:
        shutil.rmtree(p, ignore_errors=True)
    return final


if __name__ == "__main__":  # python -m train.checkpoints trust CHECKPOINT_DIR
    if len(sys.argv) != 3 or sys.argv[1] != "trust":
        sys.exit("usage: python -m train.checkpoints trust CHECKPOINT_DIR  (converts a checkpoint you trust)")
    print(f"rewrote {trust_checkpoint(sys.argv[2])}: it now loads without running code")
