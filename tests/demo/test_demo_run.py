"""The README's main job, shrunk: target -> capture -> DFlash training -> offline + live tau -> export."""

import json

import pytest

from demo.run import format_demo, run_demo


@pytest.mark.slow
@pytest.mark.integration
def test_quick_demo_runs_end_to_end(tmp_path):
    r = run_demo(tmp_path / "demo", quick=True, progress=False)
    off, live = r["offline"], r["live"]
    B = off["block_size"]
    assert 1.0 <= off["tau"] <= B and len(off["alpha"]) == B - 1
    assert off["responses_by_target"] is True  # the demo replies are the target's own; the manifest says so
    assert live["samples"] == 4 and live["matches_greedy"] == "4/4"  # speculative greedy == target greedy
    assert 1.0 <= live["tau"] <= B
    # the offline replay of decoding rounds predicts live decoding (equal but for bf16-stored taps)
    assert abs(live["tau"] - off["tau_replayed"]) <= 0.02 * off["tau_replayed"], (live["tau"], off["tau_replayed"])
    assert (tmp_path / "demo" / "export" / "dflash" / "model.safetensors").is_file()
    cfg = json.loads((tmp_path / "demo" / "export" / "dflash" / "config.json").read_text())
    assert cfg["block_size"] == B and cfg["target_layer_ids_vllm"] == [i + 1 for i in cfg["target_layer_ids"]]
    text = format_demo(r)
    assert "acceptance length (tau)" in text
    # a second run reuses everything it can and gives the same offline figure
    again = run_demo(tmp_path / "demo", quick=True, progress=False)
    assert again["offline"]["tau"] == off["tau"]
