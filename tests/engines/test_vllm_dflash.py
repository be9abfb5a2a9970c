"""vLLM serves tapdraft's DFlash export unchanged: its greedy output is the target's own, and its per-request
acceptance counters equal ``tapdraft speculate``'s, round by round, on the same conversations.

How the two count (so that "equal" is exact): a round is one verifying target forward after the prefill.
vLLM's ``per_step_accepted`` (per request, ``per_request_spec_decode_metrics="detailed"``) holds, per round,
the drafts the target's tokens agreed with, before the output is cut at eos or ``max_tokens``; tapdraft's
``DecodeResult.agreed`` holds the same count (its ``accepted`` stops at the cut, which its tau uses).
"""

from __future__ import annotations

import pytest

from tests.engines.conftest import read_jsonl
from tests.engines.serving import serve_vllm

pytestmark = [pytest.mark.engine, pytest.mark.slow]

K = 7  # drafts per round: the trained block size 8 minus the anchor slot
MAX_TOKENS = 24  # the regenerated replies' cap: decoding stays inside what the dataset covers


def prompts(bpe_target, split="validation"):
    """The dataset's own prompt ids per conversation (everything before the last reply), with the sample ids."""
    from shards.reader import open_dataset
    from speculate.run import prompt_length

    ds = open_dataset(str(bpe_target.dataset))
    out = []
    for s in ds.stream(split, seed=0, shuffle=False):
        ids = s["input_ids"].tolist()
        out.append((s["sample_id"], ids[: prompt_length(s["loss_mask"])]))
    return out


def speculate(bpe_target, run, split_file, n, max_new_tokens):
    from speculate.run import SpeculateConfig, run_speculate

    cfg = SpeculateConfig(target=str(bpe_target.target), draft=str(run), data=str(bpe_target.dataset),
                          conversations=str(split_file), max_samples=n, max_new_tokens=max_new_tokens)
    return run_speculate(cfg, progress=False)


def test_vllm_serves_dflash_export_with_tapdrafts_acceptance(vllm_venv, bpe_target, bpe_dflash, tmp_path):
    run, export = bpe_dflash
    convs = prompts(bpe_target)
    assert len(convs) >= 32
    requests = [{"prompt_token_ids": ids} for _, ids in convs]
    job = {"target": str(bpe_target.target), "requests": requests, "max_tokens": MAX_TOKENS, "max_model_len": 256}
    alone = serve_vllm(vllm_venv, job, tmp_path)
    spec = serve_vllm(vllm_venv, {**job, "speculative": {"method": "dflash", "model": str(export),
                                                          "num_speculative_tokens": K}}, tmp_path)
    ours = speculate(bpe_target, run, bpe_target.val_manifest, len(convs), MAX_TOKENS)

    assert [o["prompt_token_ids"] for o in alone["outputs"]] == [ids for _, ids in convs]
    greedy = [o["token_ids"] for o in alone["outputs"]]
    assert [o["token_ids"] for o in spec["outputs"]] == greedy  # the draft changes nothing the target says
    by_id = {c["sample_id"]: c for c in ours["conversations"]}
    assert [by_id[i]["tokens"] for i, _ in convs] == greedy  # and tapdraft's decoding says the same
    vllm_rounds = [o["spec"]["per_step_accepted"] for o in spec["outputs"]]
    our_rounds = [by_id[i]["agreed"] for i, _ in convs]
    assert vllm_rounds == our_rounds
    accepted, rounds = sum(map(sum, our_rounds)), sum(map(len, our_rounds))
    print(f"vLLM {spec['vllm']}: {len(convs)} conversations, {rounds} rounds, {accepted} drafts accepted "
          f"(1 + accepted/rounds = {1 + accepted / rounds:.3f}); tapdraft tau {ours['tau']:.3f}")
    assert accepted > 0, "the trained drafter should get some drafts accepted"
