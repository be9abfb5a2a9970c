"""Capture with template settings: an HF-layout Qwen3 (save_pretrained, tokenizer without a template)
captured with --chat-template and --template-kwarg; settings in bundle, manifest and fingerprint; the
stored mask is the derived one; a split whose every sample is refused leaves no finished dataset."""

from __future__ import annotations

import json

import pytest

from tapdraft.capture.config import CaptureConfig
from tapdraft.capture.pipeline import capture, summary
from tapdraft.capture.targets.load import load_target
from tapdraft.capture.template import ChatTemplate
from tapdraft.shards.manifest import complete_manifest
from tapdraft.shards.reader import open_dataset
from tapdraft.common.template import template_sha
from tapdraft.shards.shard_file import ShardConfig
from tests.capture.chat_templates import QWEN3, end_ids, make_tokenizer, save_qwen3

CONVS = [
    [("System", "You are a helpful assistant."), ("User", "What is the capital of France?"),
     ("Assistant", "Paris is the capital."), ("User", "How many people live there?"),
     ("Assistant", "About two million.")],
    [("User", "hello world"), ("Assistant", "good question, the answer is 42")],
    [("User", "thanks"), ("Assistant", "bye")],
]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return save_qwen3(tmp_path_factory.mktemp("qwen3"))  # its tokenizer has no template: --chat-template gives it


@pytest.fixture()
def inputs(tmp_path):
    path = tmp_path / "convs.jsonl"
    path.write_text("".join(json.dumps({"id": f"c{i}", "conversations": [{"from": r, "value": v} for r, v in c]}) + "\n"
                            for i, c in enumerate(CONVS)))
    tpl = tmp_path / "qwen3.jinja"
    tpl.write_text(QWEN3)
    return path, tpl


def _cfg(model, data, out, **kw):
    return CaptureConfig(target=str(model), out=str(out), data=(("train", str(data)),), top_k=4, progress=False,
                         shard=ShardConfig(shard_bytes=1 << 20), **kw)


def _messages(conv):
    role = {"System": "system", "User": "user", "Assistant": "assistant"}
    return [{"role": role[r], "content": v} for r, v in conv]


def test_a_tokenizer_without_template_needs_the_option(qwen3_dir):
    with pytest.raises(ValueError, match="no chat template; give one with --chat-template FILE"):
        load_target(qwen3_dir)


def test_capture_records_template_and_kwargs_and_stores_the_derived_mask(qwen3_dir, inputs, tmp_path):
    data, tpl = inputs
    off = capture(_cfg(qwen3_dir, data, tmp_path / "off", chat_template=str(tpl),
                       template_kwargs={"enable_thinking": False}))
    on = capture(_cfg(qwen3_dir, data, tmp_path / "on", chat_template=str(tpl)))
    assert off["extra"]["chat_template"] == {"sha256": template_sha(QWEN3), "kwargs": {"enable_thinking": False},
                                             "assistant_mask": "prefix rendering"}
    assert off["capture_config"]["template_kwargs"] == {"enable_thinking": False}
    assert on["extra"]["chat_template"]["kwargs"] == {}
    assert off["fingerprint"] != on["fingerprint"]  # kwargs are part of the target fingerprint
    # the first conversation's first reply loses its think block once a user turn follows: counted, not supervised
    assert off["run_stats"]["train"]["unsupervised_turns"] == 1 == on["run_stats"]["train"]["unsupervised_turns"]
    assert "1 assistant turn(s) left unsupervised" in summary(off)

    tok = make_tokenizer("qwen3")
    for name, kw in (("off", {"enable_thinking": False}), ("on", {})):
        ds = open_dataset(str(tmp_path / name))
        bundle = ds.bundle()
        assert bundle.template_settings == (QWEN3, kw)
        ct = ChatTemplate(tok, QWEN3, kw, end_ids=end_ids(tok, "qwen3"))
        for i, conv in enumerate(CONVS):
            s = ds.sample("train", i)
            want = ct.tokenize(_messages(conv))
            assert s["input_ids"].long().tolist() == want.ids.tolist()
            assert s["loss_mask"].tolist() == want.mask.tolist()
    # thinking on supervises the empty think block of every last turn as well: 6 more tokens per sample
    assert on["splits"]["train"]["supervised_tokens"] > off["splits"]["train"]["supervised_tokens"]


def test_a_split_whose_every_sample_is_refused_fails_and_leaves_no_dataset(qwen3_dir, inputs, tmp_path):
    data, tpl = inputs
    boundary = tmp_path / "colon.jinja"  # the prompt's trailing space merges into the reply's first token
    boundary.write_text("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
                        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    out = tmp_path / "ds"
    cfg = _cfg(qwen3_dir, data, out, chat_template=str(boundary), on_error="skip")
    with pytest.raises(ValueError, match=r"split 'train' has no samples: all 3 input\(s\) were skipped \(first: 'c0': "
                                         r"no supervised tokens: assistant turn 1 of 2: its generation prompt"):
        capture(cfg)
    assert complete_manifest(str(out)) is None and not (out / "manifest.json").exists()
    with pytest.raises(ValueError, match="has no samples"):  # a rerun does not turn it into a dataset either
        capture(cfg)


def test_cli_options_reach_the_dataset_and_inspect_shows_them(qwen3_dir, inputs, tmp_path):
    from typer.testing import CliRunner

    from tapdraft.cli import app

    data, tpl = inputs
    out = tmp_path / "ds"
    r = CliRunner().invoke(app, ["capture", "--target", str(qwen3_dir), "--data", str(data), "--out", str(out),
                                 "--top-k", "4", "--chat-template", str(tpl), "--template-kwarg",
                                 "enable_thinking=false", "--template-kwarg", "date_string=1 Jan 2026"])
    assert r.exit_code == 0, r.output
    assert "1 assistant turn(s) left unsupervised" in r.output
    kw = {"date_string": "1 Jan 2026", "enable_thinking": False}
    assert open_dataset(str(out)).bundle().template_settings == (QWEN3, kw)
    r = CliRunner().invoke(app, ["inspect", str(out)])
    assert r.exit_code == 0 and (f"chat template sha256 {template_sha(QWEN3)[:12]}, kwargs "
                                 '{"date_string": "1 Jan 2026", "enable_thinking": false}') in r.output
    assert "assistant mask from prefix rendering" in r.output
