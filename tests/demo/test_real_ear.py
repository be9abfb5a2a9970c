"""demo.real.ear (Whisper tiny.en's own decoder, the reference an open listener is judged against) and
benchmarks.listen_ear: the ear hears the very waves the listener is scored on, its prompt is the English-only
model's, and the package's model loads and transcribes (the slow test, on the real wheel)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tapdraft.demo.real import listen
from tapdraft.demo.real.broad import HELD_OUT_RESERVE
from tapdraft.demo.real.ear import START, start_ids
from tapdraft.demo.real.open_listen import OpenListenConfig, held_out, stage_sentences, transcript
from tests.demo.test_real_open_listen import _records


def _tokenizer(tokens: list[str]):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    return Tokenizer(WordLevel({t: i for i, t in enumerate(["<unk>", *tokens])}, unk_token="<unk>"))


def test_the_start_is_the_english_only_models_and_a_multilingual_one_is_refused():
    assert start_ids(_tokenizer(list(START))) == [1, 2]
    with pytest.raises(ValueError, match="lacks <\\|notimestamps\\|>: not an English-only Whisper"):
        start_ids(_tokenizer(["<|startoftranscript|>", "<|en|>", "<|transcribe|>"]))


def test_the_held_out_sets_are_spoken_once_and_read_back_the_same(tmp_path, fake_speech):
    cfg = OpenListenConfig(n_train=6, n_test=3)
    doc = stage_sentences(tmp_path, cfg, _records(HELD_OUT_RESERVE + 20))
    sets = held_out(tmp_path, cfg)
    closed = listen.sentences(listen.ListenConfig.n_train, listen.ListenConfig.n_test, listen.ListenConfig.n_oov,
                              listen.ListenConfig.seed)["test"]
    assert {k: (refs, cap) for k, (refs, _, cap) in sets.items()} == {
        "open_held_out": ([transcript(s) for s in doc["test"]], 48), "closed_held_out": (closed, 24)}
    spoken = len(fake_speech)
    assert spoken == 3 + len(closed)
    again = held_out(tmp_path, cfg)
    assert len(fake_speech) == spoken  # read back, not spoken again
    for name, (_, waves, _) in sets.items():
        assert all(np.array_equal(a, b) for a, b in zip(waves, again[name][1], strict=True))


def test_the_benchmark_scores_the_ear_on_the_listeners_sets(tmp_path, monkeypatch, fake_speech):
    import benchmarks.common
    import tapdraft.demo.real.ear as ear
    from benchmarks.listen_ear import main

    class Ear:
        def __init__(self, root, threads):
            pass

        def transcribe(self, waves):
            return ["please tell me"] * len(waves)

    monkeypatch.setattr(ear, "Ear", Ear)
    monkeypatch.setattr(benchmarks.common, "RESULTS", tmp_path)
    work = tmp_path / "w"
    stage_sentences(work, OpenListenConfig(n_train=6, n_test=3), _records(HELD_OUT_RESERVE + 20))
    main(["--workdir", str(work), "--sentences", "6", "--test", "3", "--name", "e.json"])
    doc = json.loads((tmp_path / "e.json").read_text())
    assert doc["open_held_out"]["n"] == 3 and doc["closed_held_out"]["n"] == listen.ListenConfig.n_test
    assert doc["open_held_out"]["examples"][0]["hyp"] == "please tell me" and doc["command"]
    assert 0 < doc["open_held_out"]["wer"] < 1  # "please tell me" opens half the held-out sentences


@pytest.mark.slow
def test_the_packages_whisper_loads_and_transcribes():
    from tapdraft.demo.real.ear import Ear, whisper_dir

    d = whisper_dir()
    assert {"model.bin", "config.json", "tokenizer.json"} <= {p.name for p in d.iterdir()}
    e = Ear()
    assert e.start == [50257, 50362]  # tiny.en's <|startoftranscript|>, <|notimestamps|>
    said = e.transcribe([np.zeros(16000, dtype=np.float32), (0.1 * np.sin(np.arange(32000) / 7)).astype(np.float32)])
    assert len(said) == 2 and all(isinstance(s, str) for s in said)
