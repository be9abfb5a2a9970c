"""Rules every drafter family's settings share, in one home: each family's config calls them from ``__post_init__``,
so a refusal comes when the recipe and ``--set`` are read, before the target or a dataset is opened.

Counts that are unrolled (a loop of modules or of draft positions, each with its own activations) are bounded:

    setting                                  bound                     why (real values)
    eagle3 num_steps, mtp num_depths,        1..MAX_DRAFT_TOKENS (64)  drafts a round: EAGLE-3 serves 5-8, MTP heads
    dflash-family block_size (from 2)                                  1-4, DFlash blocks 8-16; every step, depth or
                                                                       slot is unrolled in training (num_steps or
                                                                       num_depths 10^6 grew to 2.5-3.6 GB, then the
                                                                       generic out-of-memory line)
    draft num_layers, lilicorr lattice_layers  1..MAX_DRAFT_LAYERS (64)  real drafters have 1-8 layers (a target's
                                                                       whole depth is at most 126)
    target_layer_ids (families fusing taps)  at least one, or unset    max() of an empty sequence once the bundle
                                                                       was read (dflash), an empty fc (eagle3)

Widths a family adds beside the target's own (which ``shards.limits`` bounds) are bounded the same way:

    setting                                  bound                     why (real values)
    dspark markov_rank, dflash2              1..MAX_DRAFT_RANK (4096)  ranks 256 (the recipes; DSpark's reference),
    selector_rank, lilicorr factor_dim                                 factor_dim 64; each rank is two
                                                                       [V, r] tables (r = 4096 at V = 152k is 1.2 G
                                                                       weights, ~20 GB with Adam); 10^6 is 10^11
    lilicorr lattice_heads                   1..MAX_DRAFT_HEADS (128)  4 (the recipe); a
                                                                       target has at most 128; each head is a
                                                                       [S k, S k] bias and attention map a block
    dflash-family num_anchors                1..MAX_ANCHORS (131072)   blocks per sequence: 32-512 (peers, the
                                                                       DFlash reference); at most one a position,
                                                                       so past a 128k-token context it means nothing

Each refusal is one ``ValueError`` naming the setting as a user writes it (``drafter.num_steps``: the ``--set`` key
and the recipe's section), the value and the bound; docs/reliability.md repeats the table.
"""

from __future__ import annotations

from typing import Any, Iterable

MAX_DRAFT_TOKENS = 64
"""Most drafting steps, depths or block slots of one round (``num_steps``, ``num_depths``, ``block_size``)."""
MAX_DRAFT_LAYERS = 64
"""Most layers of a draft stack (``num_layers``, ``lattice_layers``)."""
MAX_DRAFT_RANK = 4096
"""Widest low-rank table or factor a family adds (``markov_rank``, ``selector_rank``, ``factor_dim``)."""
MAX_DRAFT_HEADS = 128
"""Most attention heads of a layer a family adds (``lattice_heads``)."""
MAX_ANCHORS = 131072
"""Most blocks drawn from one sequence (``num_anchors``)."""


def check_count(name: str, value: Any, lo: int, hi: int, why: str) -> None:
    """``drafter.<name>`` is an integer in [lo, hi], else one ValueError naming it, the bound and ``why``."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"drafter.{name} must be an integer in [{lo}, {hi}] ({why}), got {value!r}")


def check_target_layer_ids(ids: Iterable[Any] | None) -> tuple[int, ...] | None:
    """``drafter.target_layer_ids`` as a tuple of ints in the order given, None when unset; an empty list is refused
    (every family fusing taps needs one, and the default picks them when unset)."""
    if ids is None:
        return None
    out = tuple(int(i) for i in ids)
    if not out:
        raise ValueError("drafter.target_layer_ids must name at least one target layer, or be left unset (the "
                         "family's tap rule then picks them), got []")
    return out
