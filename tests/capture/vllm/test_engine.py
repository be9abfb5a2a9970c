"""``--engine vllm`` without vLLM: its settings, records, frames and user errors (tests/engines runs vLLM itself)."""

from __future__ import annotations

import ast
import json
import socket
from pathlib import Path

import pytest
import torch

from tapdraft.capture.config import CaptureConfig, VLLMConfig, check_resume, migrate_capture_record
from tapdraft.capture.vllm.engine import layer_ids
from tapdraft.capture.vllm.side import wire
from tests.capture.util import conv_record, write_manifest
from tests.test_cli import assert_one_line, run

SIDE = Path(__file__).resolve().parents[3] / "capture" / "vllm" / "side"


def _cfg(**kw):
    return CaptureConfig(target="t", out="o", data=(("train", "x.jsonl"),), **kw)


def test_engine_settings_are_validated_and_recorded(tmp_path):
    assert _cfg().to_dict()["engine"] == "transformers" and _cfg().vllm is None
    cfg = _cfg(engine="vllm", vllm_python="/opt/vllm/bin/python")
    assert cfg.vllm == VLLMConfig()
    d = cfg.to_dict()
    assert d["vllm"]["tensor_parallel_size"] == 1 and d["vllm_python"] == "python"  # no machine paths recorded
    with pytest.raises(ValueError, match="engine must be one of"):
        _cfg(engine="sglang")
    with pytest.raises(ValueError, match="add --engine vllm"):
        _cfg(vllm=VLLMConfig(tensor_parallel_size=2))
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        VLLMConfig(tensor_parallel_size=0)
    # the engine and its parallel layout are part of what a resume must match; the interpreter is not
    path = tmp_path / "capture_config.json"
    path.write_text(json.dumps({**d, "inputs": {}}))
    record = lambda c: {**c.to_dict(), "inputs": {}}  # noqa: E731
    check_resume(path, record(_cfg(engine="vllm", vllm_python="/elsewhere/python")))
    with pytest.raises(ValueError, match="engine='vllm'.*engine='transformers'"):
        check_resume(path, record(_cfg()))
    with pytest.raises(ValueError, match="vllm="):
        check_resume(path, record(_cfg(engine="vllm", vllm=VLLMConfig(tensor_parallel_size=2))))


def test_records_from_before_engines_migrate_to_the_in_process_engine():
    now = _cfg().to_dict()
    old = {k: v for k, v in now.items() if k not in ("engine", "vllm", "vllm_python")}
    assert migrate_capture_record(old) == now


def test_layer_ids_are_vllms_numbering_with_the_last_layer():
    assert layer_ids([1, 9, 17, 25, 33], 36) == [2, 10, 18, 26, 34, 36]
    assert layer_ids([0, 35], 36) == [1, 36]  # tap 35 is the last layer: vLLM id 36, once


def test_frames_round_trip_tensors_over_a_socket():
    a, b = socket.socketpair()
    hs = torch.randn(5, 2, 8).to(torch.bfloat16)
    wire.send(a, {"kind": "states", "tag": 3, "shape": list(hs.shape)}, hs.view(torch.uint8).numpy())  # [5, 2, 16]
    wire.send(a, {"kind": "done"})
    head, payload = wire.recv(b)
    assert head["tag"] == 3 and torch.equal(torch.frombuffer(payload, dtype=torch.uint8).view(torch.bfloat16)
                                            .view(head["shape"]), hs)
    assert wire.recv(b) == ({"kind": "done"}, bytearray())
    a.close()
    with pytest.raises(wire.Closed):
        wire.recv(b)


def test_the_vllm_side_imports_nothing_of_tapdraft():
    """It runs in vLLM's interpreter, under another name: only relative imports, stdlib, torch and vllm."""
    paths = sorted(SIDE.glob("*.py"))
    assert len(paths) >= 4, SIDE  # __init__, connector, wire, worker
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                assert node.module.split(".")[0] in ("__future__", "dataclasses", "typing", "torch", "vllm"), path
            elif isinstance(node, ast.Import):
                for n in node.names:
                    assert n.name.split(".")[0] not in ("capture", "shards", "train", "speculate", "demo"), path


def test_a_python_without_vllm_is_one_line_before_anything_is_written(salm_dir, tmp_path, capsys):
    man = write_manifest(tmp_path / "in.jsonl", [conv_record("u0", "missing.wav")])
    out = tmp_path / "ds"
    args = ["capture", "--target", str(salm_dir), "--data", str(man), "--out", str(out), "--engine", "vllm"]
    code, err = run([*args, "--vllm-python", str(tmp_path / "nope")], capsys)
    assert_one_line(code, err, contains="does not exist")
    code, err = run(args, capsys)  # this interpreter has no vllm
    assert_one_line(code, err, contains="has no vllm installed")
    assert not (out / "target").exists()


def test_pipeline_parallel_is_refused_only_where_vllm_refuses_it():
    from tapdraft.capture.vllm.engine import check_layout
    from tapdraft.common.errors import CaptureError

    for version in ("0.32.0", "0.31.2", "0.32.1.dev4+g1a2b"):
        with pytest.raises(CaptureError, match="vLLM .* cannot extract hidden states with pipeline parallelism"):
            check_layout(VLLMConfig(pipeline_parallel_size=2), version)
    check_layout(VLLMConfig(tensor_parallel_size=2, data_parallel_size=2), "0.32.0")
    check_layout(VLLMConfig(pipeline_parallel_size=2), "0.33.0")  # a release that may run it: vLLM decides
    check_layout(VLLMConfig(pipeline_parallel_size=2), "main")
