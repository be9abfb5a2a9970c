"""The real target end to end, bounded for CI: SmolLM2-135M-Instruct (built from its PyPI package by
``demo.real.build`` and cached in ~/.cache/tapdraft/models like the engine venvs: ~3 minutes once, then reused)
answers a few short questions (``tapdraft regenerate``: its own greedy replies), the answers are captured, an
EAGLE-3 drafter over a reduced draft vocabulary trains a few dozen steps, and vLLM serves its export beside
SmolLM2: greedy output unchanged, and acceptance equal to ``tapdraft speculate``'s round by round (how the two
count: tests/engines/test_vllm_eagle3.py).

The drafter barely trains (8 conversations, 60 steps): the test proves the chain on a real model (a tied head,
49,152 tokens, a real chat template and eos), not a speedup. It never skips: the build and the engine venv are
part of the run, and a failed build fails it.
"""

from __future__ import annotations

import json

import pytest

from tests.engines.conftest import train_and_export
from engines.serving import check_served, serve_vllm

pytestmark = [pytest.mark.engine, pytest.mark.slow]

K = 3  # drafts per round
N_NEW = 16  # reply cap: regeneration, tapdraft's decoding and vLLM's all stop here (or at eos)
DRAFT_VOCAB = 1024  # of SmolLM2's 49,152: the draft head stays small (576 x 1,024)
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "How many days are in a week?",
    "What do bees make?",
    "Which planet is closest to the sun?",
    "What is two plus two?",
    "What colour is the sky on a clear day?",
    "What animal says moo?",
]


@pytest.fixture(scope="module")
def real_case(tmp_path_factory):
    """SmolLM2, its greedy replies to QUESTIONS, the dataset captured from them and an EAGLE-3 drafter."""
    from capture.config import CaptureConfig
    from capture.pipeline import capture
    from capture.replies.generate import GenerationConfig
    from capture.replies.regenerate import RegenerateConfig, regenerate
    from capture.replies.windows import ReplyConfig
    from demo.real.build import build_real_targets

    target = build_real_targets().smollm2
    root = tmp_path_factory.mktemp("real")
    src = root / "questions.jsonl"
    src.write_text("".join(json.dumps({"id": f"q{i:02d}", "conversations": [
        {"from": "User", "type": "text", "value": q},
        {"from": "Assistant", "type": "text", "value": "-"}]}) + "\n" for i, q in enumerate(QUESTIONS)))
    convs = root / "train.jsonl"
    doc = regenerate(RegenerateConfig(target=str(target), data=str(src), out=str(convs), progress=False,
                                      replies=ReplyConfig(generation=GenerationConfig(max_new_tokens=N_NEW),
                                                          keep_truncated=True)))
    assert doc["counts"]["written"] == len(QUESTIONS), doc["counts"]
    dataset = root / "dataset"
    capture(CaptureConfig(target=str(target), out=str(dataset), data=(("train", str(convs)),), progress=False),
            target=None)
    run, export = train_and_export(dataset, root / "eagle3", "eagle3_demo", "max_steps=60",
                                   f"drafter.num_steps={K}", f"drafter.draft_vocab={DRAFT_VOCAB}")
    return {"target": target, "conversations": convs, "dataset": dataset, "run": run, "export": export}


def test_vllm_serves_an_eagle3_export_beside_smollm2(vllm_venv, real_case, tmp_path):
    from shards.reader import open_dataset
    from speculate.run import SpeculateConfig, prompt_length, run_speculate

    cfg = json.loads((real_case["export"] / "config.json").read_text())
    assert cfg["draft_vocab_size"] == DRAFT_VOCAB and cfg["vocab_size"] == 49152
    ds = open_dataset(str(real_case["dataset"]))
    convs = []
    for s in ds.stream("train", seed=0, shuffle=False):
        ids = s["input_ids"].tolist()
        convs.append((s["sample_id"], ids[: prompt_length(s["loss_mask"])]))
    assert len(convs) == len(QUESTIONS)
    job = {"target": str(real_case["target"]), "requests": [{"prompt_token_ids": ids} for _, ids in convs],
           "max_tokens": N_NEW, "max_model_len": 256}
    alone = serve_vllm(vllm_venv, job, tmp_path)
    spec = serve_vllm(vllm_venv, {**job, "speculative": {"method": "eagle3", "model": str(real_case["export"]),
                                                          "num_speculative_tokens": K}}, tmp_path)
    assert [o["prompt_token_ids"] for o in alone["outputs"]] == [ids for _, ids in convs]
    ours = run_speculate(SpeculateConfig(target=str(real_case["target"]), draft=str(real_case["run"]),
                                         data=str(real_case["dataset"]), conversations=str(real_case["conversations"]),
                                         max_samples=len(convs), max_new_tokens=N_NEW), progress=False)
    rounds, accepted = check_served(alone, spec, ours, [i for i, _ in convs])
    assert rounds > 0
    assert accepted > 0, "60 steps on the very conversations served should get some drafts accepted"
