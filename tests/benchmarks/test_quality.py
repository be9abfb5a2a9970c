"""benchmarks.quality: the family comparison holds every family to one budget, and its quick run reports, per
family and live temperature, tau, the round cost and tokens per second beside the target's own."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

import benchmarks.common as common
from benchmarks.quality import (FAMILY_RECIPES, SMALL_FAMILY_RECIPES, main, one_budget, over_seeds, recipe_config,
                                run_label)
from tapdraft.train.drafters.base import FAMILIES


def _runs(names: list[str], *overrides: str) -> dict:
    args = argparse.Namespace(overrides=list(overrides))
    return {n: recipe_config(n, 10, args) for n in names}


def test_the_family_recipes_cover_every_family_on_one_budget() -> None:
    runs = _runs(list(FAMILY_RECIPES))
    # every trainable family but the target's own MTP module (it needs a target that ships one)
    assert {r.family for r in runs.values()} == set(FAMILIES) - {"mtp_native"}
    budget = one_budget(runs)
    assert budget["train"]["max_steps"] == 10 and budget["block"] == {"block_size": 8, "num_layers": 2}


def test_the_small_family_recipes_cover_every_family_on_dflash_smalls_budget() -> None:
    runs = _runs(list(SMALL_FAMILY_RECIPES))
    assert {r.family for r in runs.values()} == set(FAMILIES) - {"mtp_native"}
    budget = one_budget(runs)
    assert budget["train"]["max_tokens"] == 2048 and budget["block"] == {"block_size": 4, "num_layers": 1}


def test_one_budget_refuses_another_budget_or_block() -> None:
    with pytest.raises(ValueError, match="mtp_demo trains on another budget .*max_tokens"):
        one_budget({**_runs(["dflash_demo"]), **_runs(["mtp_demo"], "train.max_tokens=512")})
    with pytest.raises(ValueError, match="block_size"):
        one_budget({**_runs(["dflash_demo"]), **_runs(["dspark_demo"], "drafter.block_size=4")})


def test_seeds_share_one_budget_and_are_summarised_per_recipe() -> None:
    args = argparse.Namespace(overrides=[])
    runs = {run_label("dflash_demo", s): recipe_config("dflash_demo", 10, args, s) for s in (0, 1)}
    assert list(runs) == ["dflash_demo@0", "dflash_demo@1"] and runs["dflash_demo@1"].train.seed == 1
    one_budget(runs)  # the seed is the one setting seeds may differ in
    rows = [{"recipe": "a", "alpha": [0.5, 0.2], "tau": 1.6, "tau_replayed": 1.5},
            {"recipe": "a", "alpha": [0.3, 0.1], "tau": 1.4, "tau_replayed": 1.3},
            {"recipe": "b", "alpha": [0.4], "tau": 1.4, "tau_replayed": None}]
    s = over_seeds(rows)
    assert s["a"]["first_slot"] == {"mean": 0.4, "min": 0.3, "max": 0.5, "n": 2}
    assert s["a"]["tau_replayed"]["mean"] == 1.4
    assert set(s["b"]) == {"first_slot", "tau"}  # no second slot, no replay: no figure made up


@pytest.mark.slow
def test_quick_comparison_reports_cost_and_tokens_per_second(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(common, "RESULTS", tmp_path / "results")
    path = main(["--quick", "--workdir", str(tmp_path / "w"), "--recipes", "families", "--steps", "2",
                 "--live", "2", "--max-new-tokens", "6", "--jobs", "2", "--name", "q.json"])
    doc = json.loads(path.read_text())
    rows = {r["recipe"]: r for r in doc["results"]}
    assert list(rows) == list(FAMILY_RECIPES) and doc["config"]["jobs"] == 2  # in order, whichever ends first
    assert doc["budget"]["train"]["max_steps"] == 2 and len(doc["table"]) == 2 + len(FAMILY_RECIPES)
    for r in rows.values():
        assert r["steps"] == 2 and len(r["load_avg"]) == 3
        for t, v in r["live"].items():
            assert v["round_cost"] > 0 and v["tokens_per_s"] > 0 and v["drafts_per_round"] >= 1
            assert v["speedup"] == pytest.approx(v["tau"] / v["round_cost"], rel=1e-3)
            assert v["vs_target"] > 0
        assert r["live"]["T=0"]["matches_greedy"] == "2/2"
    # drafts per round: block - 1 for DFlash's backbone (DSpark drafts the whole block), steps for the chains
    assert rows["dflash_demo"]["live"]["T=0"]["drafts_per_round"] == 7
    assert rows["eagle3_demo"]["live"]["T=0"]["drafts_per_round"] == 4
    assert rows["mtp_demo"]["live"]["T=0"]["drafts_per_round"] == 1
