"""Row chunking: apply a per-row function to [chunk, ...] slices so [rows, V] logits never exist whole.

Two users, one engine: :func:`map_row_chunks` (autograd through an activation checkpoint per chunk;
MTP's CE, LK and acceptance) and the fused loss in ``train.drafters.common.losses`` (analytic gradients, no
recompute) both walk ``shards.head.row_spans``, the one definition of a chunk (``chunk_rows <= 0``
is one chunk), which capture's top-k teacher walks too.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch.utils.checkpoint import checkpoint

from tapdraft.shards.head import row_spans


def map_row_chunks(
    fn: Callable[..., tuple[torch.Tensor, ...]],
    rows: Sequence[torch.Tensor],
    chunk_rows: int,
) -> tuple[torch.Tensor, ...]:
    """Apply ``fn`` to row chunks of ``rows`` and concatenate its per-row outputs.

    ``fn(*chunk)`` returns a tuple of [c, ...] tensors (for example per-row KL and TV after building
    [c, V] logits from [c, H] hidden states). Under autograd each chunk runs inside an activation
    checkpoint, so only one chunk's [c, V] logits exist at a time, in the backward pass as well.
    ``chunk_rows <= 0`` runs everything as one chunk.
    """
    n = int(rows[0].shape[0])
    if any(int(r.shape[0]) != n for r in rows):
        raise ValueError(f"row tensors disagree on the row count: {[tuple(r.shape) for r in rows]}")
    spans = row_spans(n, chunk_rows)
    if len(spans) <= 1:
        return tuple(fn(*rows))
    needs_grad = torch.is_grad_enabled() and any(r.requires_grad for r in rows)
    outs: list[tuple[torch.Tensor, ...]] = []
    for s, e in spans:
        chunk = [r[s:e] for r in rows]
        if needs_grad:
            outs.append(tuple(checkpoint(fn, *chunk, use_reentrant=False)))
        else:
            outs.append(tuple(fn(*chunk)))
    return tuple(torch.cat(parts, dim=0) for parts in zip(*outs))
