"""The demo's capture half in its quick form: target, data with the target's own replies, dataset."""

from __future__ import annotations

import json

import pytest
import torch

from capture.demo import prepare_demo
from capture.inputs import load_audio, read_jsonl
from capture.salm import SALM
from shards.reader import open_dataset


@pytest.mark.slow
def test_quick_demo_builds_caches_and_captures(tmp_path):
    paths = prepare_demo(tmp_path, quick=True, progress=False)
    ds = open_dataset(str(paths.dataset))
    assert sorted(ds.splits) == ["train", "validation"]
    assert ds.num_samples("train") == 12 and ds.num_samples("validation") == 4
    s = ds.sample("train", 0)
    assert s["is_audio"].any() and s["loss_mask"].any() and not (s["is_audio"] & s["loss_mask"]).any()
    assert ds.manifest["layout"]["audio_token_id"] == ds.bundle().audio["audio_token_id"]
    # assistant turns are the target's own greedy replies
    salm = SALM.from_pretrained(paths.target)
    conv = next(iter(read_jsonl(paths.train_manifest, placeholder=salm.config.audio.placeholder)))
    waves = [load_audio(a, target_sr=16000, min_sr=8000)[0] for a in conv.audios]
    with torch.no_grad():
        reply = salm.generate_batch([conv.messages[:-1]], [waves], max_new_tokens=12)[0]
    assert reply.strip() and conv.messages[-1]["content"] == reply
    # second call reuses everything
    mtime = (paths.target / "salm_config.json").stat().st_mtime_ns
    again = prepare_demo(tmp_path, quick=True, progress=False)
    assert (again.target / "salm_config.json").stat().st_mtime_ns == mtime
    assert again.info["capture"] == {"already_complete": True}
    assert json.loads((tmp_path / "demo.json").read_text())["quick"] is True
