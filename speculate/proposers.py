"""Turn a trained drafter into a proposer for the live decoding loop.

A proposer sees what the target has verified: the ids of positions 0..P (position P holds the
last emitted token, which the target has not run yet) and the taps of positions 0..P-1, in the
dataset's tap order. It returns K drafted tokens and, for sampling, their distributions.

    dflash   one block anchored at P: slot 0 = ids[P], slots 1..B-1 masked; K = B - 1
    dflash2  the same block, tokens chosen by the selector's greedy walk (sampling uses the backbone)
    mtp      depth k at position P-1 reads the drafted token of depth k-1; K = num_depths

The drafters are called through the same methods training and offline eval use, on a batch of one
sequence, so the online numbers check exactly the model the offline numbers describe.
"""

from __future__ import annotations

from typing import Any

import torch

from speculate.decode import Proposer


def _pick(logits_KV: torch.Tensor, temperature: float, generator: torch.Generator | None):
    if temperature == 0:
        return logits_KV.argmax(-1), None
    q = torch.softmax(logits_KV.float() / temperature, -1)
    return torch.multinomial(q, 1, generator=generator).squeeze(-1), q


def _batch(ids_T: torch.Tensor, taps_PnH: torch.Tensor, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    """One-sequence batch in the collated layout; taps are zero-padded to the ids' length (never read)."""
    T, P = ids_T.shape[0], taps_PnH.shape[0]
    taps = torch.zeros(T, *taps_PnH.shape[1:], dtype=dtype, device=device)
    taps[:P] = taps_PnH.to(device=device, dtype=dtype)
    return {
        "input_ids": ids_T[None].to(device),
        "taps": taps[None],
        "loss_mask": torch.ones(1, T, dtype=torch.bool, device=device),
        "is_audio": torch.zeros(1, T, dtype=torch.bool, device=device),
        "lengths": torch.tensor([T], device=device),
    }


def make_proposer(model: Any) -> Proposer:
    """A proposer for a trained drafter of any registered family."""
    family = getattr(model, "family", "")
    dev = next(model.parameters()).device
    dtype = next(model.parameters()).dtype

    @torch.no_grad()
    def dflash(seq, taps, temperature=0.0, generator=None):
        P = taps.shape[0]
        b = _batch(seq, taps, dtype, dev)
        anchors = torch.tensor([[P]], device=dev)
        h = model.block_hidden(b["input_ids"], model.context(b["taps"]), anchors)  # [1, 1, B, H]
        logits = model.logits(h[0, 0, 1:])
        if family == "dflash2" and temperature == 0:
            return model.draft_blocks(b, anchors)[0, 0, 1:].cpu(), None
        tokens, q = _pick(logits, temperature, generator)
        return tokens.cpu(), q

    @torch.no_grad()
    def mtp(seq, taps, temperature=0.0, generator=None):
        P = taps.shape[0]
        drafted, dists = [], []
        for k in range(1, model.config.num_depths + 1):
            ids = torch.cat([seq, torch.tensor(drafted, dtype=seq.dtype)])  # positions 0..P+k-1
            h = model.run_depths(_batch(ids, taps, dtype, dev))["h"][k - 1][0, P - 1]
            tok, q = _pick(model.logits(k, h[None]), temperature, generator)
            drafted.append(int(tok[0]))
            if q is not None:
                dists.append(q[0])
        return torch.tensor(drafted), (torch.stack(dists) if dists else None)

    if family in ("dflash", "dflash2"):
        return dflash
    if family == "mtp":
        return mtp
    raise ValueError(f"no live proposer for drafter family {family!r}")
