"""A recipe that needs what `tapdraft derive` dropped is refused in one line that says it was dropped."""

import pytest

from tapdraft.cli import main
from dflash_fixtures import synthetic_samples, tiny_bundle, tiny_layout, write_synthetic_dataset
from tapdraft.shards.derive import DeriveConfig, derive_dataset

FAST = ["--set", "max_steps=1", "--set", "max_tokens=160", "--set", "progress=false"]


@pytest.fixture(scope="module")
def derived(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    bundle = tiny_bundle(root / "ds")
    layout = tiny_layout(bundle)  # taps 1 and 3 of 4 layers: 3 is the last, what MTP reads
    samples = synthetic_samples(bundle, layout, 6, min_len=16, max_len=24)
    src = write_synthetic_dataset(root / "ds", bundle, layout, {"train": samples}, regenerated=False)
    out = root / "light"
    derive_dataset(DeriveConfig(src=src, out=str(out), taps=(1,), progress=False))
    return str(out)


def _train(args, capsys):
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    return e.value.code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("recipe, extra, needs", [
    ("mtp", [], "MTP heads"),
    ("dflash_b8", ["--set", "target_layer_ids=[1,3]"], "target_layer_ids [1, 3] include [3]"),
])
def test_a_recipe_needing_a_dropped_tap_is_refused_naming_the_derivation(derived, tmp_path, capsys, recipe, extra,
                                                                         needs):
    code, err = _train(["train", "--data", derived, "--recipe", recipe, "--out", tmp_path / "run", *FAST, *extra],
                       capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert needs in err[0] and "derived from ds" in err[0] and "dropping taps [3]" in err[0], err


def test_a_recipe_that_needs_only_what_was_kept_trains(derived, tmp_path, capsys):
    code, err = _train(["train", "--data", derived, "--recipe", "dflash_b8", "--out", tmp_path / "run", *FAST,
                        "--set", "target_layer_ids=[1]"], capsys)
    assert code in (0, None), err
