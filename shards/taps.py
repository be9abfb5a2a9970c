"""Tap ids: which target decoder layers a dataset stores, and how engines number them; and the taps codecs.

The one home for the default-tap rule and the HF/vLLM numbering. A tap with id ``i`` is the
output of decoder layer ``i`` (the residual stream BEFORE the final norm, the last layer included),
which vLLM names ``i + 1`` (its extracted layer id L is the last layer's output before the final norm)
and HF exposes as ``hidden_states[i + 1]`` for every layer but the last: HF's last entry is taken after
the final norm, so it is NOT tap L - 1.
"""

from __future__ import annotations

from dataclasses import dataclass

TAP_NUMBERING = ("tap i = output of decoder layer i before the final norm, the last layer included; vLLM layer "
                 "id = i + 1; HF hidden_states[i + 1] = tap i only for i < L - 1 (HF's last entry is after the "
                 "final norm)")
"""The numbering rule as manifests and exports state it."""


def default_tap_ids(num_target_layers: int, draft_layers: int) -> list[int]:
    """DFlash's default context taps for a draft of ``draft_layers`` over ``num_target_layers``.

    One draft layer taps the middle of the target; n > 1 spread evenly from layer 1 to L - 3
    (Qwen3-8B, L=36, n=5: [1, 9, 17, 25, 33]). Targets too shallow for that spread (the rule
    would repeat a layer) get n distinct layers spread over all of them instead; at most L taps.
    """
    if num_target_layers < 1 or draft_layers < 1:
        raise ValueError(
            f"need num_target_layers >= 1 and draft_layers >= 1, got {num_target_layers} and {draft_layers}"
        )
    if draft_layers == 1:
        return [num_target_layers // 2]
    L, n = num_target_layers, draft_layers
    ids = [int(round(1 + i * (L - 4) / (n - 1))) for i in range(n)]
    if L >= 4 and len(set(ids)) == n:
        return ids
    n = min(n, L)
    return sorted({int(round(i * (L - 1) / max(n - 1, 1))) for i in range(n)})


def capture_tap_ids(num_target_layers: int, draft_layers: int, *, with_last: bool = True) -> list[int]:
    """Taps a capture stores by default: the DFlash taps for ``draft_layers``, the one-layer draft's middle tap
    (the ``dflash`` recipe's depth, so the README path trains on the rule with no warning), and the last layer
    (for MTP and exact teachers). Qwen3-8B (L=36), 5 layers: [1, 9, 17, 18, 25, 33, 35]; the middle tap is
    one more of seven (+17% tap bytes over the six that left the ``dflash`` recipe off its rule)."""
    ids = default_tap_ids(num_target_layers, draft_layers) + default_tap_ids(num_target_layers, 1)
    if with_last:
        ids.append(num_target_layers - 1)
    return sorted(set(ids))


EAGLE3_SPREAD = 5
"""The capture default's draft depth (``CaptureConfig.draft_layers``), whose spread EAGLE-3's triple is taken from."""


def eagle3_tap_ids(num_target_layers: int) -> list[int]:
    """EAGLE-3's default low / middle / high taps: the first, middle and last of the five-layer spread above.

    For L >= 8 that is (1, about L/2 - 1, L - 3), vLLM ids (2, ~L/2, L - 2), beside vLLM's own default aux
    layers (2, L // 2, L - 3): the high tap sits one layer higher, so a dataset captured with the defaults
    (which store that spread and the last layer) trains DFlash, MTP and EAGLE-3 alike, with no extra tap.
    Qwen3-8B (L = 36): [1, 17, 33]. Shallow targets get the distinct ones (L = 2: [0, 1]).
    """
    ids = default_tap_ids(num_target_layers, EAGLE3_SPREAD)
    return sorted({ids[0], ids[len(ids) // 2], ids[-1]})


def to_vllm(tap_ids: list[int] | tuple[int, ...]) -> list[int]:
    """vLLM numbers the same tensors one higher (its 0 is the embedding output)."""
    return [i + 1 for i in tap_ids]


def from_vllm(vllm_ids: list[int] | tuple[int, ...]) -> list[int]:
    return [i - 1 for i in vllm_ids]


@dataclass(frozen=True)
class TapsCodec:
    """How a dataset stores its taps: one entry of :data:`TAPS_CODECS`. The byte layout itself is ``shards.codec``'s;
    everything else asks this entry, never the codec's name."""

    name: str
    lossless: bool
    """Whether taps read back as the target computed them (lossy taps never stand for the exact last hidden state:
    the exact teacher and MTP's h^0 promise the target's own distribution)."""
    layout_field: str | None = None
    """The ``ShardConfig`` field choosing this codec's byte layout (``fp8_layout``): recorded in the metadata, and
    compared on a resume, only for this codec's datasets; None: the codec has no layouts of its own."""
    help: str = ""
    """What it is, for ``--codec``'s help."""


TAPS_CODECS: dict[str, TapsCodec] = {
    "bf16": TapsCodec("bf16", lossless=True, help="lossless"),
    "fp8": TapsCodec("fp8", lossless=False, layout_field="fp8_layout", help="lossy, halves taps"),
}
"""bf16 is lossless; fp8 is e4m3 with one float32 scale per (token, tap) row, lossy, never default."""
DEFAULT_TAPS_CODEC = "bf16"


def foreign_layout_fields(codec: str | None) -> set[str]:
    """The byte-layout settings of every codec but ``codec``: they write nothing into its datasets, so a resume and
    the metadata leave them out."""
    return {c.layout_field for c in TAPS_CODECS.values() if c.layout_field and c.name != codec}


def codec_help() -> str:
    """``--codec``'s choices, as its help lists them."""
    return " | ".join(f"{c.name} ({c.help})" for c in TAPS_CODECS.values())
