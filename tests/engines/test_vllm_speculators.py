"""``export --layout speculators``: speculators' own classes load it as written, and vLLM serves it through its
speculators path with the same greedy output and the same per-round acceptance as the native export.

speculators' DFlash keeps the target's last layer out of the context (it is the teacher's), so these drafts tap
an inner layer: the target here has 4 layers and the one-layer draft taps layer 2 (vLLM id 3)."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from tests.engines.conftest import engine_bpe_size, train_and_export
from tapdraft.engines.serving import serve_vllm
from tests.engines.test_vllm_dflash import K, MAX_TOKENS, prompts

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def load_with_speculators(venv: Path, export: Path, work: Path) -> dict:
    """What speculators' own classes made of an export (tests/engines/in_venv/speculators_load.py, run in the engine venv)."""
    out = work / "load.json"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    res = subprocess.run([str(venv / "bin" / "python"), str(ROOT / "tests" / "engines" / "in_venv" / "speculators_load.py"), str(export),
                          str(out)], capture_output=True, text=True, env={**env, "HF_HUB_OFFLINE": "1"}, timeout=600,
                         cwd=work)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def deep_bpe(tmp_path_factory):
    from tapdraft.demo.bpe import prepare_bpe

    size = replace(engine_bpe_size(), layers=4)
    return prepare_bpe(tmp_path_factory.mktemp("bpe4"), quick=True, progress=False, size=size)


@pytest.fixture(scope="module")
def exports(deep_bpe, tmp_path_factory):
    from typer.testing import CliRunner

    from tapdraft.cli import app

    root = tmp_path_factory.mktemp("dflash4")
    run, native = train_and_export(deep_bpe.dataset, root, "dflash_demo", "drafter.num_layers=1", "max_steps=200")
    spec = root / "speculators"
    res = CliRunner().invoke(app, ["export", "--draft", str(run), "--out", str(spec), "--layout", "speculators",
                                   "--verifier", "bpe-target"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return run, native, spec


def test_speculators_classes_load_the_export_as_written(vllm_venv, exports, tmp_path):
    _, native, spec = exports
    doc = load_with_speculators(vllm_venv, spec, tmp_path)
    native_cfg = json.loads((native / "config.json").read_text())
    assert doc["class"] == "DFlashDraftModel" and doc["missing"] == [] and doc["unexpected"] == []
    assert doc["max_abs_diff"] == 0.0
    assert doc["sliding_window_non_causal"] is True  # vLLM: causal = not this flag, for every layer
    assert doc["aux_hidden_state_layer_ids"] == native_cfg["target_layer_ids_vllm"] == [3]
    assert doc["block_size"] == native_cfg["block_size"] and doc["mask_token_id"] == native_cfg["mask_token_id"]


def test_vllm_serves_the_speculators_export_like_the_native_one(vllm_venv, deep_bpe, exports, tmp_path):
    from tapdraft.speculate.run import SpeculateConfig, run_speculate

    run, native, spec = exports
    convs = prompts(deep_bpe)
    job = {"target": str(deep_bpe.target), "requests": [{"prompt_token_ids": ids} for _, ids in convs],
           "max_tokens": MAX_TOKENS, "max_model_len": 256}
    alone = serve_vllm(vllm_venv, job, tmp_path)
    # named as the native one is: without a method vLLM serves the directory as a plain draft model
    via_spec = serve_vllm(vllm_venv, {**job, "speculative": {"method": "dflash", "model": str(spec),
                                                              "num_speculative_tokens": K}}, tmp_path)
    via_native = serve_vllm(vllm_venv, {**job, "speculative": {"method": "dflash", "model": str(native),
                                                                "num_speculative_tokens": K}}, tmp_path)
    greedy = [o["token_ids"] for o in alone["outputs"]]
    assert [o["token_ids"] for o in via_spec["outputs"]] == greedy
    rounds = [o["spec"]["per_step_accepted"] for o in via_spec["outputs"]]
    assert rounds == [o["spec"]["per_step_accepted"] for o in via_native["outputs"]]
    ours = run_speculate(SpeculateConfig(target=str(deep_bpe.target), draft=str(run), data=str(deep_bpe.dataset),
                                         conversations=str(deep_bpe.val_manifest), max_samples=len(convs),
                                         max_new_tokens=MAX_TOKENS), progress=False)
    assert rounds == [c["agreed"] for c in ours["conversations"]]
    assert sum(map(sum, rounds)) > 0


def test_speculators_classes_load_a_dflash2_export(vllm_venv, deep_bpe, tmp_path_factory, tmp_path):
    """DFlash2 in speculators' format: its ``DFlash2DraftModel`` takes every tensor, conv and selector included.
    (Serving DFlash2 needs vLLM's V2 runner, GPU only: benchmarks/gpu.sh.)"""
    from typer.testing import CliRunner

    from tapdraft.cli import app

    run, _ = train_and_export(deep_bpe.dataset, tmp_path_factory.mktemp("dflash2_4"), "dflash2_demo",
                              "drafter.num_layers=1", "max_steps=5")
    spec = tmp_path / "speculators"
    res = CliRunner().invoke(app, ["export", "--draft", str(run), "--out", str(spec), "--layout", "speculators",
                                   "--verifier", "bpe-target"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    doc = load_with_speculators(vllm_venv, spec, tmp_path)
    assert doc["class"] == "DFlash2DraftModel" and doc["missing"] == [] and doc["unexpected"] == []
    assert doc["max_abs_diff"] == 0.0 and doc["sliding_window_non_causal"] is True
