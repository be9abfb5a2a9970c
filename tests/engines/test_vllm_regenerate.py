"""`regenerate --engine vllm` against the in-process engine, for real, in the vLLM venv (engines/venv.sh).

The small trained BPE target (tests/engines/conftest.py, a real HF layout on disk) regenerates 24 conversations,
every third one two-turn (its second prompt holds the target's first reply), greedy, through both engines: the
output files are equal byte for byte (replies, their ``token_ids``, ``truncated`` marks). Then a vLLM run killed
with SIGKILL after its second window is on disk, and rerun, writes the same bytes, recomputing only the windows
that had not settled. With ``--prefix-caching``, a second turn is served from the first turn's cached blocks.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tapdraft.capture.engines import ENGINES
from tapdraft.capture.vllm.config import VLLMConfig
from tapdraft.capture.replies.generate import GenerationConfig
from tapdraft.capture.replies.regenerate import RegenerateConfig, regenerate, work_dir
from tapdraft.capture.replies.windows import ReplyConfig
from tests.engines.conftest import read_jsonl

pytestmark = [pytest.mark.engine, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
N = 24


def _inputs(bpe_target, path: Path) -> Path:
    recs = read_jsonl(bpe_target.train_manifest)[:N + 1]
    out = []
    for i in range(N):
        turns = recs[i]["conversations"]
        if i % 3 == 0:  # two turns: the second prompt holds the first regenerated reply
            turns = turns + recs[i + 1]["conversations"]
        out.append({"id": recs[i]["id"], "conversations": turns})
    path.write_text("".join(json.dumps(r) + "\n" for r in out))
    return path


def _cfg(bpe_target, data: Path, out: Path, engine: str, venv: Path | None = None) -> RegenerateConfig:
    return RegenerateConfig(target=str(bpe_target.target), data=str(data), out=str(out), window=4, max_batch_size=8,
                            replies=ReplyConfig(generation=GenerationConfig(max_new_tokens=24), keep_truncated=True),
                            engine=engine, vllm_python=None if venv is None else str(venv / "bin" / "python"),
                            progress=False)


def test_vllm_regenerate_equals_in_process_and_resumes_after_kill9(vllm_venv, bpe_target, tmp_path):
    data = _inputs(bpe_target, tmp_path / "in.jsonl")
    ours, theirs, cut = tmp_path / "in-process.jsonl", tmp_path / "vllm.jsonl", tmp_path / "vllm-cut.jsonl"
    a = regenerate(_cfg(bpe_target, data, ours, "transformers"))
    b = regenerate(_cfg(bpe_target, data, theirs, "vllm", vllm_venv))
    assert b["run_stats"]["engine"]["name"] == "vllm" and b["settings"]["engine"] == "vllm"
    assert b["run_stats"]["engine"]["cached_tokens"] == 0 < b["run_stats"]["engine"]["prompt_tokens"]
    assert a["counts"] == b["counts"] and b["counts"]["written"] > N // 2
    ra, rb = a["run_stats"], b["run_stats"]
    assert (ra["replies"], ra["tokens"]) == (rb["replies"], rb["tokens"])
    recs = read_jsonl(theirs)
    assert sum(1 for r in recs if sum("token_ids" in t for t in r["conversations"]) == 2) >= 4  # two-turn ones
    assert ours.read_bytes() == theirs.read_bytes()
    print(f"in-process {a['run_stats']['seconds']:.1f}s, vLLM {b['run_stats']['seconds']:.1f}s "
          f"(+{b['run_stats']['engine']['startup_s']:.0f}s start) for {a['run_stats']['tokens']} tokens")

    # kill -9 once the second window's part is on disk, then rerun: the same bytes
    script = textwrap.dedent("""
        import os, signal
        from contextlib import contextmanager
        from pathlib import Path
        import tapdraft.capture.replies.regenerate as rg
        from tapdraft.capture.config import VLLMConfig
        from tapdraft.capture.replies.generate import GenerationConfig
        from tapdraft.capture.replies.windows import ReplyConfig
        real, parts = rg.staged, [0]
        @contextmanager
        def dying(path):
            with real(path) as tmp:
                yield tmp
            if Path(path).name.startswith("r00000-w"):
                parts[0] += 1
                if parts[0] == 2:
                    os.kill(os.getpid(), signal.SIGKILL)
        rg.staged = dying
        cfg = CFG
        rg.regenerate(rg.RegenerateConfig(**{**cfg, "vllm": VLLMConfig(**cfg["vllm"]), "replies": ReplyConfig(
            generation=GenerationConfig(**cfg["replies"]["generation"]),
            **{k: v for k, v in cfg["replies"].items() if k != "generation"})}))
    """).replace("CFG", repr(dataclasses.asdict(_cfg(bpe_target, data, cut, "vllm", vllm_venv))))
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    kept = sum(len(p.read_text().splitlines()) for p in work_dir(cut).glob("r*.jsonl"))
    assert not cut.exists() and kept >= 8
    c = regenerate(_cfg(bpe_target, data, cut, "vllm", vllm_venv))
    assert c["run_stats"]["conversations"] == N - kept  # only the unsettled windows ran again
    assert cut.read_bytes() == theirs.read_bytes()


def test_prefix_caching_serves_a_later_turn_from_the_earlier_ones(vllm_venv, bpe_target, tmp_path):
    """--prefix-caching: each conversation's second prompt (its first prompt, the reply and a new request) finds the
    first turn's full KV blocks in vLLM's prefix cache (vLLM's own count of a request's cached prompt tokens), where
    without it none is found, also across two engines (a conversation's turns go to one); the same conversations are
    written, and the setting is recorded."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bpe_target.target)
    recs = read_jsonl(bpe_target.train_manifest)
    users = [t["value"] for r in recs for t in r["conversations"] if t["from"].lower() == "user"]
    long, i = "", 0
    while len(tok(long)["input_ids"]) < 300:  # past two of the CPU backend's 128-token blocks
        long, i = f"{long} {users[i]}".strip(), i + 1
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"id": f"p{k}", "conversations": [
        {"from": "User", "value": f"{users[i + k]} {long}"}, {"from": "Assistant", "value": "x"},
        {"from": "User", "value": users[i + k + 1]}, {"from": "Assistant", "value": "y"}]}) + "\n" for k in range(6)))
    docs = {}
    for on in (False, True):  # with it, two engines: a conversation's turns must stay on one
        cfg = dataclasses.replace(_cfg(bpe_target, data, tmp_path / f"cached-{on}.jsonl", "vllm", vllm_venv),
                                  prefix_caching=on, vllm=VLLMConfig(data_parallel_size=2 if on else 1))
        docs[on] = regenerate(cfg)
    off, on = (docs[k]["run_stats"]["engine"] for k in (False, True))
    assert off["cached_tokens"] == 0 and off["prompt_tokens"] == on["prompt_tokens"] > 6 * 2 * 300
    assert on["prefix_caching"] and on["cached_tokens"] >= 6 * 256  # each second turn: two full blocks at least
    assert docs[True]["settings"]["prefix_caching"] is True and "prefix_caching" not in docs[False]["settings"]
    assert docs[True]["counts"] == docs[False]["counts"] and docs[True]["counts"]["written"] == 6
    a, b = (read_jsonl(tmp_path / f"cached-{k}.jsonl") for k in (False, True))
    same = sum(x == y for x, y in zip(a, b))
    print(f"prefix cache: {on['cached_tokens']} of {on['prompt_tokens']} prompt tokens; {same} of 6 conversations "
          "equal to the run without it")


def test_vllm_regenerates_qwen2_audio_as_the_in_process_engine(vllm_venv, tmp_path):
    """Speech: the tiny Qwen2-Audio of the engine tests (random init, a text model vLLM's CPU attention serves),
    its audio sent as capture sends it (one audio token an audio + the waveform); the same output bytes."""
    from tests.capture import speech_models
    from tests.capture.util import conv_record, write_manifest, write_wav

    target = tmp_path / "target"
    speech_models.save_qwen2_audio(target, text=speech_models.SERVABLE_TEXT)
    wavs = [write_wav(tmp_path / "audio" / f"{i}.wav", [(i + j) % 10 for j in range(2 + i % 3)], seed=i)
            for i in range(8)]
    recs = [conv_record(f"a{i}", str(w)) for i, w in enumerate(wavs)]
    data = write_manifest(tmp_path / "in.jsonl", recs)
    outs = {}
    for engine in ("transformers", "vllm"):
        out = tmp_path / f"{engine}.jsonl"
        own = ENGINES[engine].settings()  # None for an engine with no settings of its own, the in-process one
        doc = regenerate(RegenerateConfig(
            target=str(target), data=str(data), out=str(out), window=4, progress=False, engine=engine,
            vllm_python=None if own is None else str(vllm_venv / "bin" / "python"),
            replies=ReplyConfig(generation=GenerationConfig(max_new_tokens=12), keep_truncated=True)))
        assert doc["counts"]["written"] == 8
        outs[engine] = out.read_bytes()
    assert outs["transformers"] == outs["vllm"]
