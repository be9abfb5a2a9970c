"""The demo's capture half in its quick form: target, data with the target's own replies, dataset."""

from __future__ import annotations

import json

import dataclasses

import pytest
import torch

from tapdraft.capture.inputs import read_jsonl
from tapdraft.capture.replies.generate import GenerationConfig, generate
from tapdraft.capture.targets.salm.model import SALM
from tapdraft.capture.targets.salm.target import SALMTarget
from tapdraft.demo.data import one_thread, open_workdir, prepare_demo
from tapdraft.shards.reader import open_dataset


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


def test_a_workdir_is_reused_only_at_the_size_that_built_it(tmp_path):
    root, path, info = open_workdir(tmp_path / "w", "demo.json", quick=True, seed=3, what="demo")
    assert root == tmp_path / "w" and root.is_dir() and info == {"quick": True, "seed": 3}
    path.write_text(json.dumps({**info, "train": {"steps": 1}}))
    assert open_workdir(root, "demo.json", quick=True, seed=4, what="demo")[2] == {"quick": True, "seed": 4,
                                                                                   "train": {"steps": 1}}
    with pytest.raises(ValueError, match=r"w holds a quick BPE target; use another --workdir"):
        open_workdir(root, "demo.json", quick=False, seed=3, what="BPE target")


def test_one_thread_restores_the_callers_count_even_on_error():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(RuntimeError), one_thread():
            assert torch.get_num_threads() == 1
            raise RuntimeError("stop")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
