"""LiLiCorr exports against vLLM 0.32's own code on a CPU, served by vLLM on a CPU, and tapdraft's live tau against
its replay.

Stock vLLM serves LiLiCorr only through its V2 model runner (Triton, GPU only; ``benchmarks/gpu.sh`` serves it on a
GPU machine). With the project's plugin (``engines/vllm_plugin/tapdraft_vllm/candidate_heads.py``) its V1 runner
serves it on this CPU, round by round as ``tapdraft speculate``. Below that, in the engine venv
(``tests/engines/in_venv/vllm_lilicorr_modules.py``): vLLM's ``LiLiCorrHead``, built from the export's config as
``LiLiCorr`` builds it, takes every ``lilicorr.`` tensor of the export with its shape; its scores, in float64 on
tapdraft's candidates (ids, embeddings, log-probs, the slots' hidden rows, the anchor's context row), walked as
vLLM's selector kernel walks, draft what ``propose`` (``tapdraft speculate``'s proposer) drafts; and stock vLLM
takes the export as a LiLiCorr draft up to its runner (its V1 runner refuses candidate-head drafts)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from tests.engines.conftest import train_and_export
from tests.engines.test_vllm_dflash import speculate

pytestmark = [pytest.mark.engine, pytest.mark.slow]

MODULES = Path(__file__).resolve().parent / "in_venv" / "vllm_lilicorr_modules.py"
MAX_TOKENS = 24  # the regenerated replies' cap: decoding stays inside what the dataset covers


@pytest.fixture(scope="module")
def lilicorr(bpe_target, tmp_path_factory):
    """(run, export) of a LiLiCorr drafter (block 8: 7 drafts a round) trained briefly."""
    return train_and_export(bpe_target.dataset, tmp_path_factory.mktemp("lilicorr"), "lilicorr_demo",
                            "drafter.num_layers=1", "max_steps=200")


def walks(bpe_target, run, n: int = 6) -> tuple[list[dict], list[list[int]]]:
    """Live blocks at the start of ``n`` validation replies: vLLM's inputs and tapdraft's drafts there."""
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
            ctx = model.context(b["taps"])
            h = model.block_hidden(b["input_ids"], ctx, anchors)[0, 0, 1:]
            cand, logp = model.candidates(h)
        jobs.append({"token_embeddings": model.target.embed_tokens[cand].double().tolist(),
                     "log_probs": logp.double().tolist(), "pass_hidden": h.double().tolist(),
                     "anchor_hidden": ctx[0, P - 1].double().tolist(), "anchor_valid": P >= 1,
                     "candidates": cand.tolist()})
        want.append(tokens.tolist())
    return jobs, want


def run_modules(vllm_venv, export: Path, job: dict, tmp_path: Path) -> dict:
    (tmp_path / "job.json").write_text(json.dumps(job))
    out = tmp_path / "out.json"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    res = subprocess.run([str(vllm_venv / "bin" / "python"), str(MODULES), str(export), str(tmp_path / "job.json"),
                          str(out)], capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(out.read_text())


def test_vllms_lilicorr_head_takes_every_tensor_and_walks_as_tapdraft_drafts(vllm_venv, bpe_target, lilicorr,
                                                                            tmp_path):
    run, export = lilicorr
    jobs, want = walks(bpe_target, run)
    doc = run_modules(vllm_venv, export, {"walks": jobs}, tmp_path)
    assert doc["unset"] == [] and doc["mismatched"] == [] and doc["export_keys_not_in_vllm"] == []
    assert {"lilicorr.slot_embedding", "lilicorr.layers.1.attn.in_proj_weight", "lilicorr.anchor_out_head.bias",
            "lilicorr.factor_input_proj.weight"} <= set(doc["loaded"])
    assert [w["tokens"] for w in doc["walks"]] == want


def test_vllm_takes_the_export_as_lilicorr_up_to_its_runner(vllm_venv, bpe_target, lilicorr, tmp_path):
    """Stock vLLM (no plugin) parses the export as a DFlash draft with LiLiCorr's architecture and then, on a CPU,
    refuses its V1 runner for candidate-head drafts: it serves them in the V2 runner (GPU) only."""
    from tapdraft.engines.serving import EngineFailed, serve_vllm
    from tests.engines.test_vllm_dflash import prompts

    _, export = lilicorr
    cfg = json.loads((export / "config.json").read_text())
    assert cfg["architectures"] == ["LiLiCorrDraftModel"]
    k = cfg["tapdraft"]["serve_with"]["vllm"]["num_speculative_tokens"]
    (_, ids), = prompts(bpe_target)[:1]
    job = {"target": str(bpe_target.target), "requests": [{"prompt_token_ids": ids}], "max_tokens": 4,
           "max_model_len": 256, "speculative": {"method": "dflash", "model": str(export),
                                                  "num_speculative_tokens": k}}
    with pytest.raises(EngineFailed) as failed:
        serve_vllm(vllm_venv, job, tmp_path, plugins=False)
    assert "DFlash candidate-head drafts" in failed.value.log


def test_vllm_serves_lilicorr_with_tapdrafts_acceptance(vllm_venv, bpe_target, lilicorr, tmp_path):
    """With the plugin, vLLM's V1 runner serves the export on this CPU (``method: dflash``, K = block - 1; its LiLiCorr
    head scores the candidates with the target's embeddings and the anchor's context state): over the 32 validation
    conversations the target's greedy output is unchanged and the drafts vLLM accepts equal ``tapdraft speculate``'s,
    round by round."""
    from tests.engines.test_vllm_dflash import serve_and_check

    run, export = lilicorr
    k = json.loads((export / "config.json").read_text())["tapdraft"]["serve_with"]["vllm"]["num_speculative_tokens"]
    rounds, accepted = serve_and_check(vllm_venv, bpe_target, (run, export), "dflash", k, tmp_path)
    assert 0 < accepted < k * rounds, "both the accept and the reject path should be exercised"


def test_live_tau_agrees_with_the_replayed_tau(bpe_target, lilicorr):
    """``tapdraft speculate`` walks the lattice live; the replay counts teacher-forced slots, whose predecessor is
    the reply's token, the walk's own while it follows the reply: the two agree within ``speculate.run.AGREE_REL``."""
    from tapdraft.speculate.run import AGREE_REL, agreement

    run, _ = lilicorr
    r = speculate(bpe_target, run, bpe_target.val_manifest, 32, MAX_TOKENS)
    assert r["tau"] > 1.0
    assert abs(r["offline_tau_replayed"] - r["tau"]) <= AGREE_REL * r["tau"], agreement(r)


@pytest.mark.gpu
def test_vllms_v2_runner_serves_lilicorr_with_tapdrafts_acceptance(bpe_target, lilicorr, tmp_path):
    """On a GPU (``benchmarks/gpu.sh``): vLLM's CUDA build serves the export with ``method: dflash`` (its V2
    runner's lattice walk): greedy output identical to the target alone, and per conversation and round the
    accepted drafts equal ``tapdraft speculate``'s."""
    from tapdraft.engines.serving import engine_venv
    from tests.engines.test_vllm_dflash import serve_and_check

    run, export = lilicorr
    k = json.loads((export / "config.json").read_text())["tapdraft"]["serve_with"]["vllm"]["num_speculative_tokens"]
    rounds, _ = serve_and_check(engine_venv("vllm_gpu"), bpe_target, (run, export), "dflash", k, tmp_path)
    assert rounds > 0
