"""``regenerate --engine vllm``: the target's replies decoded by vLLM, with continuous batching.

The same worker processes as ``capture --engine vllm`` (:class:`capture.vllm.engine.VLLMEngine`: vLLM's own
venv, a Unix socket, the ``wire`` frames), started in ``generate`` mode (``capture.vllm.side.generate``): no
``extract_hidden_states``, no connector, plain generation. tapdraft keeps everything else: the prompts (its
chat template's generation prompt, audio decoded and resampled as for capture, sent as the frame's payload),
the end-of-turn ids (``Target.end_token_ids``, vLLM's own eos ignored), the checks of each reply, the part
files and the merge (:mod:`capture.replies.stream`, :mod:`capture.replies.regenerate`). Requests are sent as
soon as they are known and each reply comes back the step it finishes, so vLLM's scheduler keeps its batch
full while replies of different lengths end.

Greedy only: vLLM's argmax over its own head's logits is tapdraft's (the head capture proves against vLLM),
so a reply is the in-process engine's token for token (tests/engines/test_vllm_regenerate.py); seeded
sampling would draw other numbers than tapdraft's per-reply generators and is refused.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import numpy as np

from tapdraft.capture.generation import Generation
from tapdraft.capture.targets.base import Prepared, Target
from tapdraft.capture.vllm.config import VLLMConfig
from tapdraft.capture.vllm.engine import VLLMEngine, request
from tapdraft.capture.vllm.side import wire


class VLLMReplies:
    """vLLM workers in generate mode: :meth:`submit` prompts, :meth:`next` gives each reply as it finishes."""

    def __init__(self, cfg: VLLMConfig, target: Target, *, python: str | None, target_dir: str, dtype: str,
                 max_model_len: int, max_new_tokens: int, threads: int | None = None, prefix_caching: bool = False):
        self.target, self.max_new_tokens = target, max_new_tokens
        self.end_ids = target.end_token_ids()
        if not self.end_ids:
            raise ValueError("the target declares no end-of-turn token (eos_token_id in its config, generation config "
                             "or tokenizer); set one so replies can end")
        self.engine = VLLMEngine(cfg, python=python, target_dir=target_dir, layer_ids=[], dtype=dtype,
                                 max_model_len=max_model_len, threads=threads, mode="generate",
                                 prefix_caching=prefix_caching)
        self.version, self.startup_s = self.engine.version, self.engine.startup_s
        self.prefix_caching = prefix_caching
        self.in_flight = 0
        self.prompt_tokens = self.cached_tokens = 0

    def submit(self, prompts: Sequence[tuple[int, Prepared]]) -> None:
        """Send (tag, prompt) pairs; each worker gets one frame. A tag is a conversation's (every turn of it carries
        the same), and a conversation stays on worker ``tag % workers``, so with ``prefix_caching`` its later turns
        find its earlier ones in that engine's cache."""
        drivers = sorted(self.engine.drivers.items())
        mine: dict[int, list[tuple[int, Prepared]]] = {}
        for tag, p in prompts:
            mine.setdefault(tag % len(drivers), []).append((tag, p))
        for k, batch in mine.items():
            reqs = [(tag, request(self.target, p)) for tag, p in batch]
            head = [{"tag": tag, "prompt_token_ids": r.prompt_ids, "audio": [int(a.shape[0]) for a in r.audio],
                     "sample_rate": r.sample_rate, "max_tokens": self.max_new_tokens, "stop_token_ids": self.end_ids}
                    for tag, r in reqs]
            audio = [a for _, r in reqs for a in r.audio]
            wire.send(drivers[k][1], {"kind": "generate", "requests": head}, np.concatenate(audio) if audio else b"")
            self.prompt_tokens += sum(len(h["prompt_token_ids"]) for h in head)
        self.in_flight += len(prompts)

    def next(self) -> tuple[int, Generation]:
        """The next finished reply: (tag, its Generation)."""
        assert self.in_flight > 0, "no reply is pending"
        while True:
            _, header, _ = self.engine._next()
            if header.get("kind") == "reply":
                break
        self.in_flight -= 1
        self.cached_tokens += int(header.get("cached_tokens", 0))
        ids = list(header["token_ids"])
        stop = ids[-1] if header["finish_reason"] == "stop" and ids and ids[-1] in self.end_ids else None
        return int(header["tag"]), Generation(ids[:-1] if stop is not None else ids, stop, None)

    def stats(self) -> dict[str, Any]:
        """What the prompts cost to prefill: their tokens sent, and those vLLM's prefix cache held (0 without it)."""
        return {"prefix_caching": self.prefix_caching, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens}

    def replies(self) -> Iterator[tuple[int, Generation]]:
        while self.in_flight:
            yield self.next()

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> "VLLMReplies":
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()
