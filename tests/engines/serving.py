"""Running a real serving engine from the tests: its venv (engines/venv.sh) and one job in a subprocess.

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

ROOT = Path(__file__).resolve().parents[2]
RUNNER = ROOT / "engines" / "vllm_runner.py"


def engine_venv(name: str) -> Path:
    """The engine's venv (built on first use: minutes), with the project's plugin for it installed."""
    res = subprocess.run(["bash", str(ROOT / "engines" / "venv.sh"), name], capture_output=True, text=True,
                         timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(f"engines/venv.sh {name} failed:\n{res.stderr[-4000:]}")
    return Path(res.stdout.strip().splitlines()[-1])


class EngineFailed(RuntimeError):
    """The engine exited non-zero; ``log`` is its whole output."""

    def __init__(self, message: str, log: str):
        super().__init__(message)
        self.log = log


def serve_vllm(venv: Path, job: dict[str, Any], work: Path, *, timeout: float = 900,
               plugins: bool = True, threads: int = 1) -> dict[str, Any]:
    """Run one vllm_runner job in the vLLM venv; its log goes to WORK/vllm-N.log (its end shown on failure).
    ``plugins=False`` runs stock vLLM (no general plugin loaded: ``VLLM_PLUGINS`` names none); ``threads``
    is the engine's CPU thread count."""
    work.mkdir(parents=True, exist_ok=True)
    n = len(list(work.glob("vllm-*.json")))
    job_path, out_path, log = work / f"vllm-{n}.json", work / f"vllm-{n}.out.json", work / f"vllm-{n}.log"
    job_path.write_text(json.dumps(job))
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
