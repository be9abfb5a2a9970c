"""HF-native speech LLM adapter (Qwen2-Audio): processor expansion, the model's own merge, taps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tapdraft.capture.forward import SampleSpec, run_batch
from tapdraft.capture.targets.hf_speech import HFSpeechTarget
from tapdraft.capture.targets.load import load_target
from tests.capture.speech_models import audio_conv, decoder_inputs_embeds, layers_and_logits, save_qwen2_audio


@pytest.fixture(scope="session")
def qwen2_audio_dir(tmp_path_factory) -> Path:
    """A tiny random-init Qwen2-Audio + its processor, built from configs and saved (no downloads)."""
    d = tmp_path_factory.mktemp("qwen2_audio")
    torch.save(save_qwen2_audio(d), d.parent / "qwen2_audio_reference.pt")
    return d


@pytest.fixture()
def target(qwen2_audio_dir) -> HFSpeechTarget:
    t = load_target(qwen2_audio_dir)
    assert isinstance(t, HFSpeechTarget)
    return t


def _conv(sid, n_samples, seed, reply="you said one two ."):
    return audio_conv("<|AUDIO|>", sid, n_samples, seed, reply)


def _processor_inputs(target, conv):
    text = target.tokenizer.apply_chat_template(target._wrap(conv.messages), tokenize=False)
    waves = [a.array for a in conv.audios]
    return target.processor(text=text, audio=waves, sampling_rate=16000, return_tensors="pt")


def test_load_target_round_trip(qwen2_audio_dir, target):
    ref = torch.load(qwen2_audio_dir.parent / "qwen2_audio_reference.pt")
    got = target.model.state_dict()
    assert set(got) == set(ref)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
    assert target.placeholder == "<|AUDIO|>"
    assert target.audio_token_id == target.tokenizer.convert_tokens_to_ids("<|AUDIO|>")
    assert target.num_layers == 3 and target.hidden_size == 32 and target.tokenizer_dir == qwen2_audio_dir
    parts = target.bundle_parts()
    assert parts["config"]["hidden_size"] == 32 and parts["config"]["vocab_size"] == len(target.tokenizer)
    assert parts["audio"]["audio_token_id"] == target.audio_token_id and parts["audio"]["frame_seconds"] == 0.04


def test_taps_equal_the_models_own_forward(target):
    L = target.num_layers
    convs = [_conv("a", 20000, 0), _conv("b", 7000, 1, "you said three .")]
    batch = [target.prepare(c, i) for i, c in enumerate(convs)]
    assert batch[0].length != batch[1].length  # the batch is padded
    with torch.no_grad():
        res = run_batch(target, batch, SampleSpec(tap_ids=list(range(L)), top_k=4, final_hidden=True))
        for c, p, r in zip(convs, batch, res):
            inputs = _processor_inputs(target, c)
            assert p.length == inputs["input_ids"].shape[1]  # expanded length = the processor's
            assert r["input_ids"].tolist() == inputs["input_ids"][0].tolist()
            assert r["is_audio"].tolist() == (inputs["input_ids"][0] == target.audio_token_id).tolist()
            hs, logits = layers_and_logits(target, inputs)
            for i in range(L):
                torch.testing.assert_close(r["taps"][:, i].float(), hs[i][0].to(torch.bfloat16).float(),
                                           rtol=0.02, atol=0.02)
            torch.testing.assert_close(r["final_hidden"].float(), hs[L - 1][0].to(torch.bfloat16).float(),
                                       rtol=0.02, atol=0.02)
            ref = torch.log_softmax(logits[0].double(), dim=-1)[r["topk_rows"].long()]
            torch.testing.assert_close(r["topk_logprobs"].double(), ref.topk(4, dim=-1).values, rtol=1e-4, atol=1e-4)


def test_merge_equals_the_models_inputs_embeds(target):
    """The adapter's merged embeddings are exactly what the model's forward feeds its decoder."""
    c = _conv("a", 12000, 3)
    p = target.prepare(c, 0)
    seen = decoder_inputs_embeds(target, lambda: target.model(**_processor_inputs(target, c)))
    with torch.no_grad():
        ex = target.embed([p])[0]
    torch.testing.assert_close(ex.inputs_embeds, seen[0], rtol=1e-6, atol=1e-6)
    assert int(ex.is_audio.sum()) > 1 and (ex.input_ids[ex.is_audio] == target.audio_token_id).all()


def test_loss_mask_covers_only_assistant_text(target):
    p = target.prepare(_conv("a", 16000, 0, "you said two three ."), 0)
    ex = target.embed([p])[0]
    assert not (ex.loss_mask & ex.is_audio).any()
    supervised = target.tokenizer.convert_ids_to_tokens(ex.input_ids[ex.loss_mask].tolist())
    assert supervised == ["you", "said", "two", "three", ".", "<|im_end|>"]
    # the supervised tokens are the last turn's: nothing before the assistant header is marked
    first = int(torch.nonzero(ex.loss_mask)[0])
    header = target.tokenizer.convert_ids_to_tokens(ex.input_ids[first - 2 : first].tolist())
    assert header == ["<|im_start|>", "assistant"]


def test_audio_count_mismatch_is_an_input_error(target):
    c = _conv("a", 16000, 0)
    c.audios = c.audios * 2
    with pytest.raises(ValueError, match="audio token"):
        target.prepare(c, 0)
    with pytest.raises(ValueError, match="at most 30s"):  # never truncated silently
        target.prepare(_conv("long", 16000 * 31, 0), 0)


def test_capture_pipeline_on_the_saved_directory(qwen2_audio_dir, tone_manifest, tmp_path):
    from tapdraft.capture.config import CaptureConfig
    from tapdraft.capture.inputs import read_jsonl
    from tapdraft.capture.pipeline import capture
    from tapdraft.shards.reader import open_dataset
    from tapdraft.shards.verify import verify_dataset
    from tapdraft.shards.shard_file import ShardConfig

    cfg = CaptureConfig(target=str(qwen2_audio_dir), out=str(tmp_path / "ds"), data=(("train", str(tone_manifest)),),
                        top_k=4, window=4, batch_tokens=400, shard=ShardConfig(shard_bytes=20000), progress=False)
    m = capture(cfg)
    assert m["complete"] and m["splits"]["train"]["samples"] == 10
    assert verify_dataset(str(tmp_path / "ds"), progress=False).ok
    ds = open_dataset(str(tmp_path / "ds"))
    got = {s["sample_id"]: s for s in (ds.sample("train", i) for i in range(ds.num_samples("train")))}
    target = load_target(qwen2_audio_dir)
    conv = list(read_jsonl(tone_manifest, placeholder=target.placeholder))[3]
    ref = run_batch(target, [target.prepare(conv, 0)], SampleSpec(tap_ids=m["layout"]["tap_ids"], top_k=4))[0]
    s = got["u3"]
    assert torch.equal(s["input_ids"], ref["input_ids"]) and torch.equal(s["loss_mask"], ref["loss_mask"])
    assert int(s["is_audio"].sum()) > 0 and m["extra"]["audio_token_id"] == target.audio_token_id
    torch.testing.assert_close(s["taps"].float(), ref["taps"].float(), rtol=0.02, atol=0.02)


def test_qwen3_asr_taps_merge_and_teacher_equal_the_models_own_forward(tmp_path):
    """Qwen3-ASR rides the same mechanism: its processor's expansion, its model's packed encoder and merge."""
    from tapdraft.capture.targets.hf_speech import Qwen3ASRTarget
    from tests.capture.speech_models import own_inputs, save_qwen3_asr

    save_qwen3_asr(tmp_path)
    target = load_target(tmp_path)
    assert isinstance(target, Qwen3ASRTarget) and target.placeholder == "<|audio_pad|>"

    def conv(sid, n, seed, reply="you said one two ."):
        return audio_conv("<|audio_pad|>", sid, n, seed, reply)

    convs = [conv("a", 37000, 0), conv("b", 5000, 1, "you said three .")]  # 2.3 s (3 chunks) and under min_length
    batch = [target.prepare(c, i) for i, c in enumerate(convs)]
    L = target.num_layers
    with torch.no_grad():
        res = run_batch(target, batch, SampleSpec(tap_ids=list(range(L)), top_k=4))
        for c, p, r in zip(convs, batch, res):
            inputs = own_inputs(target, c.messages, [a.array for a in c.audios])
            assert r["input_ids"].tolist() == inputs["input_ids"][0].tolist()
            hs, logits = layers_and_logits(target, inputs)
            for i in range(L):
                torch.testing.assert_close(r["taps"][:, i].float(), hs[i][0].to(torch.bfloat16).float(),
                                           rtol=0.02, atol=0.02)
            ref = torch.log_softmax(logits[0].double(), dim=-1)[r["topk_rows"].long()]
            torch.testing.assert_close(r["topk_logprobs"].double(), ref.topk(4, dim=-1).values, rtol=1e-4, atol=1e-4)
        seen = decoder_inputs_embeds(
            target, lambda: target.model(**own_inputs(target, convs[0].messages, [convs[0].audios[0].array])))
        torch.testing.assert_close(target.embed([batch[0]])[0].inputs_embeds, seen[0], rtol=1e-6, atol=1e-6)
    two = conv("two", 16000, 2)
    two.messages[0]["content"] += " <|audio_pad|>"
    two.audios = two.audios * 2
    with pytest.raises(ValueError, match="one audio per conversation"):
        target.prepare(two, 0)


def test_a_template_without_generation_markers_gives_the_same_expanded_mask(target):
    """Published speech-LLM templates carry no {% generation %} markers: prefix rendering finds the same turns."""
    conv = _conv("a", 16000, 0, "you said two three .")
    marked = target.prepare(conv, 0)
    assert target.template.has_markers
    target.use_template(target.template.text.replace("{% generation %}", "").replace("{% endgeneration %}", ""))
    assert not target.template.has_markers
    plain = target.prepare(conv, 0)
    assert torch.equal(plain.token_ids, marked.token_ids) and torch.equal(plain.assistant_mask, marked.assistant_mask)
    assert int(plain.assistant_mask.sum()) == 6 and plain.unsupervised_turns == 0


def test_a_reply_carrying_its_ids_is_prepared_with_them(target):
    """A regenerated reply's ids (``token_ids``) replace the processor's encoding of its text, audio runs kept."""
    plain = _conv("a", 12000, 4, "you said two .")
    reply = plain.messages[-1]["content"]
    ids = target.tokenizer.encode(reply, add_special_tokens=False)
    assert target.tokenizer.decode(ids) == reply
    carried = _conv("a", 12000, 4, "you said two .")
    carried.messages[-1] = {**carried.messages[-1], "token_ids": ids}
    p, q = target.prepare(plain, 0), target.prepare(carried, 0)
    assert torch.equal(p.token_ids, q.token_ids) and torch.equal(p.assistant_mask, q.assistant_mask)
    end = target.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert q.token_ids[q.assistant_mask].tolist() == ids + [end]
