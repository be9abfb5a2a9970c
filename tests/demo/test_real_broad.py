"""demo.real.broad without the wheel or an engine: a cut-off JSON array decoded record by record, ShareGPT's records
turned into conversations (each rule counted), splits whose pool prefix no held-out size moves, and a pool regenerated
in chunks that a larger size reuses."""

from __future__ import annotations

import json

import pytest

import tapdraft.demo.real.broad as broad
from tapdraft.capture.provenance import sidecar_path
from tapdraft.demo.real.prompts import PENDING


def _rec(i, *turns):
    return {"id": f"r{i}", "conversations": [{"from": f, "value": v} for f, v in turns]}


def test_a_cut_off_array_gives_its_complete_records():
    whole = json.dumps([_rec(0, ("human", "hi")), _rec(1, ("human", "a, b"), ("gpt", "[c]"))], indent=2)
    assert broad.decode_records(whole) == ([json.loads(whole)[0], json.loads(whole)[1]],
                                           {"records": 2, "cut_off": False, "unread_chars": 0})
    cut = whole[: whole.index('"a, b"') + 3]
    records, info = broad.decode_records(cut)
    assert records == [json.loads(whole)[0]] and info["cut_off"] and info["unread_chars"] > 0
    assert broad.decode_records("[]")[0] == []
    with pytest.raises(ValueError, match="not a JSON array"):
        broad.decode_records('{"id": 1}')


def test_sharegpt_records_become_conversations_by_counted_rules():
    records = [
        _rec(0, ("gpt", "part two opens here"), ("human", "why?"), ("bing", "because."), ("human", "trailing")),
        _rec(1, ("human", "q"), ("gpt", "a"), ("human", "q2"), ("chatgpt", "a2")),
        _rec(2, ("human", "q"), ("robot", "a")),
        _rec(3, ("human", "   "), ("gpt", "a")),
        _rec(4, ("human", "Как дела? Расскажи о себе подробно."), ("gpt", "a")),
        _rec(1, ("human", "again"), ("gpt", "a")),
        _rec(5, ("gpt", "only the assistant")),
    ]
    convs, dropped = broad.conversations(records)
    assert [c["id"] for c in convs] == ["sharegpt-r0", "sharegpt-r1"]
    assert convs[0]["conversations"] == [{"from": "User", "value": "why?"}, {"from": "Assistant", "value": PENDING}]
    assert [t["from"] for t in convs[1]["conversations"]] == ["User", "Assistant"] * 2
    assert all(t["value"] == PENDING for c in convs for t in c["conversations"] if t["from"] == "Assistant")
    assert dropped == {"unknown_role": 1, "empty_turn": 1, "english": 1, "repeated_id": 1, "no_request": 1}


def test_held_out_requests_never_move_the_pool(monkeypatch):
    records = [_rec(i, ("human", f"request {i}"), ("gpt", "a"), ("human", f"more {i}"), ("gpt", "b"))
               for i in range(400)]
    monkeypatch.setattr(broad, "sharegpt_records", lambda root=None: (records, {"records": 400, "cut_off": True}))
    a, counts = broad.sharegpt_splits(10)
    b, _ = broad.sharegpt_splits(10, held_out=5)
    assert a["pool"] == b["pool"] and len(a["pool"]) == 400 - 10 - broad.HELD_OUT_RESERVE
    assert counts["kept"] == 400 and a["validation"] == b["validation"]
    ids = {c["id"] for c in b["pool"] + b["validation"]}
    assert len(b["held_out"]) == 5 and not ids & {c["id"] for c in b["held_out"]}
    assert all([t["from"] for t in c["conversations"]] == ["User", "Assistant"] for c in b["held_out"])
    with pytest.raises(ValueError, match="at most 256"):
        broad.sharegpt_splits(10, held_out=257)


def test_the_pool_grows_by_whole_chunks(monkeypatch, tmp_path):
    from tapdraft.demo.real import commands

    calls = []

    def fake_cli(*args, log=print):
        out = args[args.index("--out") + 1]
        calls.append(out)
        sidecar_path(out).write_text("{}")

    monkeypatch.setattr(commands, "run_cli", fake_cli)
    monkeypatch.setattr(broad, "POOL_CHUNK", 4)
    pool = [_rec(i, ("human", "q"), ("gpt", PENDING)) for i in range(20)]
    kw = dict(target=tmp_path / "t", venv=tmp_path / "v", log=lambda m: None)
    first = broad.regenerate_pool(tmp_path / "pool", pool, 10, **kw)
    assert [p.name for p in first] == ["chunk-00000.jsonl", "chunk-00001.jsonl", "chunk-00002-2.jsonl"]
    assert len(calls) == 3
    again = broad.regenerate_pool(tmp_path / "pool", pool, 12, **kw)
    assert [p.name for p in again] == ["chunk-00000.jsonl", "chunk-00001.jsonl", "chunk-00002.jsonl"]
    assert calls[3:] == [str(tmp_path / "pool" / "chunk-00002.jsonl")]  # the whole chunks made once
    prompts = [json.loads(x) for x in (tmp_path / "pool" / "chunk-00001.prompts.jsonl").read_text().splitlines()]
    assert prompts == pool[4:8]
    with pytest.raises(ValueError, match="the pool holds 20 conversations; asked for 21"):
        broad.regenerate_pool(tmp_path / "pool", pool, 21, **kw)
