"""benchmarks/gpu.py on a machine without CUDA: the CPU part runs, the GPU parts are marked skipped,
and ``--cpu-check`` runs the GPU parts' code on the CPU at tiny shapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu


@pytest.mark.slow
def test_tiny_run_records_cpu_parity_and_skips_gpu_parts(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the GPU parts would run")
    out = tmp_path / "gpu.json"
    root = Path(__file__).resolve().parents[2]
    env_bin = str(Path(sys.executable).parent)
    r = subprocess.run(["bash", str(root / "benchmarks" / "gpu.sh"), "--tiny", "--pairs", "1", "--name", str(out)],
                       capture_output=True, text=True,
                       env={**os.environ, "PATH": f"{env_bin}:{os.environ.get('PATH', '')}"})
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    parity = doc["results"]["parity"]
    assert parity["cpu"]["samples"] == 8 and parity["cpu"]["tokens"] > 0
    assert parity["cuda"] == {"skipped": "no CUDA device"}
    for name in ("capture", "attention", "fused_ce"):
        assert doc["results"][name]["skipped"] == "no CUDA device"
    writer = doc["results"]["writer"]  # the host's writer runs without a GPU
    got = [(c["zstd_level"], c["writers"]) for c in writer["configs"]]
    assert got == [(1, 1), (1, 2), (1, 4), (0, 1), (0, 2), (0, 4)]
    assert all(c["tokens_per_s"] > 0 for c in writer["configs"])
    assert doc["failed"] == [] and doc["machine"]["load_avg"]


@pytest.mark.slow
def test_cpu_check_runs_the_gpu_parts_code(tmp_path):
    out = tmp_path / "gpu.json"
    rc = gpu.main(["--tiny", "--cpu-check", "--pairs", "1", "--parts", "capture,attention,fused_ce",
                   "--name", str(out)])
    doc = json.loads(out.read_text())
    assert rc == 0, {k: v.get("error") for k, v in doc["results"].items()}
    cap = doc["results"]["capture"]
    assert cap["tokens"] > 0 and cap["overhead_ratio_median"] > 0 and cap["vocab_size"] == 4096
    att = doc["results"]["attention"]
    assert att["dense_backward"] is True and att["flex_backward"] is False  # no Flex backward on CPU
    ce = doc["results"]["fused_ce"]
    # the chunked CE equals dense logits + cross-entropy (float32 on CPU)
    assert ce["loss_rel_diff"] < 1e-5 and ce["grad_max_rel_diff"] < 1e-4


def test_compare_datasets_flags_a_difference(tmp_path):
    from benchmarks.gpu import TINY, build, compare_datasets, run_capture

    target, data = build(TINY, tmp_path, conversations=3, tokens=(64, 96))
    run_capture(target, data, tmp_path / "a", device="cpu", dtype="float32")
    run_capture(target, data, tmp_path / "b", device="cpu", dtype="float32")
    same = compare_datasets(tmp_path / "a", tmp_path / "b")
    assert same["taps_max_rel_diff"] == 0 and same["top1_agreement"] == 1.0 and same["taps_equal_fraction"] == 1.0
    run_capture(target, data, tmp_path / "c", device="cpu", dtype="bfloat16")
    other = compare_datasets(tmp_path / "a", tmp_path / "c")
    assert other["taps_max_rel_diff"] > 0 and other["taps_equal_fraction"] < 1.0
