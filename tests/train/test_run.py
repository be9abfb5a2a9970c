"""A run on disk: checkpoints are written atomically and only finished ones are ever read back."""

import pytest
import torch

from tapdraft.train.checkpoints import Checkpoint, latest_checkpoint, load_checkpoint, save_checkpoint


def _payload(step, w=None):
    return Checkpoint(step=step, draft={"w": torch.full((2,), float(step if w is None else w))})


def test_a_crash_while_saving_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, _payload(1), keep=2)
    real_save = torch.save

    def dies_midway(obj, f):
        real_save(obj, f)
        raise KeyboardInterrupt  # killed after the bytes, before the rename

    monkeypatch.setattr(torch, "save", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, _payload(2), keep=2)
    monkeypatch.setattr(torch, "save", real_save)
    ck = latest_checkpoint(tmp_path)
    assert ck.name == "step-0000001" and load_checkpoint(ck).step == 1


def test_leftovers_are_never_read_and_old_checkpoints_are_pruned(tmp_path):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, _payload(step), keep=2)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step-0000002", "step-0000003"]
    stray = root / "step-0000009.tmp"  # a save killed before its rename, with a whole state.pt inside
    stray.mkdir()
    torch.save(_payload(9).to_payload(), stray / "state.pt")
    assert latest_checkpoint(tmp_path).name == "step-0000003"
    save_checkpoint(tmp_path, _payload(3, w=30), keep=2)  # the same step again replaces it whole
    assert float(load_checkpoint(latest_checkpoint(tmp_path)).draft["w"][0]) == 30.0


def test_resaving_a_step_never_leaves_no_checkpoint(tmp_path, monkeypatch):
    import os

    save_checkpoint(tmp_path, _payload(1), keep=2)

    def no_rename(src, dst):
        raise KeyboardInterrupt  # killed at the rename

    monkeypatch.setattr(os, "replace", no_rename)
    try:
        save_checkpoint(tmp_path, _payload(1, w=10), keep=2)
    except KeyboardInterrupt:
        pass
    monkeypatch.undo()
    ck = latest_checkpoint(tmp_path)
    assert ck is not None and load_checkpoint(ck).step in (1, 10)
