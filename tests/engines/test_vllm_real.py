"""The real target end to end, bounded for CI: ``demo.real.speedup`` (the chain ``tapdraft demo --real`` and
``benchmarks/real_speedup`` run) on SmolLM2-135M-Instruct (built from its PyPI package by ``demo.real.build`` and
cached in ~/.cache/tapdraft/models like the engine venvs: ~3 minutes once, then reused), every stage at a miniature
size: requests, its own greedy replies through vLLM (``tapdraft regenerate --engine vllm``), capture, an EAGLE-3
drafter over a reduced draft vocabulary trained a few dozen steps, then vLLM serving held-out requests alone and
with the export: prompts expanded as capture expanded them, greedy output unchanged, and acceptance equal to
``tapdraft speculate``'s round by round (how the two count: tests/engines/test_vllm_eagle3.py).

The drafter barely trains: the test proves the chain on a real model (a tied head, 49,152 tokens, a real chat
template and eos), not a speedup. It never skips: the build and the engine venv are part of the run, and a failed
build fails it.
"""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.long]

K = 3  # drafts per round
N_NEW = 16  # reply cap: regeneration, tapdraft's decoding and vLLM's all stop here (or at eos)
DRAFT_VOCAB = 1024  # of SmolLM2's 49,152: the draft head stays small (576 x 1,024)


def test_the_real_speedup_chain_at_a_miniature_size(vllm_venv, tmp_path):
    """Every stage of demo.real.speedup on the text target (4 held-out requests, one pair): the report says that
    vLLM expanded the prompts as capture did, the drafter left the greedy output unchanged, and vLLM's rounds equal
    tapdraft speculate's; a rerun finds every stage done."""
    from tapdraft.demo.real.speedup import SpeedupConfig, format_serve, run_speedup

    cfg = SpeedupConfig(target="text", train=8, validation=2, held_out=4, prompts=4, pairs=1, max_tokens=N_NEW,
                        recipe="eagle3_demo", k=(K,), threads=2,
                        sets=("max_steps=40", f"drafter.num_steps={K}", f"drafter.draft_vocab={DRAFT_VOCAB}"))
    logs: list[str] = []
    report = run_speedup(tmp_path, cfg, log=logs.append)
    print(format_serve(report))
    export = json.loads((tmp_path / "exports" / "eagle3_demo" / "config.json").read_text())
    assert export["draft_vocab_size"] == DRAFT_VOCAB and export["vocab_size"] == 49152
    assert report["prompt_ids_equal_to_capture"] is True
    assert report[f"k={K}"]["greedy_identical"] is True
    assert report["rounds_equal_to_speculate"] is True
    assert report[f"k={K}"]["rounds"] > 0
    # the engine's own timestamps time the decode apart from the prefill, for every pass on both sides
    assert len(report["alone_decode_tokens_per_s"]) == len(report[f"k={K}"]["decode_speedup_pairs"]) == 1
    assert report["alone_decode_tokens_per_s"][0] > 0 and report[f"k={K}"]["decode_speedup_median"] > 0
    assert report[f"k={K}"]["accepted"] > 0, "40 steps should get some drafts accepted (12 of 48 rounds here)"
    assert report["speculate"]["tau"] == pytest.approx(report["speculate"]["offline_tau_replayed"])
    assert [n for n in ("regenerate", "capture", "train", "export") if any(f"tapdraft {n} " in m for m in logs)] == \
        ["regenerate", "capture", "train", "export"]
    logs.clear()
    stop = run_speedup(tmp_path, cfg, stop_after="train", log=logs.append)
    assert stop is None and not any(m.startswith("+ tapdraft") for m in logs)  # every stage was cached
