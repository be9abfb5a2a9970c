"""DFlash2, MTP and EAGLE-3 through the shared loop, offline eval and export: loss falls, eval and export work."""

import json

import pytest
import torch

from tests.train.dflash_fixtures import tiny_dataset
from tapdraft.train.config import load_run_config
from tapdraft.train.drafters.common.export_files import load_export
from tapdraft.train.evaluate import evaluate
from tapdraft.train.export import export_run
from tapdraft.train.loop import train


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tiny_dataset(tmp_path_factory.mktemp("loop"), n=24, seed=2, min_len=24, max_len=48, tap_ids=(1, 3), top_k=8)


SMALL = ["max_steps=40", "warmup_steps=4", "lr=3e-3", "max_tokens=256", "max_batch_size=4", "log_every=10",
         "ckpt_every=40", "progress=false"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe,extra",
    [
        ("dflash2", ["block_size=4", "gamma=4.0", "num_anchors=8", "conv_group_size=8", "selector_rank=16"]),
        ("mtp", ["num_depths=2"]),
        ("mtp_lk", []),
        ("mtp_lk_adaptive", ["teacher=topk"]),
        ("eagle3_demo", ["num_steps=3", "lr=3e-3"]),
    ],
)
def test_train_eval_export(data, tmp_path, recipe, extra):
    torch.set_num_threads(1)
    run = load_run_config(recipe, overrides=SMALL + extra)
    summary = train(run, data.path, tmp_path / "run")
    assert summary["final_loss"] < summary["first_loss"], summary
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert summary["final_tau_train"] is not None
    if recipe == "dflash2":
        assert "selector" in lines[-1] and "selector_candidate_recall" in lines[-1]
    else:
        assert lines[-1]["acc@1"] is not None and lines[-1]["tau"] >= 1.0
    res = evaluate(tmp_path / "run", data.path, out_dir=tmp_path / "eval", plot=False)
    assert res["family"] == run.family and res["tau"] >= 1.0 and res["blocks"] > 0
    K = len(res["alpha"])
    assert len(res["alpha_sampled"]) == K and 1.0 < res["tau_sampled"] <= 1.0 + K and res["temperature"] == 1.0
    if recipe == "mtp":  # the sampled pass is bounded: one row asked, one batch read; 0: every row
        few = evaluate(tmp_path / "run", data.path, out_dir=tmp_path / "eval1", plot=False, sampled_rows=1)
        every = evaluate(tmp_path / "run", data.path, out_dir=tmp_path / "eval0", plot=False, sampled_rows=0)
        assert 1 <= few["sampled_rows"] < every["sampled_rows"] and few["sampled_samples"] < res["samples"]
        assert every["sampled_samples"] == res["samples"] and few["tau"] == res["tau"]
    export_run(tmp_path / "run", tmp_path / "export")
    cfg, weights = load_export(tmp_path / "export")
    if recipe == "dflash2":
        assert cfg["architectures"] == ["DFlash2DraftModel"] and "candidate_selector.successor_codebook" in weights
    elif recipe == "eagle3_demo":
        assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in cfg["target_layer_ids"]]
        assert {"fc.weight", "midlayer.hidden_norm.weight", "lm_head.weight"} <= set(weights)
    else:
        assert cfg["mtp_concat_order"] == "embedding_first"
        assert f"model.layers.{data.layout.num_layers}.eh_proj.weight" in weights
