"""The worker's ``generate`` mode (``regenerate --engine vllm``): plain generation, each reply sent as it finishes.

The same worker process as capture's (``worker.py``: hello, start, ready, a closed socket ends it); a start frame
with ``"mode": "generate"`` builds vLLM's ``LLM`` without ``extract_hidden_states`` or the connector, and the
worker then serves

    {"kind": "generate", "requests": [{"tag", "prompt_token_ids", "audio": [N, ...], "sample_rate",
                                       "max_tokens", "stop_token_ids"}]}    (audio in the payload, as a run frame's)

by adding the requests to the running engine at once (continuous batching: a frame may come while others
decode) and answering each request with ``{"kind": "reply", "tag", "token_ids", "finish_reason", "cached_tokens"}``
(``cached_tokens``: its prompt tokens vLLM's prefix cache held) the step it finishes, and ``{"kind": "alive",
"running": N}`` after every ``ALIVE_S`` seconds without one (a long batch on a slow CPU may decode for many minutes
before its first reply ends: tapdraft's silence timeout is then the worker's, not the replies'). Greedy only
(``temperature=0``); ``ignore_eos`` with tapdraft's end-of-turn ids as ``stop_token_ids``, so a reply stops exactly
where the in-process engine's does (vLLM's ``token_ids`` keep the stop id, as tapdraft's ``Generation.ids`` do).
Prefix caching is what the start frame's ``llm`` says (``RegenerateConfig.prefix_caching``; off unless asked): a
cached prefix's KV was computed in another batch, so a reply then depends on what ran before it, which a resume
cannot reproduce.
"""

from __future__ import annotations

import os
import select
import sys
import time
from typing import Any

from . import wire
from .prompts import prompts

ALIVE_S = 30.0

def build(llm: dict[str, Any]) -> Any:
    from vllm import LLM

    return LLM(**{"enable_prefix_caching": False, **llm})


def serve_replies(sock: Any, start: dict[str, Any]) -> None:
    """Build the engine, say ready, then generate until a stop frame or a closed socket."""
    from vllm import SamplingParams, __version__

    llm = build(start["llm"])
    wire.send(sock, {"kind": "ready", "vllm": __version__})
    engine = llm.llm_engine
    tags: dict[str, Any] = {}  # vLLM's request id (the external one outputs carry) -> tapdraft's tag
    last = time.monotonic()
    while True:
        busy = bool(tags)
        while True:  # every frame already sent; wait for one only when nothing runs
            ready, _, _ = select.select([sock], [], [], 0 if busy else None)
            if not ready:
                break
            try:
                msg, payload = wire.recv(sock)
            except wire.Closed:
                return
            if msg["kind"] == "stop":
                sys.stdout.flush()
                os._exit(0)  # as capture's worker: one in-process engine holds nothing to release
            if msg["kind"] != "generate":
                raise ValueError(f"unexpected frame {msg['kind']!r} in generate mode")
            reqs = msg["requests"]
            params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True,
                                     stop_token_ids=list(r["stop_token_ids"]), detokenize=False) for r in reqs]
            ids = llm.enqueue(prompts(reqs, payload), params, use_tqdm=False)
            for r, rid in zip(reqs, ids):  # enqueue gives the internal id: the external one + "-" + 8 random chars
                tags[rid.split("-", 1)[0]] = r["tag"]
            busy = True
        for out in engine.step():
            if not out.finished:
                continue
            tag = tags.pop(out.request_id)
            o = out.outputs[0]
            wire.send(sock, {"kind": "reply", "tag": tag, "token_ids": [int(t) for t in o.token_ids],
                             "finish_reason": o.finish_reason, "cached_tokens": int(out.num_cached_tokens or 0)})
            last = time.monotonic()
        if tags and time.monotonic() - last > ALIVE_S:
            wire.send(sock, {"kind": "alive", "running": len(tags)})
            last = time.monotonic()
