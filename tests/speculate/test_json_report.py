"""``speculate --json`` writes the report round by round, as the Python result; its counts sum to its totals, its
round cost is measured; ``eval --round-cost`` says whether the drafter clears it. A tiny Qwen3 captured and
trained for two steps (the drafter is poor: that is the case break-even must catch)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tapdraft.cli import app, main
from tapdraft.speculate.run import REPORT_FORMAT, REPORT_VERSION, SpeculateConfig, run_speculate
from tapdraft.train.config import load_run_config
from tapdraft.train.loop import train
from tests.capture.chat_templates import save_qwen3

pytestmark = pytest.mark.slow  # a capture and a two-step training run, shared by the module (~10 s)

CONVS = [[("User", "What is the capital of France?"), ("Assistant", "Paris is the capital.")],
         [("User", "hello world"), ("Assistant", "good question, the answer is 42")],
         [("User", "How many people live there?"), ("Assistant", "About two million people live in Paris.")]]


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    model = save_qwen3(root / "qwen3", with_template=True)
    convs = root / "convs.jsonl"
    convs.write_text("".join(json.dumps({"id": f"c{i}", "conversations": [{"from": r, "value": v} for r, v in c]})
                             + "\n" for i, c in enumerate(CONVS)))
    data, run = str(root / "data"), str(root / "run")
    res = CliRunner().invoke(app, ["capture", "--target", str(model), "--data", str(convs), "--out", data,
                                   "--top-k", "4"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    train(load_run_config("dflash_demo", overrides=["max_steps=2", "log_every=2", "ckpt_every=2", "progress=false"]),
          data, run)
    return model, convs, data, run


def test_the_json_report_round_trips_and_its_rounds_sum_to_its_totals(chain, tmp_path):
    model, convs, data, run = chain
    path = tmp_path / "out" / "speculate.json"
    path.parent.mkdir()
    r = run_speculate(SpeculateConfig(target=str(model), draft=run, data=data, conversations=str(convs),
                                      max_samples=3, max_new_tokens=12, json_path=str(path)), progress=False)
    doc = json.loads(path.read_text())
    assert doc == r  # exactly the Python result
    assert doc["format"] == REPORT_FORMAT and doc["version"] == REPORT_VERSION == 1
    assert [c["sample_id"] for c in doc["conversations"]] == ["c0", "c1", "c2"]
    t = doc["totals"]
    for key in ("drafted", "accepted", "agreed", "emitted"):
        per = [c[key] for c in doc["conversations"]]
        assert all(len(x) == c["rounds"] for x, c in zip(per, doc["conversations"]))
        assert t[key] == sum(sum(x) for x in per), key
    assert t["rounds"] == sum(c["rounds"] for c in doc["conversations"]) == doc["rounds"] > 0
    assert t["drafted"] == doc["drafts_per_round"] * t["rounds"]
    assert t["emitted"] == t["tokens"] - doc["samples"] == sum(len(c["tokens"]) for c in doc["conversations"]) - 3
    assert doc["tau"] == t["emitted"] / t["rounds"]
    assert all(a <= g for c in doc["conversations"] for a, g in zip(c["accepted"], c["agreed"]))
    cost = doc["cost"]  # the greedy check timed every plain step; every round was timed
    assert cost["rounds_timed"] == t["rounds"] and cost["plain_steps_timed"] == t["tokens"] - 3
    assert cost["round_cost"] == pytest.approx(cost["round_seconds"] / cost["plain_step_seconds"]) and \
        cost["round_cost"] > 0 and "not vLLM" in cost["engine"]
    b = doc["breakeven"]
    assert b["source"] == "measured" and b["breakeven_tau"] == cost["round_cost"] and b["tau"] == doc["tau"]
    assert b["clears"] == (doc["tau"] > cost["round_cost"])


def test_sampling_times_a_few_plain_steps_and_none_when_asked(chain):
    model, convs, data, run = chain
    base = dict(target=str(model), draft=run, data=data, conversations=str(convs), max_samples=2, max_new_tokens=12,
                temperature=1.0)
    r = run_speculate(SpeculateConfig(**base, cost_steps=3), progress=False)
    assert r["cost"]["plain_steps_timed"] == 6 and r["breakeven"]["source"] == "measured"
    r = run_speculate(SpeculateConfig(**base, cost_steps=0), progress=False)
    assert r["cost"]["round_cost"] is None and r["breakeven"] is None
    with pytest.raises(ValueError, match="cost_steps"):
        SpeculateConfig(**base, cost_steps=-1)


def test_the_commands_print_the_break_even_line(chain, tmp_path):
    model, convs, data, run = chain
    path = tmp_path / "s.json"
    out = CliRunner().invoke(app, ["speculate", "--target", str(model), "--draft", run, "--data", data,
                                   "--conversations", str(convs), "--max-samples", "2", "--max-new-tokens", "8",
                                   "--json", str(path)], catch_exceptions=False)
    assert out.exit_code == 0, out.output
    line = [ln for ln in out.output.splitlines() if ln.startswith("break-even tau")]
    assert len(line) == 1 and "(measured: tapdraft's in-process decoding" in line[0]
    assert f"report, round by round: {path}" in out.output
    assert json.loads(path.read_text())["samples"] == 2
    block = load_run_config("dflash_demo").drafter.block_size
    for cost, verdict in ((float(block + 1), "falls short"), (0.5, "clears it")):  # tau lies in [1, block size]
        res = CliRunner().invoke(app, ["eval", "--draft", run, "--data", data, "--out", str(tmp_path / "e"),
                                       "--round-cost", str(cost), "--temperature", "0"], catch_exceptions=False)
        assert res.exit_code == 0, res.output
        assert f"at round cost {cost:.2f} (given: --round-cost); this drafter's tau" in res.output
        assert verdict in res.output
        saved = json.loads((tmp_path / "e" / "eval.json").read_text())["breakeven"]
        assert saved["round_cost"] == cost and saved["clears"] == (verdict == "clears it")


def test_speculate_reads_a_dataset_whose_splits_are_kinds_of_request(chain, tmp_path):
    """A per-kind dataset (one split a kind: no train or evaluation split) serves speculate as the training data
    does: its samples are found by id, so which split names the bundle does not matter."""
    model, convs, data, run = chain
    kinds = str(tmp_path / "kinds")
    res = CliRunner().invoke(app, ["capture", "--target", str(model), "--data", f"alpaca={convs}",
                                   "--data", f"gsm8k={convs}", "--out", kinds, "--top-k", "4"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    cfg = dict(target=str(model), draft=run, conversations=str(convs), max_samples=3, max_new_tokens=12)
    got = run_speculate(SpeculateConfig(data=kinds, **cfg), progress=False)
    want = run_speculate(SpeculateConfig(data=data, **cfg), progress=False)
    assert got["totals"] == want["totals"] and got["offline_tau"] == want["offline_tau"]


def test_speculate_drafts_fewer_when_asked_and_refuses_more_in_one_line(chain, capsys):
    """``--drafts N``: every round drafts N (what an engine serving the export at num_speculative_tokens=N
    drafts), the output stays the target's own, and the offline replay of the same conversations drafts as many."""
    model, convs, data, run = chain
    K = load_run_config("dflash_demo").drafter.block_size - 1
    r = run_speculate(SpeculateConfig(target=str(model), draft=run, data=data, conversations=str(convs),
                                      max_samples=2, max_new_tokens=12, drafts=2), progress=False)
    assert r["drafts_per_round"] == 2 and r["matches_greedy"] == "2/2"
    assert {d for c in r["conversations"] for d in c["drafted"]} == {2}
    assert r["offline_tau_replayed"] == pytest.approx(r["tau"], rel=0.02)  # the replay drafts as many
    with pytest.raises(SystemExit) as e:
        main(["speculate", "--target", str(model), "--draft", run, "--data", data, "--conversations", str(convs),
              "--drafts", str(K + 1)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code != 0 and len(err) == 1 and f"drafts must be 1..{K}" in err[0], err
