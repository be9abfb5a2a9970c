"""Anchor drawing for the block drafters (DFlash, DFlash2): where each training or evaluation block starts.

Anchors: positions p with loss_mask[p] and room for the block (``full_blocks_only``: p + B <= len;
default: p + 1 < len, so short replies at the end of a sequence still train, the overhanging slots
masked), sampled without replacement, sorted; at most ``num_anchors`` per sequence and
``max_total_anchors`` per micro-batch (the per-sequence cap is lowered evenly, water-filling,
until the batch fits). With FlexAttention or torch.compile the block count per sequence is fixed
(min(num_anchors, max_total_anchors // Bs)) so shapes stay static; eager sizes it to the batch.

Shapes: Bs batch, T positions, N blocks per sequence, B block size.
"""

from __future__ import annotations

import torch


def allocate_anchor_counts(eligible_B: torch.Tensor, per_seq: int, total: int) -> torch.Tensor:
    """Per-sequence anchor counts summing to min(total, sum(min(eligible, per_seq))).

    Water-filling: min(eligible, cap) with the largest cap <= per_seq whose sum fits ``total``; the
    rest of ``total`` goes one each to the first sequences still below their eligible count (so a
    budget smaller than the batch still draws anchors instead of none).
    """
    e = eligible_B.clamp(max=per_seq)
    if int(e.sum()) <= total:
        return e
    lo, hi = 0, per_seq  # largest cap with sum(min(e, cap)) <= total
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if int(e.clamp(max=mid).sum()) <= total:
            lo = mid
        else:
            hi = mid - 1
    counts = e.clamp(max=lo)
    more = e > lo
    extra = (more.cumsum(0) <= total - int(counts.sum())) & more
    return counts + extra.to(counts.dtype)


def sample_anchors(
    loss_mask_BT: torch.Tensor,
    lengths_B: torch.Tensor,
    *,
    block_size: int,
    num_anchors: int,
    max_total_anchors: int,
    full_blocks_only: bool = False,
    static: bool = False,
    generator: torch.Generator | None = None,
    take_all: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchors long [Bs, N] (sorted; padding blocks 0) and valid bool [Bs, N].

    Sampled without replacement among eligible positions (uniform random keys from ``generator``,
    drawn on the CPU so results do not depend on the device). ``take_all`` takes the first
    eligible positions in order instead (deterministic evaluation).
    """
    Bs, T = loss_mask_BT.shape
    pos = torch.arange(T)
    lm = loss_mask_BT.cpu()
    L = lengths_B.cpu()[:, None]
    room = pos + block_size <= L if full_blocks_only else pos + 1 < L
    eligible = lm & room
    n_el = eligible.sum(1)
    counts = allocate_anchor_counts(n_el, num_anchors, max_total_anchors)
    if static:
        N = max(1, min(num_anchors, max_total_anchors // max(Bs, 1)))
        counts = counts.clamp(max=N)
    else:
        N = max(1, int(counts.max()) if Bs else 1)
    if take_all:
        keys = pos.float().expand(Bs, T).clone()
    else:
        keys = torch.rand(Bs, T, generator=generator)
    keys = keys.masked_fill(~eligible, float("inf"))
    k = min(N, T)
    picked = keys.topk(k, dim=1, largest=False).indices  # [Bs, k] lowest keys
    slot = torch.arange(k)[None]
    valid = slot < counts[:, None]
    anchors = torch.where(valid, picked, torch.full_like(picked, T + 1))
    anchors = anchors.sort(dim=1).values  # valid first (padding sentinel T+1 sorts last)
    valid = slot < counts[:, None]
    anchors = torch.where(valid, anchors, torch.zeros_like(anchors))
    if k < N:
        anchors = torch.cat([anchors, anchors.new_zeros(Bs, N - k)], 1)
        valid = torch.cat([valid, valid.new_zeros(Bs, N - k)], 1)
    dev = loss_mask_BT.device
    return anchors.to(dev), valid.to(dev)
