"""Running a real serving engine: its venv (engines/venv.sh), one job in a subprocess, the requests for
conversations as tapdraft expands them, and the checks that hold what it served against tapdraft's decoding
(the engine tests, the benchmarks and ``tapdraft demo --real`` use them).

Engines pin their own torch and transformers, so each runs in its own venv built from the pins in
``engines/NAME.txt`` by ``engines/venv.sh`` (reused while the pins are unchanged). The tests never skip
when an engine is missing: building it is part of the test run, and a failed build fails the test.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

VENV_SCRIPT = Path(__file__).resolve().parents[1] / "venv.sh"
"""The engine venv builder, beside the pins it reads (``engines/NAME.txt``): package data in an installed wheel."""
RUNNER = Path(__file__).with_name("vllm_runner.py")


def engine_venv(name: str) -> Path:
    """The engine's venv (built on first use: minutes), with the project's plugin for it installed."""
    res = subprocess.run(["bash", str(VENV_SCRIPT), name], capture_output=True, text=True,
                         timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(f"engines/venv.sh {name} failed:\n{res.stderr[-4000:]}")
    return Path(res.stdout.strip().splitlines()[-1])


class EngineFailed(RuntimeError):
    """The engine exited non-zero; ``log`` is its whole output."""

    def __init__(self, message: str, log: str):
        super().__init__(message)
        self.log = log


def claim_job_file(work: Path, job: dict[str, Any]) -> Path:
    """Write ``job`` to the first free WORK/vllm-N.json, created exclusively: two benchmarks serving into one
    directory at once each get their own N (counting the files and then writing raced: both took the same N and
    one overwrote the other's job, output and log)."""
    work.mkdir(parents=True, exist_ok=True)
    n = len(list(work.glob("vllm-*.json")))
    while True:
        path = work / f"vllm-{n}.json"
        try:
            with open(path, "x") as f:
                f.write(json.dumps(job))
            return path
        except FileExistsError:
            n += 1


def serve_vllm(venv: Path, job: dict[str, Any], work: Path, *, timeout: float = 900,
               plugins: bool = True, threads: int = 1) -> dict[str, Any]:
    """Run one vllm_runner job in the vLLM venv; its log goes to WORK/vllm-N.log (its end shown on failure).
    ``plugins=False`` runs stock vLLM (no general plugin loaded: ``VLLM_PLUGINS`` names none); ``threads``
    is the engine's CPU thread count."""
    job_path = claim_job_file(work, job)
    out_path, log = job_path.with_suffix(".out.json"), job_path.with_suffix(".log")
    # the engine's own environment only: tapdraft's venv must not leak into it
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS=str(threads),
               VLLM_CPU_OMP_THREADS_BIND="nobind", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    if not plugins:
        env["VLLM_PLUGINS"] = ""
    with open(log, "w") as f:
        res = subprocess.run([str(venv / "bin" / "python"), str(RUNNER), str(job_path), str(out_path)],
                             stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout, cwd=work)
    if res.returncode != 0:
        text = log.read_text()
        raise EngineFailed(f"vLLM failed (exit {res.returncode}); the end of {log}:\n{text[-6000:]}", text)
    return json.loads(out_path.read_text())


def vllm_requests(target_dir: str | Path, conversations: str | Path, n: int, audio_dir: Path
                  ) -> tuple[list[dict[str, Any]], list[str], list[list[int]]]:
    """vLLM requests for the first ``n`` usable conversations of a JSONL file (each up to its last reply), their
    sample ids, and tapdraft's prompt ids (audio expanded as capture expands it; vLLM's must equal them). A text
    prompt goes as those ids; one with audio as the text the target's chat template renders (audio markers
    included) plus the audio at the encoder's rate in ``audio_dir`` (.npy), which vLLM's own processor expands."""
    import numpy as np

    from tapdraft.capture.inputs import BadInput, load_audio, read_inputs
    from tapdraft.capture.targets.load import load_target
    from tapdraft.speculate.run import prompt_length

    target = load_target(str(target_dir))
    requests, sample_ids, prompts = [], [], []
    for conv in read_inputs(str(conversations), placeholder=target.input_placeholder):
        if len(sample_ids) == n:
            break
        if isinstance(conv, BadInput):
            continue
        exp = target.embed([target.prepare(conv, len(sample_ids))])[0]
        prompt = exp.input_ids[: prompt_length(exp.loss_mask)].tolist()
        if conv.audios:
            text = target.tokenizer.apply_chat_template(target._wrap(conv.messages[:-1]), tokenize=False,
                                                        add_generation_prompt=True)
            (wave,) = [load_audio(a, target_sr=16000, min_sr=16000)[0] for a in conv.audios]
            audio_dir.mkdir(parents=True, exist_ok=True)
            path = audio_dir / f"audio-{len(sample_ids):05d}.npy"
            np.save(path, wave.astype(np.float32))
            requests.append({"prompt": text, "audio": str(path), "sample_rate": 16000})
        else:
            requests.append({"prompt_token_ids": prompt})
        sample_ids.append(conv.sample_id)
        prompts.append(prompt)
    return requests, sample_ids, prompts


def check_served(alone: dict[str, Any], served: dict[str, Any], ours: dict[str, Any],
                 sample_ids: list[str] | None = None) -> tuple[int, int]:
    """The served checks, given vLLM's run without and with the draft and ``tapdraft speculate``'s report on the
    same conversations (in ``sample_ids`` order, default the report's): the draft changes nothing the target
    says, tapdraft decodes the same tokens, and per conversation and round the accepted drafts are equal.
    Prints and returns (rounds, accepted)."""
    greedy = [o["token_ids"] for o in alone["outputs"]]
    assert [o["token_ids"] for o in served["outputs"]] == greedy  # the draft changes nothing the target says
    by_id = {c["sample_id"]: c for c in ours["conversations"]}
    convs = [by_id[i] for i in sample_ids] if sample_ids is not None else ours["conversations"]
    assert [c["tokens"] for c in convs] == greedy  # and tapdraft's decoding says the same
    vllm_rounds = [o["spec"]["per_step_accepted"] for o in served["outputs"]]
    our_rounds = [c["agreed"] for c in convs]
    assert vllm_rounds == our_rounds
    accepted, rounds = sum(map(sum, our_rounds)), sum(map(len, our_rounds))
    print(f"vLLM {served['vllm']}: {len(convs)} conversations, {rounds} rounds, {accepted} drafts accepted "
          f"(1 + accepted/rounds = {1 + accepted / rounds:.3f}); tapdraft tau {ours['tau']:.3f}")
    return rounds, accepted
