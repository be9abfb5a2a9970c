"""A run's life on disk: Ctrl-C / SIGTERM save a checkpoint and say so, a rerun says where it resumes,
a finished run is left alone, metrics.jsonl never logs a step twice, a tap substitution is loud and
recorded."""

import json
import shutil
import signal

import pytest

from dflash_fixtures import tiny_dataset
from tapdraft.common.errors import Interrupted
from tapdraft.train import loop
from tapdraft.train.checkpoints import latest_checkpoint
from tapdraft.train.config import load_run_config
from tapdraft.train.loop import train
from tapdraft.train.run import format_summary

FAST = ["max_tokens=160", "max_batch_size=4", "warmup_steps=2", "progress=false", "log_every=1", "lr=3e-3",
        "num_anchors=8", "max_total_anchors=24", "target_layer_ids=[1]"]


@pytest.fixture(scope="module")
def mem(tmp_path_factory):
    return tiny_dataset(tmp_path_factory.mktemp("mem"), n=12, min_len=16, max_len=28)


def _steps(run_dir):
    return [json.loads(line)["step"] for line in open(run_dir / "metrics.jsonl")]


def _losses(run_dir):
    return [json.loads(line)["loss"] for line in open(run_dir / "metrics.jsonl")]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_saves_a_checkpoint_and_the_rerun_resumes_exactly(tmp_path, mem, monkeypatch, capsys, sig):
    run = load_run_config("dflash_b8", overrides=FAST + ["max_steps=5", "ckpt_every=100"])
    train(run, mem.path, tmp_path / "full")
    real = loop._optimizer_step

    def step(t, tc, step, *a, **kw):
        out = real(t, tc, step, *a, **kw)
        if step == 2:  # the signal lands during step 3: that step finishes, then the run stops
            signal.raise_signal(sig)
        return out

    monkeypatch.setattr(loop, "_optimizer_step", step)
    before = signal.getsignal(sig)  # Python's default, or SIG_IGN where the suite was started in the background
    with pytest.raises(Interrupted,
                       match=rf"stopped by {sig.name} after step 3 of 5; checkpoint saved to .*step-0000003"):
        train(run, mem.path, tmp_path / "cut")
    assert latest_checkpoint(tmp_path / "cut").name == "step-0000003"
    assert not (tmp_path / "cut" / "summary.json").exists()
    assert signal.getsignal(sig) == before  # handlers restored to what they were
    monkeypatch.setattr(loop, "_optimizer_step", real)
    capsys.readouterr()
    s = train(run, mem.path, tmp_path / "cut")
    assert capsys.readouterr().err.splitlines()[0].startswith("resuming from step 3 of 5 (")
    assert s["resumed_from_step"] == 3 and _steps(tmp_path / "cut") == [1, 2, 3, 4, 5]
    assert _losses(tmp_path / "cut") == pytest.approx(_losses(tmp_path / "full"), rel=1e-6, abs=1e-7)


def test_finished_run_is_left_alone(tmp_path, mem, capsys):
    run = load_run_config("dflash_b8", overrides=FAST + ["max_steps=2"])
    first = train(run, mem.path, tmp_path / "r")
    before = (tmp_path / "r" / "summary.json").read_text()
    again = train(run, mem.path, tmp_path / "r")
    assert again["already_complete"] and again["final_loss"] == first["final_loss"] is not None
    assert (tmp_path / "r" / "summary.json").read_text() == before and _steps(tmp_path / "r") == [1, 2]
    assert format_summary(again).startswith("already complete: ")
    assert format_summary(first).startswith("trained dflash to step 2 of 2")


def test_the_tensorboard_command_in_the_summary_is_quoted_for_the_shell():
    text = format_summary({"steps": 1, "max_steps": 1, "tensorboard": "/runs/my run/tensorboard", "curves": "c.png"})
    assert "tensorboard --logdir '/runs/my run/tensorboard'" in text


def test_metrics_never_repeat_a_step_after_a_resume(tmp_path, mem):
    run = load_run_config("dflash_b8", overrides=FAST + ["max_steps=4", "ckpt_every=2", "keep_checkpoints=5"])
    train(run, mem.path, tmp_path / "full")
    shutil.copytree(tmp_path / "full", tmp_path / "crash")
    shutil.rmtree(tmp_path / "crash" / "checkpoints" / "step-0000004")  # killed after logging steps 3-4
    (tmp_path / "crash" / "summary.json").unlink()
    train(run, mem.path, tmp_path / "crash")
    assert _steps(tmp_path / "crash") == [1, 2, 3, 4]
    assert _losses(tmp_path / "crash") == pytest.approx(_losses(tmp_path / "full"), rel=1e-6, abs=1e-7)


def test_tap_substitution_is_loud_and_recorded(tmp_path, mem):
    over = [o for o in FAST if not o.startswith("target_layer_ids")] + ["max_steps=1"]
    run = load_run_config("dflash_b8", overrides=over)  # the rule wants taps the dataset lacks
    with pytest.warns(UserWarning, match=r"dataset stores taps \[1, 3\]: training on \[1\] instead"):
        train(run, mem.path, tmp_path / "r")
    assert json.loads((tmp_path / "r" / "config.json").read_text())["drafter"]["target_layer_ids"] == [1]


def test_a_diverged_run_stops_in_one_line_keeping_its_last_good_checkpoint_and_exports_nothing_non_finite(
        tmp_path, mem, monkeypatch, capsys):
    """A step whose loss and gradients go NaN is not applied: train exits 2 with one line naming the step and the
    checkpoint kept; a checkpoint of non-finite weights is never saved, and one written by an older tapdraft is
    never exported."""
    from tapdraft.cli import main
    from tapdraft.common.errors import DivergedError
    from tapdraft.train.checkpoints import _save, load_checkpoint, nonfinite, save_checkpoint

    real, calls = loop.combine_terms, []

    def poisoned(*a, **kw):
        loss, vals = real(*a, **kw)
        calls.append(1)
        nan = float("nan") if len(calls) == 4 else 1.0
        return loss * nan, {k: v * nan for k, v in vals.items()}

    with pytest.raises(SystemExit) as e:  # an infinite setting is refused before anything starts
        main(["train", "--data", str(mem.path), "--recipe", "dflash_b8", "--out", str(tmp_path / "inf"), "--set",
              "lr=inf"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err == "error: train.lr: inf is not a finite number; give a finite value", err
    assert not (tmp_path / "inf").exists()
    monkeypatch.setattr(loop, "combine_terms", poisoned)
    out = tmp_path / "run"
    args = ["train", "--data", str(mem.path), "--recipe", "dflash_b8", "--out", str(out), "--set", "max_steps=6",
            "--set", "ckpt_every=2", *[a for kv in FAST for a in ("--set", kv)]]
    with pytest.raises(SystemExit) as e:
        main(args)
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error: ")]
    assert e.value.code == 2 and len(err) == 1, err
    assert "training diverged at step 4: loss nan" in err[0] and "step-0000002 is kept" in err[0], err[0]
    assert "lower lr (now 0.003)" in err[0]
    assert latest_checkpoint(out).name == "step-0000002" and not (out / "summary.json").exists()
    ck = load_checkpoint(latest_checkpoint(out))
    assert nonfinite(ck.draft) == []
    name = next(k for k, v in ck.draft.items() if v.is_floating_point())
    ck.draft[name][0] = float("inf")
    with pytest.raises(DivergedError, match=rf"step 2: 1 of \d+ draft tensors are not finite \(first: {name}\)"):
        save_checkpoint(tmp_path / "other", ck, keep=2)
    assert not (tmp_path / "other" / "checkpoints").exists() or not any((tmp_path / "other" / "checkpoints").iterdir())
    _save(ck.to_payload(), latest_checkpoint(out) / "state.pt")  # as a tapdraft that saved anything left it
    with pytest.raises(SystemExit) as e:
        main(["export", "--draft", str(out), "--out", str(tmp_path / "exp")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.startswith("error: ") and "non-finite tensor(s)" in err and "\n" not in err, err
    assert "nothing was exported" in err and not (tmp_path / "exp").exists()
    with pytest.raises(SystemExit) as e:  # nor evaluated: eval printed tau 1.000 for it
        main(["eval", "--draft", str(out), "--data", str(mem.path)])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "non-finite tensor(s)" in err and "nothing was evaluated" in err, err


def test_a_finite_but_exploding_loss_stops_the_run_as_diverged(tmp_path, mem, monkeypatch):
    """A loss that stays finite but leaps past train.diverge_ratio x the first step's loss (what a too-large lr
    gives before it overflows) stops training as a NaN does, before the step is applied; the ratio 0 lets it run."""
    from tapdraft.common.errors import DivergedError

    real, calls = loop.combine_terms, []

    def exploding(*a, **kw):
        loss, vals = real(*a, **kw)
        calls.append(1)
        k = 1e4 if len(calls) >= 4 else 1.0
        return loss * k, {n: v * k for n, v in vals.items()}

    monkeypatch.setattr(loop, "combine_terms", exploding)
    run = load_run_config("dflash_b8", overrides=FAST + ["max_steps=6", "ckpt_every=2"])
    with pytest.raises(DivergedError, match=r"training diverged at step 4: loss [\d.e+]+, gradient norm [\d.e+]+ "
                                            r"\(over [\d.e+]+, train.diverge_ratio times the first step's loss\); "
                                            r"the step was not applied; the last good checkpoint .*step-0000002"):
        train(run, mem.path, tmp_path / "run")
    assert latest_checkpoint(tmp_path / "run").name == "step-0000002"
    calls.clear()
    off = load_run_config("dflash_b8", overrides=FAST + ["max_steps=6", "ckpt_every=2", "diverge_ratio=0"])
    assert train(off, mem.path, tmp_path / "off")["steps"] == 6
    with pytest.raises(ValueError, match=r"train.diverge_ratio must be > 1 \(or 0: off\), got 0.5"):
        load_run_config("dflash_b8", overrides=["diverge_ratio=0.5"])
