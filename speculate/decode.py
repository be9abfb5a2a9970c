"""Real speculative decoding: the live target verifies what a drafter proposes.

This is the check on the offline estimate: ``train.evaluate`` predicts the acceptance length tau
from teacher-forced acceptance on a dataset; here the target decodes for real, with a KV cache,
and tau is counted as tokens emitted per target forward (the accepted drafts plus the target's own
bonus token).

One round, with P tokens verified so far and x the last emitted token (not yet seen by the target):

    draft   d_1..d_K = proposer(ids[: P + 1], taps[: P])           K = block size - 1 (DFlash)
    verify  target forward over [x, d_1..d_K] at positions P..P+K  -> logits rows 0..K, taps
    greedy  accept while d_i == argmax(row i-1); bonus = argmax(row a)
    sampled accept d_i with prob min(1, p_i(d_i) / q_i(d_i)), else draw from norm(max(p_i - q_i, 0))
            and stop; if all K pass, the bonus is drawn from row K (Leviathan et al., 2023)
    then    keep the cache and taps of positions P..P+a, drop the rest

Greedy output is identical to the target's own greedy decoding (tested), whatever the drafter.

Each round is timed from the proposal to the emitted tokens (``round_seconds``; the token ids read back to the
host end every round, so an accelerator's queue is drained), and :func:`target_greedy` can time its plain
decode steps: their ratio is the round cost that decides whether the drafter pays off (``speculate.run``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import time

import torch
from torch import nn

from tapdraft.capture.head import LiveHead, derive_head
from tapdraft.capture.hooks import LayerTaps

Proposer = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
"""proposer(ids [P+1], taps [P, n, H], temperature, generator) -> (tokens [K], draft probs [K, V] or None)."""


class TargetSession:
    """One sequence on the live target: a KV cache plus the decoder-layer taps of every cached position.

    ``lm`` is an HF causal LM; ``tap_ids`` are HF decoder-layer ids (pre-final-norm outputs), in the
    order the drafter's dataset stores them. Only the decoder runs; logits come from its last layer's
    output through the target's head (``head``, default ``capture.head.derive_head(lm)``), exactly as
    capture computed the stored teacher, never from the model's own logits, which some families scale
    and some composites do not.
    """

    def __init__(self, lm: nn.Module, tap_ids: Sequence[int], *, head: LiveHead | None = None):
        from transformers import DynamicCache

        self.lm = lm
        self.decoder = lm.get_decoder()
        self.layers = self.decoder.layers
        self.tap_ids = list(tap_ids)
        self.head = head if head is not None else derive_head(lm)
        self.cache = DynamicCache()
        self.taps = torch.empty(0)  # [P, n, H]
        self.forwards = 0

    @property
    def length(self) -> int:
        return int(self.cache.get_seq_length())

    @torch.no_grad()
    def _forward(self, **inputs) -> torch.Tensor:
        last = len(self.layers) - 1
        with LayerTaps(self.layers, sorted(set(self.tap_ids) | {last})) as hooks:
            n = next(iter(inputs.values())).shape[1]
            start = self.length
            pos = torch.arange(start, start + n, device=self._device())[None]
            self.decoder(**inputs, position_ids=pos, cache=self.cache, use_cache=True)
        self.forwards += 1
        if self.tap_ids:
            new_taps = torch.stack([hooks.out[i][0] for i in self.tap_ids], dim=1).float()  # [n, ntap, H]
            self.taps = new_taps if start == 0 else torch.cat([self.taps, new_taps])
        return self.head.logits(hooks.out[last][0])  # [n, V]

    def _device(self) -> torch.device:
        return next(self.lm.parameters()).device

    def prefill(self, inputs_embeds_TH: torch.Tensor) -> torch.Tensor:
        """Run the prompt (already expanded: audio frames in place); returns the last row's logits [V]."""
        if self.length:
            raise ValueError("prefill() is for an empty session; start a new TargetSession per prompt")
        return self._forward(inputs_embeds=inputs_embeds_TH[None].to(self._device()))[-1]

    def extend(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Feed tokens at the next positions; returns their logits [n, V]."""
        return self._forward(input_ids=token_ids.view(1, -1).to(self._device()))

    def crop(self, length: int) -> None:
        """Forget every position >= ``length`` (rejected drafts)."""
        drop = self.length - length
        if drop > 0:  # transformers 5 crops by a negative count of positions to remove
            self.cache.crop(-drop)
        if self.tap_ids:
            self.taps = self.taps[:length]


@dataclass
class DecodeResult:
    tokens: list[int]
    """Emitted tokens (eos included when it was produced)."""
    accepted: list[int] = field(default_factory=list)
    """Accepted drafts that were emitted, per verification round (none past eos or the token limit)."""
    emitted: list[int] = field(default_factory=list)
    """Tokens emitted per verification round: accepted drafts + the target's bonus token, except in a
    round cut short by eos or the token limit."""
    cut: list[bool] = field(default_factory=list)
    """Whether the round ended at eos or the token limit (drafts after that were never judged)."""
    agreed: list[int] = field(default_factory=list)
    """Drafts the verifier accepted per round BEFORE the cut at eos or the token limit: serving engines count
    this (vLLM's ``per_step_accepted`` and ``num_accepted_tokens``), where ``accepted`` counts what was emitted."""
    proposed: int = 0
    """Drafts proposed per round (block size - 1)."""
    drafted: list[int] = field(default_factory=list)
    """Drafts proposed in each round."""
    round_seconds: list[float] = field(default_factory=list)
    """Wall time of each round: drafting, the verifying forward, acceptance and the cache crop."""

    @property
    def target_forwards(self) -> int:
        return len(self.emitted)

    @property
    def tau(self) -> float:
        """Tokens emitted per verifying target forward."""
        return sum(self.emitted) / len(self.emitted) if self.emitted else float("nan")


def sampled_step(p_V: torch.Tensor, q_V: torch.Tensor, draft: int, generator: torch.Generator | None) -> int | None:
    """Rejection sampling for one drafted token: None when ``draft`` is accepted, else the replacement.

    The emitted token is distributed exactly as ``p_V`` whatever ``q_V`` is (``draft`` ~ ``q_V``).
    """
    u = float(torch.rand((), generator=generator))
    if u < min(1.0, float(p_V[draft] / q_V[draft].clamp_min(1e-30))):
        return None
    r = (p_V - q_V).clamp(min=0)
    if float(r.sum()) <= 0:  # p == q: a rejection cannot happen in exact arithmetic; p is right
        r = p_V
    return int(torch.multinomial(r / r.sum(), 1, generator=generator))


def speculative_generate(
    session: TargetSession,
    inputs_embeds_TH: torch.Tensor,
    prompt_ids: torch.Tensor,
    proposer: Proposer,
    *,
    max_new_tokens: int,
    eos_token_id: int | None,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> DecodeResult:
    """Decode up to ``max_new_tokens`` after the prompt; ``temperature`` 0 is greedy (exact)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")

    def pick(logits_V: torch.Tensor) -> int:
        if temperature == 0:
            return int(logits_V.argmax())
        return int(torch.multinomial(torch.softmax(logits_V / temperature, -1), 1, generator=generator))

    ids = prompt_ids.long().cpu().tolist()
    out = DecodeResult(tokens=[])
    x = pick(session.prefill(inputs_embeds_TH))
    out.tokens.append(x)
    while len(out.tokens) < max_new_tokens and x != eos_token_id:
        t0 = time.perf_counter()
        P = session.length
        seq = torch.tensor(ids + out.tokens, dtype=torch.long)
        assert seq.shape[0] == P + 1, (seq.shape, P)
        drafts, q = proposer(seq, session.taps, temperature=temperature, generator=generator)
        drafts = drafts.long().cpu()
        K = int(drafts.shape[0])
        out.proposed = K
        logits = session.extend(torch.cat([torch.tensor([x]), drafts]))  # [K + 1, V]
        a, nxt = 0, None
        for i in range(K):
            d = int(drafts[i])
            if temperature == 0:
                if int(logits[i].argmax()) != d:
                    break
            else:
                p_i = torch.softmax(logits[i] / temperature, -1)
                nxt = sampled_step(p_i, q[i].to(p_i), d, generator)
                if nxt is not None:
                    break
            a += 1
        if nxt is None:
            nxt = pick(logits[a])
        session.crop(P + a + 1)
        n, cut = 0, False
        for t in [int(t) for t in drafts[:a]] + [nxt]:
            out.tokens.append(t)
            n += 1
            if t == eos_token_id or len(out.tokens) >= max_new_tokens:
                cut = True
                break
        out.emitted.append(n)
        out.accepted.append(min(a, n))  # drafts accepted past eos are never emitted: not counted
        out.agreed.append(a)
        out.cut.append(cut)
        out.drafted.append(K)
        out.round_seconds.append(time.perf_counter() - t0)
        x = out.tokens[-1]
    return out


def acceptance_by_position(results: list[DecodeResult], K: int) -> list[float]:
    """alpha_k = P(draft k accepted | drafts 1..k-1 accepted), over rounds where draft k was judged.

    A round cut short by eos or the token limit after ``m`` emitted tokens never judged the drafts
    beyond them; those positions are left out rather than counted as rejections.
    """
    acc = [0] * K
    seen = [0] * K
    for r in results:
        for a, cut in zip(r.accepted, r.cut):
            for k in range(1, K + 1):
                if a < k - 1 or (cut and a < k):
                    break
                seen[k - 1] += 1
                acc[k - 1] += a >= k
    return [x / n if n else float("nan") for x, n in zip(acc, seen)]


def target_greedy(lm: nn.Module, inputs_embeds_TH: torch.Tensor, *, max_new_tokens: int,
                  eos_token_id: int | None, head: LiveHead | None = None,
                  step_seconds: list[float] | None = None) -> list[int]:
    """Plain greedy decoding with the target alone (the reference speculative decoding must equal); the wall time
    of each decode step after the prefill is appended to ``step_seconds`` when given."""
    session = TargetSession(lm, [], head=head)
    tokens = [int(session.prefill(inputs_embeds_TH).argmax())]
    while len(tokens) < max_new_tokens and tokens[-1] != eos_token_id:
        t0 = time.perf_counter()
        tokens.append(int(session.extend(torch.tensor([tokens[-1]]))[-1].argmax()))
        if step_seconds is not None:
            step_seconds.append(time.perf_counter() - t0)
    return tokens
