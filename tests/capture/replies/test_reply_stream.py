"""The continuous-batching driver (capture.replies.stream) on CPU, with a stand-in engine that finishes replies
out of order: the same output file as the windowed in-process path, windows written as they settle, the progress
count per reply, and an interrupted run resumed to the same bytes. vLLM itself: tests/engines/test_vllm_regenerate.py.
"""

from __future__ import annotations

import json
import random
from contextlib import contextmanager
from pathlib import Path

import pytest

import tapdraft.capture.replies.regenerate as rg
from tapdraft.capture.engines import DEFAULT_ENGINE, ENGINES
from tapdraft.capture.replies.generate import GenerationConfig, generate
from tapdraft.capture.replies.regenerate import RegenerateConfig, regenerate, work_dir
from tapdraft.capture.replies.windows import ReplyConfig
from tests.capture.replies.test_regenerate import _text_manifest, lm_dir  # noqa: F401  (fixture)
from tests.capture.util import write_manifest


class Shuffled:
    """A ReplyEngine that decodes each prompt alone, greedy, and hands the finished replies back in a seeded random
    order (as a continuous-batching engine does: short replies first, whatever was sent first)."""

    def __init__(self, target, cfg: GenerationConfig, seed: int = 0, die_after: int | None = None):
        self.target, self.cfg, self.rng, self.die_after = target, cfg, random.Random(seed), die_after
        self.queue: list = []
        self.in_flight = self.served = self.most = 0
        self.version, self.startup_s = "shuffled", 0.0

    def stats(self):
        return {"prefix_caching": False, "prompt_tokens": 0, "cached_tokens": 0}

    def submit(self, prompts):
        self.queue += prompts
        self.in_flight += len(prompts)
        self.most = max(self.most, self.in_flight)

    def next(self):
        if self.die_after is not None and self.served == self.die_after:
            raise KeyboardInterrupt("killed")
        tag, p = self.queue.pop(self.rng.randrange(len(self.queue)))
        self.in_flight -= 1
        self.served += 1
        return tag, generate(self.target, [p], self.cfg)[0]


def _cfg(lm, data, out, **kw) -> RegenerateConfig:
    rep = ReplyConfig(generation=GenerationConfig(max_new_tokens=6), keep_truncated=True)
    return RegenerateConfig(target=str(lm), data=str(data), out=str(out), replies=rep, progress=False, **kw)


def _with(monkeypatch, make):
    engines = []

    @contextmanager
    def fake(cfg, target, device):
        engines.append(make(target, cfg.replies.generation))
        yield engines[-1]

    monkeypatch.setattr(ENGINES[DEFAULT_ENGINE], "reply_session", fake)  # a streaming engine in place of in-process
    return engines


def test_streamed_replies_equal_the_windowed_path(lm_dir, tmp_path, monkeypatch):  # noqa: F811
    data = _text_manifest(tmp_path / "in.jsonl", n=11)  # 4 of them two-turn
    ref = regenerate(_cfg(lm_dir, data, tmp_path / "ref.jsonl", window=4))
    written = []
    real_staged = rg.staged

    @contextmanager
    def spy(path):
        with real_staged(path) as tmp:
            yield tmp
        written.append(Path(path).name)

    monkeypatch.setattr(rg, "staged", spy)
    engines = _with(monkeypatch, lambda t, g: Shuffled(t, g, seed=3))
    doc = regenerate(_cfg(lm_dir, data, tmp_path / "out.jsonl", window=4, max_batch_size=3))
    assert (tmp_path / "out.jsonl").read_bytes() == (tmp_path / "ref.jsonl").read_bytes()
    assert doc["counts"] == ref["counts"] and doc["run_stats"]["replies"] == ref["run_stats"]["replies"] == 15
    assert engines[0].most <= 3  # max_batch_size conversations in flight, never more
    parts = [n for n in written if n.startswith("r00000-w")]
    assert len(parts) == 3  # windows of 4, 4, 3 conversations


def test_progress_counts_each_reply(lm_dir, tmp_path, monkeypatch):  # noqa: F811
    data = _text_manifest(tmp_path / "in.jsonl", n=7)  # 3 two-turn: 10 replies
    seen = []
    real = rg.Progress

    class Spy(real):
        def update(self, done, info=None):
            seen.append((done, self.total))
            super().update(done, info)

    monkeypatch.setattr(rg, "Progress", Spy)
    _with(monkeypatch, lambda t, g: Shuffled(t, g))
    regenerate(_cfg(lm_dir, data, tmp_path / "out.jsonl", window=100))
    assert {t for _, t in seen} == {10}
    assert [d for d, _ in seen] == list(range(1, 11))  # one step per reply, within a single window


@pytest.mark.parametrize("die_after", [7, 12])
def test_an_interrupted_stream_resumes_to_the_same_bytes(lm_dir, tmp_path, monkeypatch, die_after):  # noqa: F811
    data = _text_manifest(tmp_path / "in.jsonl", n=11)
    regenerate(_cfg(lm_dir, data, tmp_path / "ref.jsonl", window=2))
    out = tmp_path / "out.jsonl"
    _with(monkeypatch, lambda t, g: Shuffled(t, g, seed=1, die_after=die_after))
    with pytest.raises(KeyboardInterrupt):
        regenerate(_cfg(lm_dir, data, out, window=2, max_batch_size=4))
    kept = sum(len(p.read_text().splitlines()) for p in work_dir(out).glob("r*.jsonl"))
    assert not out.exists() and 0 < kept < 11
    _with(monkeypatch, lambda t, g: Shuffled(t, g, seed=2))
    doc = regenerate(_cfg(lm_dir, data, out, window=2, max_batch_size=4))
    assert out.read_bytes() == (tmp_path / "ref.jsonl").read_bytes()
    assert doc["run_stats"]["conversations"] == 11 - kept  # only the unsettled windows were recomputed


@pytest.mark.parametrize("args, says", [
    (["--engine", "vllm", "--temperature", "0.7"], "--engine vllm regenerates greedily only"),
    (["--engine", "sglang"], "RegenerateConfig.engine must be one of ('transformers', 'vllm')"),
    (["--window", "0"], "RegenerateConfig.window must be >= 1"),
    (["--prefix-caching"], "--prefix-caching is vLLM's prefix cache; add --engine vllm"),
])
def test_the_cli_refuses_in_one_line(tmp_path, capsys, args, says):
    from tapdraft.cli import main

    with pytest.raises(SystemExit) as e:
        main(["regenerate", "--target", str(tmp_path), "--data", str(tmp_path / "in.jsonl"), "--out",
              str(tmp_path / "out.jsonl"), *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and says in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out.jsonl").exists()


def _budget_manifest(path: Path) -> Path:
    """Two-turn conversations whose second request is long, and one whose first request alone passes the budget."""
    long = " ".join(["repeat the digits and add them ."] * 6)
    recs = [{"id": f"b{i}", "conversations": [
        {"from": "User", "value": "what did i say ?"}, {"from": "Assistant", "value": "you said one ."},
        {"from": "User", "value": long}, {"from": "Assistant", "value": "the sum is two ."}]} for i in range(3)]
    recs.append({"id": "first-too-long", "conversations": [{"from": "User", "value": long},
                                                            {"from": "Assistant", "value": "the sum is two ."}]})
    return write_manifest(path, recs)


def test_the_conversation_budget_cuts_at_the_last_reply_that_fits(lm_dir, tmp_path, monkeypatch):  # noqa: F811
    from tapdraft.capture.targets.load import load_target

    data = _budget_manifest(tmp_path / "in.jsonl")
    rep = ReplyConfig(generation=GenerationConfig(max_new_tokens=6), keep_truncated=True, max_conversation_tokens=30)
    doc = regenerate(RegenerateConfig(target=str(lm_dir), data=str(data), out=str(tmp_path / "ref.jsonl"),
                                      replies=rep, progress=False, on_error="skip"))
    assert doc["counts"]["dropped"] == {"over_budget": 1}
    assert doc["counts"]["cut"] == {"conversations": 3, "turns": 3}
    assert doc["settings"]["max_conversation_tokens"] == 30
    target = load_target(str(lm_dir), device="cpu")
    for rec in map(json.loads, (tmp_path / "ref.jsonl").read_text().splitlines()):
        assert [t["from"] for t in rec["conversations"]] == ["user", "assistant"]  # ends at the reply that fit
        msgs = [{"role": t["from"], "content": t["value"]} for t in rec["conversations"]]
        assert len(target.tokenizer.apply_chat_template(msgs, tokenize=True)) <= 30
    # the streaming driver cuts the same conversations at the same turns
    _with(monkeypatch, lambda t, g: Shuffled(t, g, seed=1))
    streamed = regenerate(RegenerateConfig(target=str(lm_dir), data=str(data), out=str(tmp_path / "out.jsonl"),
                                           replies=rep, progress=False, on_error="skip", max_batch_size=2))
    assert (tmp_path / "out.jsonl").read_bytes() == (tmp_path / "ref.jsonl").read_bytes()
    assert streamed["counts"] == doc["counts"]


def test_a_budget_no_turn_fits_is_refused():
    with pytest.raises(ValueError, match=r"--max-conversation-tokens \(6\) must be above --max-new-tokens \(6\)"):
        ReplyConfig(generation=GenerationConfig(max_new_tokens=6), max_conversation_tokens=6)


def test_prefix_caching_is_recorded_and_a_resume_must_match_it(lm_dir, tmp_path, monkeypatch):  # noqa: F811
    """--prefix-caching may change a reply at a near-tie, so it is part of the settings a resume matches (a run begun
    with it is not finished without it) and of the sidecar; a run without it records nothing new."""
    data = _text_manifest(tmp_path / "in.jsonl", 11)
    vllm = ENGINES["vllm"]
    monkeypatch.setattr(vllm, "preflight", lambda cfg: None)
    monkeypatch.setattr(vllm, "loads_decoder", True)  # the stand-in decodes in this process

    @contextmanager
    def fake(cfg, target, device):
        yield Shuffled(target, cfg.replies.generation, die_after=fake.die_after)

    monkeypatch.setattr(vllm, "reply_session", fake)
    out = tmp_path / "out.jsonl"
    fake.die_after = 5
    with pytest.raises(KeyboardInterrupt):
        regenerate(_cfg(lm_dir, data, out, window=2, max_batch_size=4, engine="vllm", prefix_caching=True))
    fake.die_after = None
    with pytest.raises(ValueError, match="prefix_caching=True, this run has prefix_caching=None"):
        regenerate(_cfg(lm_dir, data, out, window=2, max_batch_size=4, engine="vllm"))
    doc = regenerate(_cfg(lm_dir, data, out, window=2, max_batch_size=4, engine="vllm", prefix_caching=True))
    assert doc["settings"]["prefix_caching"] is True and doc["counts"]["written"] == 11
    plain = regenerate(_cfg(lm_dir, data, tmp_path / "plain.jsonl", window=2, max_batch_size=4, engine="vllm"))
    assert "prefix_caching" not in plain["settings"]  # the settings of runs without it are what they were


def test_the_summary_says_what_the_prefix_cache_held():
    doc = {"counts": {"written": 3, "conversations": 3, "dropped": {}}, "files": ["o.jsonl"], "output": "/x/o.jsonl",
           "generation": {"greedy": True, "max_new_tokens": 8}, "target_fingerprint": "f" * 64,
           "replies_from_target": True,
           "run_stats": {"replies": 6, "tokens": 48, "seconds": 2.0,
                         "engine": {"version": "0.32.0", "startup_s": 9.0, "prefix_caching": True,
                                    "prompt_tokens": 1200, "cached_tokens": 768}}}
    assert "prompts: 1,200 tokens, 768 of them from vLLM's prefix cache\n" in rg.summary(doc) + "\n"
    doc["run_stats"]["engine"].update(prefix_caching=False, cached_tokens=0)
    assert "0 of them from vLLM's prefix cache (off: --prefix-caching" in rg.summary(doc)
