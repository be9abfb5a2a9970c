"""vLLM serves tapdraft's DFlash export unchanged: its greedy output is the target's own, and its per-request
acceptance counters equal ``tapdraft speculate``'s, round by round, on the same conversations.

How the two count (so that "equal" is exact): a round is one verifying target forward after the prefill.
vLLM's ``per_step_accepted`` (per request, ``per_request_spec_decode_metrics="detailed"``) holds, per round,
the drafts the target's tokens agreed with, before the output is cut at eos or ``max_tokens``; tapdraft's
``DecodeResult.agreed`` holds the same count (its ``accepted`` stops at the cut, which its tau uses).
"""

from __future__ import annotations

import pytest

from tapdraft.engines.serving import EngineFailed, check_served, serve_vllm, vllm_requests

pytestmark = [pytest.mark.engine, pytest.mark.slow]

K = 7  # drafts per round: the trained block size 8 minus the anchor slot
MAX_TOKENS = 24  # the regenerated replies' cap: decoding stays inside what the dataset covers


def prompts(bpe_target, split="validation"):
    """The dataset's own prompt ids per conversation (everything before the last reply), with the sample ids."""
    from tapdraft.shards.reader import open_dataset
    from tapdraft.speculate.run import prompt_length

    ds = open_dataset(str(bpe_target.dataset))
    out = []
    for s in ds.stream(split, seed=0, shuffle=False):
        ids = s["input_ids"].tolist()
        out.append((s["sample_id"], ids[: prompt_length(s["loss_mask"])]))
    return out


def speculate(bpe_target, run, split_file, n, max_new_tokens, drafts=None):
    from tapdraft.speculate.run import SpeculateConfig, run_speculate

    cfg = SpeculateConfig(target=str(bpe_target.target), draft=str(run), data=str(bpe_target.dataset),
                          conversations=str(split_file), max_samples=n, max_new_tokens=max_new_tokens, drafts=drafts)
    return run_speculate(cfg, progress=False)


def serve_and_check(vllm_venv, bpe_target, drafter, method: str, k: int, tmp_path) -> tuple[int, int]:
    """The BPE target's validation prompts served alone and with the exported ``drafter`` (run, export) as
    ``method`` at ``k`` drafts a round, against tapdraft's speculate of the same run drafting as many:
    ``check_served``'s (rounds, accepted)."""
    run, export = drafter
    convs = prompts(bpe_target)
    assert len(convs) >= 32
    requests = [{"prompt_token_ids": ids} for _, ids in convs]
    job = {"target": str(bpe_target.target), "requests": requests, "max_tokens": MAX_TOKENS, "max_model_len": 256}
    alone = serve_vllm(vllm_venv, job, tmp_path)
    spec = serve_vllm(vllm_venv, {**job, "speculative": {"method": method, "model": str(export),
                                                          "num_speculative_tokens": k}}, tmp_path)
    ours = speculate(bpe_target, run, bpe_target.val_manifest, len(convs), MAX_TOKENS, drafts=k)
    assert [o["prompt_token_ids"] for o in alone["outputs"]] == [ids for _, ids in convs]
    return check_served(alone, spec, ours, [i for i, _ in convs])


def test_vllm_serves_dflash_export_with_tapdrafts_acceptance(vllm_venv, bpe_target, bpe_dflash, tmp_path):
    """The drafter attends a sliding window (``bpe_dflash``): every prompt is longer than it, so vLLM's rounds equal
    tapdraft's only if both hide the same context from each slot."""
    import json

    W = json.loads((bpe_dflash[1] / "config.json").read_text())["dflash_config"]["swa_window_size"]
    assert min(len(ids) for _, ids in prompts(bpe_target)) > W
    _, accepted = serve_and_check(vllm_venv, bpe_target, bpe_dflash, "dflash", K, tmp_path)
    assert accepted > 0, "the trained drafter should get some drafts accepted"


def test_vllm_serves_a_dflash_export_at_fewer_drafts_as_speculate_drafts_them(vllm_venv, bpe_target, bpe_dflash,
                                                                               tmp_path):
    """At num_speculative_tokens=3 of a block trained for 7, vLLM's DFlash proposer runs a block of 4 (the anchor and
    three masks, attending both ways): ``speculate --drafts 3`` drafts that block, round for round."""
    rounds, accepted = serve_and_check(vllm_venv, bpe_target, bpe_dflash, "dflash", 3, tmp_path)
    assert 0 < accepted < 3 * rounds


def speech_requests(case):
    """vLLM requests for the case's conversations and tapdraft's expanded prompt ids."""
    requests, _, ids = vllm_requests(case["target"], case["conversations"], 10**9, case["root"])
    return requests, ids


def test_vllm_serves_dflash_beside_a_speech_target(vllm_venv, speech_case, tmp_path):
    """With the project's vLLM plugin (installed into the venv by engines/venv.sh), a speech target serves with
    a DFlash draft: greedy output and per-round acceptance equal to tapdraft's, audio expanded alike."""
    requests, ids = speech_requests(speech_case)
    n_new = 16
    job = {"target": str(speech_case["target"]), "requests": requests, "max_tokens": n_new, "max_model_len": 512}
    alone = serve_vllm(vllm_venv, job, tmp_path)
    spec = serve_vllm(vllm_venv, {**job, "speculative": {"method": "dflash", "model": str(speech_case["export"]),
                                                          "num_speculative_tokens": K}}, tmp_path)
    assert "image_token_index" in spec["plugins"]
    assert [o["prompt_token_ids"] for o in alone["outputs"]] == ids  # vLLM expands the audio as tapdraft does
    from tapdraft.speculate.run import SpeculateConfig, run_speculate

    ours = run_speculate(SpeculateConfig(target=str(speech_case["target"]), draft=str(speech_case["run"]),
                                         data=str(speech_case["dataset"]),
                                         conversations=str(speech_case["conversations"]), max_samples=len(ids),
                                         max_new_tokens=n_new), progress=False)
    _, accepted = check_served(alone, spec, ours)
    assert accepted > 0


def test_stock_vllm_refuses_a_speech_target_with_a_draft(vllm_venv, speech_case, tmp_path):
    """Without the plugin, vLLM 0.32 fails before decoding (the upstream gap the plugin's first fix covers): the
    proposer copies ``image_token_index`` from any multimodal target not on its list of vision models."""
    requests, _ = speech_requests(speech_case)
    job = {"target": str(speech_case["target"]), "requests": requests[:1], "max_tokens": 4, "max_model_len": 512,
           "speculative": {"method": "dflash", "model": str(speech_case["export"]), "num_speculative_tokens": K}}
    with pytest.raises(EngineFailed) as failed:
        serve_vllm(vllm_venv, job, tmp_path, plugins=False)
    assert "image_token_index" in failed.value.log or "EAGLE3 interface" in failed.value.log


def test_decoding_past_the_captured_reply_is_reported(bpe_target, bpe_dflash):
    """The regenerated replies stop at 24 tokens (most of them cut there): decoding 40 tokens runs past what the
    dataset holds, where the replay sees nothing and the drafter never trained; speculate says so and how much.
    (Measured on this target: accepted drafts per round fall from 0.13 before token 24 to 0.05 after it.)"""
    from tapdraft.speculate.run import format_result

    run, _ = bpe_dflash
    inside = speculate(bpe_target, run, bpe_target.val_manifest, 32, MAX_TOKENS)
    assert inside["past_capture"] == {"conversations": 0, "tokens": 0}
    assert "decoded past" not in format_result(inside)
    past = speculate(bpe_target, run, bpe_target.val_manifest, 32, 40)
    assert past["past_capture"]["conversations"] > 0 and past["past_capture"]["tokens"] > 0
    assert "decoded past the reply their dataset sample holds" in format_result(past)


def test_profiled_serving_counts_the_engine_steps(vllm_venv, bpe_target, bpe_dflash, tmp_path):
    """A job's ``profile`` (what ``benchmarks.round_profile`` reads) times vLLM's own steps: one a token alone, one a
    round plus each request's prefill with a drafter, and the proposer only runs with one."""
    from benchmarks.round_profile import PARTS, round_cost, run_figures

    convs = prompts(bpe_target)[:4]
    job = {"target": str(bpe_target.target), "requests": [{"prompt_token_ids": ids} for _, ids in convs],
           "max_tokens": MAX_TOKENS, "max_model_len": 256, "warmup": 1, "profile": PARTS}
    alone = run_figures(serve_vllm(vllm_venv, job, tmp_path))
    served = serve_vllm(vllm_venv, {**job, "speculative": {"method": "dflash", "model": str(bpe_dflash[1]),
                                                            "num_speculative_tokens": K}}, tmp_path)
    spec = run_figures(served)
    # once a step, counted once: the runner's wrapper and the method it calls share the proposer's name
    assert served["profile"]["proposer"]["calls"] == served["profile"]["execute"]["calls"]
    assert alone["steps"] == alone["tokens"] and alone["rounds"] == 0
    assert spec["steps"] == spec["rounds"] + len(convs) and spec["tokens"] == alone["tokens"]
    assert alone["proposer_ms"] == 0 < spec["proposer_ms"]
    for r in (alone, spec):
        assert 0 < r["target_forward_ms"] < r["step_ms"] and r["rest_ms"] > 0
    cost = round_cost(alone, spec)
    assert cost["R"] == pytest.approx(1 + cost["verify_extra"] + cost["proposer"] + cost["rest_extra"])
    assert cost["tau"] > 1
