"""Where break-even lies: a round costing R plain decode steps pays off only when tau > R; eval says so at a given
cost (or tabulates a few), speculate at the cost it measures, and a tau below break-even falls short."""

import math

import pytest

from tapdraft.speculate.run import cost_line
from tapdraft.train.acceptance import ROUND_COSTS, breakeven, breakeven_text
from tapdraft.train.evaluate import breakeven_of, format_result as format_eval


def test_a_tau_below_the_round_cost_falls_short_and_one_above_clears_it():
    short = breakeven(1.6, 2.05, "given")  # DFlash-like cost, EAGLE-3-like tau
    assert short["breakeven_tau"] == 2.05 and not short["clears"]
    assert math.isclose(short["speedup"], 1.6 / 2.05)
    assert breakeven_text(short, "--round-cost") == ("break-even tau 2.05 at round cost 2.05 (given: --round-cost); "
                                                     "this drafter's tau 1.600: falls short by 22% (expected speedup "
                                                     "0.78x)")
    high = breakeven(2.5, 1.6, "measured")
    assert high["clears"] and "clears it by 56% (expected speedup 1.56x)" in breakeven_text(high)
    assert not breakeven(2.0, 2.0, "given")["clears"]  # exactly at break-even: no gain
    with pytest.raises(ValueError, match="> 0"):
        breakeven(2.0, 0.0, "given")


def _eval(tau_replayed):
    return {"tau": 2.628, "tau_replayed": tau_replayed, "family": "dflash", "step": 40, "split": "validation",
            "samples": 8, "blocks": 90, "alpha": [0.8, 0.5, 0.0], "reached": [90, 60, 5], "note": "n"}


def test_eval_says_whether_the_replayed_tau_clears_a_given_round_cost():
    r = _eval(1.63)
    r.update(breakeven_of(r, 1.6))
    assert r["breakeven"]["tau_kind"] == "replayed" and r["breakeven"]["tau"] == 1.63 and r["breakeven"]["clears"]
    assert "break-even tau 1.60 at round cost 1.60 (given: --round-cost); this drafter's tau 1.630: clears it by 2%" \
        in format_eval(r)
    r = _eval(1.63)
    r.update(breakeven_of(r, 2.05))
    assert "falls short by 20%" in format_eval(r) and not r["breakeven"]["clears"]


def test_eval_without_a_round_cost_tabulates_the_speedup_and_says_where_it_pays_off():
    r = _eval(None)  # nothing replayed: the teacher-forced tau, labelled
    r.update(breakeven_of(r, None))
    table = r["breakeven_table"]
    assert [b["round_cost"] for b in table] == list(ROUND_COSTS) and all(b["source"] == "assumed" for b in table)
    assert [b["clears"] for b in table] == [r_ < 2.628 for r_ in ROUND_COSTS]
    line = [ln for ln in format_eval(r).splitlines() if ln.startswith("break-even")][0]
    assert "not given: --round-cost R" in line and "2.628 (teacher-forced)" in line and "R 2.05: 1.28x" in line
    assert line.endswith("it pays off only where R < 2.628")


def test_speculate_prints_the_measured_break_even_or_why_there_is_none():
    cost = {"engine": "tapdraft's in-process decoding (transformers, batch 1) on cpu, not vLLM",
            "round_seconds": 0.0041, "plain_step_seconds": 0.002, "round_cost": 2.05}
    line = cost_line({"cost": cost, "breakeven": breakeven(1.2, 2.05, "measured")})
    assert line.startswith("break-even tau 2.05 at round cost 2.05 (measured: tapdraft's in-process decoding")
    assert "a round 4.10 ms over 2.00 ms a plain step" in line and "falls short by 41%" in line
    assert cost_line({"cost": {**cost, "round_cost": None}, "breakeven": None}).startswith("break-even: not measured")


def test_eval_refuses_a_round_cost_that_is_not_positive_before_loading_anything(tmp_path):
    from tapdraft.train.evaluate import evaluate

    with pytest.raises(ValueError, match="--round-cost is a round's time over a plain decode step's"):
        evaluate(tmp_path / "no-run", str(tmp_path / "no-data"), round_cost=0.0)
