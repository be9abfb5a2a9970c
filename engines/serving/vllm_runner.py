"""Serve one job with vLLM and write what it produced: run INSIDE the vLLM venv (engines/venv.sh vllm).

    python vllm_runner.py JOB.json OUT.json

JOB: {"target": DIR, "speculative": {"method": "dflash", "model": EXPORT, "num_speculative_tokens": K} | null,
      "requests": [{"prompt_token_ids": [...]} | {"prompt": TEXT, "audio": NPY_PATH, "sample_rate": SR}
                   | {"prompt_embeds": PT_PATH}],  (a [T, H] tensor: the merged input embeddings)
      "max_tokens": N, "max_model_len": M, "dtype": "float32", "ignore_eos": false,
      "max_num_seqs": 1, "repeats": 1, "warmup": 0, "profile": {NAME: "path/suffix.py:function"}}
OUT: {"vllm": VERSION, "plugins": [...], "outputs": [{"token_ids", "finish_reason", "prompt_token_ids",
      "spec": {"per_step_accepted", "per_step_drafted", ...} | null,
      "timing": {"scheduled_ts", "first_token_ts", "last_token_ts"} | null}],  (the engine core's clock, seconds)
      "seconds": [one wall time per repeat of the whole generate call], "warmup_seconds": S,
      "profile": {NAME: {"calls": N, "seconds": S}}}  (with a job "profile" only)

Greedy (temperature 0) and one sequence per request, so vLLM's per-request speculative metrics
(``per_request_spec_decode_metrics="detailed"``) give every verification step's accepted draft count,
counted as vLLM counts it: drafts the target's sampled tokens agreed with, before the output is cut at
eos or ``max_tokens``. Requests run one at a time (``max_num_seqs=1``) so no batching order can
change what a step sees; a timing job may raise ``max_num_seqs`` (continuous batching). ``warmup`` requests
(the first ones, run once untimed) warm the engine before the ``repeats`` timed passes over all requests;
each pass must give the same outputs (greedy), and the last one is written. With ``profile``, the last pass runs under
Python's profiler and each named function's calls and cumulative seconds are written (the outermost of the functions
a name matches: a wrapper and the method it wraps share a name); the profiler slows Python code, not torch's kernels. It imports only vLLM, numpy and torch (the engine venv's): it is not part of
tapdraft's package; the tests (tests/engines) run it.
"""

import json
import os
import sys


def main(job_path: str, out_path: str) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import numpy as np
    import vllm
    from vllm import LLM, SamplingParams

    job = json.load(open(job_path))
    kwargs = dict(model=job["target"], dtype=job.get("dtype", "float32"), enforce_eager=True, seed=0,
                  max_model_len=job.get("max_model_len", 512), max_num_seqs=job.get("max_num_seqs", 1), enable_prefix_caching=False,
                  disable_log_stats=False)
    if job.get("speculative"):
        kwargs["speculative_config"] = job["speculative"]
        kwargs["per_request_spec_decode_metrics"] = "detailed"
    if any("audio" in r for r in job["requests"]):
        kwargs["limit_mm_per_prompt"] = {"audio": 1}
    if any("prompt_embeds" in r for r in job["requests"]):
        kwargs["enable_prompt_embeds"] = True
    if job.get("tokenizer"):
        kwargs["tokenizer"] = job["tokenizer"]
    llm = LLM(**kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=job.get("ignore_eos", False))
    prompts = []
    for r in job["requests"]:
        if "prompt_embeds" in r:
            import torch

            prompts.append({"prompt_embeds": torch.load(r["prompt_embeds"], weights_only=True)})
        elif "audio" in r:
            prompts.append({"prompt": r["prompt"],
                            "multi_modal_data": {"audio": (np.load(r["audio"]), r["sample_rate"])}})
        else:
            prompts.append({"prompt_token_ids": r["prompt_token_ids"]})
    import time

    t0 = time.perf_counter()
    if job.get("warmup"):
        llm.generate(prompts[: job["warmup"]], params, use_tqdm=False)
    doc = {"vllm": vllm.__version__, "outputs": [], "seconds": [], "warmup_seconds": time.perf_counter() - t0}
    first = None
    repeats = job.get("repeats", 1)
    for r in range(repeats):
        profiler = None
        if job.get("profile") and r == repeats - 1:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        doc["seconds"].append(time.perf_counter() - t0)
        if profiler is not None:
            profiler.disable()
            doc["profile"] = profiled(profiler, job["profile"])
        ids = [list(o.outputs[0].token_ids) for o in outs]
        if first is not None and ids != first:
            raise SystemExit("a repeat of the same greedy requests gave other tokens")
        first = ids
    try:
        import tapdraft_vllm

        doc["plugins"] = tapdraft_vllm.applied()
    except ImportError:
        doc["plugins"] = []
    for o in outs:
        c = o.outputs[0]
        spec = c.spec_decode_metrics.to_dict() if c.spec_decode_metrics is not None else None
        m = o.metrics  # the engine's own timestamps (stats are on): the decode is first token to last
        timing = None if m is None else {"scheduled_ts": m.scheduled_ts, "first_token_ts": m.first_token_ts,
                                         "last_token_ts": m.last_token_ts}
        doc["outputs"].append({"token_ids": list(c.token_ids), "finish_reason": c.finish_reason,
                               "prompt_token_ids": list(o.prompt_token_ids or []), "spec": spec, "timing": timing})
    with open(out_path + ".tmp", "w") as f:
        json.dump(doc, f)
    os.replace(out_path + ".tmp", out_path)


def profiled(profiler, names: dict) -> dict:
    """``{name: {"calls", "seconds"}}`` of the profiled functions ``names`` maps to ("path/suffix.py:function"): per
    name the matching function with the most cumulative time (zero calls when none ran)."""
    import pstats

    stats = pstats.Stats(profiler).stats  # {(file, line, function): (prim calls, calls, own s, cumulative s, callers)}
    out = {}
    for name, where in names.items():
        suffix, function = where.rsplit(":", 1)
        hits = [(v[3], v[1]) for (f, _, fn), v in stats.items() if fn == function and f.endswith(suffix)]
        seconds, calls = max(hits, default=(0.0, 0))
        out[name] = {"calls": calls, "seconds": seconds}
    return out


if __name__ == "__main__":
    main(*sys.argv[1:3])
