"""A run or generate frame's requests as vLLM prompts: shared by the worker's two modes (``worker.py`` captures,
``generate.py`` generates), which import it, never each other."""

from __future__ import annotations

from typing import Any

import numpy as np


def prompts(reqs: list[dict[str, Any]], payload: bytearray) -> list[dict[str, Any]]:
    """vLLM prompts of a run frame: token ids, and each request's waveforms from the payload as multi_modal_data."""
    out, at = [], 0
    for r in reqs:
        prompt: dict[str, Any] = {"prompt_token_ids": r["prompt_token_ids"]}
        waves = []
        for n in r.get("audio") or []:
            waves.append((np.frombuffer(payload, dtype=np.float32, count=n, offset=at), r["sample_rate"]))
            at += 4 * n
        if waves:
            prompt["multi_modal_data"] = {"audio": waves}
        out.append(prompt)
    if at != len(payload):
        raise ValueError(f"run frame: {len(payload)} payload bytes for {at} bytes of audio")
    return out
