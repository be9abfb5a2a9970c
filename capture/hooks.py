"""Forward hooks that keep decoder-layer outputs: the one home of how a tap is taken.

A tap is the output of a decoder layer, i.e. the residual stream BEFORE the final norm, the last layer
included (HF ``hidden_states[i + 1]`` for every layer but the last; never ``hidden_states[-1]``, which is
post-norm; numbering in ``shards.taps``). Capture (one padded
forward per batch) and live speculative decoding (one forward per step) both take taps here.

    with LayerTaps(decoder.layers, [1, 9, 17]) as taps:
        decoder(inputs_embeds=...)
    taps.out[9]   # [B, T, H]
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn


class LayerTaps:
    """Register forward hooks on ``layers[i]`` for each id; ``out[i]`` holds the latest output."""

    def __init__(self, layers: nn.ModuleList, ids: Sequence[int]):
        self.out: dict[int, torch.Tensor] = {}
        self.handles = [layers[i].register_forward_hook(self._hook(i)) for i in ids]

    def _hook(self, i: int):
        def fn(_mod: nn.Module, _inp: Any, output: Any) -> None:
            self.out[i] = output[0] if isinstance(output, (tuple, list)) else output

        return fn

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def __enter__(self) -> "LayerTaps":
        return self

    def __exit__(self, *_: Any) -> None:
        self.remove()
