"""Voxtral adapter: tekken.json tokenizer, 30 s chunks, taps/top-k vs the model's own forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tapdraft.capture.forward import SampleSpec, run_batch
from tapdraft.capture.targets.load import load_target
from tapdraft.capture.targets.voxtral import VoxtralTarget
from tests.capture.speech_models import (audio_conv, decoder_inputs_embeds, layers_and_logits, own_inputs,
                                         save_voxtral)


@pytest.fixture(scope="session")
def voxtral_dir(tmp_path_factory) -> Path:
    return save_voxtral(tmp_path_factory.mktemp("voxtral"))


@pytest.fixture()
def target(voxtral_dir) -> VoxtralTarget:
    t = load_target(voxtral_dir)
    assert isinstance(t, VoxtralTarget)
    return t


def _conv(sid, n_samples, seed, reply="you said one two ."):
    return audio_conv("[AUDIO]", sid, n_samples, seed, reply)


def _own_forward(target, conv):
    inputs = own_inputs(target, conv.messages, [a.array for a in conv.audios])
    return (inputs, *layers_and_logits(target, inputs))


def test_tokens_chunks_and_bundle(target):
    assert target.placeholder == "[AUDIO]" and target.audio_token_id == 24 and target.frames_per_chunk == 375
    assert target.audio_bundle()["frame_seconds"] == pytest.approx(0.08)
    short, long = target.prepare(_conv("s", 16000, 0), 0), target.prepare(_conv("l", 16000 * 31, 1), 1)
    assert int((short.token_ids == 24).sum()) == 375 and int((long.token_ids == 24).sum()) == 750  # 2 chunks, no cut
    toks = target.tokenizer.convert_ids_to_tokens(short.token_ids.tolist())
    i = toks.index("[AUDIO]")
    assert toks[:3] == ["<s>", "[INST]", "[BEGIN_AUDIO]"] and i == 3  # mistral-common's audio chunk layout
    supervised = target.tokenizer.decode(short.token_ids[short.assistant_mask])
    assert supervised == "you said one two .</s>"


def test_taps_and_teacher_equal_the_models_own_forward(target):
    L = target.num_layers
    convs = [_conv("a", 20000, 0), _conv("b", 7000, 1, "you said three .")]
    batch = [target.prepare(c, i) for i, c in enumerate(convs)]
    assert batch[0].length != batch[1].length  # the batch is padded
    with torch.no_grad():
        res = run_batch(target, batch, SampleSpec(tap_ids=list(range(L)), top_k=4))
        for c, r in zip(convs, res):
            inputs, hs, logits = _own_forward(target, c)  # the model checks audio tokens == projected frames
            assert r["input_ids"].tolist() == inputs["input_ids"][0].tolist()
            for i in range(L):
                torch.testing.assert_close(r["taps"][:, i].float(), hs[i][0].to(torch.bfloat16).float(),
                                           rtol=0.02, atol=0.02)
            ref = torch.log_softmax(logits[0].double(), dim=-1)[r["topk_rows"].long()]
            torch.testing.assert_close(r["topk_logprobs"].double(), ref.topk(4, dim=-1).values, rtol=1e-4, atol=1e-4)


def test_merge_equals_the_models_inputs_embeds(target):
    c = _conv("a", 12000, 3)
    seen = decoder_inputs_embeds(target, lambda: _own_forward(target, c))
    with torch.no_grad():
        ex = target.embed([target.prepare(c, 0)])[0]
    torch.testing.assert_close(ex.inputs_embeds, seen[0], rtol=1e-6, atol=1e-6)


def test_tekken_audio_rate_must_match_the_encoder(tmp_path):
    d = save_voxtral(tmp_path, frame_rate=10.0)
    with pytest.raises(ValueError, match="300 tokens per 30 s chunk but the model's encoder gives 375"):
        load_target(d)


def test_mistral_layout_without_generation_markers_gives_the_same_mask(target):
    """Mistral's [INST] ... [/INST] reply</s> layout as published (no markers): prefix rendering finds the reply."""
    conv = _conv("a", 16000, 0)
    marked = target.prepare(conv, 0)
    target.use_template(target.template.text.replace("{% generation %}", "").replace("{% endgeneration %}", ""))
    plain = target.prepare(conv, 0)
    assert torch.equal(plain.token_ids, marked.token_ids) and torch.equal(plain.assistant_mask, marked.assistant_mask)
    assert target.tokenizer.decode(plain.token_ids[plain.assistant_mask]) == "you said one two .</s>"
