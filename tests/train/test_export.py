"""An export is one unit: written whole in a fresh folder, committed in one rename under a lock, never into the run
or over a directory that is not an export; what an earlier export did not write is carried over."""

import json
import shutil
from contextlib import contextmanager

import pytest

from cli import main
from dflash_fixtures import tiny_dataset
from shards.lock import exclusive_lock
from train.config import load_run_config
from train.drafters.common import export_files
from train.loop import train

FAST = ["max_tokens=160", "max_batch_size=4", "warmup_steps=2", "progress=false", "log_every=1", "lr=3e-3",
        "num_anchors=8", "max_total_anchors=24", "target_layer_ids=[1]", "max_steps=2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two finished runs of one dataset: dflash_b8 and dflash (block sizes 8 and 16)."""
    root = tmp_path_factory.mktemp("runs")
    mem = tiny_dataset(root, n=8, min_len=16, max_len=24)
    for name in ("dflash_b8", "dflash"):
        train(load_run_config(name, overrides=FAST), mem.path, root / name)
    return root


def _tree(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _export(capsys, *args):
    with pytest.raises(SystemExit) as e:
        main(["export", *map(str, args)])
    err = capsys.readouterr().err.strip()
    return e.value.code, err


def test_a_kill_between_the_files_leaves_the_old_export_whole(runs, tmp_path, capsys, monkeypatch):
    out = tmp_path / "exp"
    assert _export(capsys, "--draft", runs / "dflash_b8", "--out", out)[0] == 0
    before = _tree(out)
    real = export_files.staged

    def killed(dest):
        if dest.name == export_files.CONFIG:  # the weights of the other run are written, its config not yet
            raise KeyboardInterrupt
        return real(dest)

    monkeypatch.setattr(export_files, "staged", killed)
    assert _export(capsys, "--draft", runs / "dflash", "--out", out)[0] == 130
    assert _tree(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["exp"]
    monkeypatch.setattr(export_files, "staged", real)
    (out / "README.md").write_text("my model card")  # the user's, beside the export
    assert _export(capsys, "--draft", runs / "dflash", "--out", out)[0] == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["block_size"] == 16 and (out / "README.md").read_text() == "my model card"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp"]  # no temp, old or lock file left


def test_a_second_export_meanwhile_is_refused_and_the_run_and_foreign_folders_are_never_an_out(runs, tmp_path,
                                                                                              capsys):
    out = tmp_path / "exp"
    with exclusive_lock(str(out) + ".lock", "an export", guards=out):
        code, err = _export(capsys, "--draft", runs / "dflash", "--out", out)
    assert code == 2 and err.startswith("error: ") and "in use by an export" in err and "\n" not in err, err
    assert not out.exists()
    run = runs / "dflash"
    before = _tree(run)
    for bad in (run, runs):
        code, err = _export(capsys, "--draft", run, "--out", bad)
        assert code == 2 and "is the run" in err and "\n" not in err, err
    assert _tree(run) == before
    project = tmp_path / "project"
    project.mkdir()
    (project / "notes.txt").write_text("mine")
    code, err = _export(capsys, "--draft", run, "--out", project)
    assert code == 2 and "not a draft export" in err and _tree(project) == {"notes.txt": b"mine"}, err
    shutil.rmtree(project)


def test_sigterm_during_an_export_exits_130_and_leaves_the_old_one(runs, tmp_path, capsys, monkeypatch):
    import signal

    from train import export

    out = tmp_path / "exp"
    assert _export(capsys, "--draft", runs / "dflash_b8", "--out", out)[0] == 0
    before = _tree(out)
    real = export.staged

    @contextmanager
    def hit(dest):
        with real(dest) as tmp:
            yield tmp  # the new export is written whole in its temp folder, then the signal lands
            signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(export, "staged", hit)
    code, err = _export(capsys, "--draft", runs / "dflash", "--out", out)
    assert code == 130 and err.startswith("interrupted: export stopped by SIGTERM: ") and "is as it was" in err, err
    assert "\n" not in err and _tree(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["exp"]


def test_a_checkpoint_pruned_while_it_is_opened_is_followed_by_the_newer_one(runs, tmp_path, monkeypatch, capsys):
    """eval and export read the latest checkpoint while a training may prune it: a raw ``[Errno 2] ... state.pt``
    before; now the newer checkpoint that replaced it is read."""
    from train import checkpoints
    from train.run import load_run

    run = tmp_path / "run"
    shutil.copytree(runs / "dflash_b8", run)
    old = checkpoints.latest_checkpoint(run)
    real = checkpoints.load_checkpoint

    def pruned(path, *a, **kw):  # the training saves step N+1 and prunes step N just as it is opened
        if path == old and (run / "checkpoints" / "step-0000003").exists() is False:
            shutil.copytree(old, run / "checkpoints" / "step-0000003")
            shutil.rmtree(old)
        return real(path, *a, **kw)

    monkeypatch.setattr(checkpoints, "load_checkpoint", pruned)
    _, ck, state = load_run(run)
    assert ck.name == "step-0000003" and state.step == 2
    shutil.rmtree(run / "checkpoints" / "step-0000003")
    shutil.copytree(runs / "dflash_b8" / "checkpoints", run / "checkpoints", dirs_exist_ok=True)
    code, err = _export(capsys, "--draft", run, "--out", tmp_path / "exp")
    assert code == 0 and "step-0000003" in json.loads((tmp_path / "exp" / "config.json").read_text())["tapdraft"][
        "source_checkpoint"], err
    code, err = _export(capsys, "--draft", run, "--out", tmp_path / "exp2", "--checkpoint", run / "nope")
    assert code == 2 and "holds no state.pt" in err and "\n" not in err, err
