"""tapdraft regenerate: determinism, kill -9 resume, counted drops, bad input, ranks, one writer per output,
provenance for capture."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tapdraft.capture.inputs import read_inputs, read_jsonl
from tapdraft.capture.replies.generate import GenerationConfig
from tapdraft.capture.replies.regenerate import RegenerateConfig, lock_path, regenerate, work_dir
from tapdraft.capture.replies.windows import RegenerateError, ReplyConfig
from tapdraft.capture.targets.salm.model import SALM
from tapdraft.common.errors import LockedError
from tapdraft.common.lock import exclusive_lock
from tests.capture.util import conv_record, write_manifest, write_wav

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def lm_dir(salm_dir, tmp_path_factory) -> Path:
    """A tiny causal LM in the HF layout (the demo SALM's LM and its word tokenizer)."""
    d = tmp_path_factory.mktemp("lm")
    s = SALM.from_pretrained(salm_dir)
    s.lm.save_pretrained(d)
    s.tokenizer.save_pretrained(d)
    return d


def _text_manifest(path: Path, n: int = 8) -> Path:
    words = ["what did i say ?", "how many digits ?", "what is the sum ?", "repeat the digits and add them ."]
    recs = []
    for i in range(n):
        conv = [{"from": "User", "value": words[i % 4]}, {"from": "Assistant", "value": "you said one ."}]
        if i % 3 == 0:  # multi-turn: both assistant turns are rewritten
            conv += [{"from": "User", "value": words[(i + 1) % 4]}, {"from": "Assistant", "value": "the sum is two ."}]
        recs.append({"id": f"t{i}", "conversations": conv, "keep": i})
    return write_manifest(path, recs)


def _cfg(target, data, out, **kw) -> RegenerateConfig:
    rep = kw.pop("replies", None) or ReplyConfig(generation=GenerationConfig(max_new_tokens=kw.pop("max_new", 6),
                                                                              temperature=kw.pop("temperature", 0.0),
                                                                              seed=kw.pop("seed", 0)),
                                                 keep_truncated=kw.pop("keep_truncated", True))
    return RegenerateConfig(target=str(target), data=str(data), out=str(out), replies=rep, progress=False, **kw)


def test_sampled_runs_with_one_seed_write_the_same_file(lm_dir, tmp_path):
    data = _text_manifest(tmp_path / "in.jsonl")
    a = regenerate(_cfg(lm_dir, data, tmp_path / "a.jsonl", temperature=1.0, seed=7, max_batch_size=3))
    b = regenerate(_cfg(lm_dir, data, tmp_path / "b.jsonl", temperature=1.0, seed=7, max_batch_size=3))
    regenerate(_cfg(lm_dir, data, tmp_path / "c.jsonl", temperature=1.0, seed=8, max_batch_size=3))
    assert a["counts"]["written"] + a["counts"]["dropped"].get("placeholder", 0) == 8 and a["counts"] == b["counts"]
    assert a["counts"]["written"] >= 6
    ta, tb = (tmp_path / "a.jsonl").read_text(), (tmp_path / "b.jsonl").read_text()
    assert ta == tb and ta != (tmp_path / "c.jsonl").read_text()
    recs = [json.loads(x) for x in ta.splitlines()]
    assert [r["keep"] for r in recs] == sorted(r["keep"] for r in recs)
    assert all(r["id"] == f"t{r['keep']}" for r in recs)
    assert all(r["regenerated_by"] == a["target_fingerprint"] for r in recs)
    side = json.loads((tmp_path / "a.regenerate.json").read_text())
    assert side["generation"]["seed"] == 7 and side["replies_from_target"] is False and side["complete"]
    assert not work_dir(tmp_path / "a.jsonl").exists()
    # every assistant turn was rewritten (the input's replies are not the target's)
    convs = list(read_jsonl(tmp_path / "a.jsonl", placeholder="<|audioplaceholder|>"))
    assert all(m["content"] not in ("you said one .", "the sum is two .") for c in convs for m in c.messages
               if m["role"] == "assistant")
    again = regenerate(_cfg(lm_dir, data, tmp_path / "a.jsonl", temperature=1.0, seed=7, max_batch_size=3))
    assert again["run_stats"] == {"already_complete": True}
    with pytest.raises(ValueError, match="other settings"):
        regenerate(_cfg(lm_dir, data, tmp_path / "a.jsonl", temperature=1.0, seed=9))


_KILLER = """
import os, signal, sys
sys.path.insert(0, {root!r})
import tapdraft.capture.replies.regenerate as rg
calls = [0]
orig = rg.process_window
def dying(*a, **k):
    calls[0] += 1
    if calls[0] == {kill_at}:
        os.kill(os.getpid(), signal.SIGKILL)
    return orig(*a, **k)
rg.process_window = dying
from tapdraft.capture.replies.generate import GenerationConfig
from tapdraft.capture.replies.windows import RegenerateError, ReplyConfig
rg.regenerate(rg.RegenerateConfig(target={target!r}, data={data!r}, out={out!r}, window=3, max_batch_size=2,
              replies=ReplyConfig(generation=GenerationConfig(max_new_tokens=6, temperature=1.0, seed=1),
                                  keep_truncated=True), progress=False))
"""


@pytest.mark.slow
def test_kill_9_then_rerun_equals_an_uninterrupted_run(salm_dir, tone_manifest, tmp_path):
    ref = tmp_path / "ref.jsonl"
    regenerate(_cfg(salm_dir, tone_manifest, ref, window=3, max_batch_size=2, temperature=1.0, seed=1))
    out = tmp_path / "killed.jsonl"
    code = _KILLER.format(root=str(ROOT), kill_at=3, target=str(salm_dir), data=str(tone_manifest), out=str(out))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    parts = sorted(work_dir(out).glob("r*.jsonl"))
    assert len(parts) == 2 and not out.exists()  # two windows finished, the third died mid-way
    doc = regenerate(_cfg(salm_dir, tone_manifest, out, window=3, max_batch_size=2, temperature=1.0, seed=1))
    assert doc["run_stats"]["conversations"] == 10 - 6  # only the unfinished windows were computed
    assert out.read_text() == ref.read_text()
    audio = [json.loads(x)["conversations"][0]["audio"][0]["path"] for x in out.read_text().splitlines()]
    assert all((tmp_path / p).is_file() for p in audio)


def test_truncated_and_empty_replies_are_counted_and_dropped(lm_dir, tmp_path):
    data = _text_manifest(tmp_path / "in.jsonl", n=4)
    never_ends = ReplyConfig(generation=GenerationConfig(max_new_tokens=3))
    # random weights never end a reply: nothing is written, and the error says why and what to do
    with pytest.raises(ValueError, match=r"wrote nothing: all 4 conversation\(s\) were dropped \(truncated: 4\)\. "
                       r"The target did not end its replies within --max-new-tokens 3: raise --max-new-tokens"):
        regenerate(_cfg(lm_dir, data, tmp_path / "t.jsonl", replies=never_ends))
    assert not (tmp_path / "t.jsonl").exists() and not (tmp_path / "t.regenerate.json").exists()
    kept = regenerate(_cfg(lm_dir, data, tmp_path / "k.jsonl", replies=ReplyConfig(
        generation=GenerationConfig(max_new_tokens=3), keep_truncated=True)))
    recs = [json.loads(x) for x in (tmp_path / "k.jsonl").read_text().splitlines()]
    assert kept["counts"]["written"] == 4 and sum(bool(r.get("truncated")) for r in recs) == 4
    # a target whose every first token is the end of turn: every reply is empty
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tapdraft.capture.targets.causal_lm import CausalLMTarget

    lm = AutoModelForCausalLM.from_pretrained(lm_dir)
    eos = lm.config.eos_token_id
    with torch.no_grad():
        lm.lm_head.weight.zero_()
        lm.lm_head.weight[eos, 0] = 1.0
        lm.model.norm.weight.fill_(1.0)
    tgt = CausalLMTarget(lm, AutoTokenizer.from_pretrained(lm_dir), lm_dir)
    with pytest.raises(ValueError, match=r"regenerate wrote nothing: all 4 conversation\(s\) were dropped \(empty: 4\)"
                       r"\. The target replied with nothing"):
        regenerate(_cfg(lm_dir, data, tmp_path / "e.jsonl"), target=tgt)
    assert not (tmp_path / "e.jsonl").exists() and not (tmp_path / "e.regenerate.json").exists()
    assert not work_dir(tmp_path / "e.jsonl").exists()


def test_bad_inputs_are_counted_or_fail_in_one_line(salm_dir, tmp_path):
    write_wav(tmp_path / "audio" / "ok.wav", [1, 2], seed=0)
    (tmp_path / "audio" / "broken.wav").write_bytes(b"RIFF not really a wav")
    recs = [conv_record("ok", "audio/ok.wav"), conv_record("broken", "audio/broken.wav"),
            {"id": "nouser", "conversations": [{"from": "Assistant", "value": "hello"},
                                               {"from": "User", "value": "sum"},
                                               {"from": "Assistant", "value": "one ."}]},
            conv_record("missing", "audio/missing.wav"), "{not json"]
    data = write_manifest(tmp_path / "in.jsonl", recs)
    with pytest.warns(UserWarning, match=r"kept only 1 of 5 conversations \(dropped bad_input: 3, no_user_turn: 1\)"
                      r"\. Fix the inputs \(first: 'broken'"):
        doc = regenerate(_cfg(salm_dir, data, tmp_path / "out.jsonl", on_error="skip"))
    assert doc["counts"]["written"] == 1
    assert doc["counts"]["dropped"] == {"bad_input": 3, "no_user_turn": 1}
    assert {d["sample_id"] for d in doc["dropped"]} == {"broken", "nouser", "missing", "in-5"}
    with pytest.raises(RegenerateError, match="bad input .(nouser|broken)"):
        regenerate(_cfg(salm_dir, data, tmp_path / "fail.jsonl"))  # fail is the default, as for capture
    assert not (tmp_path / "fail.jsonl").exists() and not (tmp_path / "fail.regenerate.json").exists()


def test_too_long_for_the_context_is_skipped(lm_dir, tmp_path):
    data = _text_manifest(tmp_path / "in.jsonl", n=2)
    with pytest.raises(ValueError, match=r"dropped \(too_long: 2\)\. The prompts do not fit the target's context"):
        regenerate(_cfg(lm_dir, data, tmp_path / "out.jsonl", max_new=1020, on_error="skip"))  # context 1024


def test_a_second_regeneration_into_the_same_output_is_refused(lm_dir, tmp_path, monkeypatch):
    import tapdraft.capture.replies.regenerate as rg
    data, out = _text_manifest(tmp_path / "in.jsonl", n=2), tmp_path / "out.jsonl"
    refused = []
    orig = rg.process_window

    def racing(*a, **k):  # while the first run works, a second one into the same output
        with pytest.raises(LockedError, match=rf"out.jsonl is in use by a regeneration \(rank 0\) "
                                              rf"\(pid {os.getpid()} on .*one writer per directory") as e:
            regenerate(_cfg(lm_dir, data, out))
        refused.append(str(e.value))
        return orig(*a, **k)

    monkeypatch.setattr(rg, "process_window", racing)
    regenerate(_cfg(lm_dir, data, out))
    assert len(refused) == 1 and "\n" not in refused[0]
    monkeypatch.setattr(rg, "process_window", orig)
    # another process holds it; once that process is killed (-9), its lock is stale and taken over
    other = tmp_path / "other.jsonl"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from tapdraft.capture.replies.regenerate import lock_path
        from tapdraft.common.lock import exclusive_lock
        with exclusive_lock(lock_path({str(other)!r}, 0), "a regeneration (rank 0)"):
            print("held", flush=True)
            time.sleep(60)
    """)], cwd=ROOT, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(LockedError, match=rf"pid {holder.pid} on .*wait for it to finish"):
            regenerate(_cfg(lm_dir, data, other))
        assert not work_dir(other).exists()  # refused before anything was written
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert regenerate(_cfg(lm_dir, data, other))["counts"] == json.loads(
        (tmp_path / "out.regenerate.json").read_text())["counts"]
    with exclusive_lock(lock_path(other, 0), "a check"):  # released at the end of the run
        pass


def test_ranks_take_slices_and_rank0_merges_in_input_order(lm_dir, tmp_path, monkeypatch):
    import tapdraft.capture.replies.regenerate as rg
    data = _text_manifest(tmp_path / "in.jsonl", n=7)
    monkeypatch.setattr(rg, "barrier", lambda world: None)
    out = tmp_path / "shards"
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    r1 = regenerate(_cfg(lm_dir, data, out, shard_size=3))
    assert r1["rank"] == 1 and r1["run_stats"]["conversations"] == 3
    monkeypatch.setenv("RANK", "0")
    doc = regenerate(_cfg(lm_dir, data, out, shard_size=3))
    assert doc["run_stats"]["conversations"] == 4
    assert doc["files"] == [f"regenerated-0000{i}-of-00003.jsonl" for i in range(3)]
    convs = list(read_inputs(str(out), placeholder="<|audioplaceholder|>"))
    keep = [c.record["keep"] for c in convs]
    assert keep == sorted(keep) and len(keep) == doc["counts"]["written"] >= 5
    monkeypatch.setenv("WORLD_SIZE", "1")
    single = regenerate(_cfg(lm_dir, data, tmp_path / "one.jsonl"))
    assert [json.loads(x)["conversations"] for x in (tmp_path / "one.jsonl").read_text().splitlines()] == \
        [c.record["conversations"] for c in convs]
    assert single["counts"] == doc["counts"]


def test_audio_given_as_bytes_is_written_beside_the_output_and_reads_back(tmp_path):
    from tapdraft.capture.inputs import AudioRef, Conversation
    from tapdraft.capture.replies.windows import output_record

    write_wav(tmp_path / "src.wav", [3, 4], seed=2)
    data = (tmp_path / "src.wav").read_bytes()
    conv = Conversation("b1", "hf:x", [{"role": "user", "content": "<|audioplaceholder|> what did i say ?"},
                                       {"role": "assistant", "content": "you said three four ."}],
                        [AudioRef(data=data)], record=None)
    out = tmp_path / "out"
    rec = output_record(conv, conv.messages, out, "<|audioplaceholder|>", "fp", truncated=False)
    path = out / rec["conversations"][0]["audio"][0]["path"]
    assert path.suffix == ".wav" and path.read_bytes() == data
    (out / "x.jsonl").write_text(json.dumps(rec) + "\n")
    back = next(iter(read_jsonl(out / "x.jsonl", placeholder="<|audioplaceholder|>")))
    assert back.messages == conv.messages and Path(back.audios[0].path) == path


def test_template_kwargs_reach_the_prompt_and_the_sidecar(lm_dir, tmp_path):
    """A template variable changes the rendered prompt (so the replies) and is recorded per file."""
    import dataclasses

    from tapdraft.capture.targets.load import load_target

    tgt = load_target(lm_dir)
    template = tmp_path / "t.jinja"
    template.write_text("{% if terse %}{{ 'sum' }}{% endif %}" + tgt.template.text)
    data = _text_manifest(tmp_path / "in.jsonl", n=2)
    rep = ReplyConfig(generation=GenerationConfig(max_new_tokens=4), keep_truncated=True)
    doc = regenerate(_cfg(lm_dir, data, tmp_path / "k.jsonl", replies=rep, chat_template=str(template),
                          template_kwargs={"terse": True}))
    side = json.loads((tmp_path / "k.regenerate.json").read_text())
    assert doc["chat_template"]["kwargs"] == {"terse": True} == side["settings"]["template_kwargs"]
    plain = regenerate(_cfg(lm_dir, data, tmp_path / "p.jsonl", replies=rep))
    assert plain["target_fingerprint"] != doc["target_fingerprint"]  # template and kwargs are in the fingerprint
    conv = next(iter(read_jsonl(data, placeholder="<|audioplaceholder|>")))
    tgt.use_template(template.read_text(), {"terse": True})
    with_kw = tgt.prepare_prompt(dataclasses.replace(conv, messages=conv.messages[:1]), 0)
    tgt.use_template(template.read_text(), {})
    without = tgt.prepare_prompt(dataclasses.replace(conv, messages=conv.messages[:1]), 0)
    assert with_kw.length == without.length + 1


def test_one_output_split_by_id_equals_each_part_regenerated_alone(lm_dir, tmp_path):
    """``split_output``: a greedy regeneration of two splits joined, split back, writes each split's records as a
    regeneration of that split alone would, with a sidecar capture reads as that split's provenance."""
    from tapdraft.capture.provenance import read_provenance, replies_from_target
    from tapdraft.capture.replies.regenerate import split_output

    data = _text_manifest(tmp_path / "in.jsonl", n=6)
    rows = [json.loads(x) for x in data.read_text().splitlines()]
    parts = {"a": [r["id"] for r in rows[:4]][::-1], "b": [r["id"] for r in rows[4:]]}
    regenerate(_cfg(lm_dir, data, tmp_path / "all.jsonl"))
    split_output(tmp_path / "all.jsonl", {n: (ids, tmp_path / f"{n}.jsonl") for n, ids in parts.items()})
    for name, ids in parts.items():
        alone = write_manifest(tmp_path / f"{name}.in.jsonl", [next(r for r in rows if r["id"] == i) for i in ids])
        regenerate(_cfg(lm_dir, alone, tmp_path / f"{name}.alone.jsonl"))
        split = [json.loads(x) for x in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        assert [r["id"] for r in split] == ids  # the order asked for
        assert split == [json.loads(x) for x in (tmp_path / f"{name}.alone.jsonl").read_text().splitlines()]
        doc = read_provenance(str(tmp_path / f"{name}.jsonl"))
        assert doc["counts"] == {"conversations": len(ids), "written": len(ids), "dropped": {}}
        assert doc["files"] == [f"{name}.jsonl"] and doc["split_from"] == "all.jsonl"
    assert replies_from_target([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]) is True
    with pytest.raises(ValueError, match=r"holds no conversation 'nope' of c \(1 missing\)"):
        split_output(tmp_path / "all.jsonl", {"c": (["nope"], tmp_path / "c.jsonl")})
    assert not (tmp_path / "c.jsonl").exists()
    with pytest.raises(ValueError, match=r"is not a complete FILE\.jsonl regeneration; run regenerate to it first"):
        split_output(tmp_path / "a.in.jsonl", {"c": ([], tmp_path / "c.jsonl")})


def test_chunks_joined_equal_one_regeneration_of_the_whole(lm_dir, tmp_path):
    """A pool regenerated in chunks (each its own run) joins into what one run over the whole input writes, with a
    sidecar capture reads as a whole output's; parts of another setup are refused."""
    from tapdraft.capture.provenance import read_provenance, replies_from_target
    from tapdraft.capture.replies.regenerate import join_outputs

    data = _text_manifest(tmp_path / "in.jsonl", n=7)
    rows = [json.loads(x) for x in data.read_text().splitlines()]
    whole = regenerate(_cfg(lm_dir, data, tmp_path / "whole.jsonl"))
    parts = []
    for i, chunk in enumerate((rows[:3], rows[3:])):
        regenerate(_cfg(lm_dir, write_manifest(tmp_path / f"c{i}.in.jsonl", chunk), tmp_path / f"c{i}.jsonl"))
        parts.append(tmp_path / f"c{i}.jsonl")
    doc = join_outputs(parts, tmp_path / "joined.jsonl")
    assert (tmp_path / "joined.jsonl").read_text() == (tmp_path / "whole.jsonl").read_text()
    assert doc["counts"] == whole["counts"] and doc["joined_from"] == ["c0.jsonl", "c1.jsonl"]
    assert read_provenance(str(tmp_path / "joined.jsonl"))["target_fingerprint"] == whole["target_fingerprint"]
    assert replies_from_target([str(tmp_path / "joined.jsonl")]) is True
    regenerate(_cfg(lm_dir, write_manifest(tmp_path / "o.in.jsonl", rows[:2]), tmp_path / "other.jsonl", max_new=5))
    with pytest.raises(ValueError, match=r"other\.jsonl was regenerated with another target or other settings"):
        join_outputs([parts[0], tmp_path / "other.jsonl"], tmp_path / "bad.jsonl")
    assert not (tmp_path / "bad.jsonl").exists()


def test_an_audio_path_that_is_no_regular_file_is_refused_as_what_it_is(salm_dir, tmp_path):
    """regenerate refuses a FIFO, a directory or a device given as audio through the same check as capture
    (``inputs.check_audio_path``), saying what it is: a directory or a device was "does not exist"."""
    from tests.capture.test_capture_guards import SPECIAL_AUDIO, special_audio, within

    man, fifo = special_audio(tmp_path)
    with pytest.warns(UserWarning, match=r"kept only 1 of 4 conversations \(dropped bad_input: 3\)"):
        doc = within(60, lambda: regenerate(_cfg(salm_dir, man, tmp_path / "out.jsonl", on_error="skip")),
                     fifos=[fifo])
    reasons = {d["sample_id"]: d["message"] for d in doc["dropped"]}
    assert reasons.keys() == SPECIAL_AUDIO.keys()
    for sid, what in SPECIAL_AUDIO.items():
        assert f"audio path {tmp_path / (sid + '.wav')} {what}" in reasons[sid], reasons[sid]
    with pytest.raises(RegenerateError, match=r"bad input 'pipe'.*is a FIFO \(named pipe\)"):
        within(60, lambda: regenerate(_cfg(salm_dir, man, tmp_path / "fail.jsonl")), fifos=[fifo])


def test_a_huge_text_turn_is_refused_before_the_tokenizer_sees_it(lm_dir, tmp_path, monkeypatch):
    """A 50 MB text turn aborted regenerate (SIGABRT from the tokenizer) as it did capture: the same bound
    (``ChatTemplate.check_text_size``) makes it a bad input, counted or one line, never tokenized."""
    from tapdraft.capture.targets.load import load_target
    from tests.capture.test_capture_guards import huge_turn, tokenized_lengths

    text = huge_turn(load_target(lm_dir))
    recs = [{"id": "big", "conversations": [{"from": "User", "value": text}, {"from": "Assistant", "value": "x ."}]},
            {"id": "ok", "conversations": [{"from": "User", "value": "what did i say ?"},
                                           {"from": "Assistant", "value": "you said one ."}]}]
    data = write_manifest(tmp_path / "in.jsonl", recs)
    seen = tokenized_lengths(monkeypatch)
    doc = regenerate(_cfg(lm_dir, data, tmp_path / "out.jsonl", on_error="skip"))
    assert doc["counts"]["written"] == 1 and doc["counts"]["dropped"] == {"bad_input": 1}
    (drop,) = doc["dropped"]
    assert drop["sample_id"] == "big"
    assert drop["message"].startswith("too long to tokenize: its text is 1,999,999 characters (turn 1, user")
    with pytest.raises(RegenerateError, match=r"bad input 'big'.*line 1.*too long to tokenize") as e:
        regenerate(_cfg(lm_dir, data, tmp_path / "fail.jsonl"))
    assert "\n" not in str(e.value) and seen and max(seen) < 1000
