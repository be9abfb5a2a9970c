"""The demo's capture half in its quick form: target, data with the target's own replies, dataset."""

from __future__ import annotations

import json

import dataclasses

import pytest

from capture.generate import GenerationConfig, generate
from capture.inputs import read_jsonl
from capture.salm import SALM
from capture.targets import SALMTarget
from demo.data import prepare_demo
from shards.reader import open_dataset


@pytest.mark.slow
def test_quick_demo_builds_caches_and_captures(tmp_path):
    paths = prepare_demo(tmp_path, quick=True, progress=False)
    ds = open_dataset(str(paths.dataset))
    assert sorted(ds.splits) == ["train", "validation"]
    assert 8 <= ds.num_samples("train") <= 12 and 2 <= ds.num_samples("validation") <= 4  # empty replies dropped
    s = ds.sample("train", 0)
    assert s["is_audio"].any() and s["loss_mask"].any() and not (s["is_audio"] & s["loss_mask"]).any()
    assert ds.manifest["layout"]["audio_token_id"] == ds.bundle().audio["audio_token_id"]
    # assistant turns are the target's own greedy replies, written by regenerate (sidecar beside them)
    side = json.loads((paths.data / "train.regenerate.json").read_text())
    assert side["replies_from_target"] is True and side["counts"]["written"] == ds.num_samples("train")
    assert ds.manifest["capture_config"]["responses_from_target"] is True
    target = SALMTarget(SALM.from_pretrained(paths.target))
    conv = next(iter(read_jsonl(paths.train_manifest, placeholder=target.placeholder)))
    prompt = target.prepare_prompt(dataclasses.replace(conv, messages=conv.messages[:-1]), 0)
    gen = generate(target, [prompt], GenerationConfig(max_new_tokens=12))[0]
    assert gen.tokens and conv.messages[-1]["content"] == target.tokenizer.decode(gen.tokens)
    # second call reuses everything
    mtime = (paths.target / "salm_config.json").stat().st_mtime_ns
    again = prepare_demo(tmp_path, quick=True, progress=False)
    assert (again.target / "salm_config.json").stat().st_mtime_ns == mtime
    assert again.info["capture"] == {"already_complete": True}
    assert json.loads((tmp_path / "demo.json").read_text())["quick"] is True
    # cached data written in the other reply mode is not valid for this call: refused before any work
    with pytest.raises(ValueError, match="regenerate=True"):
        prepare_demo(tmp_path, quick=True, progress=False, regenerate=False)
