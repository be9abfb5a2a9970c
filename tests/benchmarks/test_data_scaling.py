"""benchmarks.data_scaling's parts that need no target: a size's run (the work directory's own at its whole split, a
size beyond it refused), the split's counts from the manifest, and the median and worst kind of a curve's row."""

from __future__ import annotations

import json

import pytest

from benchmarks.data_scaling import format_curve, parse_sizes, size_run, split_counts, summary


def _work(tmp_path, samples=40):
    ds = tmp_path / "dataset"
    ds.mkdir()
    (ds / "manifest.json").write_text(json.dumps({"splits": {"train": {"samples": samples, "tokens": 900}}}))
    return tmp_path


def test_the_whole_split_is_the_work_directorys_own_run_and_a_larger_size_is_refused(tmp_path):
    work = _work(tmp_path)
    run = work / "runs" / "dflash_small"
    run.mkdir(parents=True)
    (run / "summary.json").write_text("{}")
    assert size_run(work, 40, "dflash_small", 2) == run
    with pytest.raises(ValueError, match="trains on 40 conversations; asked for a size of 41"):
        size_run(work, 41, "dflash_small", 2)
    assert split_counts(work / "dataset") == {"samples": 40, "tokens": 900, "supervised_tokens": None}


def test_a_smaller_size_derives_its_prefix_then_trains(tmp_path, monkeypatch):
    work = _work(tmp_path)
    calls = []
    monkeypatch.setattr("benchmarks.data_scaling.run_cli", lambda *a, log=print: calls.append(a))
    run = size_run(work, 10, "dflash_small", 2)
    assert run == work / "scaling" / "n10" / "runs" / "dflash_small"
    derive, train = calls
    assert derive[:2] == ("derive", str(work / "dataset")) and derive[-2:] == ("--max-samples", "10")
    assert train[:5] == ("train", "--data", str(work / "scaling" / "n10" / "dataset"), "--recipe", "dflash_small")


def test_overrides_train_every_size_again_under_their_own_name(tmp_path, monkeypatch):
    """A run trained at the recipe's budget is never reused for a curve at another: ``--set`` names the run, at the
    whole split (reading the work directory's dataset, no copy derived) as at a smaller size."""
    work = _work(tmp_path)
    for here in (work / "runs" / "dflash_small", work / "scaling" / "n10" / "runs" / "dflash_small"):
        here.mkdir(parents=True)
        (here / "summary.json").write_text("{}")
    (work / "scaling" / "n10" / "dataset").mkdir()
    (work / "scaling" / "n10" / "dataset" / "manifest.json").write_text("{}")
    calls = []
    monkeypatch.setattr("benchmarks.data_scaling.run_cli", lambda *a, log=print: calls.append(a))
    sets = ("max_steps=1800",)
    assert size_run(work, 40, "dflash_small", 2, sets) == work / "runs" / "dflash_small+max_steps-1800"
    assert size_run(work, 10, "dflash_small", 2, sets) == work / "scaling" / "n10" / "runs" / "dflash_small+max_steps-1800"
    assert [c[0] for c in calls] == ["train", "train"]
    assert calls[0][2] == str(work / "dataset") and calls[0][-2:] == ("--set", "max_steps=1800")
    assert size_run(work, 10, "dflash_small", 2) == work / "scaling" / "n10" / "runs" / "dflash_small"
    assert len(calls) == 2


def test_sizes_are_whole_numbers_or_all():
    assert parse_sizes("932,all,469,932", 1397) == [469, 932, 1397]
    with pytest.raises(ValueError, match="--sizes '469,half': give comma-separated whole numbers"):
        parse_sizes("469,half", 1397)


def test_the_curve_states_the_median_and_the_worst_kind_never_the_best():
    rows = {"a": {"tau": 2.0}, "b": {"tau": 1.2}, "c": {"tau": 3.0}}
    assert summary(rows) == {"median": 2.0, "worst": 1.2, "worst_kind": "b"}
    table = format_curve({10: {"train": {"tokens": 99}, "kinds": rows, **summary(rows)}})
    assert "median" in table and "1.200" in table.splitlines()[1]


def test_the_fit_is_the_training_batches_tau_over_the_last_tenth_of_the_steps(tmp_path):
    from benchmarks.data_scaling import fit_tau

    assert fit_tau(tmp_path) is None  # no metrics: no figure, not a zero
    rows = [{"step": 10 * i, "loss": 1.0, "tau": 1.0 + i / 100} for i in range(1, 21)]
    rows.insert(5, {"step": 55, "eval": {"tau": 9.0}})  # a held-out line is not a training batch
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert fit_tau(tmp_path) == pytest.approx((1.19 + 1.20) / 2)
    kinds = {"a": {"tau": 1.4}}
    table = format_curve({10: {"train": {"tokens": 9}, "kinds": kinds, "fit_tau": 2.09, **summary(kinds)}})
    assert table.splitlines()[0].split()[-1] == "fit" and table.splitlines()[1].split()[-1] == "2.090"


class Stopped(Exception):
    """A stop in the middle of a run."""


def test_scores_are_kept_kind_by_kind_and_a_rerun_scores_only_what_is_missing(tmp_path, monkeypatch):
    import benchmarks.data_scaling as ds
    from benchmarks.per_kind import KINDS

    work = tmp_path
    (work / "kinds" / "dataset").mkdir(parents=True)
    (work / "kinds" / "dataset" / "manifest.json").write_text("{}")
    for kind in KINDS:
        (work / "kinds" / f"{kind}.jsonl").write_text('{"id": 1}\n' * 3)
    run = work / "runs" / "r"
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"checkpoint": "checkpoints/step-0000600"}))
    scored = []

    def speculate(conversations, target, run_, dataset, n, max_tokens):
        kind = conversations.stem
        scored.append(kind)
        if kind == "sum" and scored.count("sum") == 1:
            raise Stopped  # a stop in the middle of the first pass
        return {"tau": 1.0 + KINDS.index(kind) / 10, "offline_same": False}

    monkeypatch.setattr(ds, "speculate_served", speculate)
    cache = work / "scaling" / "n3" / "taus-r.json"
    with pytest.raises(Stopped):
        ds.kind_taus(work, run, work / "target", 16, 192, cache=cache)
    first = list(scored)
    rows = ds.kind_taus(work, run, work / "target", 16, 192, cache=cache)
    assert scored[len(first):] == [k for k in KINDS if k not in first[:-1]]  # the stopped kind and the rest
    assert list(rows) == list(KINDS) and rows["alpaca"] == {"requests": 3, "tau": 1.1, "offline_tau_replayed": None}
    n = len(scored)
    assert ds.kind_taus(work, run, work / "target", 16, 192, cache=cache) == rows and len(scored) == n
    ds.kind_taus(work, run, work / "target", 8, 192, cache=cache)  # other settings: scored again
    assert len(scored) == n + len(KINDS)
