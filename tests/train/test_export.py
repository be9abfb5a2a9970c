"""An export is one unit: written whole in a fresh folder, committed in one rename under a lock, never into the run
or over a directory that is not an export; what an earlier export did not write is carried over."""

import json
import shutil
from contextlib import contextmanager

import pytest

from tapdraft.cli import main
from dflash_fixtures import tiny_dataset
from tapdraft.common.lock import exclusive_lock
from tapdraft.train.config import load_run_config
from tapdraft.train.drafters.common import export_files
from tapdraft.train.loop import train

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


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_sigterm_during_an_export_exits_130_and_leaves_the_old_one(sig, runs, tmp_path, capsys, monkeypatch,
                                                                  terminal_signals):
    import signal

    from tapdraft.train import export

    out = tmp_path / "exp"
    assert _export(capsys, "--draft", runs / "dflash_b8", "--out", out)[0] == 0
    before = _tree(out)
    real = export.staged

    @contextmanager
    def hit(dest):
        with real(dest) as tmp:
            yield tmp  # the new export is written whole in its temp folder, then the signal lands
            signal.raise_signal(getattr(signal, sig))

    monkeypatch.setattr(export, "staged", hit)
    code, err = _export(capsys, "--draft", runs / "dflash", "--out", out)
    assert code == 130 and err.startswith(f"interrupted: export stopped by {sig}: ") and "is as it was" in err, err
    assert "\n" not in err and _tree(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["exp"]


def test_a_checkpoint_pruned_while_it_is_opened_is_followed_by_the_newer_one(runs, tmp_path, monkeypatch, capsys):
    """eval and export read the latest checkpoint while a training may prune it: a raw ``[Errno 2] ... state.pt``
    before; now the newer checkpoint that replaced it is read."""
    from tapdraft.train import checkpoints
    from tapdraft.train.run import load_run

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


def test_an_over_long_out_is_one_line_for_export_and_train(runs, tmp_path, capsys):
    """ENAMETOOLONG was a traceback in train and export: one line (exit 2) that says to choose a shorter path."""
    code, err = _export(capsys, "--draft", runs / "dflash_b8", "--out", tmp_path / ("z" * 300))
    assert code == 2 and err.startswith("error: file name too long") and "\n" not in err, err
    with pytest.raises(SystemExit) as e:  # runs/ is the runs' dataset too
        main(["train", "--data", str(runs), "--recipe", "dflash_b8", "--out", str(tmp_path / ("t" * 300)),
              *[a for kv in FAST for a in ("--set", kv)]])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.startswith("error: file name too long") and "\n" not in err, err


KILLED_EXPORT = """
import os, signal, sys
from tapdraft.common import atomic
from tapdraft.train.drafters.common import export_files
point, run, out = sys.argv[1:]
die = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
if point == "between_files":  # the new weights written, their config not yet
    real_staged = export_files.staged
    export_files.staged = lambda dest: die() if dest.name == export_files.CONFIG else real_staged(dest)
elif point == "before_swap":  # the new export whole in its temp folder
    atomic._exchange = die
else:  # swapped in; the old one not yet removed from the temp name
    real_exchange = atomic._exchange
    atomic._exchange = lambda a, b: (real_exchange(a, b), die())
from tapdraft.cli import main
main(["export", "--draft", run, "--out", out])
"""


@pytest.mark.parametrize("point", ["between_files", "before_swap", "after_swap"])
def test_a_kill_9_anywhere_in_an_export_leaves_the_old_or_the_new_one_whole(point, runs, tmp_path, capsys):
    """A real SIGKILL of the export process (no handler runs): the old export or the new one, whole, then a rerun
    exits 0 and leaves no temp, old or lock file."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    ref, out = tmp_path / "ref" / "exp", tmp_path / "a" / "exp"
    assert _export(capsys, "--draft", runs / "dflash", "--out", ref)[0] == 0
    assert _export(capsys, "--draft", runs / "dflash_b8", "--out", out)[0] == 0
    old, new = _tree(out), _tree(ref)
    proc = subprocess.run([sys.executable, "-c", KILLED_EXPORT, point, str(runs / "dflash"), str(out)],
                          cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert _tree(out) == (new if point == "after_swap" else old)
    assert _export(capsys, "--draft", runs / "dflash", "--out", out)[0] == 0
    assert _tree(out) == new and sorted(p.name for p in out.parent.iterdir()) == ["exp"]


def _cli(capsys, *args):
    with pytest.raises(SystemExit) as e:
        main([*map(str, args)])
    return e.value.code, capsys.readouterr().err.strip()


def _older_tapdraft(monkeypatch):
    """No schema checks anywhere, as before they existed: a bundle or a run of then."""
    import tapdraft.shards.bundle as bundle_mod
    import tapdraft.train.drafters.base as drafters_base

    monkeypatch.setattr(bundle_mod, "check_target_config", lambda *a, **k: None)
    monkeypatch.setattr(drafters_base, "check_fields", lambda *a, **k: None)


ONE_STEP = ["max_tokens=160", "max_batch_size=4", "warmup_steps=1", "progress=false", "max_steps=1"]
RECIPES = {"dflash_b8": ONE_STEP + ["num_anchors=8", "max_total_anchors=24", "target_layer_ids=[1]"], "mtp": ONE_STEP}


@pytest.mark.parametrize("key,value,recipe,exported", [
    ("layer_types", ["<script>"] * 4, "dflash_b8", "tapdraft.target_layer_types"),
    ("num_attention_heads", 0, "mtp", "num_attention_heads"),
])
def test_a_bundle_value_outside_the_schema_is_refused_before_training_and_never_exported(key, value, recipe, exported,
                                                                                         tmp_path, capsys, monkeypatch):
    """A dataset an older tapdraft wrote (its fingerprint consistent with the value, so no checksum can tell) holds
    layer kinds `<script>`, or zero attention heads (which trained an MTP draft of zero heads, exported as servable):
    `train` refuses it in one line naming bundle.json, the field, the value and the bound, before any step; a run an
    older tapdraft trained from it carries the value in its checkpoint, and `export` refuses it, writing nothing."""
    _older_tapdraft(monkeypatch)
    mem = tiny_dataset(tmp_path / "ds", n=8, min_len=16, max_len=24, bundle_config={key: value})
    monkeypatch.undo()
    run, out = tmp_path / "run", tmp_path / "exp"
    sets = [a for s in RECIPES[recipe] for a in ("--set", s)]
    code, err = _cli(capsys, "train", "--data", mem.path, "--recipe", recipe, "--out", run, *sets)
    bundle_json = tmp_path / "ds" / "target" / "bundle.json"
    assert code == 2 and err.startswith(f"error: {bundle_json}: {key} = {json.dumps(value)[:20]}"), err
    assert "is not " in err and "\n" not in err and not (run / "checkpoints").exists()
    _older_tapdraft(monkeypatch)
    train(load_run_config(recipe, overrides=RECIPES[recipe]), mem.path, run)
    monkeypatch.undo()
    capsys.readouterr()  # the training's own lines
    code, err = _cli(capsys, "export", "--draft", run, "--out", out)
    assert code == 2 and f"(its export config): {exported} = {json.dumps(value)[:20]}" in err, err
    assert "nothing was exported" in err and "\n" not in err and not out.exists()


@pytest.mark.parametrize("recipe", ["mtp", "dflash_b8"])
def test_a_string_hidden_size_is_one_line_not_a_traceback(recipe, tmp_path, capsys, monkeypatch):
    """`"hidden_size": "32"` in a bundle an older tapdraft wrote ended MTP's training in a TypeError traceback."""
    _older_tapdraft(monkeypatch)
    mem = tiny_dataset(tmp_path / "ds", n=4, min_len=16, max_len=24, bundle_config={"hidden_size": "32"})
    monkeypatch.undo()
    sets = [a for s in RECIPES[recipe] for a in ("--set", s)]
    code, err = _cli(capsys, "train", "--data", mem.path, "--recipe", recipe, "--out", tmp_path / "run", *sets)
    assert code == 2 and err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    assert 'hidden_size = "32" is not an integer in [1, 131072]' in err
