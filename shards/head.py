"""The target's output head and input embedding, described by the bundle, applied here once.

Capture (stored top-k), training (exact teacher rows, draft logits through the frozen lm_head, the
drafters' use of the frozen embedding), MTP's h^0 and live decoding all turn hidden rows into
logits, and token ids into input embeddings, the way the target does:

    embed(ids) = embed_scale * E[ids]
    logits     = softcap(scale(lm_head(final_norm(h))))
    final_norm = rms:        w * (x / sqrt(mean(x^2) + eps))           x normalised in float32, cast back, then * w
                 rms_offset: ((1 + w) * (x / sqrt(mean(x^2) + eps)))    all in float32, then cast back (Gemma)
                 layer:      LayerNorm(x; w, b, eps)                    with its bias (Phi)
    lm_head(x) = x @ W^T (+ b when the head has a bias, Phi)
    scale(z)   = z / logits_scaling                                     (Granite divides; others 1)
    softcap(z) = c * tanh(z / c) when final_logit_softcap c is set      (Gemma2, Gemma3)

:class:`HeadSpec` declares that head; the bundle stores it (``bundle.json["head"]``) and capture
derives it from the live model (``capture.head``), checked there against the model's own forward.
Sources, transformers 5.24: ``models/qwen3/modeling_qwen3.py`` (Qwen3RMSNorm),
``models/gemma/modeling_gemma.py`` (GemmaRMSNorm ``1.0 + weight``, GemmaTextScaledWordEmbedding
``embed_scale = hidden_size**0.5``), ``models/gemma2/modeling_gemma2.py`` (``final_logit_softcapping``
in Gemma2ForCausalLM.forward), ``models/phi/modeling_phi.py`` (``final_layernorm`` nn.LayerNorm,
``lm_head`` with bias), ``models/granite/modeling_granite.py`` (``embedding_multiplier`` on the input
embeddings, ``logits / logits_scaling``). A head outside these terms is refused, never approximated.

It lives with the bundle because capture, train and speculate all need it and ``shards`` is the
package every one of them may import; like the rest of ``shards`` it uses plain ``torch`` calls
only (no ``torch.nn`` modules, no model code).

Row chunking is here too (:func:`row_spans`): every loop that projects rows through a vocab-sized
head walks the same spans, so ``chunk_rows <= 0`` means "one chunk" everywhere.

Shapes: R rows, H hidden, V vocab.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping

import torch

NORM_KINDS = ("rms", "rms_offset", "layer")
"""Final-norm kinds the head spec can describe (see the module docstring)."""
DEFAULT_EPS = 1e-6


@dataclass(frozen=True)
class HeadSpec:
    """How the target turns ids into input embeddings and its last decoder layer's output into logits."""

    norm: str = "rms"
    """Final norm kind, one of NORM_KINDS."""
    eps: float = DEFAULT_EPS
    """The final norm's epsilon."""
    logits_scaling: float = 1.0
    """Logits are divided by it (Granite's ``logits_scaling``; 1 for every other family)."""
    embed_scale: float = 1.0
    """Input embeddings are the table rows times this (Gemma: sqrt(hidden); Granite: embedding_multiplier)."""
    lm_head_bias: bool = False
    """Whether the lm_head adds a bias (Phi); the bundle then stores ``lm_head_bias`` [V]."""
    final_logit_softcap: float | None = None
    """Logits become c * tanh(logits / c) with this c (Gemma2/3's ``final_logit_softcapping``); None: off."""
    tied: bool = False
    """Whether the lm_head is the input embedding table (stored once in the bundle)."""

    def __post_init__(self) -> None:
        if self.norm not in NORM_KINDS:
            raise ValueError(f"final norm kind {self.norm!r} is not supported; known kinds: {list(NORM_KINDS)}")
        for name in ("eps", "logits_scaling", "embed_scale"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                raise ValueError(f"head spec {name} must be a positive number, got {v!r}")
        c = self.final_logit_softcap
        if c is not None and not (c > 0 and math.isfinite(c)):
            raise ValueError(f"head spec final_logit_softcap must be None or a positive number, got {c!r}")

    @property
    def norm_bias(self) -> bool:
        """Whether the final norm has a bias (LayerNorm); the bundle then stores ``norm_bias`` [H]."""
        return self.norm == "layer"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> "HeadSpec":
        """The spec a bundle records; an unknown key is refused (a newer writer's head this code cannot apply)."""
        unknown = sorted(set(doc) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"the bundle's head spec has fields this tapdraft does not know: {unknown}; "
                             "upgrade tapdraft to read it")
        return cls(**doc)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "HeadSpec":
        """The head of a bundle written before heads were declared: RMSNorm with ``rms_norm_eps``, untied,
        logits divided by ``logits_scaling`` (missing or null = default)."""
        return cls(eps=float(config.get("rms_norm_eps") or DEFAULT_EPS),
                   logits_scaling=float(config.get("logits_scaling") or 1.0))


def head_spec(bundle: Any) -> HeadSpec:
    """The head spec of a target bundle (``shards.bundle.TargetBundle``)."""
    return bundle.head


def embed(ids: torch.Tensor, table_VH: torch.Tensor, spec: HeadSpec) -> torch.Tensor:
    """Input embeddings of token ids as the target computes them: table rows times ``embed_scale``
    (the scale cast to the table's dtype first, as Gemma's scaled embedding does)."""
    e = torch.nn.functional.embedding(ids, table_VH)
    if spec.embed_scale == 1.0:
        return e
    return e * torch.tensor(spec.embed_scale, dtype=table_VH.dtype, device=table_VH.device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3 RMSNorm: normalise in at least float32 (float64 stays float64), scale in the input dtype."""
    dtype = x.dtype
    h = x.to(torch.promote_types(dtype, torch.float32))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rms_offset_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma RMSNorm: x * (1 + w), all in at least float32, cast back to the input dtype at the end."""
    wd = torch.promote_types(x.dtype, torch.float32)
    h = x.to(wd)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.to(wd))).to(x.dtype)


def final_norm(h_RH: torch.Tensor, weight_H: torch.Tensor, spec: HeadSpec,
               bias_H: torch.Tensor | None = None) -> torch.Tensor:
    """The target's final norm of pre-norm rows, in their dtype (``bias_H``: the LayerNorm's bias)."""
    if spec.norm == "rms":
        return rms_norm(h_RH, weight_H, spec.eps)
    if spec.norm == "rms_offset":
        return _rms_offset_norm(h_RH, weight_H, spec.eps)
    if bias_H is None:
        raise ValueError("the head spec's LayerNorm needs its bias (the bundle's norm_bias)")
    return torch.nn.functional.layer_norm(h_RH, (h_RH.shape[-1],), weight_H.to(h_RH.dtype),
                                          bias_H.to(h_RH.dtype), spec.eps)


def scale_logits(z_RV: torch.Tensor, spec: HeadSpec) -> torch.Tensor:
    """Raw lm_head outputs -> the target's logits (divided by logits_scaling, then soft-capped), at least float32."""
    z = z_RV.to(torch.promote_types(z_RV.dtype, torch.float32))
    if spec.logits_scaling != 1.0:
        z = z / float(spec.logits_scaling)
    if spec.final_logit_softcap is not None:
        c = float(spec.final_logit_softcap)
        z = torch.tanh(z / c) * c
    return z


def softcap_jacobian(logits_RV: torch.Tensor, spec: HeadSpec) -> torch.Tensor | None:
    """d softcap / d its input, from the capped logits: 1 - (logits / c)^2; None when there is no cap."""
    if spec.final_logit_softcap is None:
        return None
    return 1.0 - (logits_RV / float(spec.final_logit_softcap)).square()


def _check_bias(spec: HeadSpec, bias_V: torch.Tensor | None) -> None:
    if spec.lm_head_bias != (bias_V is not None):
        raise ValueError(f"the head spec says lm_head_bias={spec.lm_head_bias} but "
                         f"{'a' if bias_V is not None else 'no'} bias was given")


def project(x_RH: torch.Tensor, lm_head_VH: torch.Tensor, spec: HeadSpec,
            bias_V: torch.Tensor | None = None) -> torch.Tensor:
    """Normalised rows -> logits through the (frozen) lm_head, in its dtype, then scaled; differentiable in x."""
    _check_bias(spec, bias_V)
    z = _head_matmul(x_RH, lm_head_VH)
    if bias_V is not None:
        z = z + bias_V.to(z.dtype)
    return scale_logits(z, spec)


def add_projection_(z_RV: torch.Tensor, x_RH: torch.Tensor, lm_head_VH: torch.Tensor, spec: HeadSpec) -> torch.Tensor:
    """``z += project(x)`` in place, bitwise: with no scaling or cap the head's logits are added in its dtype (a
    bf16 head's into float32 ``z`` in one pass, not an upcast copy and then an add); otherwise through ``project``."""
    if spec.logits_scaling != 1.0 or spec.final_logit_softcap is not None:
        return z_RV.add_(project(x_RH, lm_head_VH, spec))
    return z_RV.add_(_head_matmul(x_RH, lm_head_VH))


def _head_matmul(x_RH: torch.Tensor, lm_head_VH: torch.Tensor) -> torch.Tensor:
    """The raw lm_head outputs, in the head's dtype."""
    return torch.matmul(x_RH.to(lm_head_VH.dtype), lm_head_VH.T)


def project_backward(grad_logits_RV: torch.Tensor, lm_head_VH: torch.Tensor, spec: HeadSpec,
                     jacobian_RV: torch.Tensor | None = None) -> torch.Tensor:
    """The gradient w.r.t. the normalised rows of :func:`project`, given the gradient w.r.t. its logits.

    For losses that compute dL/dlogits themselves (``train.losses``' fused chunked CE/KD). With a
    soft cap, ``jacobian_RV`` is :func:`softcap_jacobian` of the same logits (required).
    """
    g = grad_logits_RV
    if spec.final_logit_softcap is not None:
        if jacobian_RV is None:
            raise ValueError("project_backward of a soft-capped head needs softcap_jacobian(logits)")
        g = g * jacobian_RV
    return torch.matmul(g.to(lm_head_VH.dtype), lm_head_VH) / float(spec.logits_scaling)


def teacher_logits(hidden_RH: torch.Tensor, norm_weight_H: torch.Tensor, lm_head_VH: torch.Tensor,
                   spec: HeadSpec, *, norm_bias_H: torch.Tensor | None = None,
                   lm_head_bias_V: torch.Tensor | None = None) -> torch.Tensor:
    """The teacher head: pre-norm last-layer rows -> the target's logits [R, V], at least float32, no gradient.

    Computed in the lm_head's dtype (bf16 on GPU, as the target runs), like the target's own forward.
    """
    with torch.no_grad():
        dtype = lm_head_VH.dtype
        x = final_norm(hidden_RH.to(dtype), norm_weight_H.to(dtype), spec,
                       None if norm_bias_H is None else norm_bias_H.to(dtype))
        return project(x, lm_head_VH, spec, lm_head_bias_V)


def row_spans(n: int, chunk_rows: int) -> list[tuple[int, int]]:
    """[start, end) spans covering n rows, ``chunk_rows`` at a time (<= 0: one span; n == 0: none)."""
    step = n if chunk_rows <= 0 else int(chunk_rows)
    return [(s, min(s + step, n)) for s in range(0, n, max(step, 1))]
