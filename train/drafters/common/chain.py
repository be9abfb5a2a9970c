"""MTP alignment: which token each depth predicts at each position, and acceptance chained over depths.

Alignment: with ``labels[t]`` = the token at t + 1 (IGNORE where it is unsupervised or past the
sequence), depth k's target at t is ``labels[t + k]`` when t + k is inside t's sequence; rows
whose target is IGNORE are invalid (``train.drafters.mtp.model`` also masks the rows whose input is an audio frame it
cannot embed).

The chained drafters (MTP's depths, EAGLE-3's steps) share this alignment and :func:`chain_acceptance`.

Shapes: Bs batch, T positions, D depths.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tapdraft.train.acceptance import AcceptanceCounts, replay_rounds

IGNORE = -100


def doc_end_from_lengths(lengths: torch.Tensor, T: int) -> torch.Tensor:
    """Padded batch (one sequence per row): exclusive end of each position's sequence, [Bs, T]."""
    return lengths.long()[:, None].expand(-1, T).clone()


def next_token_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor, doc_end: torch.Tensor) -> torch.Tensor:
    """labels[t] = input_ids[t + 1] when t + 1 is in t's sequence and supervised, else IGNORE. [..., T]."""
    T = input_ids.shape[-1]
    t = torch.arange(T, device=input_ids.device)
    nxt = F.pad(input_ids[..., 1:], (0, 1), value=0).long()
    sup = F.pad(loss_mask[..., 1:], (0, 1), value=False)
    ok = sup & (t + 1 < doc_end)
    return torch.where(ok, nxt, torch.full_like(nxt, IGNORE))


def depth_labels(labels: torch.Tensor, doc_end: torch.Tensor, depth: int) -> torch.Tensor:
    """Depth k's target at t: labels[t + k] when t + k is inside t's sequence, else IGNORE. [..., T]."""
    T = labels.shape[-1]
    t = torch.arange(T, device=labels.device)
    shifted = F.pad(labels[..., depth:], (0, depth), value=IGNORE) if depth < T else torch.full_like(labels, IGNORE)
    return torch.where(t + depth < doc_end, shifted, torch.full_like(shifted, IGNORE))


def shift_left(x: torch.Tensor, k: int) -> torch.Tensor:
    """x[:, t + k] at t (zeros past the end), along dim 1."""
    if k == 0:
        return x
    pad = torch.zeros_like(x[:, :k])
    return torch.cat([x[:, k:], pad], dim=1)[:, : x.shape[1]]


def chain_counts(labels: list[torch.Tensor], hits: list[torch.Tensor]) -> AcceptanceCounts:
    """Acceptance over depths: a row counts at depth k only if depths 1..k are all valid and correct.

    ``labels[k-1]`` [Bs, T] (IGNORE = invalid) and ``hits[k-1]`` bool [Bs, T] (prediction == target).
    ``reached[k-1]``: rows with depths < k all correct and depth k valid; ``accepted[k-1]``: those
    also correct at k. ``blocks``: rows valid at depth 1 (one draft opportunity each).
    """
    ok = None
    accepted, reached, correct, valid = [], [], [], []
    for lab, hit in zip(labels, hits):
        v = lab != IGNORE
        hit = hit & v
        prior = torch.ones_like(v) if ok is None else ok
        reached.append((prior & v).sum())
        ok = prior & hit
        accepted.append(ok.sum())
        correct.append(hit.sum())
        valid.append(v.sum())
    return AcceptanceCounts(
        accepted=torch.stack(accepted).double().cpu(),
        reached=torch.stack(reached).double().cpu(),
        correct=torch.stack(correct).double().cpu(),
        valid=torch.stack(valid).double().cpu(),
        blocks=int(valid[0]),
    )


def chain_acceptance(labels: list[torch.Tensor], hits: list[torch.Tensor], loss_mask: torch.Tensor) -> AcceptanceCounts:
    """:func:`chain_counts` plus the greedy rounds replayed on the chains (``train.acceptance.replay_rounds``).

    A live round anchored at position p (its last emitted token, which the target has not run yet) drafts
    from row p - 1, so the chain of row p - 1 is the block of anchor p.
    """
    counts = chain_counts(labels, hits)
    valid = torch.stack([t != IGNORE for t in labels], -1)  # [Bs, T, D] by row
    correct = torch.stack(hits, -1) & valid
    pad = torch.zeros_like(valid[:, :1])
    valid_p, correct_p = torch.cat([pad, valid[:, :-1]], 1), torch.cat([pad, correct[:, :-1]], 1)
    Bs, T = loss_mask.shape
    anchors = torch.arange(T, device=valid.device)[None].expand(Bs, T)
    counts.round_tokens, counts.rounds = replay_rounds(loss_mask, anchors, correct_p, valid_p)
    return counts


AUDIO_MASKED = "rows_audio_masked"
"""The metric of the supervised rows dropped because their input is an audio frame (their share)."""


def step_metric(name: str, k: int) -> str:
    """The log name of a per-step quantity of a drafted chain (``loss``, ``kl``, ``sampled_acceptance``,
    ``lk_lambda``): ``{name}@{k}``, k = 1 for the first drafted token as in ``acc@k``; one spelling for EAGLE-3's
    steps and MTP's depths."""
    return f"{name}@{k}"
