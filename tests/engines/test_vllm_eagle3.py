"""vLLM serves tapdraft's EAGLE-3 export unchanged: greedy output is the target's own, and its per-request
acceptance counters equal ``tapdraft speculate``'s round by round; tapdraft's offline replay equals its live
decoding on the same conversations.

How each counts (so "equal" is exact): a round is one verifying target forward after the prefill. vLLM's
EAGLE-3 proposer drafts K tokens per round by chaining its one layer (step 0 over the newly verified tokens
with the target's aux hidden states, then K - 1 steps on its own pre-norm outputs); ``per_step_accepted``
(``per_request_spec_decode_metrics="detailed"``) holds per round the drafts the target's tokens agreed with,
before the output is cut at eos or ``max_tokens``. ``tapdraft speculate`` drafts the same chain
(``Eagle3Drafter.propose``) and its ``agreed`` holds the same count per round; its ``accepted`` (and tau)
stop at the cut. The offline replay (``tau_replayed``) walks those rounds on the dataset's teacher-forced
chains: it equals live decoding on replies that end with the target's own eos inside the dataset (a reply the
regeneration cut at its token cap continues live past what the dataset holds).
"""

from __future__ import annotations

import json

import pytest

from tests.engines.conftest import read_jsonl, train_and_export
from tests.engines.test_vllm_dflash import MAX_TOKENS, serve_and_check, speculate

pytestmark = [pytest.mark.engine, pytest.mark.slow]

K = 4  # drafts per round: eagle3_demo's training-time-test steps


DRAFT_VOCAB = 384  # of the target's 1,024: vLLM then reads d2t and places the logits itself


@pytest.fixture(scope="module", params=["target_vocab", "draft_vocab"])
def bpe_eagle3(request, bpe_target, tmp_path_factory):
    """An EAGLE-3 drafter trained briefly on the BPE target's dataset (`tapdraft train` + `tapdraft export`), over
    the target's vocabulary or a reduced draft vocabulary."""
    extra = [f"drafter.draft_vocab={DRAFT_VOCAB}"] if request.param == "draft_vocab" else []
    return train_and_export(bpe_target.dataset, tmp_path_factory.mktemp("eagle3"), "eagle3_demo", "max_steps=200",
                            f"drafter.num_steps={K}", *extra)


def test_replayed_tau_equals_live_tau(bpe_target, bpe_eagle3, tmp_path):
    run, _ = bpe_eagle3
    whole = [r for r in read_jsonl(bpe_target.val_manifest) if not r.get("truncated")]
    assert len(whole) >= 8, "the held-out replies should mostly end with the target's eos"
    path = tmp_path / "whole.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in whole))
    ours = speculate(bpe_target, run, path, len(whole), 4 * MAX_TOKENS)
    assert ours["samples"] == len(whole) and ours["matches_greedy"] == f"{len(whole)}/{len(whole)}"
    assert ours["offline_over"] == f"the same {len(whole)} conversations"
    print(f"live tau {ours['tau']:.4f}, offline replay {ours['offline_tau_replayed']:.4f}, uniform anchors "
          f"{ours['offline_tau']:.4f} over {len(whole)} conversations")
    assert ours["tau"] > 1.2, "the trained drafter should get drafts accepted"
    assert ours["tau"] == pytest.approx(ours["offline_tau_replayed"], rel=1e-9)


def test_vllm_serves_eagle3_export_with_tapdrafts_acceptance(vllm_venv, bpe_target, bpe_eagle3, tmp_path):
    _, export = bpe_eagle3
    cfg = json.loads((export / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in cfg["target_layer_ids"]]
    assert cfg["draft_vocab_size"] in (DRAFT_VOCAB, cfg["vocab_size"])
    rounds, accepted = serve_and_check(vllm_venv, bpe_target, bpe_eagle3, "eagle3", K, tmp_path)
    assert accepted > rounds, "the trained drafter should get more than one draft a round accepted"
