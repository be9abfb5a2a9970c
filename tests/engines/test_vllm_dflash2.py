"""DFlash2 exports against vLLM's own code: its DFlash2 modules take every tensor, and vLLM routes the export to
its DFlash2 (candidate-head) path. Serving it needs vLLM's V2 runner (Triton, GPU only): on a GPU machine
``benchmarks/gpu.sh`` serves it (greedy identity, acceptance vs replay)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.engines.conftest import train_and_export
from tapdraft.engines.serving import EngineFailed, serve_vllm
from tests.engines.test_vllm_dflash import prompts

pytestmark = [pytest.mark.engine, pytest.mark.slow]

MODULES = Path(__file__).resolve().parent / "in_venv" / "vllm_dflash2_modules.py"


@pytest.fixture(scope="module")
def dflash2_export(bpe_target, tmp_path_factory):
    _, export = train_and_export(bpe_target.dataset, tmp_path_factory.mktemp("dflash2"), "dflash2_demo",
                                 "drafter.num_layers=1", "max_steps=10")
    return export


def test_vllms_dflash2_modules_take_every_export_tensor(vllm_venv, dflash2_export, tmp_path):
    out = tmp_path / "modules.json"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    res = subprocess.run([str(vllm_venv / "bin" / "python"), str(MODULES), str(dflash2_export), str(out)],
                         capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["unset"] == [] and doc["mismatched"] == [] and doc["export_keys_not_in_vllm"] == []
    assert any(k.endswith("attention_conv.base_kernel") for k in doc["loaded"])
    assert "candidate_selector.successor_codebook" in doc["loaded"]


def test_vllm_routes_the_export_to_its_dflash2_path(vllm_venv, bpe_target, dflash2_export, tmp_path):
    """``architectures: [DFlash2DraftModel]`` is what vLLM keys DFlash2 on; under another name it would serve the
    export as DFlash with the selector ignored. On a CPU vLLM then refuses the V1 runner for it, by that name."""
    cfg = json.loads((dflash2_export / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    k = cfg["tapdraft"]["serve_with"]["vllm"]["num_speculative_tokens"]
    assert k == cfg["block_size"] - 1
    (_, ids), = prompts(bpe_target)[:1]
    job = {"target": str(bpe_target.target), "requests": [{"prompt_token_ids": ids}], "max_tokens": 4,
           "max_model_len": 256, "speculative": {"method": "dflash", "model": str(dflash2_export),
                                                  "num_speculative_tokens": k}}
    with pytest.raises(EngineFailed) as failed:
        serve_vllm(vllm_venv, job, tmp_path)
    assert "DFlash candidate-head drafts" in failed.value.log
