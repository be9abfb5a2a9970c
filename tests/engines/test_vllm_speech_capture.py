"""``capture --engine vllm`` on a speech target: Qwen2-Audio through vLLM's multimodal inputs writes the
in-process engine's dataset.

The tiny Qwen2-Audio of the engine tests (conftest ``speech_case``: a text model vLLM's CPU attention
serves) is captured by both engines from the same conversations: split ``train`` is the case's 24
one-audio conversations with the target's own greedy replies; split ``mixed`` adds conversations with
two audios and one with none. vLLM gets each prompt with one audio token an audio and the waveforms;
its own processor computes the features and expands the tokens. The checks are
``test_vllm_capture.compare``'s, with its tolerances: sample ids, input ids (after expansion),
is_audio, loss mask, teacher rows and audio_seconds equal; taps within one bf16 step; teacher top-k
ids equal except counted near-ties; log-probs within ``LP_TOL``.

Then vLLM is handed another expansion than tapdraft's (one sample's audio cut to half before it is
sent, as a disagreeing processor would do): the capture stops with the CaptureError naming that
sample. The speech targets the engine refuses (Qwen3-ASR, Granite Speech) and ``--audio-embeds`` get
one error line from the CLI, exit 2, before anything is written.
"""

from __future__ import annotations

import pytest

from tests.engines.test_vllm_capture import compare, samples

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def _data(case):
    """(split, manifest) pairs: the case's conversations, and two-audio and text-only ones from its audio."""
    from tests.capture.util import write_manifest

    wavs = sorted((case["root"] / "audio").glob("*.wav"))
    mixed = []
    for i in range(4):
        a, b = wavs[i], wavs[-1 - i]
        mixed.append({"id": f"two-{i}", "conversations": [
            {"from": "User", "type": "audio", "value": str(a)},
            {"from": "User", "type": "text", "value": "and then ?"},
            {"from": "User", "type": "audio", "value": str(b)},
            {"from": "User", "type": "text", "value": "what did i say ?"},
            {"from": "Assistant", "type": "text", "value": "you said one two ."}]})
    mixed.append({"id": "text", "conversations": [{"from": "User", "type": "text", "value": "what did i say ?"},
                                                  {"from": "Assistant", "type": "text", "value": "one ."}]})
    return (("train", str(case["conversations"])), ("mixed", str(write_manifest(case["root"] / "mixed.jsonl", mixed))))


def _cfg(case, out, engine, vllm_venv=None):
    from tapdraft.capture.config import CaptureConfig
    from tapdraft.shards.shard_file import ShardConfig

    return CaptureConfig(target=str(case["target"]), out=str(out), data=_data(case), top_k=8, window=8,
                         batch_tokens=512, progress=False, shard=ShardConfig(shard_bytes=100_000), engine=engine,
                         vllm_python=None if vllm_venv is None else str(vllm_venv / "bin" / "python"))


def test_vllm_captures_qwen2_audio_as_the_in_process_engine(vllm_venv, speech_case, tmp_path):
    from tapdraft.capture.pipeline import capture
    from tapdraft.shards.verify import verify_dataset

    ours, theirs = tmp_path / "in-process", tmp_path / "vllm"
    ref = capture(_cfg(speech_case, ours, "transformers"))
    m = capture(_cfg(speech_case, theirs, "vllm", vllm_venv))
    assert m["complete"] and m["capture_config"]["engine"] == "vllm"
    assert m["fingerprint"] == ref["fingerprint"] and m["layout"] == ref["layout"]
    assert m["extra"] == ref["extra"] and m["extra"]["target_kind"] == "qwen2_audio"
    totals = ("samples", "tokens", "supervised_tokens", "audio_seconds")
    assert {s: {k: d[k] for k in totals} for s, d in m["splits"].items()} == \
        {s: {k: d[k] for k in totals} for s, d in ref["splits"].items()}
    for split, n in (("train", 24), ("mixed", 5)):
        a, b = samples(ours, split), samples(theirs, split)
        assert len(a) == len(b) == n
        audio_rows = sum(int(x["is_audio"].sum()) for x in a)
        assert audio_rows > 0 and sum(x["audio_seconds"] for x in a) > 0
        compare(a, b, split)
        print(f"{split}: {audio_rows} audio rows of {sum(x['input_ids'].numel() for x in a)}")
    assert verify_dataset(str(theirs), progress=False).ok


def test_vllm_capture_stops_when_vllms_expansion_differs(vllm_venv, speech_case, tmp_path, monkeypatch):
    import dataclasses

    from tapdraft.capture.pipeline import capture
    from tapdraft.capture.vllm import engine as vllm_engine
    from tapdraft.common.errors import CaptureError

    real = vllm_engine.request

    def halved(target, p):  # the second sample's audio as a processor keeping half of it would see it
        r = real(target, p)
        if p.index == 1:
            r = dataclasses.replace(r, audio=[a[: a.shape[0] // 2] for a in r.audio])
        return r

    monkeypatch.setattr(vllm_engine, "request", halved)
    out = tmp_path / "vllm"
    cfg = dataclasses.replace(_cfg(speech_case, out, "vllm", vllm_venv), data=_data(speech_case)[:1])
    with pytest.raises(CaptureError, match="vLLM expanded the audio of sample 'qwen2_audio-001' into"):
        capture(cfg)
    assert not (out / "manifest.json").exists()


@pytest.mark.parametrize("kind", ["qwen3_asr", "granite_speech", "qwen2_audio+audio_embeds"])
def test_vllm_capture_refuses_in_one_line(vllm_venv, speech_case, tmp_path, kind, capsys):
    from tests.capture import speech_models
    from tests.test_cli import assert_one_line, run

    if kind.startswith("qwen2_audio"):
        target, extra, why = speech_case["target"], ["--audio-embeds"], "--audio-embeds stores the in-process"
    else:
        target, extra = tmp_path / "target", []
        getattr(speech_models, f"save_{kind}")(target)
        capsys.readouterr()  # save_pretrained's progress bar
        why = {"qwen3_asr": "qwen3_asr targets: vLLM's qwen3_asr module imports torchvision",
               "granite_speech": "granite_speech targets: vLLM computes Granite Speech's features"}[kind]
    out = tmp_path / "out"
    code, err = run(["capture", "--target", target, "--data", speech_case["conversations"], "--out", out,
                     "--engine", "vllm", "--vllm-python", vllm_venv / "bin" / "python", *extra], capsys)
    assert_one_line(code, err, contains=why)
    assert not any(out.rglob("*.arrow")) and not (out / "target").exists() and not (out / "manifest.json").exists()
