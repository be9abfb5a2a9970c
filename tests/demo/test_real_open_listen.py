"""demo.real.open_listen: which sentences of ShareGPT's requests are heard and which held out, the transcripts, the
voices, the resumable stages, and the chain on a tiny Qwen2-Audio in its real layout (espeak-ng replaced by tones)."""

from __future__ import annotations

import json

import pytest
import torch

from tapdraft.demo.real import listen
from tapdraft.demo.real.broad import HELD_OUT_RESERVE
from tapdraft.demo.real.open_listen import (OpenListenConfig, open_sentences, split_sentences, stage_frames,
                                            stage_sentences, training_pairs, transcript, voice_of)


def test_sentences_keep_spoken_english_words_alone():
    text = ("How can I skip the rows that give an error? Use x = 3 here.\nThis is fine, isn't it! "
            "Too short. Visit https://example.com for the list of things.\nEr hielt ihr stand bis zum Ende.")
    assert split_sentences(text) == ["How can I skip the rows that give an error?", "This is fine, isn't it!"]
    assert split_sentences(" ".join(["word"] * 16 + ["the"])) == []  # 17 words: longer than MAX_WORDS
    assert transcript("This is fine, isn't it!") == "this is fine isn't it"


def _name(i: int) -> str:
    return "".join(chr(97 + (i // 26 ** k) % 26) for k in range(3))


def _records(n: int) -> list[dict]:
    """ShareGPT-shaped records, each request two sentences no other record holds."""
    return [{"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"Please tell me about the topic called {_name(i)} now. "
                                   f"What is the story of the place called {_name(i)[::-1]}x today?"},
        {"from": "gpt", "value": "An answer that is never heard."}]} for i in range(n)]


def test_held_out_sentences_come_from_the_reserved_conversations_and_are_never_trained():
    records = _records(HELD_OUT_RESERVE + 400)
    d, counts = open_sentences(records, n_train=300, n_test=40)
    assert len(d["train"]) == 300 and len(d["test"]) == 40
    assert not {listen.normalise(s) for s in d["train"]} & {listen.normalise(s) for s in d["test"]}
    assert open_sentences(records, n_train=300, n_test=40) == (d, counts)  # a pure function of the seed
    from tapdraft.demo.real.broad import conversations
    import random

    convs, _ = conversations(records)
    random.Random(0).shuffle(convs)
    reserved = {s for c in convs[-HELD_OUT_RESERVE:] for t in c["conversations"] for s in split_sentences(t["value"])}
    assert set(d["test"]) <= reserved and not set(d["train"]) & reserved
    with pytest.raises(ValueError, match="hold .* usable sentences; asked for 100000"):
        open_sentences(records, n_train=100000, n_test=40)


def test_voices_cycle_and_speeds_move_within_the_jitter():
    vs = [voice_of(i, seed=0) for i in range(50)]
    assert [v for v, _ in vs] == [listen.VOICES[i % len(listen.VOICES)][0] for i in range(50)]
    assert all(abs(s - listen.VOICES[i % len(listen.VOICES)][1]) <= 20 for i, (_, s) in enumerate(vs))
    assert len({s for _, s in vs}) > 5 and vs == [voice_of(i, seed=0) for i in range(50)]


def test_closed_pairs_take_their_share_and_point_at_their_sentences(tiny):
    _, proc = tiny
    examples, picks = training_pairs(proc.tokenizer, ["Hello there, my friend."] * 9, ["the cat", "a dog"], 0.1)
    assert len(examples) == 10 and picks == [0]
    assert [e.audio for e in examples] == list(range(10))
    tok = proc.tokenizer
    assert examples[0].reply.tolist() == tok("hello there my friend", add_special_tokens=False)["input_ids"] + [
        tok.convert_tokens_to_ids("<|im_end|>")]
    assert training_pairs(proc.tokenizer, ["a b c d"], ["x"], 0.0)[1] == []
    with pytest.raises(ValueError, match="closed_share"):
        OpenListenConfig(closed_share=1.0)
    with pytest.raises(ValueError, match="frozen_lm"):
        OpenListenConfig(frozen_lm="fp16")
    assert OpenListenConfig(frozen_lm="float32").frozen_dtype() == torch.float32
    assert OpenListenConfig(frozen_lm="bfloat16").frozen_dtype() == torch.bfloat16


def test_stages_resume_and_refuse_another_size(tmp_path, tiny, fake_speech):
    model, proc = tiny
    records = _records(HELD_OUT_RESERVE + 100)
    cfg = OpenListenConfig(n_train=12, n_test=3)
    doc = stage_sentences(tmp_path, cfg, records)
    assert stage_sentences(tmp_path, cfg) == doc  # made once: the records are not read again
    with pytest.raises(ValueError, match="use another --workdir"):
        stage_sentences(tmp_path, OpenListenConfig(n_train=13, n_test=3), records)
    import tapdraft.demo.real.open_listen as ol

    ol_chunk = ol.CHUNK
    ol.CHUNK = 5
    try:
        frames = stage_frames(tmp_path, model, proc.feature_extractor, doc["train"], 0, log=lambda *_: None)
        assert sorted(p.name for p in (tmp_path / "frames").iterdir()) == ["00000.pt", "00001.pt", "00002.pt"]
        assert len(frames) == 12 and all(f.dtype == torch.float16 for f in frames)
        assert [t for t, _, _ in fake_speech] == doc["train"]
        (tmp_path / "frames" / "00001.pt").unlink()  # a stop before the second chunk was written
        again = stage_frames(tmp_path, model, proc.feature_extractor, doc["train"], 0, log=lambda *_: None)
        assert [t for t, _, _ in fake_speech[12:]] == doc["train"][5:10]  # only the missing chunk is spoken
        assert all(torch.equal(a, b) for a, b in zip(frames, again))
    finally:
        ol.CHUNK = ol_chunk
    assert json.loads((tmp_path / "sentences.json").read_text())["made_with"] == {"n_train": 12, "n_test": 3,
                                                                                   "seed": 0}


def test_the_chain_trains_saves_a_loadable_model_and_reports_both_wers(tmp_path, tiny, fake_speech):
    from tests.capture.speech_models import save_qwen2_audio

    from tapdraft.demo.real.open_listen import train_open_listener

    start = tmp_path / "start"
    save_qwen2_audio(start, seed=3)
    work = tmp_path / "work"
    cfg = OpenListenConfig(n_train=6, n_test=2, steps=3, batch=2)
    stage_sentences(work, cfg, _records(HELD_OUT_RESERVE + 20))
    report = train_open_listener(work, cfg, start, log=lambda *_: None)
    assert report["open_held_out"]["n"] == 2 and report["closed_held_out"]["n"] == listen.ListenConfig.n_test
    assert (work / "fit.pt").is_file() and json.loads((work / "listen.json").read_text())["seconds"] >= 0
    from transformers import Qwen2AudioForConditionalGeneration

    trained = Qwen2AudioForConditionalGeneration.from_pretrained(work / "model")
    base = Qwen2AudioForConditionalGeneration.from_pretrained(start)
    changed = {k for k, v in base.state_dict().items() if not torch.equal(v, trained.state_dict()[k])}
    assert changed and all(k.startswith("model.multi_modal_projector.") for k in changed)
    again = train_open_listener(work, cfg, start, log=lambda *_: None)  # resumed at its end: nothing retrained
    assert again["final_loss"] == report["final_loss"]


def test_the_encoders_top_layers_train_from_cached_inputs(tmp_path, tiny, fake_speech):
    """``encoder_layers``: the encoder's top layers and final norm train with the projector, from its log-mel inputs
    (cached in ``mels/``, rebuilt into what ``listen.audio_inputs`` gives); nothing else moves."""
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

    from tests.capture.speech_models import save_qwen2_audio
    from tapdraft.demo.real.open_listen import train_open_listener

    start = tmp_path / "start"
    save_qwen2_audio(start, seed=3, audio={"encoder_layers": 2})  # the lower layer must not move
    base = Qwen2AudioForConditionalGeneration.from_pretrained(start)
    work = tmp_path / "work"
    cfg = OpenListenConfig(n_train=4, n_test=2, steps=2, batch=2, encoder_layers=1, encoder_lr=1e-2)
    doc = stage_sentences(work, cfg, _records(HELD_OUT_RESERVE + 20))
    fe = AutoProcessor.from_pretrained(start).feature_extractor
    cached = stage_frames(work, base, fe, doc["train"], cfg.seed, mels=True)
    tower = base.model.audio_tower
    fresh = listen.audio_inputs(tower, [listen.speak(s, *voice_of(i, cfg.seed)) for i, s in enumerate(doc["train"])], fe)
    with torch.no_grad():
        for a, b in zip(cached, fresh):
            assert torch.allclose(listen.tower_frames(tower, a), listen.tower_frames(tower, b), atol=1e-2)
    assert (work / "mels").is_dir() and not (work / "frames").exists()
    train_open_listener(work, cfg, start, log=lambda *_: None)
    trained = Qwen2AudioForConditionalGeneration.from_pretrained(work / "model")
    changed = {k for k, v in base.state_dict().items() if not torch.equal(v, trained.state_dict()[k])}
    last = f"model.audio_tower.layers.{len(tower.layers) - 1}."
    assert any(k.startswith(last) for k in changed) and any(k.startswith("model.multi_modal_projector.") for k in changed)
    assert all(k.startswith((last, "model.multi_modal_projector.", "model.audio_tower.layer_norm.")) for k in changed)
    with pytest.raises(ValueError, match="encoder_layers"):
        OpenListenConfig(encoder_layers=-1)


def test_the_lms_low_rank_update_trains_with_the_projector_and_is_merged(tmp_path, tiny, fake_speech):
    """``lm_rank``: the LM's linear weights move by a merged low-rank update (the saved model has the checkpoint's
    plain names), the projector moves, the encoder does not; the LM then trains in float32 only."""
    from transformers import Qwen2AudioForConditionalGeneration

    from tests.capture.speech_models import save_qwen2_audio
    from tapdraft.demo.real.open_listen import train_open_listener

    start = tmp_path / "start"
    save_qwen2_audio(start, seed=3)
    base = Qwen2AudioForConditionalGeneration.from_pretrained(start).state_dict()
    work = tmp_path / "work"
    cfg = OpenListenConfig(n_train=4, n_test=2, steps=2, batch=2, lr=1e-2, lm_rank=2)
    stage_sentences(work, cfg, _records(HELD_OUT_RESERVE + 20))
    train_open_listener(work, cfg, start, log=lambda *_: None)
    trained = Qwen2AudioForConditionalGeneration.from_pretrained(work / "model").state_dict()
    assert trained.keys() == base.keys()
    changed = {k for k, v in base.items() if not torch.equal(v, trained[k])}
    lm = [k for k in changed if k.startswith("model.language_model.")]
    assert lm and all(k.endswith(".weight") and "norm" not in k and "embed" not in k for k in lm)
    assert any(k.startswith("model.multi_modal_projector.") for k in changed)
    assert not any(k.startswith("model.audio_tower.") for k in changed)
    assert cfg.frozen_dtype() == torch.float32
    with pytest.raises(ValueError, match="lm_rank trains the LM"):
        OpenListenConfig(lm_rank=2, frozen_lm="bfloat16")


def test_the_benchmark_records_the_chains_own_report(tmp_path, monkeypatch):
    """``benchmarks.listen_open`` runs the chain its flags describe (the same flags as ``python -m tapdraft.demo.real
    listen-open``), from the closed listener, and writes that chain's report with the machine's facts."""
    import benchmarks.common
    import tapdraft.demo.real.listen as listen_mod
    import tapdraft.demo.real.open_listen as open_listen
    from benchmarks.listen_open import main

    asked = []

    def train(work, cfg, start):
        asked.append((work, cfg, start))
        return {"config": {}, "open_held_out": {"wer": 0.42}, "seconds": 7}

    monkeypatch.setattr(listen_mod, "build_listener", lambda root: (tmp_path / "closed", {}))
    monkeypatch.setattr(open_listen, "train_open_listener", train)
    monkeypatch.setattr(benchmarks.common, "RESULTS", tmp_path)
    main(["--workdir", str(tmp_path / "w"), "--sentences", "300", "--steps", "12", "--encoder-layers", "2",
          "--frozen-lm", "float32", "--name", "o.json"])
    assert asked == [(tmp_path / "w", OpenListenConfig(n_train=300, steps=12, encoder_layers=2, frozen_lm="float32"),
                      tmp_path / "closed")]
    doc = json.loads((tmp_path / "o.json").read_text())
    assert doc["open_held_out"]["wer"] == 0.42
    assert "load_avg_before" in doc["machine"] and doc["command"]
