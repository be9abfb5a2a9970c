"""docs/layout.md's "where to add" row for a drafter family, followed to the letter: one folder (a package naming its
layouts, a model module defining CONFIG and DRAFTER), one line in FAMILIES, one recipe. Nothing else is touched, and
the family trains, resumes, evaluates, exports and is listed by ``export --layout``'s help."""

import json
import sys
import textwrap

import pytest

from tapdraft.cli import _layout_help, main
from dflash_fixtures import tiny_dataset
from tapdraft.train import drafters

FAST = ["max_tokens=160", "max_batch_size=4", "warmup_steps=2", "progress=false", "log_every=1", "lr=3e-3",
        "num_anchors=8", "max_total_anchors=24", "target_layer_ids=[1]"]


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """The family ``scratch``: DFlash's drafter under another name and config, in a folder outside the tree."""
    pkg = tmp_path / "src" / "scratchfam"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text('LAYOUTS: tuple[str, ...] = ("speculators",)\n')
    (pkg / "model.py").write_text(textwrap.dedent('''
        from dataclasses import dataclass

        from tapdraft.train.drafters.dflash.model import DFlashConfig, DFlashDrafter


        @dataclass(frozen=True)
        class ScratchConfig(DFlashConfig):
            note: str = "scratch"


        class ScratchDrafter(DFlashDrafter):
            family = "scratch"


        CONFIG = ScratchConfig
        DRAFTER = ScratchDrafter
    '''))
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    monkeypatch.setitem(drafters.FAMILIES, "scratch", "scratchfam.model")  # the one line
    recipe = tmp_path / "scratch.yaml"
    recipe.write_text("base: dflash_b8\nfamily: scratch\ndrafter:\n  note: planted\n")
    yield recipe
    sys.modules.pop("scratchfam.model", None)
    sys.modules.pop("scratchfam", None)


def test_a_family_is_one_folder_one_registry_line_and_one_recipe(scratch, tmp_path, capsys):
    mem = tiny_dataset(tmp_path / "ds", n=8, min_len=16, max_len=24)
    out, exp = tmp_path / "run", tmp_path / "exp"
    sets = [a for kv in FAST for a in ("--set", kv)]
    with pytest.raises(SystemExit) as e:
        main(["train", "--data", str(mem.path), "--recipe", str(scratch), "--out", str(out), *sets, "--set",
              "max_steps=2"])
    assert e.value.code == 0, capsys.readouterr().err
    saved = json.loads((out / "config.json").read_text())
    assert saved["family"] == "scratch" and saved["drafter"]["note"] == "planted"
    with pytest.raises(SystemExit) as e:  # resumes to a longer run under the same recipe
        main(["train", "--data", str(mem.path), "--recipe", str(scratch), "--out", str(out), *sets, "--set",
              "max_steps=3"])
    assert e.value.code == 0 and "resuming from step 2 of 3" in capsys.readouterr().err
    for args in (["eval", "--draft", str(out), "--data", str(mem.path)], ["export", "--draft", str(out), "--out",
                                                                           str(exp)]):
        with pytest.raises(SystemExit) as e:
            main(args)
        assert e.value.code == 0, capsys.readouterr().err
    assert json.loads((exp / "config.json").read_text())["tapdraft"]["family"] == "scratch"
    assert "scratch" in _layout_help()  # export --layout's help lists it with DFlash's layouts


def test_without_its_registry_line_the_family_is_unknown(scratch, monkeypatch):
    from tapdraft.train.config import load_run_config

    monkeypatch.delitem(drafters.FAMILIES, "scratch")
    with pytest.raises(ValueError, match=r"unknown drafter family 'scratch'"):
        load_run_config(str(scratch))
