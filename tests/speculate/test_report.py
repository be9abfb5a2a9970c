"""One tau to trust: eval and speculate lead with the replayed tau (the serving prediction), label the
teacher-forced one, say whether live and replayed agree, and print unreached positions one way."""

from __future__ import annotations

import math

from tapdraft.speculate.run import AGREE_REL, agreement, format_result
from tapdraft.train.acceptance import UNREACHED, alpha_text
from tapdraft.train.evaluate import format_result as format_eval


def _live(tau: float, replayed: float | None, *, temperature: float = 0.0, same: bool = True) -> dict:
    return {"samples": 4, "tokens": 100, "rounds": 60, "drafts_per_round": 3, "tau": tau,
            "alpha": [0.5, 0.25, math.nan], "config": {"temperature": temperature}, "offline_tau": 2.6,
            "offline_tau_replayed": replayed, "offline_over": "the same 4 conversations", "offline_same": same}


def test_speculate_prints_live_against_replayed_and_whether_they_agree():
    text = format_result(_live(1.619, 1.630))
    lines = text.splitlines()
    assert lines[1] == "tau (tokens per target forward) = 1.619 live"
    assert lines[2].startswith("tau = 1.630 replayed offline over the same 4 conversations") and "agree (within 0.7%)" \
        in lines[2]
    assert "teacher-forced tau at every anchor over the same 4 conversations = 2.600 (a training metric" in text
    assert f"0.500 0.250 {UNREACHED}" in text and "nan" not in text
    far = agreement(_live(1.2, 1.6))
    assert far.startswith(f"DIFFER by 33.3% (> {100 * AGREE_REL:g}%)") and "--max-new-tokens" in far
    assert "other conversations" in agreement(_live(1.2, 1.6, same=False))
    assert agreement(_live(1.2, 1.6, temperature=1.0)).startswith("not comparable")
    assert agreement(_live(1.2, None)) is None and "replayed offline" not in format_result(_live(1.2, None))


def _eval(reached: list[int]) -> dict:
    return {"tau": 2.628, "tau_replayed": 1.630, "family": "dflash", "step": 40, "split": "validation",
            "samples": 8, "blocks": 90, "alpha": [0.8, 0.5, 0.0], "reached": reached, "note": "n"}


def test_eval_leads_with_the_replayed_tau_and_labels_the_teacher_forced_one():
    lines = format_eval(_eval([90, 60, 0])).splitlines()
    assert lines[0].startswith("tau = 1.630  (replayed: ") and "serving prediction" in lines[0]
    assert lines[1].startswith("teacher-forced tau at every anchor = 2.628  (a training metric")
    assert lines[2] == f"alpha_k (teacher-forced): 0.80 0.50 {UNREACHED}  ({UNREACHED}: position never reached)"
    assert f"0.80 0.50 0.00" in format_eval(_eval([90, 60, 5]))  # reached and never accepted: a real zero


def test_unreached_positions_print_the_same_way_whatever_their_value():
    assert alpha_text([0.5, math.nan, None]) == f"0.500 {UNREACHED} {UNREACHED}"
    assert alpha_text([0.5, 0.0], reached=[3, 0], digits=2) == f"0.50 {UNREACHED}"


def test_the_replay_covers_the_last_reply_alone_as_speculate_decodes_it():
    """A two-turn conversation is decoded on its last reply; its first reply is context, not replayed."""
    import torch

    from tapdraft.speculate.run import last_reply, prompt_length

    mask = torch.tensor([0, 0, 1, 1, 1, 0, 0, 1, 1, 0], dtype=torch.bool)
    sample = {"loss_mask": mask, "sample_id": "mt-81-2"}
    got = last_reply(sample)
    assert got["loss_mask"].tolist() == [False] * 7 + [True, True, False]
    assert prompt_length(got["loss_mask"]) == prompt_length(mask) == 7
    assert sample["loss_mask"].tolist() == mask.tolist()  # the dataset's sample is left as it was
