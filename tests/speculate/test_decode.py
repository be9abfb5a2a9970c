"""Speculative decoding with a live target: greedy output is the target's own; sampling keeps its law."""

import math

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from tapdraft.speculate.decode import (
    DecodeResult,
    TargetSession,
    acceptance_by_position,
    sampled_step,
    speculative_generate,
    target_greedy,
)


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
    return Qwen3ForCausalLM(cfg).eval()


def _prompt(lm, n=7, seed=1):
    ids = torch.randint(0, 32, (n,), generator=torch.Generator().manual_seed(seed))
    return ids, lm.get_input_embeddings()(ids).detach()


def _random_proposer(K, seed=0):
    g = torch.Generator().manual_seed(seed)

    def propose(seq, taps, temperature, generator):
        assert taps.shape[0] == seq.shape[0] - 1  # taps cover exactly the verified positions
        return torch.randint(0, 32, (K,), generator=g), torch.full((K, 32), 1 / 32)

    return propose


def _oracle_proposer(lm, K):
    """Proposes the target's own greedy continuation: every draft must be accepted."""

    def propose(seq, taps, temperature, generator):
        with torch.no_grad():
            ids = seq.clone()
            for _ in range(K):
                nxt = lm(input_ids=ids[None]).logits[0, -1].argmax()
                ids = torch.cat([ids, nxt[None]])
        return ids[-K:], None

    return propose


def test_greedy_equals_target_greedy_with_a_bad_drafter(lm):
    ids, emb = _prompt(lm)
    ref = target_greedy(lm, emb, max_new_tokens=20, eos_token_id=None)
    out = speculative_generate(TargetSession(lm, [0, 2]), emb, ids, _random_proposer(4), max_new_tokens=20,
                               eos_token_id=None)
    assert out.tokens == ref
    assert out.tau < 2.0


def test_a_perfect_drafter_gets_every_draft_accepted(lm):
    ids, emb = _prompt(lm, seed=3)
    ref = target_greedy(lm, emb, max_new_tokens=21, eos_token_id=None)
    out = speculative_generate(TargetSession(lm, [1]), emb, ids, _oracle_proposer(lm, 4), max_new_tokens=21,
                               eos_token_id=None)
    assert out.tokens == ref
    assert out.accepted == [4, 4, 4, 4]  # 1 + 4 rounds of (4 drafts + bonus) = 21 tokens
    assert out.tau == 5.0


def test_eos_stops_and_taps_track_the_cache(lm):
    ids, emb = _prompt(lm, seed=5)
    ref = target_greedy(lm, emb, max_new_tokens=12, eos_token_id=None)
    eos = ref[5]
    s = TargetSession(lm, [0, 2])
    out = speculative_generate(s, emb, ids, _random_proposer(3), max_new_tokens=12, eos_token_id=eos)
    assert out.tokens == ref[: ref.index(eos) + 1]
    assert s.taps.shape[0] == s.length and s.taps.shape[1:] == (2, 32)


def test_taps_equal_a_full_forward(lm):
    ids, emb = _prompt(lm, seed=2)
    s = TargetSession(lm, [0, 2])
    speculative_generate(s, emb, ids, _random_proposer(3), max_new_tokens=9, eos_token_id=None)
    done = target_greedy(lm, emb, max_new_tokens=s.length - len(ids), eos_token_id=None)
    full = torch.cat([emb, lm.get_input_embeddings()(torch.tensor(done))])
    hs = {}
    hooks = [lm.model.layers[i].register_forward_hook(lambda m, i_, o, i=i: hs.__setitem__(i, o)) for i in (0, 2)]
    with torch.no_grad():
        lm(inputs_embeds=full[None])
    for h in hooks:
        h.remove()
    want = torch.stack([hs[0][0], hs[2][0]], dim=1)
    torch.testing.assert_close(s.taps, want, atol=1e-4, rtol=1e-4)


def test_rejection_step_preserves_the_target_distribution():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    q = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 12000
    counts = torch.zeros(4)
    for _ in range(n):
        d = int(torch.multinomial(q, 1, generator=g))
        r = sampled_step(p, q, d, g)
        counts[d if r is None else r] += 1
    assert torch.allclose(counts / n, p, atol=0.015), counts / n


def test_drafts_accepted_past_eos_are_not_counted(lm):
    ids, emb = _prompt(lm, seed=3)
    ref = target_greedy(lm, emb, max_new_tokens=21, eos_token_id=None)
    eos = ref[3]  # the oracle's first round drafts ref[1..4]; eos is its third draft
    assert eos not in ref[:3]
    out = speculative_generate(TargetSession(lm, [1]), emb, ids, _oracle_proposer(lm, 4), max_new_tokens=21,
                               eos_token_id=eos)
    assert out.tokens == ref[:4]
    assert out.emitted == [3] and out.accepted == [3] and out.cut == [True]
    assert out.tau == 3.0  # 3 tokens for one target forward, not 1 + 4 accepted drafts


def test_acceptance_by_position_leaves_out_unjudged_drafts():
    r = DecodeResult(tokens=[], accepted=[0, 2, 3, 1], emitted=[1, 3, 3, 1], cut=[False, False, True, True])
    # round 1 rejects draft 1; round 2 accepts 1-2, rejects 3; round 3 accepts 1-3 then stops at eos;
    # round 4 accepted draft 1 (emitted as the last token), nothing after it was judged
    alpha = acceptance_by_position([r], 4)
    assert alpha[:3] == [3 / 4, 2 / 2, 1 / 2] and math.isnan(alpha[3])  # draft 4 was never judged


@pytest.mark.parametrize("family", ["granite", "gemma2", "phi"])
def test_live_probabilities_are_the_models_own(family, tmp_path):
    """Live logits go through the target's head once: Granite's division (its forward already divides)
    is not applied twice, Gemma2's soft cap and Phi's biases are applied; sampling sees the model's law."""
    from tapdraft.capture.targets.load import load_target
    from tests.capture.lm_families import save_family

    torch.manual_seed(0)
    target = load_target(save_family(family, tmp_path))
    lm = target.lm
    ids = torch.randint(0, 60, (9,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        own = torch.softmax(lm(input_ids=ids[None]).logits[0].float() / 0.7, -1)
        s = TargetSession(lm, [0])
        live = torch.cat([s.prefill(lm.get_input_embeddings()(ids[:5]))[None], s.extend(ids[5:])])
    live = torch.softmax(live / 0.7, -1)  # rows: the prompt's last position, then each fed token
    torch.testing.assert_close(live, own[4:], rtol=1e-5, atol=1e-6)


def test_every_round_is_counted_and_timed_and_plain_steps_are_timed(lm):
    ids, emb = _prompt(lm)
    out = speculative_generate(TargetSession(lm, [0]), emb, ids, _random_proposer(3), max_new_tokens=12,
                               eos_token_id=None)
    n = out.target_forwards
    assert n > 0 and out.drafted == [3] * n and len(out.round_seconds) == n
    assert all(t > 0 for t in out.round_seconds)
    assert sum(out.emitted) == len(out.tokens) - 1  # the first token comes from the prefill, outside any round
    steps: list[float] = []
    ref = target_greedy(lm, emb, max_new_tokens=12, eos_token_id=None, step_seconds=steps)
    assert len(steps) == len(ref) - 1 == 11 and all(t > 0 for t in steps)
