"""Draft losses over gathered rows: chunked lm_head + cross-entropy, and optional distillation.

The drafter hands over only the rows that carry a loss (R rows of hidden size H, R << Bs*T*B),
and this module projects them through the frozen lm_head in chunks of ``chunk_rows``. Each chunk
runs inside an activation checkpoint (``train.divergences.map_row_chunks``), so neither the
forward nor the backward ever holds the [R, V] logits whole: at V = 152k, 16k rows of float32
logits would be 10 GB; a 2048-row chunk is 1.2 GB, freed before the next.

Per row i (label y_i, weight w_i):
    ce_i = -log softmax(lm_head(h_i) / scaling)[y_i]
    kd_i = KL(p_teacher,i || q_draft,i)       (exact per-row teacher, or stored top-k + tail bin)
The callers turn these into LossOutput terms (sum_i w_i * ce_i, sum_i w_i, weight); the one
normalisation rule lives in ``train.drafter.combine_terms``.

DFlash's slot weights: slot k >= 1 of a block weighs exp(-(k - 1) / gamma) (gamma 7 for B = 16,
4 for B = 8): early slots matter most because acceptance stops at the first miss.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from train.divergences import kl_tv_full, kl_tv_topk, map_row_chunks
from train.teacher import ExactTeacher, TopKTeacher, teacher_logits


def slot_weights(block_size: int, gamma: float) -> torch.Tensor:
    """float32 [B - 1]: the weight of slots k = 1..B-1, exp(-(k - 1) / gamma)."""
    k = torch.arange(1, block_size, dtype=torch.float64)
    return torch.exp(-(k - 1) / gamma).float()


def _logits(h: torch.Tensor, lm_head: torch.Tensor, scaling: float) -> torch.Tensor:
    z = F.linear(h.to(lm_head.dtype), lm_head)
    return z.to(torch.promote_types(z.dtype, torch.float32)) / float(scaling)


def row_losses(
    h_RH: torch.Tensor,
    labels_R: torch.Tensor,
    lm_head_VH: torch.Tensor,
    *,
    scaling: float = 1.0,
    chunk_rows: int = 2048,
    teacher: ExactTeacher | TopKTeacher | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-row (ce [R], correct [R] float 0/1 (argmax == label), kd [R] or None), chunked."""
    rows: list[torch.Tensor] = [h_RH, labels_R.long()]
    if isinstance(teacher, ExactTeacher):
        rows.append(teacher.hidden_RH)
    elif isinstance(teacher, TopKTeacher):
        rows += [teacher.ids_Rk.long(), teacher.logprobs_Rk]
    elif teacher is not None:
        raise TypeError(f"unknown teacher type {type(teacher).__name__}")

    def fn(h, y, *t):
        z = _logits(h, lm_head_VH, scaling)
        ce = F.cross_entropy(z, y, reduction="none")
        correct = (z.detach().argmax(-1) == y).to(z.dtype)
        if isinstance(teacher, ExactTeacher):
            p = teacher_logits(t[0], teacher.norm_weight, teacher.eps, teacher.lm_head, teacher.scaling)
            return ce, correct, kl_tv_full(p.to(z.dtype), z)[0]
        if isinstance(teacher, TopKTeacher):
            return ce, correct, kl_tv_topk(t[0], t[1], z)[0]
        return ce, correct

    out = map_row_chunks(fn, rows, chunk_rows)
    return out[0], out[1], (out[2] if len(out) > 2 else None)


def weighted_terms(
    ce_R: torch.Tensor, w_R: torch.Tensor, kd_R: torch.Tensor | None, kd_w_R: torch.Tensor | None,
    *, ce_weight: float, kd_weight: float,
) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """LossOutput terms: ce = (sum w*ce, sum w, ce_weight); kd likewise over the rows with a teacher."""
    terms = {"ce": ((w_R * ce_R).sum(), w_R.sum().detach(), ce_weight)}
    if kd_R is not None:
        assert kd_w_R is not None
        terms["kd"] = ((kd_w_R * kd_R).sum(), kd_w_R.sum().detach(), kd_weight)
    return terms


def reference_loss_f64(
    h_RH: torch.Tensor, labels_R: torch.Tensor, w_R: torch.Tensor, lm_head_VH: torch.Tensor, scaling: float = 1.0
) -> float:
    """Float64 sum(w * CE) / sum(w), written from the definition (for tests and sanity checks)."""
    z = (h_RH.double() @ lm_head_VH.double().T) / scaling
    logp = z - torch.logsumexp(z, dim=-1, keepdim=True)
    ce = -logp.gather(-1, labels_R.long()[:, None])[:, 0]
    w = w_R.double()
    return float((w * ce).sum() / w.sum()) if float(w.sum()) > 0 else math.nan
