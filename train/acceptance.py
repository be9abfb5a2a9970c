"""Acceptance bookkeeping: counts by block position, replayed decoding rounds, tau, sampled acceptance.

Every family's ``acceptance()`` returns :class:`AcceptanceCounts`; evaluation sums them and turns
the conditional rates alpha_k into the acceptance length tau = 1 + sum_k prod_{j<=k} alpha_j.
:func:`acceptance_counts` counts blocks from per-slot correctness (DFlash, DFlash2; MTP chains its
depths in ``train.drafters.common.chain``) and :func:`acceptance_metrics` is every family's acc@k / alpha@k log.
:func:`replay_rounds` replays greedy decoding round by round on teacher-forced block outcomes, so
the offline number is comparable with live decoding. Sampled decoding's acceptance is each family's
``sampled_acceptance`` (sum_v min(p, q) per draft position), summed by ``train.evaluate`` and turned into
tau by the same :func:`tau_from_alpha`. :func:`breakeven` says whether a tau pays off on an engine whose
round (draft + verify) costs R plain decode steps: speedup = tau / R, break-even at tau = R.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class AcceptanceCounts:
    """Teacher-forced acceptance counts by block position k = 1..K (eval hook output).

    ``accepted[k-1]``: blocks whose slots 1..k were all predicted correctly (valid at every slot).
    ``reached[k-1]``: blocks whose slots 1..k-1 were all correct and slot k is valid (a target
    exists and is supervised). The conditional acceptance alpha_k = accepted / reached, and
    tau = 1 + sum_k prod_{j<=k} alpha_j.
    ``correct[k-1]`` / ``valid[k-1]``: unconditional per-position accuracy.
    ``round_tokens`` / ``rounds``: greedy decoding replayed on the dataset (optional, 0 when a family
    does not replay): each reply decoded round by round from its first token, every round anchored
    where the previous one stopped, as a live decoder would; tokens emitted per round is then
    comparable with live decoding (uniform anchors overweight the easy positions inside a reply).
    """

    accepted: torch.Tensor
    reached: torch.Tensor
    correct: torch.Tensor
    valid: torch.Tensor
    blocks: int = 0
    round_tokens: int = 0
    rounds: int = 0

    def __add__(self, other: "AcceptanceCounts") -> "AcceptanceCounts":
        return AcceptanceCounts(
            self.accepted + other.accepted,
            self.reached + other.reached,
            self.correct + other.correct,
            self.valid + other.valid,
            self.blocks + other.blocks,
            self.round_tokens + other.round_tokens,
            self.rounds + other.rounds,
        )


def replay_rounds(
    loss_mask_BT: torch.Tensor, anchors_BN: torch.Tensor, correct_BNK: torch.Tensor, valid_BNK: torch.Tensor,
) -> tuple[int, int]:
    """Greedy speculative decoding replayed on teacher-forced block outcomes -> (tokens, rounds).

    Every supervised run (a reply) is decoded from its first token: a round at anchor p accepts
    the leading correct slots a of its valid ones; with a < valid it emits a + 1 tokens (the
    target's correction) and the next round is anchored at p + a + 1; when every valid slot is
    right it emits them, plus the target's next token when the reply goes on past the block (then
    the next round is anchored there), else the reply has ended.
    A round needs its anchor among ``anchors`` with a valid slot; otherwise the reply has ended.
    """
    K = correct_BNK.shape[-1]
    ok = (correct_BNK.bool() & valid_BNK).cpu()
    nvalid = valid_BNK.long().cumprod(-1).sum(-1).cpu()  # leading valid slots
    lead = ok.long().cumprod(-1).sum(-1)  # leading correct slots
    lm = loss_mask_BT.bool().cpu()
    tokens = rounds = 0
    for b in range(anchors_BN.shape[0]):
        row = {int(p): n for n, p in enumerate(anchors_BN[b].tolist()) if int(nvalid[b, n]) > 0}
        starts = [t for t in range(lm.shape[1]) if lm[b, t] and (t == 0 or not lm[b, t - 1])]
        for p in starts:
            while p in row:
                n = row[p]
                a, v = int(lead[b, n]), int(nvalid[b, n])
                rounds += 1
                if a < v:
                    tokens += a + 1
                    p += a + 1
                elif v == K and p + K + 1 < lm.shape[1] and lm[b, p + K + 1]:
                    tokens += K + 1  # a full block and the reply goes on: the target adds its token
                    p += K + 1
                else:
                    tokens += v  # the last draft was the reply's last token (eos): nothing follows
                    break
    return tokens, rounds


def acceptance_counts(correct_BNK: torch.Tensor, valid_BNK: torch.Tensor) -> AcceptanceCounts:
    """Teacher-forced acceptance counts from per-slot correctness [Bs, N, B-1] (slots 1..B-1)."""
    ok = (correct_BNK.bool() & valid_BNK).long()
    prefix = torch.cumprod(ok, dim=-1)  # slots 1..k all accepted
    before = torch.cat([torch.ones_like(prefix[..., :1]), prefix[..., :-1]], -1)
    reached = before * valid_BNK.long()
    block_valid = valid_BNK.any(-1)
    return AcceptanceCounts(
        accepted=prefix.sum((0, 1)).double(),
        reached=reached.sum((0, 1)).double(),
        correct=ok.sum((0, 1)).double(),
        valid=valid_BNK.long().sum((0, 1)).double(),
        blocks=int(block_valid.sum()),
    )


def with_rounds(acc: AcceptanceCounts, batch: dict[str, Any], anchors: torch.Tensor, correct: torch.Tensor,
                valid: torch.Tensor) -> AcceptanceCounts:
    """``acc`` with the greedy rounds :func:`replay_rounds` replays on the batch's blocks at ``anchors``."""
    acc.round_tokens, acc.rounds = replay_rounds(batch["loss_mask"], anchors, correct, valid)
    return acc


def acceptance_metrics(acc: AcceptanceCounts) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Training-log metrics of every family: acc@k (unconditional) and alpha@k (conditional on positions < k
    accepted) as (sum, count)."""
    m = {}
    for k in range(acc.accepted.shape[0]):
        m[f"acc@{k + 1}"] = (acc.correct[k], acc.valid[k])
        m[f"alpha@{k + 1}"] = (acc.accepted[k], acc.reached[k])
    return m


def tau_from_alpha(alpha: list[float]) -> float:
    """Acceptance length tau = 1 + sum_k prod_{j<=k} alpha_j (alpha_k conditional per position)."""
    tau, run = 1.0, 1.0
    for a in alpha:
        run *= a
        tau += run
    return tau


UNREACHED = "-"
"""How a block position no round reached prints, everywhere (eval, speculate, train): never 0.000 or nan."""


def alpha_text(alpha: list[float | None], reached: list[int] | None = None, digits: int = 3) -> str:
    """Acceptance by position as text; a position never reached (``reached[k] == 0``, None or NaN) is
    :data:`UNREACHED`, so it cannot be read as a rejection."""
    out = []
    for k, a in enumerate(alpha):
        unreached = a is None or a != a or (reached is not None and reached[k] == 0)
        out.append(UNREACHED if unreached else f"{a:.{digits}f}")
    return " ".join(out)


ROUND_COSTS = (1.1, 1.25, 1.6, 2.05, 2.5)
"""Round costs ``eval`` tabulates when none is given: cheap rounds, then vLLM's measured EAGLE-3 (1.6) and DFlash
(2.05) rounds on a speech target (16 prompts, 128 tokens; docs/speedup.md)."""


def breakeven(tau: float, round_cost: float, source: str) -> dict[str, Any]:
    """Where a drafter pays off: a round (draft + verify) costs ``round_cost`` plain decode steps and emits ``tau``
    tokens, so the expected speedup is tau / round_cost and break-even lies at tau = round_cost. ``source`` says
    where the cost comes from ('measured', 'given' or 'assumed')."""
    if not round_cost > 0:
        raise ValueError(f"a round's cost relative to a plain decode step must be > 0, got {round_cost}")
    speedup = tau / round_cost
    return {"round_cost": round_cost, "source": source, "tau": tau, "breakeven_tau": round_cost,
            "speedup": speedup, "clears": speedup > 1.0}


def breakeven_text(b: dict[str, Any], where: str = "") -> str:
    """The one line ``eval`` and ``speculate`` print for :func:`breakeven`."""
    src = b["source"] + (f": {where}" if where else "")
    head = (f"break-even tau {b['breakeven_tau']:.2f} at round cost {b['round_cost']:.2f} ({src}); "
            f"this drafter's tau {b['tau']:.3f}: ")
    pct = 100 * abs(b["speedup"] - 1)
    verdict = f"clears it by {pct:.0f}%" if b["clears"] else f"falls short by {pct:.0f}%"
    return head + f"{verdict} (expected speedup {b['speedup']:.2f}x)"
