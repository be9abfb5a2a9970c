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
    """One served run: per request its engine seconds, its tokens, its accepted drafts a round (None: alone)."""
    n = len(seconds)
    return {"seconds": sum(seconds), "tokens": sum(tokens), "load_avg": 1.0, "decode": None,
            "outputs": [[7] * t for t in tokens], "prompt_ids": [[1]] * n,
            "spec": [None] * n if accepted is None else [{"per_step_accepted": a} for a in accepted],
            "timing": [{"scheduled_ts": 0.0, "first_token_ts": 0.1 * s, "last_token_ts": s} for s in seconds]}


def test_each_kind_is_timed_on_its_own_requests():
    a = {"alone": [_run([2.0, 2.0], [10, 10], None)] * 2, "k=3": [_run([1.0, 1.0], [10, 10], [[2, 2], [1]])] * 2}
    b = {"alone": [_run([1.0, 1.0], [10, 10], None)] * 2, "k=3": [_run([1.0, 1.0], [10, 10], [[0, 0, 0], [0]])] * 2}
    rows = kind_rows({"a": a, "b": b}, "k=3")
    assert rows["a"]["speedup_median"] == pytest.approx(2.0) and rows["b"]["speedup_median"] == pytest.approx(1.0)
    assert rows["a"]["vllm_tau"] == pytest.approx(1 + 5 / 3) and rows["b"]["vllm_tau"] == pytest.approx(1.0)
    assert rows["a"]["greedy_identical"] and rows["a"]["requests"] == 2
    assert rows["a"]["decode_speedup_median"] == pytest.approx(2.0)  # first token to last: 1.8 s -> 0.9 s
    assert rows["a"]["round_cost"] == pytest.approx(rows["a"]["vllm_tau"] / 2.0)
    h = headline({"a": {"x": 2.0}, "b": {"x": 1.0}, "c": {"x": 1.5}}, "x")
    assert h == {"median": 1.5, "worst": 1.0, "worst_kind": "b"}


def test_every_served_k_gets_its_own_rows_and_headline():
    served = {"a": {"alone": [_run([2.0, 2.0], [10, 10], None)], "k=1": [_run([1.6, 1.6], [10, 10], [[1], [1]])],
                    "k=3": [_run([1.0, 1.0], [10, 10], [[2, 2], [1]])]},
              "b": {"alone": [_run([1.0, 1.0], [10, 10], None)], "k=1": [_run([0.8, 0.8], [10, 10], [[0], [1]])],
                    "k=3": [_run([1.25, 1.25], [10, 10], [[0, 0, 0], [0]])]}}
    one, three = (k_report(kind_rows(served, k)) for k in ("k=1", "k=3"))
    assert one["whole_requests"] == {"median": pytest.approx(1.25), "worst": pytest.approx(1.25), "worst_kind": "a"}
    assert three["whole_requests"]["worst"] == pytest.approx(0.8) and three["whole_requests"]["worst_kind"] == "b"
    assert one["kinds"]["b"]["vllm_tau"] == pytest.approx(1.5) and "decode" in one


def test_each_kind_is_served_in_its_own_engine_sized_to_its_requests(tmp_path, monkeypatch):
    """One serve_pairs a kind, over that kind's requests alone, at its longest prompt plus the reply cap (rounded
    up to ENGINE_LENGTH_STEP), and each kind's rows from its own runs."""
    import benchmarks.per_kind as pk
    from tapdraft.demo.real.speedup import SpeedupConfig

    assert pk.engine_length([[1] * 10, [1] * 300], 192) == 512 and pk.engine_length([[1] * 64], 192) == 256
    (tmp_path / "exports" / "r").mkdir(parents=True)
    (tmp_path / "exports" / "r" / "config.json").write_text(
        json.dumps({"tapdraft": {"serve_with": {"vllm": {"num_speculative_tokens": 3}}}}))
    prompts = {"qa": [[1] * 20] * 2, "sum": [[1] * 900, [1] * 1500]}
    monkeypatch.setattr(pk, "target_dir", lambda cfg, log: tmp_path / "target")
    monkeypatch.setattr("tapdraft.engines.serving.engine_venv", lambda name: tmp_path / "venv")
    monkeypatch.setattr("tapdraft.engines.serving.vllm_requests",
                        lambda target, path, n, audio: ([{"kind": path.stem}] * 2, ["x", "y"], prompts[path.stem]))
    monkeypatch.setattr(pk, "kind_conversations", lambda prompts, n: {"qa": [], "sum": []})
    monkeypatch.setattr(pk, "stage_replies", lambda *a: None)
    monkeypatch.setattr(pk, "stage_capture", lambda *a: tmp_path / "kinds" / "dataset")
    engines = []
    fast = {"qa": 2.0, "sum": 1.0}

    def serve(work, cfg, target, venv, export, requests, log, max_model_len):
        kind = requests[0]["kind"]
        engines.append((kind, len(requests), max_model_len))
        return {"alone": [_run([2.0, 2.0], [10, 10], None)],
                "k=3": [_run([2.0 / fast[kind]] * 2, [10, 10], [[1, 1], [1]])]}

    monkeypatch.setattr(pk, "serve_pairs", serve)
    held = []
    monkeypatch.setattr(pk, "speculate_check", lambda *a, drafts: held.append(drafts) or
                        {"rounds_equal_to_speculate": True, "speculate": {"tau": 1.5}})
    report = pk.run_per_kind(tmp_path, SpeedupConfig(target="general", run="r", max_tokens=192), tmp_path, 2,
                             log=lambda *_: None)
    assert engines == [("qa", 2, 256), ("sum", 2, 1792)] and held == [3, 3]
    assert report["kinds"]["qa"]["speedup_median"] == pytest.approx(2.0)
    assert report["kinds"]["sum"]["speedup_median"] == pytest.approx(1.0)
    assert report["kinds"]["sum"]["max_model_len"] == 1792
    # a stopped benchmark serves only what it had not: each kind's runs are kept once served
    kept = next((tmp_path / "kinds" / "served").iterdir())
    (kept / "sum.json").unlink()
    again = pk.run_per_kind(tmp_path, SpeedupConfig(target="general", run="r", max_tokens=192), tmp_path, 2,
                            log=lambda *_: None)
    assert engines[2:] == [("sum", 2, 1792)] and again["kinds"] == report["kinds"]
    pk.run_per_kind(tmp_path, SpeedupConfig(target="general", run="r", max_tokens=192, pairs=1), tmp_path, 2,
                    log=lambda *_: None)
    assert engines[3:] == [("qa", 2, 256), ("sum", 2, 1792)]  # other settings: served anew


def test_stop_after_capture_makes_the_kinds_data_and_serves_nothing(tmp_path, monkeypatch):
    """The kinds' data needs no drafter (data_scaling trains its runs after it): no run or export exists until the
    capture is made, and serving, which needs one, comes only without --stop-after."""
    import benchmarks.per_kind as pk
    from tapdraft.demo.real.speedup import SpeedupConfig

    done = []
    monkeypatch.setattr(pk, "target_dir", lambda cfg, log: tmp_path / "target")
    monkeypatch.setattr("tapdraft.engines.serving.engine_venv", lambda name: tmp_path / "venv")
    monkeypatch.setattr("tapdraft.engines.serving.vllm_requests", lambda *a: ([], [], [[1]]))
    monkeypatch.setattr(pk, "kind_conversations", lambda prompts, n: {"alpaca": []})
    monkeypatch.setattr(pk, "stage_replies", lambda *a: done.append("replies"))
    monkeypatch.setattr(pk, "stage_capture", lambda *a: done.append("capture") or tmp_path / "kinds" / "dataset")
    monkeypatch.setattr(pk, "serve_pairs", lambda *a, **k: done.append("served"))
    cfg = SpeedupConfig(target="general", run="r")
    assert pk.run_per_kind(tmp_path, cfg, tmp_path, 8, log=lambda *_: None, stop_after="capture") is None
    assert done == ["replies", "capture"]
    (tmp_path / "exports" / "r").mkdir(parents=True)
    (tmp_path / "exports" / "r" / "config.json").write_text("{}")
    with pytest.raises(TypeError):  # without it the serving runs (the stub returns no runs)
        pk.run_per_kind(tmp_path, cfg, tmp_path, 8, log=lambda *_: None)
    assert done[-1] == "served"


def test_a_run_trained_elsewhere_is_exported_on_first_use_and_a_missing_one_is_one_line(tmp_path, monkeypatch,
                                                                                        capsys):
    """A run benchmarks.data_scaling trained (runs/RUN, no export) is exported once, from the work directory's own
    dataset in the asked layout; a run that is not there stops the benchmark with one line naming what to do."""
    import benchmarks.per_kind as pk
    from tapdraft.demo.real import speedup
    from tapdraft.demo.real.speedup import SpeedupConfig

    (tmp_path / "runs" / "r").mkdir(parents=True)
    (tmp_path / "runs" / "r" / "config.json").write_text("{}")
    calls = []

    def run_cli(*args, log):
        calls.append(args)
        out = tmp_path / "exports" / "r"
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(speedup.commands, "run_cli", run_cli)
    cfg = SpeedupConfig(target="general", run="r", layout="tapdraft-vllm")
    for _ in range(2):
        assert speedup.stage_export(tmp_path, cfg, log=lambda *_: None) == tmp_path / "exports" / "r"
    assert calls == [("export", "--draft", str(tmp_path / "runs" / "r"), "--out", str(tmp_path / "exports" / "r"),
                      "--data", str(tmp_path / "dataset"), "--layout", "tapdraft-vllm")]
    with pytest.raises(SystemExit) as e:
        pk.main(["--workdir", str(tmp_path), "--run", "missing", "--prompts", str(tmp_path)])
    assert str(e.value).count("\n") == 0 and "runs/missing" in str(e.value) and "train the run first" in str(e.value)


def test_the_first_k_is_held_against_speculate_and_one_it_cannot_draft_is_refused_before_serving(tmp_path):
    """MTP drafts fewer than trained as vLLM does, so --k 2 of a three-draft MTP export is held against speculate;
    DFlash2 walks its whole block, so --k 2 of its export stops the benchmark in one line, nothing served."""
    import benchmarks.per_kind as pk

    for family in ("mtp", "dflash2"):
        export = tmp_path / "exports" / family
        export.mkdir(parents=True)
        (export / "config.json").write_text(json.dumps(
            {"tapdraft": {"family": family, "serve_with": {"vllm": {"num_speculative_tokens": 3}}}}))
    pk.held_drafts(tmp_path / "exports" / "mtp", 2)
    pk.held_drafts(tmp_path / "exports" / "dflash2", 3)
    with pytest.raises(ValueError, match="1..3"):
        pk.held_drafts(tmp_path / "exports" / "mtp", 4)
    with pytest.raises(SystemExit) as e:
        pk.main(["--workdir", str(tmp_path), "--run", "dflash2", "--prompts", str(tmp_path), "--k", "2,3"])
    assert "dflash2 draft drafts the 3 a round it was trained for, not 2" in str(e.value)
    assert "\n" not in str(e.value) and not (tmp_path / "kinds").exists()
