"""Batched KV-cache generation against the model's own generate and its own full forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tapdraft.capture.inputs import AudioRef, Conversation
from tapdraft.capture.replies.generate import GenerationConfig, generate, row_seed
from tapdraft.capture.targets.causal_lm import CausalLMTarget
from tapdraft.capture.targets.salm.target import SALMTarget
from tests.capture.targets.test_hf_speech import qwen2_audio_dir  # noqa: F401  (fixture)


def _prompt(sid, n_samples, seed, question="what did i say ?"):
    wave = np.random.default_rng(seed).normal(0, 0.1, n_samples).astype(np.float32)
    return Conversation(sid, "mem", [{"role": "user", "content": f"<|audioplaceholder|> {question}"}],
                        [AudioRef(array=wave, sample_rate=16000)])


def _text_prompt(sid, words):
    return Conversation(sid, "mem", [{"role": "user", "content": words}])


def _targets(salm):
    audio = [_prompt("a", 20000, 0), _prompt("b", 7000, 1), _prompt("c", 12000, 2, "what is the sum ?")]
    return {"salm": (SALMTarget(salm), audio),
            "causal": (CausalLMTarget(salm.lm, salm.tokenizer),
                       [_text_prompt("a", "what did i say ?"),
                        _text_prompt("b", "how many digits ? one two three four"),
                        _text_prompt("c", "sum")])}


@pytest.mark.parametrize("kind", ["salm", "causal"])
def test_greedy_batch_equals_hf_generate_one_at_a_time(salm, kind):
    target, convs = _targets(salm)[kind]
    prompts = [target.prepare_prompt(c, i) for i, c in enumerate(convs)]
    assert len({p.length for p in prompts}) == 3 and not any(p.assistant_mask.any() for p in prompts)
    got = generate(target, prompts, GenerationConfig(max_new_tokens=10))
    for p, g in zip(prompts, got):
        e = target.embed([p])[0]
        ref = target.lm.generate(inputs_embeds=e.inputs_embeds[None],
                                 attention_mask=torch.ones(1, p.length, dtype=torch.long),
                                 max_new_tokens=10, do_sample=False, eos_token_id=target.end_token_ids(),
                                 pad_token_id=target.tokenizer.pad_token_id)
        assert g.ids == ref[0].tolist()
        assert g.truncated == (len(g.ids) == 10 and g.ids[-1] not in target.end_token_ids())


def test_sampling_is_per_row_and_reproducible(salm):
    target, convs = _targets(salm)["salm"]
    prompts = [target.prepare_prompt(c, i) for i, c in enumerate(convs)]
    cfg = GenerationConfig(max_new_tokens=8, temperature=1.0, top_p=0.9, seed=3)
    seeds = [row_seed(3, c.sample_id, 0) for c in convs]
    a = generate(target, prompts, cfg, seeds=seeds)
    b = generate(target, prompts[::-1], cfg, seeds=seeds[::-1])[::-1]  # other batch order, same rows
    assert [g.ids for g in a] == [g.ids for g in b]
    c = generate(target, prompts, cfg, seeds=[row_seed(4, c.sample_id, 0) for c in convs])
    assert [g.ids for g in a] != [g.ids for g in c]
    assert row_seed(3, "a", 0) != row_seed(3, "a", 1) and row_seed(3, "a", 0) == row_seed(3, "a", 0)
    with pytest.raises(ValueError, match="seed"):
        generate(target, prompts, cfg)


def test_generation_states_match_a_full_forward(salm):
    """Taps gathered while decoding (prefill + one step per token) equal a full forward over the same
    tokens up to kernel rounding (float32 here)."""
    target, convs = _targets(salm)["salm"]
    L = target.num_layers
    prompts = [target.prepare_prompt(c, i) for i, c in enumerate(convs)]
    got = generate(target, prompts, GenerationConfig(max_new_tokens=6), tap_ids=[0, L - 1])
    for p, g in zip(prompts, got):
        e = g.expanded
        ids = torch.tensor(g.ids)
        emb = torch.cat([e.inputs_embeds, target.lm.get_input_embeddings()(ids)])
        hs = target.lm(inputs_embeds=emb[None], output_hidden_states=True).hidden_states
        assert g.taps.shape == (p.length + len(g.ids), 2, target.hidden_size)
        torch.testing.assert_close(g.taps[:, 0], hs[1][0], rtol=1e-4, atol=1e-4)
        pre_norm = g.last
        torch.testing.assert_close(target.decoder.norm(pre_norm), hs[-1][0], rtol=1e-4, atol=1e-4)


def test_hf_native_speech_llm_generation_equals_its_own_generate(qwen2_audio_dir):  # noqa: F811
    """Qwen2-Audio: our batched decode over the adapter's merged embeddings = the model's own generate
    from the processor's inputs (audio features, expanded audio tokens)."""
    from tapdraft.capture.targets.load import load_target

    target = load_target(qwen2_audio_dir)
    convs = [Conversation(sid, "mem", [{"role": "user", "content": "<|AUDIO|> what did i say ?"}],
                          [AudioRef(array=np.random.default_rng(i).normal(0, 0.1, n).astype(np.float32),
                                    sample_rate=16000)]) for i, (sid, n) in enumerate([("a", 16000), ("b", 9000)])]
    prompts = [target.prepare_prompt(c, i) for i, c in enumerate(convs)]
    got = generate(target, prompts, GenerationConfig(max_new_tokens=6))
    for c, g in zip(convs, got):
        text = target.template.render(target._wrap(c.messages), add_generation_prompt=True)
        inputs = target.processor(text=text, audio=[c.audios[0].array], sampling_rate=16000, return_tensors="pt")
        ref = target.model.generate(**inputs, max_new_tokens=6, do_sample=False, eos_token_id=target.end_token_ids(),
                                    pad_token_id=target.tokenizer.pad_token_id)
        assert g.ids == ref[0, inputs["input_ids"].shape[1]:].tolist()
