"""Template drift is refused: a dataset captured with thinking off (enable_thinking=false) against a
trainer, eval and live decoding given other settings, each as one line naming what differs; the same
settings pass. A tiny Qwen3 in its saved HF layout, its tokenizer carrying the Qwen3 template."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tapdraft.cli import app, main
from tapdraft.train.config import load_run_config
from tapdraft.train.evaluate import evaluate
from tapdraft.train.loop import train
from tests.capture.chat_templates import QWEN3, save_qwen3

pytestmark = pytest.mark.slow  # two captures and a short training run, shared by the module (~15 s)

CONVS = [[("User", "What is the capital of France?"), ("Assistant", "Paris is the capital.")],
         [("User", "hello world"), ("Assistant", "good question, the answer is 42")],
         [("User", "How many people live there?"), ("Assistant", "About two million people live in Paris.")]]


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """Model dir, conversations, a thinking-off and a thinking-on dataset, and a run trained on thinking off."""
    root = tmp_path_factory.mktemp("drift")
    model = save_qwen3(root / "qwen3", with_template=True)
    convs = root / "convs.jsonl"
    convs.write_text("".join(json.dumps({"id": f"c{i}", "conversations": [{"from": r, "value": v} for r, v in c]})
                             + "\n" for i, c in enumerate(CONVS)))
    off, on, run = str(root / "off"), str(root / "on"), str(root / "run")
    for out, extra in ((off, ["--template-kwarg", "enable_thinking=false"]), (on, [])):
        res = CliRunner().invoke(app, ["capture", "--target", str(model), "--data", str(convs), "--out", out,
                                       "--top-k", "4", *extra], catch_exceptions=False)
        assert res.exit_code == 0, res.output
    train(load_run_config("dflash_demo", overrides=["max_steps=2", "log_every=2", "ckpt_every=2", "progress=false"]),
          off, run)
    return model, convs, off, on, run


def _cli_error(monkeypatch, capsys, *argv) -> str:
    monkeypatch.setattr("sys.argv", ["tapdraft", *argv])
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]  # (transformers' weight-loading bar may come first)
    assert line.startswith("error: ")
    return line


def test_speculate_compares_the_live_targets_settings_with_the_datasets(chain, monkeypatch, capsys):
    model, convs, off, _, run = chain
    args = ["speculate", "--target", str(model), "--draft", run, "--data", off, "--conversations", str(convs),
            "--max-samples", "2", "--max-new-tokens", "4"]
    err = _cli_error(monkeypatch, capsys, *args)
    assert err == (f"error: {off} was captured with other chat-template settings: speculate's target (its own "
                   "template or --chat-template, and --template-kwarg) has template kwargs {} (the dataset's are "
                   '{"enable_thinking": false}); use the capture\'s --chat-template/--template-kwarg settings '
                   "(tapdraft inspect shows them) or a dataset captured with yours")
    out = CliRunner().invoke(app, [*args, "--template-kwarg", "enable_thinking=false"], catch_exceptions=False)
    assert out.exit_code == 0 and "output identical to the target's greedy decoding: 2/2" in out.output


def test_train_refuses_a_dataset_against_its_expectation(chain, tmp_path):
    _, _, off, _, _ = chain
    tpl = tmp_path / "qwen3.jinja"
    tpl.write_text(QWEN3 + "\n")  # one byte more than the captured template
    cases = ((["template_kwargs={enable_thinking: true}"], r'template kwargs \{"enable_thinking": true\}'),
             ([f"chat_template={tpl}"], r"chat template sha256 \w+ \(the dataset's is sha256 \w+\)"))
    for overrides, msg in cases:
        cfg = load_run_config("dflash_demo", overrides=["max_steps=1", "progress=false", *overrides])
        with pytest.raises(ValueError, match="was captured with other chat-template settings: this run "
                                             r"\(train.chat_template / train.template_kwargs\) has " + msg):
            train(cfg, off, str(tmp_path / "run"))
        assert not (tmp_path / "run").exists()  # refused before anything was written
    tpl.write_text(QWEN3)
    ok = load_run_config("dflash_demo", overrides=["max_steps=1", "progress=false", f"chat_template={tpl}",
                                                   "template_kwargs={enable_thinking: false}"])
    assert train(ok, off, str(tmp_path / "run2"))["steps"] == 1


def test_eval_refuses_other_settings_than_the_draft_was_trained_with_or_was_given(chain, monkeypatch, capsys):
    _, _, off, on, run = chain
    err = _cli_error(monkeypatch, capsys, "eval", "--draft", run, "--data", on)
    assert err.startswith(f"error: dataset {on} was captured with other chat-template settings: the draft in {run} "
                          'was trained on a dataset that has template kwargs {"enable_thinking": false} (the '
                          "dataset's are {}); use a dataset captured with the settings the draft was trained with")
    err = _cli_error(monkeypatch, capsys, "eval", "--draft", run, "--data", off,
                     "--template-kwarg", "enable_thinking=true")
    assert "the settings given (--chat-template/--template-kwarg) has template kwargs" in err
    assert evaluate(run, off, template=QWEN3, template_kwargs={"enable_thinking": False}, plot=False)["tau"] >= 1.0


def test_resume_refuses_a_dataset_with_other_settings(chain):
    _, _, _, on, run = chain
    same = load_run_config("dflash_demo", overrides=["max_steps=2", "log_every=2", "ckpt_every=2", "progress=false"])
    with pytest.raises(ValueError, match=f"the draft in {run} was trained on a dataset that has template kwargs"):
        train(same, on, run)


def test_the_export_names_the_template_settings_serving_must_use(chain, tmp_path):
    from tapdraft.common.template import template_sha
    from tapdraft.train.drafters.common.export_files import load_export
    from tapdraft.train.export import export_run

    _, _, _, _, run = chain
    export_run(run, tmp_path / "export")
    cfg, _ = load_export(tmp_path / "export")
    assert cfg["tapdraft"]["chat_template"] == {"sha256": template_sha(QWEN3), "kwargs": {"enable_thinking": False}}
