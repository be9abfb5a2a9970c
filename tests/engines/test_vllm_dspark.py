"""DSpark exports against vLLM 0.32's own code on a CPU, and tapdraft's live tau against its replay.

vLLM serves DSpark only through its V2 model runner (Triton, GPU only); ``benchmarks/gpu.sh`` serves it on a GPU
machine. Here, in the engine venv (``tests/engines/in_venv/vllm_dspark_modules.py``): vLLM's ``DSparkMarkovHead`` and
``DSparkConfidenceHead`` take every DSpark tensor of the export with its shape; vLLM's sequential Markov sampling,
run in float64 with those modules on tapdraft's base logits, drafts what ``propose`` (``tapdraft speculate``'s
proposer) drafts, and its confidence is tapdraft's; the ``qwen3_omni`` export passes vLLM's own Qwen3-Omni
standalone validator (``_validate_qwen3_omni_dspark``) for a Qwen3-Omni target with the BPE target's text
config, which refuses the generic export and a mismatched ``num_speculative_tokens``; and vLLM takes the export
as a DSpark draft up to its runner (its V1 runner refuses DSpark by name)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tests.engines.conftest import train_and_export
from tests.engines.test_vllm_dflash import speculate

pytestmark = [pytest.mark.engine, pytest.mark.slow]

MODULES = Path(__file__).resolve().parent / "in_venv" / "vllm_dspark_modules.py"
MAX_TOKENS = 24  # the regenerated replies' cap: decoding stays inside what the dataset covers


@pytest.fixture(scope="module")
def dspark(bpe_target, tmp_path_factory):
    """(run, native export, qwen3_omni export) of a DSpark drafter (block 8: 8 drafts a round) trained briefly."""
    from tapdraft.cli import app

    out = tmp_path_factory.mktemp("dspark")
    run, export = train_and_export(bpe_target.dataset, out, "dspark_demo", "drafter.num_layers=1", "max_steps=200")
    omni = out / "omni"
    res = CliRunner().invoke(app, ["export", "--draft", str(run), "--out", str(omni), "--layout", "qwen3_omni"],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return run, export, omni


def walks(bpe_target, run, n: int = 6) -> tuple[list[dict], list[dict]]:
    """Live blocks at the start of ``n`` validation replies: vLLM's inputs (base logits, anchor, the slots' hidden
    rows) and tapdraft's drafts and confidences there."""
    from tapdraft.shards.reader import open_dataset
    from tapdraft.speculate.run import prompt_length
    from tapdraft.train.run import load_trained

    model = load_trained(run, bpe_target.dataset).model.eval()
    jobs, want = [], []
    for i, s in enumerate(open_dataset(str(bpe_target.dataset)).stream("validation", seed=0, shuffle=False)):
        if i == n:
            break
        P = prompt_length(s["loss_mask"])
        ids, taps = s["input_ids"][: P + 1].long(), s["taps"][:P].float()
        with torch.no_grad():
            tokens, _ = model.propose(ids, taps)
            b, anchors = model._live_block(ids, taps)
            h = model.block_hidden(b["input_ids"], model.context(b["taps"]), anchors)[0, 0]
            conf = model.confidence(h, torch.cat([ids[P:], tokens[:-1]]))
            jobs.append({"base_logits": model.logits(h).double().tolist(), "anchor": int(ids[P]),
                         "hidden": h.double().tolist()})
        want.append({"tokens": tokens.tolist(), "confidence": conf.tolist()})
    return jobs, want


def run_modules(vllm_venv, export: Path, job: dict, tmp_path: Path) -> dict:
    (tmp_path / "job.json").write_text(json.dumps(job))
    out = tmp_path / "out.json"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    res = subprocess.run([str(vllm_venv / "bin" / "python"), str(MODULES), str(export), str(tmp_path / "job.json"),
                          str(out)], capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(out.read_text())


def test_vllms_dspark_modules_take_every_tensor_and_walk_as_tapdraft_drafts(vllm_venv, bpe_target, dspark, tmp_path):
    run, export, _ = dspark
    jobs, want = walks(bpe_target, run)
    doc = run_modules(vllm_venv, export, {"walks": jobs}, tmp_path)
    assert doc["unset"] == [] and doc["mismatched"] == [] and doc["export_keys_not_in_vllm"] == []
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
            "confidence_head.proj.bias"} <= set(doc["loaded"])
    assert [w["tokens"] for w in doc["walks"]] == [w["tokens"] for w in want]
    for got, ours in zip(doc["walks"], want):
        torch.testing.assert_close(torch.tensor(got["confidence"]), torch.tensor(ours["confidence"]),
                                   rtol=1e-5, atol=1e-6)


def test_qwen3_omni_export_passes_vllms_standalone_validator(vllm_venv, bpe_target, dspark, tmp_path):
    _, _, omni = dspark
    cfg = json.loads((omni / "config.json").read_text())
    K = cfg["tapdraft"]["serve_with"]["vllm"]["num_speculative_tokens"]
    assert cfg["architectures"] == ["Qwen3OmniDSparkModel"] and K == cfg["block_size"] == 8
    text = json.loads((Path(bpe_target.target) / "config.json").read_text())
    job = {"target_text_config": text, "validate": [
        {"num_speculative_tokens": K},
        {"num_speculative_tokens": K - 1},
        {"num_speculative_tokens": K, "draft_config_overrides": {"architectures": ["Qwen3DSparkModel"]}},
    ]}
    doc = run_modules(vllm_venv, omni, job, tmp_path)
    ok, short, generic = doc["validate"]
    assert ok == "ok", ok
    assert "num_speculative_tokens to match the trained block_size" in short
    assert "generic Qwen3DSparkModel checkpoints must be converted first" in generic


def test_vllm_takes_the_export_as_dspark_up_to_its_runner(vllm_venv, bpe_target, dspark, tmp_path):
    """vLLM parses the export's config as a DSpark draft (its speculative config, block size and registry entry
    accepted) and then, on a CPU, refuses its V1 runner for DSpark by name: serving needs the V2 runner (GPU)."""
    from tapdraft.engines.serving import EngineFailed, serve_vllm
    from tests.engines.test_vllm_dflash import prompts

    _, export, _ = dspark
    k = json.loads((export / "config.json").read_text())["tapdraft"]["serve_with"]["vllm"]["num_speculative_tokens"]
    (_, ids), = prompts(bpe_target)[:1]
    job = {"target": str(bpe_target.target), "requests": [{"prompt_token_ids": ids}], "max_tokens": 4,
           "max_model_len": 256, "speculative": {"method": "dspark", "model": str(export),
                                                  "num_speculative_tokens": k}}
    with pytest.raises(EngineFailed) as failed:
        serve_vllm(vllm_venv, job, tmp_path)
    assert "Model Runner V1 does not support: dspark speculative decoding" in failed.value.log


def test_live_tau_agrees_with_the_replayed_tau(bpe_target, dspark):
    """``tapdraft speculate`` walks the Markov head live; the replay counts teacher-forced slots, whose predecessor
    is the reply's token, the walk's own while it follows the reply: on the target's own replies the two agree
    within ``speculate.run.AGREE_REL`` (live taps are the target's float32 states, the stored ones bf16, so a
    near-tie can flip a draft: measured 2.235 live, 2.226 replayed over 32 conversations; DFlash on the same target
    shows the same kind of gap, 1.147 live against 1.143 replayed)."""
    from tapdraft.speculate.run import AGREE_REL, agreement

    run, _, _ = dspark
    r = speculate(bpe_target, run, bpe_target.val_manifest, 32, MAX_TOKENS)
    assert r["tau"] > 1.0
    assert abs(r["offline_tau_replayed"] - r["tau"]) <= AGREE_REL * r["tau"], agreement(r)


@pytest.mark.gpu
def test_vllms_v2_runner_serves_dspark_with_tapdrafts_acceptance(bpe_target, dspark, tmp_path):
    """On a GPU (``benchmarks/gpu.sh``): vLLM's CUDA build (``engines/vllm_gpu.txt``) serves the export with
    ``method: dspark`` (its V2 runner's sequential Markov sampling): greedy output identical to the target alone,
    and per conversation and round the accepted drafts equal ``tapdraft speculate``'s."""
    from tapdraft.engines.serving import engine_venv
    from tests.engines.test_vllm_dflash import serve_and_check

    run, export, _ = dspark
    k = json.loads((export / "config.json").read_text())["tapdraft"]["serve_with"]["vllm"]["num_speculative_tokens"]
    rounds, accepted = serve_and_check(engine_venv("vllm_gpu"), bpe_target, (run, export), "dspark", k, tmp_path)
    assert rounds > 0
