"""demo.real.speedup's parts that need no engine: the configuration, the spoken requests for a drafter's data
(held out from the listener's and the drafter's sentences), the prompts stage, and the serve summary. The whole
chain through vLLM on a real target is tests/engines/test_vllm_real.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tapdraft.capture.inputs import BadInput, read_inputs
from tapdraft.demo.real.listen import VOCAB_OOV, ListenConfig, sentences, speech_other, speech_splits
from tapdraft.demo.real.speedup import (SpeedupConfig, decode_rate, format_serve, served_method, served_transcripts,
                               stage_prompts)


def test_config_defaults_follow_the_target_and_bad_values_are_refused():
    assert (SpeedupConfig(target="text").train, SpeedupConfig(target="text").max_tokens) == (1800, 192)
    s = SpeedupConfig(target="speech", recipe="eagle3")
    assert (s.train, s.max_tokens, s.run) == (2400, 32, "eagle3")
    assert (SpeedupConfig(target="assistant").train, SpeedupConfig(target="assistant").max_tokens) == (1200, 128)
    with pytest.raises(ValueError, match="target must be one of"):
        SpeedupConfig(target="video")
    with pytest.raises(ValueError, match="prompts .* must be <= held_out"):
        SpeedupConfig(prompts=65, held_out=64)
    with pytest.raises(ValueError, match="must be >= 1"):
        SpeedupConfig(k=(0,))
    with pytest.raises(ValueError, match="requests must be one of"):
        SpeedupConfig(requests="test")


def test_spoken_requests_hold_out_what_the_listener_and_the_drafter_heard(tmp_path, fake_speech):
    convs = speech_splits(tmp_path, 40, 5, 12)
    assert [len(convs[s]) for s in ("train", "validation", "held_out")] == [40, 5, 12]
    cfg = ListenConfig()
    listener = sentences(cfg.n_train, cfg.n_test, cfg.n_oov, cfg.seed)
    text = {s: [c["reference"] for c in v] for s, v in convs.items()}
    held = set(text["held_out"])
    assert not held & (set(listener["train"]) | set(listener["test"]) | set(text["train"]) | set(text["validation"]))
    assert len(set(text["train"]) | set(text["validation"]) | held) == 57
    assert len(fake_speech) == 57
    (tmp_path / "held_out.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs["held_out"]))
    parsed = list(read_inputs(str(tmp_path / "held_out.jsonl"), placeholder="<|AUDIO|>"))
    assert not [p for p in parsed if isinstance(p, BadInput)]
    first = parsed[0]
    assert first.messages[0] == {"role": "system", "content": "You are a speech recognizer."}
    assert first.messages[1]["content"] == "<|AUDIO|>Transcribe the audio."  # the listener's prompt, no space
    assert first.audios[0].path == str(tmp_path / "audio" / "held_out-00000.wav")
    again = speech_splits(tmp_path, 40, 5, 12)  # a rerun reuses the wavs and gives the same requests
    assert again == convs and len(fake_speech) == 57


def test_the_prompts_stage_writes_each_split_once(tmp_path, fake_speech):
    cfg = SpeedupConfig(target="speech", train=6, validation=2, held_out=3, prompts=3)
    stage_prompts(tmp_path, cfg, log=lambda m: None)
    rows = {s: (tmp_path / "data" / f"{s}.prompts.jsonl").read_text().splitlines()
            for s in ("train", "validation", "held_out")}
    assert [len(v) for v in rows.values()] == [6, 2, 3]
    stage_prompts(tmp_path, cfg, log=lambda m: None)
    assert len(fake_speech) == 11


def test_the_replies_stage_regenerates_every_split_in_one_call(tmp_path, fake_speech, monkeypatch):
    """One ``tapdraft regenerate`` for every split (vLLM starts once), each split's file and sidecar written back in
    its prompts' order; a rerun calls nothing, and ``other`` asked later regenerates alone."""
    import tapdraft.demo.real.speedup as sp
    from tapdraft.demo.real import commands
    from tapdraft.capture.provenance import read_provenance

    calls = []

    def regenerate(*args, log):  # what the engine writes: the conversations with a reply, then the sidecar
        calls.append(args)
        data, out = Path(args[args.index("--data") + 1]), Path(args[args.index("--out") + 1])
        rows = [{**json.loads(x), "reply": "ok"} for x in data.read_text().splitlines()][::-1]  # order by id only
        out.write_text("".join(json.dumps(r) + "\n" for r in rows))
        side = {"complete": True, "replies_from_target": True, "files": [out.name], "dropped": [],
                "counts": {"conversations": len(rows), "written": len(rows), "dropped": {}}}
        out.with_name(out.name.replace(".jsonl", ".regenerate.json")).write_text(json.dumps(side))

    monkeypatch.setattr(commands, "run_cli", regenerate)
    cfg = SpeedupConfig(target="speech", train=6, validation=2, held_out=3, prompts=3)
    stage_prompts(tmp_path, cfg, log=lambda m: None)
    sp.stage_replies(tmp_path, cfg, tmp_path, tmp_path, log=lambda m: None)
    assert len(calls) == 1
    data = tmp_path / "data"
    for split, n in (("train", 6), ("validation", 2), ("held_out", 3)):
        prompts = [json.loads(x)["id"] for x in (data / f"{split}.prompts.jsonl").read_text().splitlines()]
        rows = [json.loads(x) for x in (data / f"{split}.jsonl").read_text().splitlines()]
        assert [r["id"] for r in rows] == prompts and len(rows) == n and all(r["reply"] == "ok" for r in rows)
        assert read_provenance(str(data / f"{split}.jsonl"))["counts"]["written"] == n
    sp.stage_replies(tmp_path, cfg, tmp_path, tmp_path, log=lambda m: None)
    assert len(calls) == 1
    other = SpeedupConfig(target="speech", train=6, validation=2, held_out=3, prompts=3, requests="other")
    stage_prompts(tmp_path, other, log=lambda m: None)
    sp.stage_replies(tmp_path, other, tmp_path, tmp_path, log=lambda m: None)
    assert len(calls) == 2 and calls[1][calls[1].index("--out") + 1].endswith("replies-other.jsonl")
    assert len((data / "other.jsonl").read_text().splitlines()) == 3


def test_the_self_target_trains_on_requests_the_target_wrote_and_checks_on_sharegpts_validation(tmp_path,
                                                                                                monkeypatch):
    """``--target self``: ``tapdraft requests`` writes ``train`` requests, regenerate answers them under the broad
    pool's budget; validation and held-out are the general target's; a rerun makes nothing again."""
    import tapdraft.demo.real.speedup as sp
    from tapdraft.demo.real import commands

    calls = []

    def cli(*args, log):
        calls.append(args)
        out = Path(args[args.index("--out") + 1])
        if args[0] == "requests":
            n = int(args[args.index("--count") + 1])
            out.write_text("".join(json.dumps({"id": f"q{i}", "conversations": [
                {"from": "User", "value": f"request {i}"}, {"from": "Assistant", "value": "?"}]}) + "\n"
                for i in range(n)))
            out.with_name(out.name.replace(".jsonl", ".requests.json")).write_text("{}")
            return
        data = Path(args[args.index("--data") + 1])
        out.write_text("".join(json.dumps({**json.loads(x), "reply": "ok"}) + "\n" for x in data.read_text().splitlines()))
        side = {"complete": True, "replies_from_target": True, "files": [out.name], "dropped": [],
                "counts": {"conversations": 1, "written": 1, "dropped": {}}}
        out.with_name(out.name.replace(".jsonl", ".regenerate.json")).write_text(json.dumps(side))

    monkeypatch.setattr(commands, "run_cli", cli)
    data = tmp_path / "data"
    data.mkdir()
    for split in ("validation", "held_out"):
        (data / f"{split}.prompts.jsonl").write_text(json.dumps({"id": f"{split}0", "conversations": [
            {"from": "User", "value": "hi"}, {"from": "Assistant", "value": "?"}]}) + "\n")
    cfg = SpeedupConfig(target="self", train=5, validation=1, held_out=1, prompts=1)
    sp.stage_replies(tmp_path, cfg, tmp_path / "model", tmp_path / "venv", log=lambda m: None)
    made = [(c[0], Path(c[c.index("--out") + 1]).name) for c in calls]
    assert made == [("regenerate", "validation.jsonl"), ("requests", "requests.jsonl"), ("regenerate", "train.jsonl"),
                    ("regenerate", "replies-held_out.jsonl")]
    assert calls[1][calls[1].index("--count") + 1] == "5"
    assert "--max-conversation-tokens" in calls[2] and "--max-conversation-tokens" in calls[0]
    assert len((data / "train.jsonl").read_text().splitlines()) == 5
    sp.stage_replies(tmp_path, cfg, tmp_path / "model", tmp_path / "venv", log=lambda m: None)
    assert len(calls) == 4


def test_spoken_requests_of_another_kind_hold_words_the_listener_never_heard(tmp_path, fake_speech):
    other = speech_other(tmp_path, 16)
    text = [c["reference"] for c in other]
    cfg = ListenConfig()
    listener = sentences(cfg.n_train, cfg.n_test, cfg.n_oov, cfg.seed)
    assert len(set(text)) == 16 and all(VOCAB_OOV & set(t.split()) for t in text)
    assert not set(text) & set(listener["oov"])  # not the listener's own out-of-vocabulary test
    assert [c["id"] for c in other[:2]] == ["other-00000", "other-00001"]
    assert (tmp_path / "audio" / "other-00015.wav").exists()


def test_the_prompts_stage_adds_the_other_kind_when_asked(tmp_path, fake_speech):
    cfg = SpeedupConfig(target="speech", train=6, validation=2, held_out=3, prompts=3)
    stage_prompts(tmp_path, cfg, log=lambda m: None)
    assert not (tmp_path / "data" / "other.prompts.jsonl").exists()
    stage_prompts(tmp_path, SpeedupConfig(**{**cfg.__dict__, "requests": "other"}), log=lambda m: None)
    assert len((tmp_path / "data" / "other.prompts.jsonl").read_text().splitlines()) == 3
    assert len(fake_speech) == 11 + 3  # the three splits were not spoken again


def test_the_serve_summary_names_both_speeds_and_the_agreement():
    report = {"alone_tokens_per_s": [10.0, 11.0, 12.0], "rounds_equal_to_speculate": True,
              "speculate": {"k": 3, "tau": 2.5, "offline_tau_replayed": 2.5},
              "k=3": {"tokens_per_s": [14.0, 15.0, 16.0], "speedup_median": 1.36, "speedup_pairs": [1.4, 1.36, 1.33],
                      "vllm_tau": 2.5, "greedy_identical": True}}
    out = format_serve(report)
    assert "alone: 11.0 tokens/s" in out and "15.0 tokens/s: 1.36x" in out
    assert "greedy output identical" in out and "rounds equal to it: True" in out
    assert "another kind" not in out and "another kind" in format_serve({**report, "requests": "other"})
    other = {**report, "requests": "other", "speculate": {"k": 3, "tau": 1.4, "offline_tau_replayed": None}}
    assert "tau 1.400 (no offline replay: the requests are not in the dataset)" in format_serve(other)


def test_the_decode_rate_leaves_out_what_comes_before_the_first_token():
    outs = [{"token_ids": [1, 2, 3, 4, 5], "timing": {"scheduled_ts": 0.0, "first_token_ts": 9.0, "last_token_ts": 11.0}},
            {"token_ids": [7], "timing": {"scheduled_ts": 20.0, "first_token_ts": 21.0, "last_token_ts": 21.0}},
            {"token_ids": [1, 2, 3], "timing": {"scheduled_ts": 30.0, "first_token_ts": 35.0, "last_token_ts": 37.0}}]
    assert decode_rate(outs) == (4 + 0 + 2) / (2.0 + 0.0 + 2.0)  # the encoder and prefill (9 s, 1 s, 5 s) excluded
    assert decode_rate([*outs, {"token_ids": [1, 2], "timing": None}]) is None  # no timestamps: no figure made up
    assert decode_rate(outs[1:2]) is None  # one-token replies: no decode to time
    report = {"alone_tokens_per_s": [1.0], "alone_decode_tokens_per_s": [10.0, 12.0, 11.0],
              "k=3": {"tokens_per_s": [1.2], "speedup_median": 1.2, "speedup_pairs": [1.2], "vllm_tau": 2.0,
                      "greedy_identical": True, "decode_speedup_median": 1.8, "decode_speedup_pairs": [1.7, 1.8, 1.9]}}
    assert "over the decode alone (first token to last): 1.80x (pairs 1.70, 1.80, 1.90; the target alone 11.0" \
        in format_serve(report)


def test_served_speech_replies_are_scored_as_transcripts(tmp_path, monkeypatch):
    class Words:  # token id i is word i
        words = ["the", "old", "cat", "sees", "dog", "Dog."]

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(self.words[i] for i in ids)

    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda path: Words())
    prompts = tmp_path / "held_out.prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"h{i}", "reference": r}) + "\n"
                               for i, r in enumerate(["the old cat sees the dog", "the dog"])))
    t = served_transcripts(tmp_path, prompts, ["h1", "h0"], [[0, 5], [0, 2, 3, 0, 4]])
    assert (t["wer"], t["exact"], t["n"]) == (1 / 8, 1, 2)  # "Dog." is "dog"; one word of eight missing
    assert "WER 12.5%, 1/2 exact" in format_serve({"alone_tokens_per_s": [1.0], "transcripts": t})
    prompts.write_text(json.dumps({"id": "h0", "conversations": []}) + "\n")
    assert served_transcripts(tmp_path, prompts, ["h0"], [[0]]) is None  # a text request has no sentence


def test_an_export_is_served_with_the_method_it_states():
    """A DFlash export states method dflash; the stage's default (eagle3) applies only when an export states none."""
    assert served_method({"serve_with": {"vllm": {"method": "dflash", "num_speculative_tokens": 3}}}, "eagle3") == "dflash"
    assert served_method({"serve_with": {"vllm": {"method": "mtp"}}}, "eagle3") == "mtp"
    assert served_method({}, "eagle3") == "eagle3"


def test_the_chain_builds_the_models_its_builders_default_to():
    from tapdraft.demo.real.answer import AnswerConfig
    from tapdraft.demo.real.listen import ListenConfig

    assert (SpeedupConfig.listen_steps, SpeedupConfig.answer_steps) == (ListenConfig.steps, AnswerConfig.steps)


def test_the_demo_sizes_are_the_chain_at_two_sizes():
    """``tapdraft demo --real`` and ``--real --quick``: the full size is the speech LLM that answers; the quick size
    needs no listener trained and makes a general drafter (broad data the target regenerates), serves fewer requests
    with fewer drafter steps, and prints how long the command took."""
    from tapdraft.demo.real.speedup import DEMO_SIZES

    full, quick = DEMO_SIZES["full"], DEMO_SIZES["quick"]
    assert full.target == "assistant" and quick.target == "general"
    assert quick.train < full.train and quick.prompts < full.prompts and quick.max_tokens <= full.max_tokens * 3
    assert any(s.startswith("max_steps=") for s in quick.sets)
    report = {"alone_tokens_per_s": [10.0], "seconds": 930}
    assert "this command: 15.5 minutes" in format_serve(report)


def test_a_work_directory_refuses_another_targets_chain(tmp_path):
    """Stages are cached by name: a work directory that holds one target's chain refuses another target's run in one
    line, before it writes anything, and takes its own target's again."""
    from tapdraft.demo.real.speedup import claim_workdir

    claim_workdir(tmp_path, "text")
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ValueError, match="holds the text target's chain; give the general target another --workdir"):
        claim_workdir(tmp_path, "general")
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    claim_workdir(tmp_path, "text")


def test_speculate_for_the_served_requests_runs_at_the_commands_thread_default(tmp_path, monkeypatch):
    """In-process scoring uses ``tapdraft speculate``'s thread default (half the cores), not torch's every core, and
    gives torch its count back after."""
    import torch

    import tapdraft.speculate.run as run
    from tapdraft.demo.real.speedup import speculate_served

    seen = []
    monkeypatch.setattr("tapdraft.common.host.usable_cores", lambda: 6)
    monkeypatch.setattr(run, "run_speculate", lambda cfg, progress: seen.append(torch.get_num_threads()) or {})
    before = torch.get_num_threads()
    speculate_served(tmp_path / "k.jsonl", tmp_path, tmp_path, tmp_path, 4, 32)
    assert seen == [3] and torch.get_num_threads() == before


def test_regeneration_runs_the_threads_as_engines_of_engine_threads_each():
    assert SpeedupConfig(target="text", threads=4, engine_threads=1).engines == 4
    assert SpeedupConfig(target="text", threads=4, engine_threads=2).engines == 2
    assert SpeedupConfig(target="text", threads=1, engine_threads=2).engines == 1
