"""DSpark's sequential stage: the low-rank Markov head, the confidence head, and the left-to-right walk.

The parallel backbone (DFlash's) gives every slot k of a block its base logits U_k. The Markov head adds a
transition bias from the token before the slot's target,

    z_k = U_k + markov_w2(markov_w1[x_{k-1}])          markov_w1: V x r embedding, markov_w2: r -> V, r = 256

where x_{-1} is the anchor (the last emitted token) and x_{k-1} for k >= 1 is the token drafted (live) or
the reply's token (teacher-forced training and evaluation) at slot k - 1. Drafting is therefore sequential:
slot k's distribution is known only once slot k - 1 is drawn (:func:`walk`). The confidence head estimates
slot k's acceptance probability from [h_k ; markov_w1[x_{k-1}]] (one logit, with bias).

Names and shapes are vLLM 0.32's (vllm/model_executor/models/qwen3_dspark.py: ``DSparkMarkovHead``
``markov_head.markov_w{1,2}``, ``DSparkConfidenceHead`` ``confidence_head.proj`` over hidden + markov_rank
when ``confidence_head_with_markov``), so the exported tensors load there unrenamed. The walk is vLLM's
``DSparkSpeculator._sample_sequential`` (vllm/v1/worker/gpu/spec_decode/dspark/speculator.py): prev = the
anchor, then per slot base + bias, drawn, fed back. The head follows ModelOpt's DSpark
(modelopt/torch/speculative/plugins/modeling_dspark.py, ``DSparkModule``: normal(0, 0.02) init).

Variants: only ``vanilla`` is built. ModelOpt also trains ``gated`` (a sigmoid gate on markov_w1[x] from
[h; markov_w1[x]]) and ``rnn`` (a GRU-like state over the block), but vLLM 0.32 cannot load them:
``Qwen3DSparkModel.__init__`` always builds the vanilla ``DSparkMarkovHead`` (no ``gate_proj`` /
``joint_proj`` parameter exists, so their tensors would be unexpected), and ``_validate_qwen3_omni_dspark``
(vllm/config/speculative.py) raises "Qwen3-Omni DSpark currently requires markov_head_type='vanilla'".

Shapes: R rows, V vocab, r Markov rank, H hidden, K drafted slots.
"""

from __future__ import annotations

import torch
from torch import nn

from tapdraft.train.drafters.base import pick_tokens

HEAD_TYPES = ("vanilla",)
"""Markov head variants a DSpark draft may use (the ones vLLM 0.32 loads; see the module docstring)."""


class MarkovHead(nn.Module):
    """The low-rank transition bias markov_w2(markov_w1[prev]) over the (target) vocabulary."""

    def __init__(self, vocab_size: int, rank: int, std: float = 0.02) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        nn.init.normal_(self.markov_w1.weight, std=std)
        nn.init.normal_(self.markov_w2.weight, std=std)

    def embed(self, prev_R: torch.Tensor) -> torch.Tensor:
        """markov_w1[prev] [R, r]."""
        return self.markov_w1(prev_R.long())

    def bias(self, prev_R: torch.Tensor) -> torch.Tensor:
        """The transition bias [R, V] of predecessor tokens ``prev_R``."""
        return self.markov_w2(self.embed(prev_R))


class ConfidenceHead(nn.Module):
    """One acceptance logit per slot from [h ; markov_w1[prev]] (vLLM's ``confidence_head.proj``, with bias)."""

    def __init__(self, hidden_size: int, rank: int, std: float = 0.02) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_size + rank, 1, bias=True)
        nn.init.normal_(self.proj.weight, std=std)
        nn.init.zeros_(self.proj.bias)

    def forward(self, h_RH: torch.Tensor, embed_Rr: torch.Tensor) -> torch.Tensor:
        """Logits [R] (sigmoid: the estimated acceptance probability)."""
        x = torch.cat([h_RH, embed_Rr.to(h_RH.dtype)], -1)
        return self.proj(x.to(self.proj.weight.dtype)).squeeze(-1)


def walk(head: MarkovHead, base_BKV: torch.Tensor, first_B: torch.Tensor, *, temperature: float = 0.0,
         generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft K slots left to right: slot k draws from base[:, k] + bias(previous token), prev starting at the
    anchor ``first_B``. Greedy (temperature 0) or sampled; returns tokens [B, K] and, when sampling, the
    distributions [B, K, V] each slot was drawn from (the drafts' q)."""
    prev = first_B.long()
    tokens, qs = [], []
    for k in range(base_BKV.shape[1]):
        z = base_BKV[:, k] + head.bias(prev).to(base_BKV.dtype)
        tok, q = pick_tokens(z, temperature, generator)
        tokens.append(tok)
        qs.append(q)
        prev = tok
    out = torch.stack(tokens, 1)
    return out, (torch.stack(qs, 1) if temperature > 0 else None)
