"""Checkpoints are loaded without running code: a crafted pickle is refused before it can act, version 1
states load through their named migration, and a trusted old checkpoint is converted once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cli import main
from train.checkpoints import CKPT_VERSION, STATE_FILE, load_checkpoint, migrate_v1, save_checkpoint, trust_checkpoint
from train.config import load_run_config
from train.run import load_run

ROOT = Path(__file__).resolve().parents[2]


class _WritesAFile:
    """Unpickling this opens (creates) ``path``: what a hostile run directory would do on load."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _crafted_run(root: Path, marker: Path) -> Path:
    run = root / "run"
    (run / "checkpoints" / "step-0000001").mkdir(parents=True)
    load_run_config("dflash_b8").save(run / "config.json")
    torch.save({"version": CKPT_VERSION, "step": 1, "draft": {"w": torch.zeros(2)}, "x": _WritesAFile(marker)},
               run / "checkpoints" / "step-0000001" / STATE_FILE)
    return run


def test_a_crafted_run_directory_is_refused_and_its_pickle_never_runs(tmp_path, capsys):
    marker = tmp_path / "pwned.txt"
    run = _crafted_run(tmp_path, marker)
    with pytest.raises(ValueError, match="holds Python objects other than tensors and plain types.*never runs code"):
        load_run(run)
    assert not marker.exists()
    with pytest.raises(SystemExit) as e:  # as `tapdraft export` (and eval, speculate) read it
        main(["export", "--draft", str(run), "--out", str(tmp_path / "exp")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: checkpoint ") and "trust" in err[0]
    assert not marker.exists() and not (tmp_path / "exp").exists()
    torch.load(run / "checkpoints" / "step-0000001" / STATE_FILE, weights_only=False)  # the control: it would
    assert marker.exists()


def test_a_version_1_checkpoint_loads_through_its_migration(tmp_path):
    state = {"version": 1, "step": 3, "draft": {"w": torch.arange(4.0)}, "data_states": [{"epoch": 0, "pos": 7}]}
    save_checkpoint(tmp_path, 3, state, keep=2)
    got = load_checkpoint(tmp_path / "checkpoints" / "step-0000003")
    assert got["version"] == CKPT_VERSION == migrate_v1(state)["version"] == 2
    assert got["step"] == 3 and torch.equal(got["draft"]["w"], torch.arange(4.0)) and got["data_states"] == [
        {"epoch": 0, "pos": 7}]
    save_checkpoint(tmp_path, 4, {**state, "version": 99}, keep=2)
    with pytest.raises(ValueError, match="has version 99, this trainer reads 2"):
        load_checkpoint(tmp_path / "checkpoints" / "step-0000004")


def test_a_trusted_old_checkpoint_is_converted_once(tmp_path):
    ck = tmp_path / "checkpoints" / "step-0000002"
    save_checkpoint(tmp_path, 2, {"version": 1, "step": 2, "draft": {"w": torch.ones(3)},
                                  "data_states": [{"rng": np.arange(3), "pos": np.int64(5)}]}, keep=2)
    with pytest.raises(ValueError, match="python -m train.checkpoints trust"):
        load_checkpoint(ck)  # numpy values need a full unpickle
    proc = subprocess.run([sys.executable, "-m", "train.checkpoints", "trust", str(ck)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "now loads without running code" in proc.stdout, proc.stderr
    got = load_checkpoint(ck)
    assert got["version"] == 2 and torch.equal(got["data_states"][0]["rng"], torch.arange(3))
    assert got["data_states"][0]["pos"] == 5 and type(got["data_states"][0]["pos"]) is int
    torch.save({"version": 1, "x": _WritesAFile(tmp_path / "m")}, ck / STATE_FILE)
    with pytest.raises(ValueError, match=r"state\.x is a _io\.TextIOWrapper, which a checkpoint cannot hold"):
        trust_checkpoint(ck)  # runs it (the owner trusts it), but refuses to keep an object
