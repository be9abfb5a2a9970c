"""MTP's training loss: one term per depth over the rows whose target is known (the model is ``mtp.model``).

Losses: ``ce`` on the dataset's labels (default) or ``lk`` (``train.drafters.common.divergences``):
lambda*KL(p||q) + (1-lambda)*TV(p,q), p the frozen target's distribution at row t + k (the row that
predicts the same token t + k + 1), q the head's. The teacher (``teacher``) is the exact per-row
projection (gather the rows' last hidden -> final norm -> lm_head; ``auto`` picks it whenever the
dataset has the last layer, which MTP needs anyway for h^0) or the stored top-k with the tail as one
bin. Only the rows a loss reads are projected, in row chunks, so [rows, V] is never whole: CE through the fused
frozen-head loss (``train.drafters.common.losses.row_losses``: analytic gradient, nothing recomputed), LK (whose TV
term needs TV's gradient) through autograd in checkpointed chunks.
Each depth is its own loss term (weight 1/D, its own denominator over the data-parallel group).

Draft vocabulary (``draft_vocab = N``, CE only; the subset rule is ``train.drafters.common.draft_vocab``): the head
scores N rows of the frozen lm_head instead of V, so a loss row costs N/V of its full-vocabulary price, in training
and in every served round; a row whose label lies outside the subset carries no loss and counts as a miss.

Shapes: Bs batch, T positions, H hidden, V vocab, D depths, n valid rows.
"""

from __future__ import annotations

from typing import Any

import torch

from tapdraft.train.acceptance import acceptance_metrics
from tapdraft.train.drafters.base import LossOutput
from tapdraft.train.drafters.common.chain import AUDIO_MASKED, IGNORE, chain_counts, step_metric
from tapdraft.train.drafters.common.chunks import map_row_chunks
from tapdraft.train.drafters.common.divergences import kl_tv_full, kl_tv_topk, lk_loss
from tapdraft.train.drafters.common.draft_vocab import DraftVocabMixin, draft_index
from tapdraft.train.drafters.common.losses import row_losses


class MTPLoss(DraftVocabMixin):
    """The training half of :class:`MTPDrafter` (``mtp.model``) (a mixin of it): the draft vocabulary, ``forward`` and
    its per-row CE and LK losses. It reads the drafter's config, ``run_depths``, ``logits``, ``teacher`` and
    ``teacher_kind``."""

    def forward(self, batch: dict[str, Any], generator: torch.Generator | None = None) -> LossOutput:
        run = self.run_depths(batch)
        D = self.config.num_depths
        terms: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
        metrics: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        last = self.last_hidden(batch) if self.teacher_kind == "exact" else None
        hits: list[torch.Tensor] = []
        for k in range(1, D + 1):
            lab = run["labels"][k - 1]
            rows = (lab != IGNORE).nonzero(as_tuple=True)  # (b, t)
            hk = run["h"][k - 1][rows]
            y = lab[rows]
            n = torch.tensor(int(y.numel()), device=y.device)
            if self.config.loss_type == "ce":
                ce, correct = self._ce_rows(k, hk, y)
                terms[step_metric("loss", k)] = (ce.sum(), torch.tensor(int(ce.numel()), device=y.device), 1.0 / D)
            else:
                trow = (rows[0], rows[1] + k)  # the target's row predicting the same token
                kl, tv, correct = self._lk_rows(k, hk, y, trow, batch, last)
                every = torch.ones_like(y, dtype=torch.bool)
                res = lk_loss(kl, tv, every, self.config.lk_lambda, eta=self.config.lk_eta)
                terms[step_metric("loss", k)] = (res.loss_sum, n, 1.0 / D)
                metrics[step_metric("kl", k)] = (res.kl_sum, n)
                metrics[step_metric("sampled_acceptance", k)] = (n - res.tv_sum, n)
                metrics[step_metric("lk_lambda", k)] = (torch.tensor(res.lam * float(n > 0)), (n > 0).long())
            hit = torch.zeros_like(lab, dtype=torch.bool)
            hit[rows] = correct.detach().bool()
            hits.append(hit)
        # every parameter stays in the graph even when a depth has no row here (DDP waits on all grads)
        first = terms[step_metric("loss", 1)]
        terms[step_metric("loss", 1)] = (first[0] + 0.0 * sum(p.sum() for p in self.parameters()), first[1], first[2])
        # acc@k / alpha@k / tau in the log: the teacher-forced chain over depths, as ``acceptance`` counts it
        for name, val in acceptance_metrics(chain_counts(run["labels"], hits)).items():
            metrics[name] = val
        masked = torch.stack(run["audio_masked"]).sum()
        seen = masked + sum(int((t != IGNORE).sum()) for t in run["labels"])
        metrics[AUDIO_MASKED] = (masked, seen)
        return LossOutput(terms=terms, metrics=metrics)

    def _ce_rows(self, k: int, h: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row CE over the head's vocabulary (the draft vocabulary's rows when it has one: a row whose label lies
        outside carries no loss and is a miss) and argmax == label for every row, through the frozen lm_head, fused:
        the gradient w.r.t. the rows is computed in the forward, so no chunk is recomputed in the backward."""
        lm_head, bias = self.frozen_draft_head()
        keep = None if self.config.draft_vocab is None else self.t2d[y]
        if keep is not None:
            h, y_in = h[keep], draft_index(self.t2d, y[keep])
        else:
            y_in = y
        ce, correct, _ = row_losses(self.out_norm(k, h), y_in, lm_head, head=self.head_spec, lm_head_bias=bias,
                                    chunk_rows=self.config.chunk_rows)
        if keep is None:
            return ce, correct.bool()
        hit = torch.zeros_like(keep)
        hit[keep] = correct.bool()
        return ce, hit

    def _lk_rows(self, k, hk, y, trow, batch, last):
        if self.teacher_kind == "exact":
            t_h = last[trow]

            def fn(a, b, yy):
                q = self.logits(k, a)
                p = self.teacher(b)
                kl, tv = kl_tv_full(p.to(q.dtype), q)
                return kl, tv, q.argmax(-1) == yy

            return map_row_chunks(fn, [hk, t_h, y], self.config.chunk_rows)
        if "topk_ids" not in batch:
            raise ValueError("LK with teacher 'topk' needs topk_ids/topk_logprobs in the batch (dataset top_k > 0)")
        if not bool(batch["topk_valid"][trow].all()):
            raise ValueError(
                "a supervised MTP row's teacher row has no stored top-k; the dataset's topk_rows are incomplete"
            )
        ids, lps = batch["topk_ids"][trow], batch["topk_logprobs"][trow]

        def fn(a, i, lp, yy):
            q = self.logits(k, a)
            kl, tv = kl_tv_topk(i, lp, q)
            return kl, tv, q.argmax(-1) == yy

        return map_row_chunks(fn, [hk, ids, lps, y], self.config.chunk_rows)

