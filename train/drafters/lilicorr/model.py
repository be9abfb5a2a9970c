"""LiLiCorr: DFlash's backbone and a lattice reranker over each slot's top-k candidates, trained offline.

What changes from DFlash (``train.drafters.dflash.model``; context, blocks, anchors, mask, frozen head, DFlash's
CE / KD on the backbone's slots are inherited unchanged):

(a) The lattice (``train.drafters.lilicorr.lattice``): per block, slot s = 0..B-2 (DFlash slot s + 1, predicting
    a + s + 1) keeps its top-k candidate ids c_{s,j} of the draft's full softmax, with their log-probs (detached:
    vLLM reads them from ``compute_candidates``); the head scores transitions pair[s, i, j], start[j] from the
    anchor's context row ctx[a - 1] (vLLM's ``prepare_context_anchor``: hidden_norm of the last accepted row).
(b) Drafting walks the lattice greedily left to right (``lattice.walk``, vLLM's ``_selector_walk_kernel``).
    Evaluation and replay are teacher-forced: slot s's predecessor index is that of the reply's token a + s in
    slot s - 1's candidates (any row when it is absent: the walk has failed there already).
(c) The loss, over slots whose teacher-forced predecessor is in the lattice, slot weight exp(-s / gamma) as DFlash:

        loss = DFlash's ce_weight CE + kd_weight KD (backbone)
             + lattice_weight x CE over the k candidates of the row given the predecessor (gold among them)
             + penalty_weight x (1 - sum_j min(p_j, q_j))

    q = softmax of the row's k scores, p_j = the target's probability of candidate j on row a + s (rows
    anchor..anchor+B-2). The penalty is the slot's rejection probability when drafting from q (speculative
    sampling accepts with sum_v min(p_v, q_v), and q lives on the k candidates). ModelOpt trains it online only,
    since it needs the target's logits at the k ids. Here p comes from the dataset (``penalty``):
    ``exact``: the stored final pre-norm state through the bundle's norm and lm_head, the target's own row;
    ``topk_bound``: the stored top-k row, and for a candidate outside it the upper bound min(smallest stored p,
    1 - sum stored p) (the true p can exceed neither: the stored ids are the top of the row, and the tail holds
    it). With p replaced by upper bounds the term is a lower bound of the exact penalty.

Export: vLLM 0.32's ``LiLiCorrDraftModel`` (vllm/model_executor/models/lilicorr.py, ``LiLiCorrForCausalLM``): the
DFlash tensors plus ``lilicorr.*`` and the ``dflash_config`` fields ``LiLiCorrHead`` reads; served with method
dflash and num_speculative_tokens <= B - 1. vLLM scores candidates from lm_head(h) with no bias, cap or scaling, and
embeds them with the target's raw embedding, so targets needing those are refused.

Variant ``lilicorr_conv`` (``conv_kernel_size`` and ``conv_group_size`` both > 0; recipe lilicorr_conv): the backbone's
layers are DFlash2's (``train.drafters.dflash2.model.ConvDecoderLayer``: the two-tap dynamic in-block convolutions
around attention and MLP, identity at initialisation), DFlash2's candidate selector replaced by the lattice; vLLM's
``LiLiCorr`` builds ``DFlash2Qwen3DecoderLayer`` when ``dflash_config.conv_kernel_size`` is set and requires the
``attention_conv`` / ``mlp_conv`` tensors (``load_weights``' coverage check).

Shapes: Bs batch, T positions, N blocks per sequence, B block size, S = B - 1 slots, k candidates, H hidden,
V vocab, R rows.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from tapdraft.shards.bundle import TargetBundle
from tapdraft.shards.head import head_spec
from tapdraft.shards.schema import Layout
from tapdraft.train.acceptance import acceptance_counts, acceptance_metrics
from tapdraft.train.drafters.base import LossOutput
from tapdraft.train.drafters.common.losses import row_losses, weighted_terms
from tapdraft.train.drafters.common.teacher import last_hidden, require_last_hidden
from tapdraft.train.drafters.dflash.model import DFlashDrafter
from tapdraft.train.drafters.dflash2.model import ConvDecoderLayer
from tapdraft.train.drafters.lilicorr.lattice import LiLiCorrHead, walk
from tapdraft.train.drafters.lilicorr.config import LiLiCorrConfig


class LiLiCorrDrafter(DFlashDrafter):
    family = "lilicorr"
    fewer_drafts = False  # its walk is over the trained block; no engine drafts a shorter one of it

    def __init__(self, config: LiLiCorrConfig, bundle: TargetBundle, layout: Layout) -> None:
        super().__init__(config, bundle, layout)
        cfg = self.config
        if cfg.conv_kernel_size:  # lilicorr_conv: the same layers and weights re-housed with DFlash2's convolutions
            convs = []
            for layer in self.layers:
                new = ConvDecoderLayer(self.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                       cfg.intermediate_size, self.eps, block_size=cfg.block_size,
                                       group_size=cfg.conv_group_size, kernel_size=cfg.conv_kernel_size)
                missing, unexpected = new.load_state_dict(layer.state_dict(), strict=False)
                assert not unexpected and all("conv" in m for m in missing), (missing, unexpected)
                convs.append(new)
            self.layers = nn.ModuleList(convs)
        self.lilicorr = LiLiCorrHead(
            model_hidden=self.hidden_size, block_size=cfg.block_size, eps=self.eps,
            hidden=cfg.lattice_hidden or self.hidden_size, topk=cfg.candidate_topk, num_heads=cfg.lattice_heads,
            num_layers=cfg.lattice_layers, mlp_ratio=cfg.lattice_mlp_ratio, factor_dim=cfg.factor_dim,
            vector_eps=cfg.vector_eps, logit_scale=cfg.logit_scale, std=cfg.init_std)

    @classmethod
    def check_dataset(cls, config: LiLiCorrConfig, bundle: TargetBundle, layout: Layout) -> None:
        super().check_dataset(config, bundle, layout)
        spec = head_spec(bundle)
        if spec.lm_head_bias or spec.final_logit_softcap or spec.logits_scaling != 1.0:
            raise ValueError("vLLM's LiLiCorr takes candidates from lm_head(h) with no bias, soft cap or scaling, so "
                             "this target's head cannot be served as trained; train family "
                             "dflash instead")
        if config.candidate_topk > int(bundle.lm_head.shape[0]):
            raise ValueError(f"candidate_topk {config.candidate_topk} exceeds the vocabulary")
        if config.penalty == "exact":
            require_last_hidden(layout, "penalty='exact'")
        elif layout.top_k == 0:
            raise ValueError("penalty='topk_bound' needs a dataset with top-k teacher rows (captured with top_k > 0)")

    # -- the lattice ---------------------------------------------------------------------------
    def candidates(self, h_RH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k ids [R, k] of the draft's full softmax and their log-probs (vLLM's ``compute_candidates``)."""
        out_i, out_v = [], []
        with torch.no_grad():
            for r in h_RH.split(self.logits_chunk_rows()):
                lp = torch.log_softmax(self.logits(r).float(), -1)
                v, i = lp.topk(self.config.candidate_topk, -1)
                out_i.append(i)
                out_v.append(v)
        k = self.config.candidate_topk
        if not out_i:
            return h_RH.new_zeros(0, k, dtype=torch.long), h_RH.new_zeros(0, k, dtype=torch.float32)
        return torch.cat(out_i), torch.cat(out_v)

    def lattice(self, ids_BT: torch.Tensor, ctx_BTH: torch.Tensor, anchors_BN: torch.Tensor,
                h_BNBH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Candidates [Bs, N, S, k] and scores [Bs, N, S, k, k] of blocks at ``anchors`` (hidden ``h``)."""
        Bs, N, B, H = h_BNBH.shape
        S, k = B - 1, self.config.candidate_topk
        hs = h_BNBH[:, :, 1:]
        cand, logp = self.candidates(hs.reshape(-1, H))
        cand, logp = cand.view(Bs * N, S, k), logp.view(Bs * N, S, k)
        tok = self.target.embed_tokens[cand]
        row = (anchors_BN - 1).clamp(min=0)
        anchor = ctx_BTH.gather(1, row[..., None].expand(Bs, N, ctx_BTH.shape[-1])).reshape(Bs * N, -1)
        ok = (anchors_BN >= 1).reshape(-1)
        scores = self.lilicorr(tok, logp, hs.reshape(Bs * N, S, H), anchor * ok[:, None].to(anchor.dtype), ok)
        return cand.view(Bs, N, S, k), scores.view(Bs, N, S, k, k)

    @staticmethod
    def teacher_rows(cand: torch.Tensor, scores: torch.Tensor, labels: torch.Tensor):
        """Teacher-forced lattice rows: the scores [..., S, k] given the reply's predecessor, the gold's index and
        presence [..., S], and whether the predecessor is in the lattice [..., S] (slot 0's always is)."""
        hit = cand == labels[..., None]
        gold_in, gold_idx = hit.any(-1), hit.long().argmax(-1)
        prev_idx = torch.cat([torch.zeros_like(gold_idx[..., :1]), gold_idx[..., :-1]], -1)
        prev_ok = torch.cat([torch.ones_like(gold_in[..., :1]), gold_in[..., :-1]], -1)
        rows = scores.gather(-2, prev_idx[..., None, None].expand(*prev_idx.shape, 1, scores.shape[-1])).squeeze(-2)
        return rows, gold_idx, gold_in, prev_ok

    def target_probs(self, batch: dict[str, Any], b_R: torch.Tensor, row_R: torch.Tensor, cand_Rk: torch.Tensor,
                     *, mode: str, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's probability of each candidate on rows (b, row) [R, k], and which rows have one [R]:
        ``exact`` from the final pre-norm state, ``topk_bound`` the stored value or the bound outside the top-k."""
        if mode == "exact":
            hid = last_hidden(batch, self.last_tap)[b_R, row_R]
            out = []
            with torch.no_grad():
                for h, c in zip(hid.split(self.logits_chunk_rows()), cand_Rk.split(self.logits_chunk_rows())):
                    lp = torch.log_softmax(self.target.logits(h).double() / temperature, -1)
                    out.append(lp.gather(-1, c).exp())
            p = torch.cat(out) if out else cand_Rk.new_zeros(cand_Rk.shape, dtype=torch.float64)
            return p, torch.ones(cand_Rk.shape[0], dtype=torch.bool, device=cand_Rk.device)
        return topk_bound(batch["topk_ids"][b_R, row_R], batch["topk_logprobs"][b_R, row_R], cand_Rk), \
            batch["topk_valid"][b_R, row_R].bool()

    # -- training ----------------------------------------------------------------------------
    def forward(self, batch: dict[str, Any], generator: torch.Generator | None = None) -> LossOutput:
        cfg = self.config
        anchors, vblk = self._anchors(batch, generator)
        ctx = self.context(batch["taps"])
        h = self.block_hidden(batch["input_ids"], ctx, anchors)  # [Bs, N, B, H]
        labels, valid, tpos = self._targets(batch, anchors, vblk)  # [Bs, N, S]
        w_all = self.weights_k.to(h.device).expand_as(valid)
        w = w_all[valid]
        teacher, kd_w = self.kd_teacher(batch, valid, tpos, w)
        ce, _, kd = row_losses(h[:, :, 1:][valid], labels[valid], self.target.lm_head, head=self.head_spec,
                               lm_head_bias=self.target.lm_head_bias, chunk_rows=cfg.chunk_rows, teacher=teacher)
        terms = weighted_terms(ce, w, kd, kd_w, ce_weight=cfg.ce_weight, kd_weight=cfg.kd_weight)
        terms["ce"] = (terms["ce"][0] + 0.0 * h.sum(), terms["ce"][1], terms["ce"][2])

        cand, scores = self.lattice(batch["input_ids"], ctx, anchors, h)
        rows, gold_idx, gold_in, prev_ok = self.teacher_rows(cand, scores, labels)
        lsm = torch.log_softmax(rows, -1)
        ce_rows = valid & prev_ok & gold_in
        lat = -lsm.gather(-1, gold_idx[..., None]).squeeze(-1)
        pen_rows = valid & prev_ok
        b_idx = torch.arange(valid.shape[0], device=h.device)[:, None, None].expand_as(valid)
        p, has = self.target_probs(batch, b_idx[pen_rows], (tpos - 1)[pen_rows], cand[pen_rows], mode=cfg.penalty)
        q = lsm[pen_rows].exp()
        pen = 1.0 - torch.minimum(p.to(q.dtype), q).sum(-1)
        pw = w_all[pen_rows] * has.to(w.dtype)
        anchor = 0.0 * scores.sum()  # the head stays in the graph when no row carries a lattice loss
        terms["lattice"] = ((w_all[ce_rows] * lat[ce_rows]).sum() + anchor, w_all[ce_rows].sum().detach(),
                            cfg.lattice_weight)
        terms["penalty"] = ((pw * pen).sum(), pw.sum().detach(), cfg.penalty_weight)
        corr = valid & prev_ok & gold_in & (rows.argmax(-1) == gold_idx)
        metrics = acceptance_metrics(acceptance_counts(corr, valid))
        metrics["candidate_recall"] = (gold_in[valid].double().sum(), valid.double().sum())
        return LossOutput(terms=terms, metrics=metrics)

    # -- drafting and evaluation ---------------------------------------------------------------
    @torch.no_grad()
    def draft_slots(self, batch: dict[str, Any], ctx_BTH: torch.Tensor, anchors_BN: torch.Tensor) -> torch.Tensor:
        """Teacher-forced greedy lattice drafts long [Bs, N, S]: slot s takes the argmax of its row given the
        reply's token a + s (what the walk drafts while every earlier slot was right)."""
        ids = batch["input_ids"]
        h = self.block_hidden(ids, ctx_BTH, anchors_BN)
        cand, scores = self.lattice(ids, ctx_BTH, anchors_BN, h)
        tpos = anchors_BN[:, :, None] + torch.arange(1, self.config.block_size, device=ids.device)
        labels = ids.gather(1, tpos.clamp(max=ids.shape[1] - 1).view(ids.shape[0], -1)).view_as(tpos)
        rows = self.teacher_rows(cand, scores, labels)[0]
        return cand.gather(-1, rows.argmax(-1, keepdim=True)).squeeze(-1)

    @torch.no_grad()
    def propose(self, ids_T: torch.Tensor, taps_PnH: torch.Tensor, *, temperature: float = 0.0,
                generator: torch.Generator | None = None,
                extras: Mapping[str, torch.Tensor] | None = None,
                drafts: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One block anchored at P: the lattice walk over its S = B - 1 slots (q over the vocabulary, zero off the
        candidates, when sampling)."""
        self.draft_count(drafts)
        b, anchors = self._live_block(ids_T, taps_PnH)
        ctx = self.context(b["taps"])
        h = self.block_hidden(b["input_ids"], ctx, anchors)
        cand, scores = self.lattice(b["input_ids"], ctx, anchors, h)
        tokens, _, q = walk(scores[0], cand[0], temperature=temperature, generator=generator)
        if q is None:
            return tokens[0].cpu(), None
        full = q.new_zeros(*q.shape[1:-1], self.vocab_size).scatter(-1, cand[0, 0], q[0])
        return tokens[0].cpu(), full.float()

    @torch.no_grad()
    def sampled_acceptance(self, batch: dict[str, Any], temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """sum_j min(p_j, q_j) per slot (q: the lattice row's softmax at the temperature given the reply's
        predecessor, p: the target's exact row; 0 where the predecessor left the lattice); ([S], [S]) float64."""
        if temperature <= 0:
            raise ValueError(f"sampled acceptance needs a temperature > 0, got {temperature}")
        ids = batch["input_ids"]
        S = self.config.block_size - 1
        anchors, vblk = self.eval_anchors(batch)
        labels, valid, tpos = self._targets(batch, anchors, vblk)
        ctx = self.context(batch["taps"])
        sums, counts = torch.zeros(S, dtype=torch.float64), torch.zeros(S, dtype=torch.float64)
        for c in self.anchor_chunks(anchors):
            v = valid[:, c]
            if not bool(v.any()):
                continue
            h = self.block_hidden(ids, ctx, anchors[:, c])
            cand, scores = self.lattice(ids, ctx, anchors[:, c], h)
            rows, _, _, prev_ok = self.teacher_rows(cand, scores, labels[:, c])
            b = torch.arange(ids.shape[0], device=ids.device)[:, None, None].expand_as(v)
            p, _ = self.target_probs(batch, b[v], (tpos[:, c] - 1)[v], cand[v], mode="exact", temperature=temperature)
            q = torch.softmax(rows[v].double() / temperature, -1)
            a = torch.minimum(p, q).sum(-1) * prev_ok[v].double()
            slot = torch.arange(S, device=ids.device).expand_as(v)[v]
            sums.index_add_(0, slot.cpu(), a.cpu())
            counts.index_add_(0, slot.cpu(), torch.ones_like(a).cpu())
        return sums, counts

    # -- export ------------------------------------------------------------------------------
    def export_config(self) -> dict[str, Any]:
        """DFlash's config under vLLM's ``LiLiCorrDraftModel`` with the ``dflash_config`` fields ``LiLiCorrHead``
        and ``LiLiCorr.__init__`` read; no ``auto_map`` (no shipped modeling file walks the lattice)."""
        doc = super().export_config()
        cfg = self.config
        doc["architectures"] = ["LiLiCorrDraftModel"]
        doc.pop("auto_map", None)
        doc["dflash_config"].update({
            "block_size": cfg.block_size,
            "lilicorr_enabled": True,
            "lilicorr_hidden_size": cfg.lattice_hidden or self.hidden_size,
            "lilicorr_candidate_topk": cfg.candidate_topk,
            "lilicorr_num_heads": cfg.lattice_heads,
            "lilicorr_num_layers": cfg.lattice_layers,
            "lilicorr_mlp_ratio": cfg.lattice_mlp_ratio,
            "lilicorr_factor_dim": cfg.factor_dim,
            "lilicorr_vector_eps": cfg.vector_eps,
            "lilicorr_logit_scale": cfg.logit_scale,
            "conv_kernel_size": cfg.conv_kernel_size,
            "conv_group_size": cfg.conv_group_size,
        })
        doc["tapdraft"]["family"] = self.family
        doc["tapdraft"]["decode"] = ("slots 1..B-1 of a block at anchor a predict a + 1..a + B - 1; each keeps its "
                                     "top-k lm_head candidates and the lilicorr head's transition scores are walked "
                                     "greedily left to right from the anchor")
        doc["tapdraft"]["serve_with"] = {"vllm": {"method": "dflash", "num_speculative_tokens": cfg.block_size - 1}}
        doc["tapdraft"]["block_size"] = {"vllm": cfg.block_size}
        return doc


def topk_bound(ids_Rkt: torch.Tensor, logprobs_Rkt: torch.Tensor, cand_Rk: torch.Tensor) -> torch.Tensor:
    """Target probabilities of candidates [R, k] from a stored top-kt row: the stored value where the candidate is
    among the stored ids, else min(smallest stored p, 1 - sum stored p), an upper bound of the true value."""
    p_t = logprobs_Rkt.double().exp()
    match = cand_Rk[:, :, None] == ids_Rkt.long()[:, None, :]
    inside = match.any(-1)
    p_in = (match.double() * p_t[:, None, :]).sum(-1)
    bound = torch.minimum(p_t.min(-1).values, (1.0 - p_t.sum(-1)).clamp(min=0.0))
    return torch.where(inside, p_in, bound[:, None].expand_as(p_in))


CONFIG = LiLiCorrConfig
DRAFTER = LiLiCorrDrafter
