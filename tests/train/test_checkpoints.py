"""Checkpoints are loaded without running code: a crafted pickle is refused before it can act, version 1
states load through their named migration, and a trusted old checkpoint is converted once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tapdraft.cli import main
from tapdraft.train.checkpoints import CKPT_VERSION, STATE_FILE, load_checkpoint, migrate_v1, trust_checkpoint
from tapdraft.train.config import load_run_config
from tapdraft.train.run import load_run

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


def _write(out: Path, step: int, state: dict) -> Path:
    """A raw ``state.pt`` payload (old versions, hand-made ones), as an older trainer wrote it."""
    ck = out / "checkpoints" / f"step-{step:07d}"
    ck.mkdir(parents=True)
    torch.save(state, ck / STATE_FILE)
    return ck


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
    got = load_checkpoint(_write(tmp_path, 3, state))
    assert migrate_v1(state)["version"] == 2 and CKPT_VERSION == got.to_payload()["version"] == 3
    assert got.dataset is None  # version 3's key, not recorded before it
    assert got.step == 3 and torch.equal(got.draft["w"], torch.arange(4.0)) and got.data_states == [
        {"epoch": 0, "pos": 7}]
    _write(tmp_path, 4, {**state, "version": 99})
    with pytest.raises(ValueError, match="has version 99, this trainer reads 3"):
        load_checkpoint(tmp_path / "checkpoints" / "step-0000004")


def test_a_trusted_old_checkpoint_is_converted_once(tmp_path):
    ck = _write(tmp_path, 2, {"version": 1, "step": 2, "draft": {"w": torch.ones(3)},
                              "data_states": [{"rng": np.arange(3), "pos": np.int64(5)}]})
    with pytest.raises(ValueError, match="python -m train.checkpoints trust"):
        load_checkpoint(ck)  # numpy values need a full unpickle
    proc = subprocess.run([sys.executable, "-m", "tapdraft.train.checkpoints", "trust", str(ck)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "now loads without running code" in proc.stdout, proc.stderr
    got = load_checkpoint(ck)
    assert torch.equal(got.data_states[0]["rng"], torch.arange(3))
    assert got.data_states[0]["pos"] == 5 and type(got.data_states[0]["pos"]) is int
    torch.save({"version": 1, "x": _WritesAFile(tmp_path / "m")}, ck / STATE_FILE)
    with pytest.raises(ValueError, match=r"state\.x is a _io\.TextIOWrapper, which a checkpoint cannot hold"):
        trust_checkpoint(ck)  # runs it (the owner trusts it), but refuses to keep an object


def test_the_checkpoint_payload_keeps_its_keys_and_order(tmp_path):
    """``Checkpoint`` owns the keys of ``state.pt``: the same keys, in the order the loop always wrote them (so
    the file's bytes are unchanged; version 3 appends ``dataset``), and a round trip through the file gives the same
    checkpoint back."""
    from tapdraft.train.checkpoints import Checkpoint, save_checkpoint

    ck = Checkpoint(step=5, draft={"w": torch.arange(3.0)}, config={"family": "dflash"}, fingerprint="ab" * 8,
                    template={"text": "t", "kwargs": {}}, optimizer={"state": {}}, scheduler={"last_epoch": 5},
                    data_states=[{"epoch": 0}], export_config={"block_size": 4},
                    dataset={"split": "train", "shards": 1, "sha256": "cd" * 32})
    payload = ck.to_payload()
    assert list(payload) == ["version", "step", "config", "fingerprint", "template", "draft", "optimizer",
                             "scheduler", "data_states", "export_config", "dataset"] and payload["version"] == CKPT_VERSION
    got = load_checkpoint(save_checkpoint(tmp_path, ck, keep=1))
    assert got.step == 5 and torch.equal(got.draft["w"], ck.draft["w"]) and got.config == ck.config
    assert (got.template, got.data_states, got.export_config, got.dataset) == (ck.template, ck.data_states,
                                                                               ck.export_config, ck.dataset)
    with pytest.raises(ValueError, match=r"keys this trainer does not know: \['extra'\]"):
        load_checkpoint(_write(tmp_path / "x", 1, {**payload, "extra": 1}))
