"""Recipes, --set overrides and their errors."""

import json
import re
from pathlib import Path

import pytest

from tapdraft.train.config import RECIPES_DIR, RunConfig, load_run_config, migrate_run_config


def test_recipes_load_with_their_defaults():
    r = load_run_config("dflash")
    assert r.family == "dflash" and r.drafter.block_size == 16 and r.drafter.gamma == 7.0
    r8 = load_run_config("dflash_b8")
    assert r8.drafter.block_size == 8 and r8.drafter.gamma == 4.0


def test_overrides_and_round_trip(tmp_path):
    r = load_run_config("dflash", overrides=["max_steps=100", "drafter.gamma=3", "lr=1e-3",
                                             "target_layer_ids=[1, 2]", "max_seq_len=null"])
    assert r.train.max_steps == 100 and r.drafter.gamma == 3.0 and r.train.lr == 1e-3
    assert r.drafter.target_layer_ids == (1, 2) and r.train.max_seq_len is None
    r.save(tmp_path / "c.json")
    assert RunConfig.load(tmp_path / "c.json") == r
    f = tmp_path / "extra.yaml"
    f.write_text("drafter:\n  num_layers: 3\ntrain:\n  seed: 7\n")
    r2 = load_run_config("dflash", config_file=str(f), overrides=["seed=9"])
    assert r2.drafter.num_layers == 3 and r2.train.seed == 9 and r2.drafter.block_size == 16


@pytest.mark.parametrize("bad,msg", [
    ("nope=1", "unknown field 'nope'"),
    ("max_steps=abc", "train.max_steps: expected int"),
    ("max_steps=1.5", "expected int"),
    ("drafter.max_steps=3", r"unknown field 'drafter.max_steps'; did you mean train.max_steps\?"),
    ("max_step=50", r"unknown field 'max_step'; did you mean max_steps\? \(`tapdraft train --show-recipe"),
    ("gamma", "key=value"),
    ("attention=sparse", "attention must be one of"),
    ("max_steps=0", "max_steps must be >= 1"),
    ("lr=inf", "train.lr: inf is not a finite number"),
    ("lr=-inf", "train.lr: -inf is not a finite number"),
    ("lr=nan", "train.lr: nan is not a finite number"),
    ("drafter.gamma=inf", "drafter.gamma: inf is not a finite number"),
    ("lr=1e30", r"0 < lr <= 1.0"),
    ("beta2=1", "beta2 < 1"),
    ("grad_clip=1e400", "train.grad_clip: inf is not a finite number"),
    ("seed=-1", r"train.seed must be in \[0, 2\*\*32\)"),  # issue 57: it failed only once training started
    ("seed=!!python/object/apply:os.system [echo hi]", r"^--set 'seed=!!python.*is not plain YAML"),  # a traceback
    ("drafter.target_layer_ids=[]", "target_layer_ids must name at least one target layer"),  # max() of nothing
])
def test_bad_overrides_are_clear_errors(bad, msg):
    with pytest.raises(ValueError, match=msg):
        load_run_config("dflash", overrides=[bad])


@pytest.mark.parametrize("recipe,bad", [
    ("eagle3", "drafter.num_steps=1000000"),  # issue 57: 2.5-3.6 GB unrolled, then the generic out-of-memory line
    ("mtp", "drafter.num_depths=1000000"),
    ("dflash", "drafter.block_size=1000000"),
    ("dflash2", "drafter.num_layers=1000000"),
    ("lilicorr", "drafter.lattice_layers=1000000"),
])
def test_an_unrolled_count_past_its_bound_is_refused_when_the_config_is_read(recipe, bad):
    """Every step, depth, slot or layer is a module or an activation of its own: past MAX_DRAFT_TOKENS /
    MAX_DRAFT_LAYERS (train.drafters.common.settings) the refusal names the --set key and the bound, before any
    target or dataset is read."""
    from tapdraft.train.drafters.common.settings import MAX_DRAFT_LAYERS, MAX_DRAFT_TOKENS

    key = bad.split("=")[0]
    bound = MAX_DRAFT_LAYERS if "layers" in key else MAX_DRAFT_TOKENS
    with pytest.raises(ValueError, match=rf"^{re.escape(key)} must be an integer in \[\d, {bound}\] .*got 1000000$"):
        load_run_config(recipe, overrides=[bad])
    load_run_config(recipe, overrides=[f"{key}={bound}"])  # the bound itself is allowed


@pytest.mark.parametrize("recipe,key,bound", [
    ("dspark", "drafter.markov_rank", "MAX_DRAFT_RANK"),  # issue 57: two [V, r] tables, 10^11 weights at 10^6
    ("dflash2", "drafter.selector_rank", "MAX_DRAFT_RANK"),
    ("lilicorr", "drafter.factor_dim", "MAX_DRAFT_RANK"),
    ("lilicorr", "drafter.lattice_heads", "MAX_DRAFT_HEADS"),
    ("dflash", "drafter.num_anchors", "MAX_ANCHORS"),
])
def test_a_draft_width_past_its_bound_is_refused_when_the_config_is_read(recipe, key, bound):
    """The widths a family adds beside the target's have their bounds in train.drafters.common.settings: past one,
    or zero, the refusal is one line naming the --set key and the bound, before any target or dataset is read."""
    from tapdraft.train.drafters.common import settings

    hi = getattr(settings, bound)
    for bad in (hi + 1, 10**6, 0):
        with pytest.raises(ValueError, match=rf"^{re.escape(key)} must be an integer in \[1, {hi}\] .*got {bad}$"):
            load_run_config(recipe, overrides=[f"{key}={bad}"])
    load_run_config(recipe, overrides=[f"{key}={hi}"])  # the bound itself is allowed


@pytest.mark.parametrize("recipe", ["dflash", "dflash2", "dspark", "lilicorr", "eagle3"])
def test_an_empty_target_layer_ids_is_one_rule_for_every_family_fusing_taps(recipe):
    """One home (train.drafters.common.settings.check_target_layer_ids): eagle3 said something else than the DFlash
    families, each from its own copy of the check."""
    with pytest.raises(ValueError, match=r"^drafter.target_layer_ids must name at least one target layer, or be left "
                                         r"unset .*got \[\]$"):
        load_run_config(recipe, overrides=["drafter.target_layer_ids=[]"])


def test_unknown_recipe():
    with pytest.raises(ValueError, match="unknown recipe"):
        load_run_config("no-such-recipe")


RESOLVED = Path(__file__).with_name("recipes_resolved.json")


def test_recipes_resolve_to_the_configs_they_always_gave():
    """Every recipe, with its base chain, resolves to exactly the config it resolved to before bases existed
    (that file keeps the names from before the renames: through ``migrate_run_config``, and only through it)."""
    want = json.loads(RESOLVED.read_text())
    have = {p.stem: load_run_config(p.stem).to_dict() for p in sorted(RECIPES_DIR.glob("*.yaml"))
            if not p.stem.startswith("_")}
    assert sorted(have) == sorted(want)
    assert any("ce_chunk_size" in want[name]["drafter"] for name in want)  # the old names are really there
    for name in want:
        assert json.loads(json.dumps(have[name])) == migrate_run_config(want[name]), name


def test_configs_written_before_the_renames_migrate(tmp_path):
    """Old recipes, ``--set`` keys, saved run configs and checkpoints' configs: one migration, today's names."""
    old = {"family": "dflash", "drafter": {"ce_chunk_size": 64, "block_size": 8},
           "train": {"precision": "bf16", "head_dtype": "fp32", "device": "cuda"}}
    new = migrate_run_config(old)
    assert new == {"family": "dflash", "drafter": {"chunk_rows": 64, "block_size": 8},
                   "train": {"precision": "bfloat16", "head_dtype": "float32", "device": "cuda:0"}}
    assert migrate_run_config(new) == new and old["drafter"] == {"ce_chunk_size": 64, "block_size": 8}
    run = RunConfig.from_dict(old)  # a saved config.json / a checkpoint's config
    assert (run.drafter.chunk_rows, run.train.precision, run.train.device) == (64, "bfloat16", "cuda:0")
    (tmp_path / "old.yaml").write_text("base: dflash_b8\ndrafter:\n  ce_chunk_size: 32\ntrain:\n  precision: fp32\n")
    r = load_run_config(str(tmp_path / "old.yaml"), overrides=["head_dtype=bf16", "drafter.ce_chunk_size=16"])
    assert (r.drafter.chunk_rows, r.train.precision, r.train.head_dtype) == (16, "float32", "bfloat16")
    with pytest.raises(ValueError, match="sets both ce_chunk_size and chunk_rows"):
        migrate_run_config({"drafter": {"ce_chunk_size": 1, "chunk_rows": 2}})
    with pytest.raises(ValueError, match="cuda:N"):
        load_run_config("dflash_b8", overrides=["device=gpu"])


def test_base_chain_merges_sections_and_refuses_cycles(tmp_path):
    (tmp_path / "a.yaml").write_text("base: dflash_b8\ndrafter:\n  gamma: 2.0\ntrain:\n  seed: 3\n")
    r = load_run_config(str(tmp_path / "a.yaml"))
    got = (r.family, r.drafter.block_size, r.drafter.gamma, r.train.seed, r.train.max_steps)
    assert got == ("dflash", 8, 2.0, 3, 2000)
    (tmp_path / "b.yaml").write_text(f"base: {tmp_path / 'c.yaml'}\n")
    (tmp_path / "c.yaml").write_text(f"base: {tmp_path / 'b.yaml'}\n")
    with pytest.raises(ValueError, match="its own base"):
        load_run_config(str(tmp_path / "b.yaml"))
    (tmp_path / "d.yaml").write_text("base: [dflash, mtp]\n")
    with pytest.raises(ValueError, match="one recipe name"):
        load_run_config(str(tmp_path / "d.yaml"))


def test_shared_blocks_are_not_listed_as_recipes():
    with pytest.raises(ValueError, match="unknown recipe") as e:
        load_run_config("nope")
    assert "_train" not in str(e.value) and "dflash_b8" in str(e.value)


def test_every_family_config_has_what_the_drafter_protocol_reads():
    from tapdraft.train.drafters import FAMILIES
    from tapdraft.train.drafters.base import CONFIG_MEMBERS, get_family

    assert {"num_heads", "draft_vocab", "chunk_rows"} <= set(CONFIG_MEMBERS)
    for family in FAMILIES:
        get_family(family)  # raises for a config without a member


def test_a_family_config_without_a_protocol_field_is_refused():
    import dataclasses

    from tapdraft.train.drafters.base import check_config_class
    from tapdraft.train.drafters.eagle3.config import Eagle3Config

    check_config_class("eagle3", Eagle3Config)
    fields = [(f.name, f.type, f) for f in dataclasses.fields(Eagle3Config) if f.name != "chunk_rows"]
    planted = dataclasses.make_dataclass("Planted", fields, frozen=True)
    with pytest.raises(ValueError, match="lacks the fields chunk_rows"):
        check_config_class("planted", planted)
    with pytest.raises(ValueError, match="lacks the fields"):
        check_config_class("planted", dict)
