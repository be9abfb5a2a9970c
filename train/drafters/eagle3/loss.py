"""EAGLE-3's training loss over the unrolled steps (the model is ``train.drafters.eagle3.model``).

Step j (0-based) at row t predicts the token at t + j + 2; its teacher row is t + j + 1 (the target's row
predicting the same token). Per valid row, with q the draft's distribution over its vocabulary S:

    kl  KL(p || q)                   forward KL against the teacher (EAGLE-3's objective): the exact row
                                     (last hidden -> final norm -> lm_head) restricted to S and renormalised,
                                     as EAGLE-3 restricts its target to the draft vocabulary; or, without a
                                     draft vocabulary, the stored top-k with the tail as one bin
    ce  -log q(y)                    the dataset's label; a label outside S carries no loss
    lk  lambda*KL + (1-lambda)*TV    as MTP's (``train.drafters.common.divergences.lk_loss``)

Loss rows: with ``max_loss_rows`` set (a recipe's null is fitted to the device when training starts, ``train.fit``),
max_loss_rows // num_steps positions are sampled per micro-batch, the same at every step, each step's term still
normalised by its own row count, so the loss estimates the all-rows one (a ratio estimate) at a bounded head cost.

Each step is its own term (weight ``step_decay ** j``, its own denominator over the data-parallel group,
``train.drafters.base.combine_terms``). The draft's lm_head is its own and may train, so the rows go through
row chunks, never [rows, V] whole. kl and ce take the fused path (``train.drafters.common.losses.trained_head_losses``:
each chunk's gradients w.r.t. the rows and the draft's head computed in the forward, so the draft and teacher logits
are computed once, not again in an activation checkpoint's recompute, and TV, logged as sampled acceptance, is one
more elementwise pass over the chunk's q - p); lk, whose TV term needs TV's gradient, keeps autograd through
checkpointed chunks (``train.drafters.common.chunks.map_row_chunks``).

Shapes: Bs batch, T positions, n valid rows of a step, N draft vocab, V target vocab.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from tapdraft.train.acceptance import acceptance_metrics
from tapdraft.train.drafters.base import LossOutput
from tapdraft.train.drafters.common.chain import AUDIO_MASKED, IGNORE, chain_counts, step_metric
from tapdraft.train.drafters.common.chunks import map_row_chunks
from tapdraft.train.drafters.common.divergences import kl_tv_full, kl_tv_topk, lk_loss
from tapdraft.train.drafters.common.draft_vocab import DraftVocabMixin, draft_index
from tapdraft.train.drafters.common.losses import trained_head_losses
from tapdraft.train.drafters.common.teacher import ExactTeacher, TopKTeacher, last_hidden


class Eagle3Loss(DraftVocabMixin):
    """The training half of :class:`Eagle3Drafter` (``eagle3.model``; a mixin of it): ``forward``. It reads the
    drafter's config, ``run_steps``, ``draft_logits``, ``teacher``, ``teacher_kind`` and the draft vocabulary."""

    def forward(self, batch: dict[str, Any], generator: torch.Generator | None = None) -> LossOutput:
        cfg = self.config
        run = self.run_steps(batch)
        supervised = sum(int((t != IGNORE).sum()) for t in run["labels"])
        labels = self._loss_positions(run["labels"], generator)
        last = last_hidden(batch, self.last_tap) if self.teacher_kind == "exact" else None
        terms: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
        metrics: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        hits = []
        for j, (h, lab) in enumerate(zip(run["h"], labels)):
            rows = (lab != IGNORE).nonzero(as_tuple=True)
            y = lab[rows]
            trow = (rows[0], rows[1] + j + 1)
            if cfg.loss_type == "lk":
                kl, tv, carries, correct = self._lk_rows(h[rows], y, trow, batch, last)
                n = carries.sum()
                res = lk_loss(kl, tv, carries, cfg.lk_lambda, eta=cfg.lk_eta)
                loss_sum = res.loss_sum
                metrics[step_metric("lk_lambda", j + 1)] = (torch.tensor(res.lam * float(n > 0)), (n > 0).long())
            else:
                loss_sum, kl, tv, carries, correct = self._rows(h[rows], y, trow, batch, last)
                n = carries.sum()
            terms[step_metric("loss", j + 1)] = (loss_sum, n, cfg.step_decay**j)
            if kl is not None:
                metrics[step_metric("kl", j + 1)] = ((kl.detach() * carries).sum(), n)
                metrics[step_metric("sampled_acceptance", j + 1)] = (((1.0 - tv.detach()) * carries).sum(), n)
            hit = torch.zeros_like(lab, dtype=torch.bool)
            hit[rows] = correct.detach().bool()
            hits.append(hit)
        # every parameter stays in the graph even when no row carries a loss (DDP waits on all grads)
        first = terms[step_metric("loss", 1)]
        terms[step_metric("loss", 1)] = (first[0] + 0.0 * sum(p.sum() for p in self.parameters()), first[1], first[2])
        metrics.update(acceptance_metrics(chain_counts(labels, hits)))
        masked = torch.stack(run["audio_masked"]).sum()
        metrics[AUDIO_MASKED] = (masked, masked + supervised)
        return LossOutput(terms=terms, metrics=metrics)

    def _loss_positions(self, labels: list[torch.Tensor], generator: torch.Generator | None) -> list[torch.Tensor]:
        """The steps' labels with IGNORE outside max_loss_rows // num_steps positions sampled uniformly among those
        supervised at some step (all of them when they fit, or without a budget); the same positions at every step, so
        each chain stays whole and the acceptance metrics count whole chains."""
        cap = self.config.max_loss_rows
        if cap is None:
            return labels
        pos = torch.stack([t != IGNORE for t in labels]).any(0).flatten().nonzero()[:, 0]
        m = cap // self.config.num_steps
        if pos.numel() <= m:
            return labels
        pick = torch.randperm(pos.numel(), generator=generator)[:m].to(pos.device)
        keep = torch.zeros(labels[0].numel(), dtype=torch.bool, device=pos.device)
        keep[pos[pick]] = True
        keep = keep.view_as(labels[0])
        return [torch.where(keep, t, torch.full_like(t, IGNORE)) for t in labels]

    def _rows(self, h_nH: torch.Tensor, y_n: torch.Tensor, trow, batch: dict[str, Any], last: torch.Tensor | None):
        """kl / ce, fused (``common.losses.trained_head_losses``: analytic gradients, no recompute): (the step's
        weighted loss sum, kl [n] or None, tv [n] or None, carries-a-loss bool [n], correct [n])."""
        ids = self.draft_ids()
        x, W = self.norm(h_nH), self.lm_head.weight
        chunk = self.config.chunk_rows
        if self.config.loss_type == "ce":
            in_s = torch.ones_like(y_n, dtype=torch.bool) if ids is None else self.t2d[y_n]
            y_d = y_n if ids is None else draft_index(self.t2d, y_n).clamp(min=0)
            loss, _, pred, _ = trained_head_losses(x, W, in_s.to(x.dtype), labels_n=y_d, chunk_rows=chunk)
            return loss, None, None, in_s, self.draft_to_target(pred) == y_n
        carries = torch.ones_like(y_n, dtype=torch.bool)
        if self.teacher_kind == "exact":
            t = self.target  # the target restricted to S: projecting only S's rows is the renormalised restriction
            lm_head = t.lm_head if ids is None else t.lm_head.index_select(0, ids)
            bias = t.lm_head_bias if ids is None or t.lm_head_bias is None else t.lm_head_bias.index_select(0, ids)
            teacher = ExactTeacher(last[trow], t.norm_weight, lm_head, self.head_spec, t.norm_bias, bias)
        else:
            teacher = self._topk_teacher(batch, trow)
        loss, kl, pred, tv = trained_head_losses(x, W, carries.to(x.dtype), teacher=teacher, chunk_rows=chunk)
        return loss, kl, tv, carries, self.draft_to_target(pred) == y_n

    def _topk_teacher(self, batch: dict[str, Any], trow) -> TopKTeacher:
        if "topk_ids" not in batch:
            raise ValueError(f"loss_type {self.config.loss_type!r} with teacher 'topk' needs topk_ids/topk_logprobs "
                             "in the batch")
        if not bool(batch["topk_valid"][trow].all()):
            raise ValueError("a supervised EAGLE-3 row's teacher row has no stored top-k; the dataset's topk_rows "
                             "are incomplete")
        return TopKTeacher(batch["topk_ids"][trow], batch["topk_logprobs"][trow])

    def _lk_rows(self, h_nH: torch.Tensor, y_n: torch.Tensor, trow, batch: dict[str, Any], last: torch.Tensor | None):
        """lk (TV's gradient goes through autograd, in checkpointed chunks): (kl [n], tv [n], carries, correct)."""
        ids = self.draft_ids()
        carries = torch.ones_like(y_n, dtype=torch.bool)
        if self.teacher_kind == "exact":
            def div(a, b, yy):
                z = self.draft_logits(a)
                p = self.teacher(b)
                p = p if ids is None else p[:, ids]  # the target restricted to S: softmax renormalises over it
                kl, tv = kl_tv_full(p.to(z.dtype), z)
                return kl, tv, self.draft_to_target(z.argmax(-1)) == yy

            kl, tv, correct = map_row_chunks(div, [h_nH, last[trow], y_n], self.config.chunk_rows)
        else:
            teacher = self._topk_teacher(batch, trow)

            def div_topk(a, i, lp, yy):
                z = self.draft_logits(a)
                kl, tv = kl_tv_topk(i, lp, z)
                return kl, tv, z.argmax(-1) == yy

            kl, tv, correct = map_row_chunks(
                div_topk, [h_nH, teacher.ids_Rk, teacher.logprobs_Rk, y_n], self.config.chunk_rows)
        return kl, tv, carries, correct
