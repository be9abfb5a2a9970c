"""benchmarks.per_kind's parts that need no engine: the kinds' requests from a question-set folder (MT-bench with
both turns), a regenerated conversation split into one request a turn, and the per-kind figures of served runs with
the median and the worst kind."""

from __future__ import annotations

import json

import pytest

from benchmarks.per_kind import EVAL_SETS, eval_conversations, headline, k_report, kind_rows, spread, turn_records


def _question_sets(d):
    for kind, name in EVAL_SETS.items():
        rows = [{"question_id": 100 + i, "category": f"c{i // 10}",
                 "turns": [f"{kind} question {i}?"] + ([f"follow-up {i}"] if kind == "mt_bench" else [])}
                for i in range(30)]
        (d / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def test_mt_bench_keeps_both_turns_and_the_others_their_first(tmp_path):
    d = _question_sets(tmp_path)
    mt = eval_conversations(d, "mt_bench", 5)
    assert len(mt) == 3 and [t["from"] for t in mt[0]["conversations"]] == ["User", "Assistant"] * 2
    assert [c["id"] for c in mt] == ["mt_bench-100", "mt_bench-110", "mt_bench-120"]  # spread over categories
    qa = eval_conversations(d, "qa", 4)
    assert len(qa) == 4 and all(len(c["conversations"]) == 2 for c in qa)
    (d / "sum.jsonl").unlink()
    with pytest.raises(FileNotFoundError, match=r"sum\.jsonl is missing: --prompts names a folder"):
        eval_conversations(d, "sum", 4)
    assert spread(list(range(80)), 8) == list(range(0, 80, 10)) and spread([1, 2], 5) == [1, 2]


def test_a_two_turn_reply_becomes_a_request_per_turn():
    rec = {"id": "mt_bench-81", "regenerated_by": "f", "conversations": [
        {"from": "user", "value": "q1"}, {"from": "assistant", "value": "a1", "token_ids": [1, 2]},
        {"from": "user", "value": "q2"}, {"from": "assistant", "value": "a2", "token_ids": [3]}]}
    one, two = turn_records(rec)
    assert one["id"] == "mt_bench-81-1" and one["conversations"] == rec["conversations"][:2]
    assert two["id"] == "mt_bench-81-2" and two["conversations"] == rec["conversations"]
    assert one["regenerated_by"] == "f"


def _run(seconds, tokens, accepted):
    """One served run of four requests: two of kind a, two of kind b."""
    return {"seconds": sum(seconds), "tokens": sum(tokens), "load_avg": 1.0, "decode": None,
            "outputs": [[7] * t for t in tokens], "prompt_ids": [[1]] * 4,
            "spec": [None] * 4 if accepted is None else [{"per_step_accepted": a} for a in accepted],
            "timing": [{"scheduled_ts": 0.0, "first_token_ts": 0.1 * s, "last_token_ts": s} for s in seconds]}


def test_each_kind_is_timed_on_its_own_requests():
    alone = _run([2.0, 2.0, 1.0, 1.0], [10, 10, 10, 10], None)
    fast_a = _run([1.0, 1.0, 1.0, 1.0], [10, 10, 10, 10], [[2, 2], [1], [0, 0, 0], [0]])
    runs = {"alone": [alone, alone], "k=3": [fast_a, fast_a]}
    rows = kind_rows(runs, {"a": [0, 1], "b": [2, 3]}, "k=3")
    assert rows["a"]["speedup_median"] == pytest.approx(2.0) and rows["b"]["speedup_median"] == pytest.approx(1.0)
    assert rows["a"]["vllm_tau"] == pytest.approx(1 + 5 / 3) and rows["b"]["vllm_tau"] == pytest.approx(1.0)
    assert rows["a"]["greedy_identical"] and rows["a"]["requests"] == 2
    assert rows["a"]["decode_speedup_median"] == pytest.approx(2.0)  # first token to last: 1.8 s -> 0.9 s
    assert rows["a"]["round_cost"] == pytest.approx(rows["a"]["vllm_tau"] / 2.0)
    h = headline({"a": {"x": 2.0}, "b": {"x": 1.0}, "c": {"x": 1.5}}, "x")
    assert h == {"median": 1.5, "worst": 1.0, "worst_kind": "b"}


def test_every_served_k_gets_its_own_rows_and_headline():
    alone = _run([2.0, 2.0, 1.0, 1.0], [10, 10, 10, 10], None)
    k1 = _run([1.6, 1.6, 0.8, 0.8], [10, 10, 10, 10], [[1], [1], [0], [1]])
    k3 = _run([1.0, 1.0, 1.25, 1.25], [10, 10, 10, 10], [[2, 2], [1], [0, 0, 0], [0]])
    runs = {"alone": [alone], "k=1": [k1], "k=3": [k3]}
    one, three = (k_report(kind_rows(runs, {"a": [0, 1], "b": [2, 3]}, k)) for k in ("k=1", "k=3"))
    assert one["whole_requests"] == {"median": pytest.approx(1.25), "worst": pytest.approx(1.25), "worst_kind": "a"}
    assert three["whole_requests"]["worst"] == pytest.approx(0.8) and three["whole_requests"]["worst_kind"] == "b"
    assert one["kinds"]["b"]["vllm_tau"] == pytest.approx(1.5) and "decode" in one


def test_stop_after_capture_makes_the_kinds_data_and_serves_nothing(tmp_path, monkeypatch):
    import benchmarks.per_kind as pk
    from tapdraft.demo.real.speedup import SpeedupConfig

    (tmp_path / "exports" / "r").mkdir(parents=True)
    (tmp_path / "exports" / "r" / "config.json").write_text("{}")
    done = []
    monkeypatch.setattr(pk, "target_dir", lambda cfg, log: tmp_path / "target")
    monkeypatch.setattr("tapdraft.engines.serving.engine_venv", lambda name: tmp_path / "venv")
    monkeypatch.setattr("tapdraft.engines.serving.vllm_requests", lambda *a: ([], [], []))
    monkeypatch.setattr(pk, "kind_conversations", lambda prompts, n: {"alpaca": []})
    monkeypatch.setattr(pk, "stage_replies", lambda *a: done.append("replies"))
    monkeypatch.setattr(pk, "stage_capture", lambda *a: done.append("capture") or tmp_path / "kinds" / "dataset")
    monkeypatch.setattr(pk, "serve_pairs", lambda *a, **k: done.append("served"))
    cfg = SpeedupConfig(target="general", run="r")
    assert pk.run_per_kind(tmp_path, cfg, tmp_path, 8, log=lambda *_: None, stop_after="capture") is None
    assert done == ["replies", "capture"]
    with pytest.raises(TypeError):  # without it the serving runs (the stub returns no runs)
        pk.run_per_kind(tmp_path, cfg, tmp_path, 8, log=lambda *_: None)
    assert done[-1] == "served"
