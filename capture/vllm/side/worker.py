"""The vLLM worker of ``capture --engine vllm``: run in vLLM's venv as ``python -m PKG.worker ADDRESS N``.

It connects to tapdraft's socket at ADDRESS, says ``{"kind": "hello", "worker": N}``, receives
``{"kind": "start", "llm": {...}, "layer_ids": [...]}``, builds vLLM's ``LLM`` with the
``extract_hidden_states`` speculative method and :class:`TapConnector` (prefix caching off: a cached
prefix is never recomputed, and its states would be another request's;
vLLM #44485), answers ``{"kind": "ready", "vllm": VERSION}``, then serves
``{"kind": "run", "window": W, "requests": [{"tag", "prompt_token_ids", "audio": [N, ...], "sample_rate"}]}``
with one ``generate`` call (``max_tokens=1``, greedy) and ``{"kind": "done", "window": W}``; a run frame
with ``"logprobs": K`` also gets each request's top-K next-token log-probs in its done frame (``{"logprobs":
{tag: [[id, log-prob], ...]}}``: vLLM's own head, which tapdraft's is proven against). The frame's
payload holds the requests' audio, float32, one waveform of N samples after another in request order;
each goes to vLLM as ``multi_modal_data`` (waveform, sample rate), so vLLM's processor computes the
features and expands the audio token. The states themselves travel on the
connector's own connection, from whichever vLLM process holds the cache. A closed socket (tapdraft
exited or was killed) ends the worker; any failure is sent as ``{"kind": "error", "message"}`` first.
A start frame with ``"mode": "generate"`` serves ``regenerate --engine vllm`` instead (``generate.py``).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import traceback
from typing import Any

from . import wire
from .connector import SOCKET_KEY, TAG_KEY
from .prompts import prompts


EAGLE3_HINT = ("stock vLLM 0.32 lets extract_hidden_states read the layers of a speech target's language model only "
               "when the target class declares SupportsEagle3, which Qwen2-Audio's does not: install tapdraft's vLLM "
               "plugin into this environment (in a tapdraft checkout: pip install engines/vllm_plugin; "
               "engines/venv.sh vllm does it)")


def build_llm(address: str, llm: dict[str, Any], layer_ids: list[int]) -> Any:
    try:
        return _llm(address, llm, layer_ids)
    except RuntimeError as e:
        if "does not support EAGLE3 interface" in str(e):
            raise RuntimeError(EAGLE3_HINT) from e
        raise


def _llm(address: str, llm: dict[str, Any], layer_ids: list[int]) -> Any:
    from vllm import LLM

    connector = __package__ + ".connector"
    return LLM(
        **llm,
        enable_prefix_caching=False,
        speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}}},
        kv_transfer_config={"kv_connector": "TapConnector", "kv_connector_module_path": connector,
                            "kv_role": "kv_producer", "kv_connector_extra_config": {SOCKET_KEY: address}},
    )


def next_logprobs(out: Any) -> list[list[float]]:
    """[[token id, log-prob], ...] of a request's first generated token: vLLM's own head on the prompt's last
    position (raw log-probs, before any sampling transform: ``logprobs_mode`` "raw_logprobs", vLLM 0.32's default in
    vllm/config/model.py)."""
    return [[int(i), float(lp.logprob)] for i, lp in out.outputs[0].logprobs[0].items()]


def drain(llm: Any) -> None:
    """Step the engine until no finished request holds blocks any more.

    ``generate`` returns when every request has its output, but TapConnector sends a request's states
    one step later (vLLM hands finished requests to the connector in the next step's metadata), and with
    nothing left to run no further step comes: the in-process engine core is stepped here until its
    scheduler has nothing left (``has_requests`` counts finished requests whose blocks are still kept;
    vllm/v1/core/sched/scheduler.py in 0.32). Without it the last requests' states never leave.
    """
    core = llm.llm_engine.engine_core.engine_core  # InprocClient -> EngineCore (VLLM_ENABLE_V1_MULTIPROCESSING=0)
    while core.scheduler.has_requests():
        llm.llm_engine.step()


def serve(address: str, worker: int) -> None:
    sock = wire.connect(address)
    wire.send(sock, {"kind": "hello", "worker": worker})
    try:
        start, _ = wire.recv(sock)
        if start.get("mode") == "generate":  # regenerate --engine vllm (generate.py)
            from .generate import serve_replies

            return serve_replies(sock, start)
        llm = build_llm(address, start["llm"], start["layer_ids"])
        from vllm import SamplingParams, __version__

        wire.send(sock, {"kind": "ready", "vllm": __version__})
        while True:
            try:
                msg, payload = wire.recv(sock)
            except wire.Closed:
                return
            if msg["kind"] == "stop":
                if start["llm"].get("tensor_parallel_size", 1) * start["llm"].get("pipeline_parallel_size", 1) == 1:
                    sys.stdout.flush()
                    os._exit(0)  # one in-process engine holds nothing to release; its teardown took 8 s
                return
            reqs = msg["requests"]
            k = msg.get("logprobs")
            params = [SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, logprobs=k,
                                     extra_args={"kv_transfer_params": {TAG_KEY: r["tag"]}}) for r in reqs]
            outs = llm.generate(prompts(reqs, payload), params, use_tqdm=False)
            drain(llm)
            done: dict[str, Any] = {"kind": "done", "window": msg["window"]}
            if k:
                done["logprobs"] = {str(r["tag"]): next_logprobs(o) for r, o in zip(reqs, outs)}
            wire.send(sock, done)
    except wire.Closed:
        return
    except BaseException as e:  # reported to tapdraft, which turns it into its error line
        try:
            wire.send(sock, {"kind": "error", "message": f"{type(e).__name__}: {e}",
                             "traceback": traceback.format_exc()[-4000:]})
        except OSError:
            pass
        raise


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` writes every thread's stack to the log
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    serve(sys.argv[1], int(sys.argv[2]))
