"""The demo's capture half in its quick form: target, data with the target's own replies, dataset."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from demo.data import greedy_replies, prepare_demo
from demo.target import QUICK, build_demo_salm
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
        reply = greedy_replies(salm, [conv.messages[:-1]], [waves], max_new_tokens=12)[0]
    assert reply.strip() and conv.messages[-1]["content"] == reply
    # second call reuses everything
    mtime = (paths.target / "salm_config.json").stat().st_mtime_ns
    again = prepare_demo(tmp_path, quick=True, progress=False)
    assert (again.target / "salm_config.json").stat().st_mtime_ns == mtime
    assert again.info["capture"] == {"already_complete": True}
    assert json.loads((tmp_path / "demo.json").read_text())["quick"] is True
    # cached data written in the other reply mode is not valid for this call: refused before any work
    with pytest.raises(ValueError, match="regenerate=True"):
        prepare_demo(tmp_path, quick=True, progress=False, regenerate=False)


def test_greedy_replies_batched_match_unbatched():
    salm = build_demo_salm(QUICK, seed=0).eval()
    rng = np.random.default_rng(3)
    waves = [[rng.normal(0, 0.1, n).astype(np.float32)] for n in (8000, 20000)]
    prompts = [[{"role": "user", "content": "<|audioplaceholder|> what did i say ?"}]] * 2
    both = greedy_replies(salm, prompts, waves, max_new_tokens=6)
    alone = [greedy_replies(salm, [p], [w], max_new_tokens=6)[0] for p, w in zip(prompts, waves)]
    assert both == alone and all(isinstance(r, str) for r in both)
