"""Every HF-native speech target end to end: capture -> verify -> train -> eval -> speculate on a tiny
checkpoint in its real on-disk layout, greedy decoding equal to the model's own ``generate``, and
input errors (audio past the encoder's window) as one ``error:`` line."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from tapdraft.capture.inputs import read_jsonl
from tapdraft.capture.targets.load import load_target
from tapdraft.cli import app, main
from tapdraft.speculate.decode import target_greedy
from tapdraft.speculate.run import prompt_length
from tests.capture.speech_models import (own_inputs, save_granite_speech, save_qwen2_audio, save_qwen3_asr,
                                         save_voxtral)
from tests.capture.util import conv_record, write_manifest, write_wav

BUILDERS = {"qwen2_audio": save_qwen2_audio, "qwen3_asr": save_qwen3_asr, "voxtral": save_voxtral,
            "granite_speech": save_granite_speech}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def speech_dir(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    BUILDERS[request.param](d)
    return d


def _manifest(root, n=6):
    rng = np.random.default_rng(1)
    recs = []
    for i in range(n):
        digits = [int(x) for x in rng.integers(0, 10, size=int(rng.integers(2, 5)))]
        write_wav(root / "audio" / f"u{i}.wav", digits, seed=i)
        recs.append(conv_record(f"u{i}", f"audio/u{i}.wav", reply="you said " + " ".join(["one"] * len(digits)) + " ."))
    return write_manifest(root / "train.jsonl", recs)


def _ok(*args):
    res = CliRunner().invoke(app, list(args), catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return res.output


def test_capture_verify_train_eval_speculate(speech_dir, tmp_path):
    man, ds, run = _manifest(tmp_path), str(tmp_path / "ds"), str(tmp_path / "run")
    _ok("capture", "--target", str(speech_dir), "--data", str(man), "--out", ds, "--top-k", "4",
        "--batch-tokens", "400")
    assert "0 problem(s), OK" in _ok("verify", ds)
    _ok("train", "--data", ds, "--recipe", "dflash_demo", "--set", "max_steps=3", "--set", "log_every=3",
        "--set", "ckpt_every=3", "--out", run)
    assert "tau =" in _ok("eval", "--draft", run, "--data", ds)
    out = _ok("speculate", "--target", str(speech_dir), "--draft", run, "--data", ds, "--conversations", str(man),
              "--max-samples", "3", "--max-new-tokens", "6")
    assert "output identical to the target's greedy decoding: 3/3" in out


def test_greedy_decoding_equals_the_models_own_generate(speech_dir, tmp_path):
    """The reference speculate compares against is the model's own greedy ``generate`` on processor inputs."""
    target = load_target(speech_dir)
    conv = next(iter(read_jsonl(_manifest(tmp_path, 1), placeholder=target.placeholder)))
    exp = target.embed([target.prepare(conv, 0)])[0]
    P = prompt_length(exp.loss_mask)
    with torch.no_grad():
        ours = target_greedy(target.lm, exp.inputs_embeds[:P], max_new_tokens=6, eos_token_id=None,
                             head=target.head)
        inputs = own_inputs(target, conv.messages[:-1], target.prepare(conv, 0).waveforms, add_generation_prompt=True)
        assert inputs["input_ids"][0].tolist() == exp.input_ids[:P].tolist()
        gen = target.model.generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert ours == gen[0, P:].tolist()


def test_audio_past_the_encoder_window_is_one_error_line(monkeypatch, capsys, tmp_path, tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen2_audio_window")
    save_qwen2_audio(d)
    write_wav(tmp_path / "long.wav", [1] * 100)  # 100 tone digits: 32 s, past the 30 s window
    man = write_manifest(tmp_path / "m.jsonl", [conv_record("long", "long.wav")])
    monkeypatch.setattr("sys.argv", ["tapdraft", "capture", "--target", str(d), "--data", str(man),
                                     "--out", str(tmp_path / "ds"), "--top-k", "4"])
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("error: bad input 'long'") and "at most 30s per audio" in err


@pytest.mark.slow
def test_live_mtp_on_final_hidden_and_audio_embeds(tmp_path):
    """MTP trained on a dataset that stores final_hidden (last layer not tapped) and the audio frames' embeddings:
    live decoding gives the head both, and stays exact."""
    target = tmp_path / "qwen2_audio"
    save_qwen2_audio(target)
    man, ds, run = _manifest(tmp_path, 4), str(tmp_path / "ds"), str(tmp_path / "run")
    _ok("capture", "--target", str(target), "--data", str(man), "--out", ds, "--taps", "0,1", "--final-hidden",
        "--audio-embeds", "--top-k", "4", "--batch-tokens", "400")
    _ok("train", "--data", ds, "--recipe", "mtp_demo", "--set", "drafter.num_depths=2", "--set", "max_steps=2",
        "--set", "log_every=2", "--set", "ckpt_every=2", "--out", run)
    out = _ok("speculate", "--target", str(target), "--draft", run, "--data", ds, "--conversations", str(man),
              "--max-samples", "2", "--max-new-tokens", "6")
    assert "output identical to the target's greedy decoding: 2/2" in out
