"""The target's output head: how hidden rows become logits, described by the bundle, applied here once.

Capture (stored top-k), training (exact teacher rows, draft logits through the frozen lm_head),
MTP's h^0 and live decoding all turn hidden rows into logits the way the target does:

    logits = scale(final_norm(h) @ lm_head^T)

:class:`HeadSpec` declares that head: today a Qwen3-style RMSNorm (normalise in at least float32,
cast back, multiply by the weight) with its ``eps``, no lm_head bias, and logits divided by
``logits_scaling`` (Granite divides; every other family has 1). It is derived from the bundle's
config (``rms_norm_eps``, ``logits_scaling``), so the on-disk format is unchanged; a family with
another head (unit-offset RMSNorm, LayerNorm with bias, softcap, embedding scale) extends this
spec and these functions, never a caller. A head the spec cannot describe is refused.

It lives with the bundle because capture, train and speculate all need it and ``shards`` is the
package every one of them may import; like the rest of ``shards`` it uses plain ``torch`` calls
only (no ``torch.nn``, no model code).

Row chunking is here too (:func:`row_spans`): every loop that projects rows through a vocab-sized
head walks the same spans, so ``chunk_rows <= 0`` means "one chunk" everywhere.

Shapes: R rows, H hidden, V vocab.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch

NORM_KINDS = ("rms",)
"""Final-norm kinds the head spec can describe."""
DEFAULT_EPS = 1e-6


@dataclass(frozen=True)
class HeadSpec:
    """How the target turns its last decoder layer's output into logits."""

    norm: str = "rms"
    """Final norm kind: ``rms`` = weight * (x / sqrt(mean(x^2) + eps)), normalised in float32 or wider."""
    eps: float = DEFAULT_EPS
    """The final norm's epsilon (the bundle's ``rms_norm_eps``)."""
    logits_scaling: float = 1.0
    """Logits are divided by it (Granite's ``logits_scaling``; 1 for every other family)."""

    def __post_init__(self) -> None:
        if self.norm not in NORM_KINDS:
            raise ValueError(f"final norm kind {self.norm!r} is not supported; known kinds: {list(NORM_KINDS)}")
        if not (self.eps > 0 and math.isfinite(self.eps)):
            raise ValueError(f"final norm eps must be a positive number, got {self.eps}")
        if not (self.logits_scaling > 0 and math.isfinite(self.logits_scaling)):
            raise ValueError(f"logits_scaling must be a positive number, got {self.logits_scaling}")

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "HeadSpec":
        """The head of a bundle config (``rms_norm_eps``, ``logits_scaling``; missing or null = default)."""
        return cls(eps=float(config.get("rms_norm_eps") or DEFAULT_EPS),
                   logits_scaling=float(config.get("logits_scaling") or 1.0))


def head_spec(bundle: Any) -> HeadSpec:
    """The head spec of a target bundle (``shards.bundle.TargetBundle``)."""
    return HeadSpec.from_config(bundle.config)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3 RMSNorm: normalise in at least float32 (float64 stays float64), scale in the input dtype."""
    dtype = x.dtype
    h = x.to(torch.promote_types(dtype, torch.float32))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def final_norm(h_RH: torch.Tensor, weight_H: torch.Tensor, spec: HeadSpec) -> torch.Tensor:
    """The target's final norm of pre-norm rows, in their dtype."""
    return rms_norm(h_RH, weight_H, spec.eps)


def scale_logits(z_RV: torch.Tensor, spec: HeadSpec) -> torch.Tensor:
    """Raw lm_head outputs -> the target's logits, at least float32."""
    return z_RV.to(torch.promote_types(z_RV.dtype, torch.float32)) / float(spec.logits_scaling)


def project(x_RH: torch.Tensor, lm_head_VH: torch.Tensor, spec: HeadSpec) -> torch.Tensor:
    """Normalised rows -> logits through the (frozen) lm_head, in its dtype, then scaled; differentiable in x."""
    return scale_logits(torch.matmul(x_RH.to(lm_head_VH.dtype), lm_head_VH.T), spec)


def project_backward(grad_logits_RV: torch.Tensor, lm_head_VH: torch.Tensor, spec: HeadSpec) -> torch.Tensor:
    """The gradient w.r.t. the normalised rows of :func:`project`, given the gradient w.r.t. its logits.

    For losses that compute dL/dlogits themselves (``train.losses``' fused chunked CE/KD).
    """
    return torch.matmul(grad_logits_RV.to(lm_head_VH.dtype), lm_head_VH) / float(spec.logits_scaling)


def teacher_logits(hidden_RH: torch.Tensor, norm_weight_H: torch.Tensor, lm_head_VH: torch.Tensor,
                   spec: HeadSpec) -> torch.Tensor:
    """The teacher head: pre-norm last-layer rows -> the target's logits [R, V], at least float32, no gradient.

    Computed in the lm_head's dtype (bf16 on GPU, as the target runs), like the target's own forward.
    """
    with torch.no_grad():
        dtype = lm_head_VH.dtype
        return project(final_norm(hidden_RH.to(dtype), norm_weight_H.to(dtype), spec), lm_head_VH, spec)


def row_spans(n: int, chunk_rows: int) -> list[tuple[int, int]]:
    """[start, end) spans covering n rows, ``chunk_rows`` at a time (<= 0: one span; n == 0: none)."""
    step = n if chunk_rows <= 0 else int(chunk_rows)
    return [(s, min(s + step, n)) for s in range(0, n, max(step, 1))]
