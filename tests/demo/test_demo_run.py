"""The README's main job, shrunk: target -> capture -> DFlash training -> offline + live tau -> export."""

import json

import pytest

from tapdraft.demo.run import format_demo, run_demo


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
    # a second run reuses the cached target, data, dataset and trained drafter, and prints the same figures
    target_mtime = (tmp_path / "demo" / "target" / "salm_config.json").stat().st_mtime_ns
    again = run_demo(tmp_path / "demo", quick=True, progress=False)
    assert (tmp_path / "demo" / "target" / "salm_config.json").stat().st_mtime_ns == target_mtime
    assert again["offline"]["tau"] == off["tau"] and again["live"]["tau"] == live["tau"]
    assert again["train_loss"] == r["train_loss"] and None not in r["train_loss"]
    text_again = format_demo(again)
    assert text_again.splitlines()[1:] == text.splitlines()[1:]  # all but the timings line
    # speculate's offline figures cover exactly the conversations it decoded (here 5 training ones, not the
    # validation split eval.json holds), so the replay matches live decoding on them too
    from tapdraft.speculate.run import SpeculateConfig, run_speculate

    d = tmp_path / "demo"
    other = run_speculate(SpeculateConfig(target=str(d / "target"), draft=str(d / "runs" / "dflash"),
                                          data=str(d / "dataset"), conversations=str(d / "data" / "train.jsonl"),
                                          max_samples=5, max_new_tokens=32), progress=False)
    assert other["offline_over"] == "the same 5 conversations"
    assert abs(other["tau"] - other["offline_tau_replayed"]) <= 0.02 * other["tau"], other


def _result(tau_uniform: float, tau_replayed: float, tau_live: float) -> dict:
    return {
        "target_and_data_seconds": 1.0, "train_seconds": 2.0, "total_seconds": 3.0, "dataset": "D", "run": "R",
        "export": "E", "train_loss": [4.0, 2.0],
        "offline": {"block_size": 8, "tau": tau_uniform, "tau_replayed": tau_replayed, "samples": 120,
                    "split": "validation", "plot": "P"},
        "live": {"tau": tau_live, "samples": 120, "matches_greedy": "120/120"},
    }


def test_summary_headlines_the_tau_that_predicts_serving():
    lines = format_demo(_result(4.47, 2.912, 2.913)).splitlines()
    assert "2.91" in lines[-1] and "4.47" not in lines[-1] and "live" in lines[-1]
    uniform = [ln for ln in lines if "4.47" in ln]
    assert len(uniform) == 1 and "every anchor" in uniform[0] and "not what serving sees" in uniform[0]
