"""DFlash's training loss: anchors within the loss-row budget, CE and KD over the block slots' rows, and
the reduced draft vocabulary the loss and the drafter's logits share (the model is ``train.drafters.dflash.model``).

Loss-row budget: a training micro-batch carries at most ``max_loss_rows`` loss rows (blocks x
(B - 1) slots), so its blocks are capped at ``train_anchors = min(max_total_anchors,
max_loss_rows // (B - 1))``. Each row costs a [V, H] lm_head matmul forward and backward (0.62
GFLOP at Qwen3's V = 151,936, H = 1024), which is most of a step at a real vocabulary
(benchmarks/train_step.py measures step time against rows), so the budget, not the sequence
length, sets a step's cost. Evaluation (``acceptance``) is not budgeted: it keeps the anchor caps.

Draft vocabulary (``draft_vocab = N``, off by default; the subset rule is ``train.drafters.common.draft_vocab``): the
draft's logits are computed over the N subset rows of the frozen lm_head only, W_S = lm_head[S]. With
S the subset and z_S = scale(W_S h) the draft's logits over it, for a loss row with label y:

    q_S      = softmax(z_S)                                   the draft's distribution, over S only
    CE       = -log q_S(y)                     y in S; a row whose label is outside S carries no loss
                                               (CE nor KD): the draft can never emit it, so no gradient
                                               can help it; acceptance still counts it as a miss
    KD       = KL(p_S || q_S),  p_S(v) = p(v) / sum_{u in S} p(u) = softmax over S of the teacher's
                                               logits (the exact teacher restricted and renormalised;
                                               kd='topk' is refused: its tail's share of S is unknown)

so the loss is the full-vocabulary loss with lm_head replaced by W_S and labels by their draft ids.
Everything that drafts (eval, replay, live ``propose``) sees logits over the target vocabulary, -inf
outside S, so a token outside S is never proposed and ids are target ids throughout. The subset is
kept as EAGLE-3's persistent ``d2t`` / ``t2d`` buffers (checkpoint and export carry them).

Shapes: Bs batch, N blocks per sequence, B block size, H hidden, R loss rows.
"""

from __future__ import annotations

from typing import Any

import torch

from tapdraft.train.acceptance import acceptance_counts, acceptance_metrics
from tapdraft.train.drafters.base import LossOutput
from tapdraft.train.drafters.common.draft_vocab import DraftVocabMixin, draft_index
from tapdraft.train.drafters.common.losses import dpace_weights, reach_weights, row_losses, weighted_terms
from tapdraft.train.drafters.common.teacher import gather_exact, gather_topk
from tapdraft.train.drafters.dflash.anchors import sample_anchors


class DFlashLoss(DraftVocabMixin):
    """The training half of :class:`DFlashDrafter` (``dflash.model``) (a mixin of it): the draft vocabulary, the
    training anchors, the KD teacher rows and ``forward``. It reads the drafter's config, frozen head
    buffers, ``block_hidden``, ``context`` and ``_targets``."""

    # -- draft vocabulary: set_draft_vocab, draft_ids, frozen_draft_head (common.draft_vocab.DraftVocabMixin) ---------
    def _anchors(self, batch: dict[str, Any], generator: torch.Generator | None, take_all: bool = False):
        """Training anchors (within the loss-row budget), or with ``take_all`` evaluation's (caps only)."""
        cfg = self.config
        return sample_anchors(
            batch["loss_mask"], batch["lengths"], block_size=cfg.block_size, num_anchors=cfg.num_anchors,
            max_total_anchors=cfg.max_total_anchors if take_all else cfg.train_anchors,
            full_blocks_only=cfg.full_blocks_only,
            static=cfg.static_anchors, generator=generator, take_all=take_all,
        )

    def kd_teacher(self, batch: dict[str, Any], valid: torch.Tensor, tpos: torch.Tensor, w: torch.Tensor,
                   head: tuple[torch.Tensor, torch.Tensor | None] | None = None):
        """Teacher rows anchor+k-1 of the valid slots and their KD weights; (None, None) without KD.

        ``exact``: gather those rows' last hidden -> bundle final norm -> lm_head (``head``: the rows and bias
        to project on, default the whole lm_head; a draft vocabulary's rows give the renormalised restriction);
        ``topk``: the stored rows (a slot whose row was not stored gets weight 0).
        """
        cfg = self.config
        if cfg.kd == "none":
            return None, None
        b_idx = torch.arange(valid.shape[0], device=valid.device)[:, None, None].expand_as(valid)[valid]
        rows = tpos[valid] - 1
        if cfg.kd == "exact":
            lm_head, bias = head or (self.target.lm_head, self.target.lm_head_bias)
            teacher = gather_exact(batch, b_idx, rows, last_tap=self.last_tap, bundle_norm=self.target.norm_weight,
                                   lm_head=lm_head, head=self.head_spec, norm_bias=self.target.norm_bias,
                                   lm_head_bias=bias)
            return teacher, w
        teacher, has = gather_topk(batch, b_idx, rows)
        return teacher, w * has.to(w.dtype)

    # -- training ----------------------------------------------------------------------------
    def slot_row_weights(self, ce_R: torch.Tensor, rows_ok: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Each loss row's slot weight [R]: the fixed decay, or reach / D-PACE weights from the rows' own detached CE
        (``common.losses``; a valid slot that carries no loss, its label outside the draft vocabulary, counts as a
        sure miss, q = 0)."""
        cfg = self.config
        if cfg.slot_weighting == "decay":
            return self.weights_k.to(ce_R.device).expand_as(rows_ok)[rows_ok]
        q = torch.zeros(rows_ok.shape, dtype=ce_R.dtype, device=ce_R.device)
        q[rows_ok] = torch.exp(-ce_R.detach())
        if cfg.slot_weighting == "reach":
            return reach_weights(q, valid).expand_as(rows_ok)[rows_ok]
        return dpace_weights(q, valid, cfg.dpace_alpha)[rows_ok]

    def forward(self, batch: dict[str, Any], generator: torch.Generator | None = None) -> LossOutput:
        cfg = self.config
        anchors, vblk = self._anchors(batch, generator)
        ctx = self.context(batch["taps"])
        h = self.block_hidden(batch["input_ids"], ctx, anchors)  # [Bs, N, B, H]
        labels, valid, tpos = self._targets(batch, anchors, vblk)
        lm_head, bias = self.frozen_draft_head()
        if cfg.draft_vocab is None:
            rows_ok, y = valid, labels[valid]
        else:  # loss rows: labels the draft vocabulary holds, as draft ids (module docstring)
            rows_ok = valid & self.t2d[labels]
            y = draft_index(self.t2d, labels[rows_ok])
        h_rows = h[:, :, 1:][rows_ok]  # [R, H]
        ones = torch.ones(int(rows_ok.sum()), device=h.device)
        teacher, has_teacher = self.kd_teacher(batch, rows_ok, tpos, ones, (lm_head, bias))
        ce, correct, kd = row_losses(h_rows, y, lm_head, head=self.head_spec, lm_head_bias=bias,
                                     chunk_rows=cfg.chunk_rows, teacher=teacher, ce_grad=cfg.ce_weight > 0)
        w = self.slot_row_weights(ce, rows_ok, valid)
        kd_w = None if has_teacher is None else w * has_teacher
        terms = weighted_terms(ce, w, kd, kd_w, ce_weight=cfg.ce_weight, kd_weight=cfg.kd_weight)
        # keep every parameter in the graph even when no row carries a loss (DDP waits on all grads)
        terms["ce"] = (terms["ce"][0] + 0.0 * h.sum(), terms["ce"][1], terms["ce"][2])
        corr = torch.zeros(valid.shape, dtype=torch.bool, device=h.device)
        corr[rows_ok] = correct.detach().bool()  # a label outside the draft vocabulary is a miss
        return LossOutput(terms=terms, metrics=acceptance_metrics(acceptance_counts(corr, valid)))
