"""tapdraft requests: requests sampled from the target's opening of a user turn, seeded, filtered with counted
reasons, written with a sidecar that regenerate carries on, so a dataset says its requests were the target's."""

from __future__ import annotations

import json

import pytest

from tapdraft.capture.generation import GenerationConfig
from tapdraft.capture.replies.regenerate import RegenerateConfig, regenerate
from tapdraft.capture.replies.requests import (SENTINEL, RequestsConfig, _key, _why_dropped, read_requests_provenance,
                                               user_turn_opening, write_requests)
from tapdraft.capture.replies.windows import ReplyConfig
from tapdraft.capture.targets.load import load_target
from tests.capture.replies.test_regenerate import lm_dir  # noqa: F401  (fixture)


def _cfg(lm, out, **kw) -> RequestsConfig:
    gen = GenerationConfig(max_new_tokens=kw.pop("max_new", 8), temperature=1.0, top_p=1.0, seed=kw.pop("seed", 0))
    return RequestsConfig(target=str(lm), out=str(out), generation=gen, progress=False, **kw)


def test_the_opening_is_what_the_template_writes_before_a_users_words(lm_dir):  # noqa: F811
    target = load_target(str(lm_dir), device="cpu")
    ids = user_turn_opening(target)
    text = target.template.render([{"role": "user", "content": SENTINEL}])
    assert ids == target.template.encode(text[:text.index(SENTINEL)]) and ids
    assert target.tokenizer.decode(ids, skip_special_tokens=False).rstrip().endswith("user")


def test_requests_are_seeded_filtered_and_counted(lm_dir, tmp_path):  # noqa: F811
    a = write_requests(_cfg(lm_dir, tmp_path / "a.jsonl", count=4, min_words=1, max_draws=400, batch_size=32))
    b = write_requests(_cfg(lm_dir, tmp_path / "b.jsonl", count=4, min_words=1, max_draws=400, batch_size=7))
    c = write_requests(_cfg(lm_dir, tmp_path / "c.jsonl", count=4, min_words=1, max_draws=400, seed=1))
    assert (tmp_path / "a.jsonl").read_text() == (tmp_path / "b.jsonl").read_text()  # the batch changes nothing
    assert (tmp_path / "a.jsonl").read_text() != (tmp_path / "c.jsonl").read_text()
    assert a["counts"]["kept"] == 4 and a["counts"]["drawn"] >= 4
    assert a["counts"]["drawn"] - 4 == sum(a["counts"]["dropped"].values())
    assert "truncated" in a["counts"]["dropped"]  # a random model seldom ends its turn within 8 tokens
    recs = [json.loads(x) for x in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert [r["id"] for r in recs] == [f"request-{i:06d}" for i in range(4)]
    assert len({_key(r["conversations"][0]["value"]) for r in recs}) == 4
    assert all([t["from"] for t in r["conversations"]] == ["User", "Assistant"] for r in recs)
    assert read_requests_provenance(tmp_path / "a.jsonl")["method"].startswith("magpie")
    assert b["counts"] == a["counts"] and b["tokens"] == a["tokens"] and c["generation"]["seed"] == 1


def test_drops_say_why():
    seen = {_key("Hello, World!")}
    assert _why_dropped("anything", True, 3, [], set()) == "truncated"
    assert _why_dropped("  ", False, 0, [], set()) == "empty"
    assert _why_dropped("two words", False, 3, [], set()) == "short"
    assert _why_dropped("ask <|im_start|> me", False, 1, ["<|im_start|>"], set()) == "special"
    assert _why_dropped("hello   world", False, 1, [], seen) == "duplicate"
    assert _why_dropped("a fine request here", False, 3, ["<|im_start|>"], seen) is None


def test_regenerate_carries_the_requests_provenance(lm_dir, tmp_path):  # noqa: F811
    write_requests(_cfg(lm_dir, tmp_path / "req.jsonl", count=3, min_words=1, max_draws=400))
    rep = ReplyConfig(generation=GenerationConfig(max_new_tokens=6), keep_truncated=True)
    doc = regenerate(RegenerateConfig(target=str(lm_dir), data=str(tmp_path / "req.jsonl"),
                                      out=str(tmp_path / "out.jsonl"), replies=rep, progress=False))
    assert doc["requests"]["counts"]["kept"] == 3 and doc["requests"]["target_fingerprint"] == doc["target_fingerprint"]


def test_a_request_config_is_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="--temperature 0 would write the same request every time"):
        RequestsConfig(target="t", out="o.jsonl", generation=GenerationConfig(temperature=0.0))
    with pytest.raises(ValueError, match="give a FILE.jsonl"):
        RequestsConfig(target="t", out="o.json")
    with pytest.raises(ValueError, match=r"--max-draws \(2\) must be >= --count \(3\)"):
        RequestsConfig(target="t", out="o.jsonl", count=3, max_draws=2)
