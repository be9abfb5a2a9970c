"""The draft-attention visibility rules, each written once, and the masks built from them: DFlash's blocks
and EAGLE-3's unrolled training-time test (at the end of this module).

Queries are the draft blocks laid end to end: query q belongs to block j = q // B (B = block
size). Keys are ``[context (T rows) | draft slots (N * B rows)]``, the order the layers
concatenate them in (``train.drafters.common.layers.Attention`` prepends the context K/V). A query in block j sees

- context key kv (kv < T) iff kv < anchor_j: strictly before the anchor POSITION (not the block
  index: anchors are sorted but may be arbitrary positions, and overlapping blocks are fine);
- every slot of its own block (T + j*B <= kv < T + (j+1)*B); nothing else.

With a sliding window W (``window``), a context key must also lie fewer than W positions behind the query: slot s of
block j sits at position anchor_j + s and sees context kv iff anchor_j + s - W < kv < anchor_j. That is the rule of
the DFlash reference model (``query - key < sliding_window``) and of vLLM's sliding-window attention, which serves
such a draft; W >= B keeps the whole own block visible (its keys lie within B - 1 positions of every query).

Padding blocks carry anchor 0, so they see only their own block: no row is fully masked, so no NaN.

:func:`draft_mask_mod` is the rule; :func:`dense_mask` evaluates it on broadcast index grids for
SDPA and :func:`flex_block_mask` hands it to FlexAttention's ``create_block_mask``. The block size
of the BlockMask must be a multiple of the Flex kernel tile on GPU (the kernel asserts
``SPARSE_BLOCK % TILE == 0``); :func:`flex_tile` picks the tile from the block size, so both rules
live here together.

Shapes: Bs batch, N blocks per sequence, B block size, T context length, Q = N * B, KV = T + Q.
"""

from __future__ import annotations

from typing import Callable

import torch

try:
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask
except ImportError:  # pragma: no cover
    BlockMask = None  # type: ignore[assignment,misc]
    create_block_mask = None  # type: ignore[assignment]

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def draft_mask_mod(anchors_BN: torch.Tensor, ctx_len: int, block_size: int, window: int | None = None) -> MaskMod:
    """The visibility rule as a FlexAttention mask_mod(b, h, q_idx, kv_idx) -> bool.

    anchors_BN: int [Bs, N], the anchor position of every block (0 for padding blocks); window: the sliding window
    W (None: the whole context before the anchor).
    """

    def mask_mod(b, h, q_idx, kv_idx):
        j = q_idx // block_size
        in_ctx = kv_idx < ctx_len
        sees_ctx = in_ctx & (kv_idx < anchors_BN[b, j])
        if window is not None:
            sees_ctx = sees_ctx & (kv_idx > anchors_BN[b, j] + q_idx % block_size - window)
        own_block = (~in_ctx) & ((kv_idx - ctx_len) // block_size == j)
        return sees_ctx | own_block

    return mask_mod


def dense_mask(anchors_BN: torch.Tensor, ctx_len: int, block_size: int, window: int | None = None) -> torch.Tensor:
    """Bool [Bs, 1, Q, KV] (True = may attend) for ``scaled_dot_product_attention``."""
    Bs, N = anchors_BN.shape
    dev = anchors_BN.device
    Q = N * block_size
    b = torch.arange(Bs, device=dev)[:, None, None, None]
    h = torch.zeros((), dtype=torch.long, device=dev)
    q = torch.arange(Q, device=dev)[None, None, :, None]
    kv = torch.arange(ctx_len + Q, device=dev)[None, None, None, :]
    return draft_mask_mod(anchors_BN, ctx_len, block_size, window)(b, h, q, kv)


def flex_tile(mask_block: int) -> int:
    """Kernel tile for a BlockMask block size: the largest of 64/32/16 dividing it."""
    for t in (64, 32, 16):
        if mask_block % t == 0:
            return t
    raise ValueError(f"flex_block_size {mask_block} must be a multiple of 16")


def flex_block_mask(anchors_BN: torch.Tensor, ctx_len: int, block_size: int, mask_block: int = 128,
                    window: int | None = None) -> "BlockMask":
    """FlexAttention BlockMask of the same rule (heads broadcast)."""
    if create_block_mask is None:
        raise ValueError("this torch has no FlexAttention; use attention='dense'")
    flex_tile(mask_block)
    Bs, N = anchors_BN.shape
    Q = N * block_size
    return create_block_mask(
        draft_mask_mod(anchors_BN, ctx_len, block_size, window),
        Bs,
        None,
        Q,
        ctx_len + Q,
        device=anchors_BN.device,
        BLOCK_SIZE=mask_block,
    )


# -- EAGLE-3 -------------------------------------------------------------------------------------------
# The training-time test unrolls the draft over steps j = 0..K-1. Step 0 runs every position t of the
# sequence (T rows) on the target's fused feature; step j >= 1 runs Q chosen rows (every row in training,
# the last verified one when drafting live), each the j-th step of the chain anchored at its row r_q,
# at position r_q + j, on the previous step's own output. Keys are ``[step 0 (T rows) | step 1 (Q) | ...
# | step j (Q)]``; a query of chain q at step j sees
#
# - step-0 key s (s < T) iff s <= r_q: the target-fed positions up to the chain's anchor (causal);
# - the key of its own chain at every step 1..j (kv = T + i*Q + q); nothing of other chains.
#
# This is what live drafting computes (vLLM's EAGLE-3 proposer keeps the verified positions' keys from
# the target-fed pass and appends each draft step's own), so teacher-forced acceptance is the live one.
# Step 0 is the same rule with no later keys (plain causal attention). The own-chain keys are one per query
# (a diagonal): the dense mask spends Q x (T + jQ) scores on them where FlexAttention's block mask skips
# the empty blocks, so long sequences on GPU take ``attention: flex``. Shapes: Q query rows, T positions.


def eagle3_mask_mod(rows_Q: torch.Tensor, ctx_len: int) -> MaskMod:
    """EAGLE-3's visibility as a mask_mod(b, h, q_idx, kv_idx) -> bool; ``rows_Q`` int [Q]: each chain's anchor row."""
    Q = rows_Q.shape[0]

    def mask_mod(b, h, q_idx, kv_idx):
        in_ctx = kv_idx < ctx_len
        causal = in_ctx & (kv_idx <= rows_Q[q_idx])
        own_chain = (~in_ctx) & ((kv_idx - ctx_len) % Q == q_idx)
        return causal | own_chain

    return mask_mod


def eagle3_dense_mask(rows_Q: torch.Tensor, ctx_len: int, step: int) -> torch.Tensor:
    """Bool [1, 1, Q, T + step * Q] (True = may attend) for step ``step``'s queries (batch and heads broadcast)."""
    dev = rows_Q.device
    Q = rows_Q.shape[0]
    zero = torch.zeros((), dtype=torch.long, device=dev)
    q = torch.arange(Q, device=dev)[None, None, :, None]
    kv = torch.arange(ctx_len + step * Q, device=dev)[None, None, None, :]
    return eagle3_mask_mod(rows_Q, ctx_len)(zero, zero, q, kv)


def eagle3_block_mask(rows_Q: torch.Tensor, ctx_len: int, step: int, mask_block: int = 128) -> "BlockMask":
    """FlexAttention BlockMask of the same rule for step ``step``'s queries (batch and heads broadcast)."""
    if create_block_mask is None:
        raise ValueError("this torch has no FlexAttention; use attention='dense'")
    flex_tile(mask_block)
    Q = rows_Q.shape[0]
    return create_block_mask(eagle3_mask_mod(rows_Q, ctx_len), None, None, Q, ctx_len + step * Q,
                             device=rows_Q.device, BLOCK_SIZE=mask_block)
