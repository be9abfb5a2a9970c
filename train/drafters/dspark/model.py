"""DSpark: DFlash's parallel backbone, next-token slots, and a sequential low-rank Markov head on the logits.

What changes from DFlash (``train.drafters.dflash.model``; context fusion, KV injection, anchors, visibility
mask, frozen target head and checkpointing are inherited):

(a) Next-token alignment (vLLM's ``sample_from_anchor``): a block is [anchor, mask x (B - 1)] at positions
    a..a+B-1 and slot k predicts the token at a + k + 1, so every slot is supervised (slot 0 too) and a
    block drafts K = B tokens; vLLM serves it with num_speculative_tokens = block_size. The teacher row of
    slot k is a + k, the target's own next-token row there. Slot k weighs exp(-k / gamma).
(b) The Markov head (``train.drafters.dspark.markov``): z_k = U_k + markov_w2(markov_w1[x_{k-1}]), x_{-1} =
    the anchor, teacher-forced in training and evaluation (x_{k-1} = the reply's token at a + k), walked left
    to right when drafting (live ``propose``, the replayed and live tau of ``tapdraft speculate``).
(c) The loss (ModelOpt's DSpark, modelopt/torch/speculative/plugins/hf_dspark.py, ``_compute_dspark_loss``):

        loss = ce_weight x CE(z) + tv_weight x L1(z, teacher) + confidence_weight x BCE(c, 1 - TV)

    L1 = sum_v |p_v - q_v| = 2 TV (ModelOpt's "TVD" term is this sum, unhalved; its defaults 0.1 and 0.9 are
    kept on it), p the stored teacher row (``kd``: ``topk``, the lumped-tail form, a lower bound; or
    ``exact``), q = softmax(z). The confidence head's logit c is trained towards the row's analytical
    acceptance 1 - TV (detached). Each term is normalised by its own slot-weighted row count
    (``train.drafters.base.combine_terms``). The CE and L1 rows are fused (``train.drafters.dspark.loss``): chunks of
    ``chunk_rows`` whose gradients are computed in the forward, so [rows, V] logits never exist whole and none is
    computed twice.

Export: vLLM 0.32's ``Qwen3DSparkModel`` (vllm/model_executor/models/qwen3_dspark.py): DFlash's tensors plus
``markov_head.markov_w{1,2}.weight`` and ``confidence_head.proj.{weight,bias}``, and the config fields its
DSpark path and ``_validate_qwen3_omni_dspark`` read; layout ``qwen3_omni`` is the same export under
``Qwen3OmniDSparkModel``, the standalone checkpoint vLLM requires for a Qwen3-Omni target.

Shapes: Bs batch, T positions, N blocks per sequence, B block size (= K drafts), H hidden, V vocab, R rows.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn.functional as F

from tapdraft.shards.bundle import TargetBundle
from tapdraft.shards.head import head_spec
from tapdraft.shards.schema import Layout
from tapdraft.train.acceptance import acceptance_counts, acceptance_metrics
from tapdraft.train.drafters.base import LossOutput
from tapdraft.train.drafters.common.chunks import map_row_chunks
from tapdraft.train.drafters.common.divergences import tv_full
from tapdraft.train.drafters.common.losses import slot_weights
from tapdraft.train.drafters.common.teacher import last_hidden
from tapdraft.train.drafters.dflash.model import DFlashDrafter
from tapdraft.train.drafters.dspark import LAYOUTS
from tapdraft.train.drafters.dspark.markov import ConfidenceHead, MarkovHead, walk
from tapdraft.train.drafters.dspark.config import DSparkConfig
from tapdraft.train.drafters.dspark.loss import dspark_row_losses


class DSparkDrafter(DFlashDrafter):
    family = "dspark"
    fewer_drafts = False  # its walk is over the trained block; no engine drafts a shorter one of it

    def __init__(self, config: DSparkConfig, bundle: TargetBundle, layout: Layout) -> None:
        super().__init__(config, bundle, layout)
        cfg = self.config
        self.weights_k = slot_weights(cfg.block_size + 1, cfg.gamma)  # exp(-k / gamma), k = 0..B-1
        self.markov_head = MarkovHead(self.vocab_size, cfg.markov_rank, cfg.init_std)
        self.confidence_head = ConfidenceHead(self.hidden_size, cfg.markov_rank, cfg.init_std) \
            if cfg.confidence_head else None

    @classmethod
    def check_dataset(cls, config: DSparkConfig, bundle: TargetBundle, layout: Layout) -> None:
        super().check_dataset(config, bundle, layout)
        spec = head_spec(bundle)
        if spec.lm_head_bias or spec.final_logit_softcap:
            raise ValueError("vLLM's DSpark adds the Markov bias to lm_head(h) with no lm_head bias or soft cap, so a "
                             "target head with either cannot be served as trained; train family dflash instead")
        if config.confidence_head and spec.logits_scaling != 1.0:
            raise ValueError("the confidence head reads the draft's last norm, which the export divides by the "
                             f"target's logits_scaling ({spec.logits_scaling}); set confidence_head false")

    # -- the model ---------------------------------------------------------------------------
    def _targets(self, batch: dict[str, Any], anchors: torch.Tensor, valid_blocks: torch.Tensor):
        """Slot targets for k = 0..B-1 (slot k predicts a + k + 1): labels, validity, positions; each [Bs, N, B]."""
        B = self.config.block_size
        ids, lm, L = batch["input_ids"], batch["loss_mask"], batch["lengths"].to(anchors.device)
        T = ids.shape[1]
        tpos = anchors[:, :, None] + torch.arange(1, B + 1, device=anchors.device)
        flat = tpos.clamp(max=T - 1).view(ids.shape[0], -1)
        labels = ids.gather(1, flat).view_as(tpos)
        sup = lm.gather(1, flat).view_as(tpos)
        valid = valid_blocks[:, :, None] & (tpos < L[:, None, None]) & sup
        return labels, valid, tpos

    @staticmethod
    def predecessors(ids_BT: torch.Tensor, tpos: torch.Tensor) -> torch.Tensor:
        """The teacher-forced predecessor of each slot (the token at tpos - 1: slot 0's is the anchor), tpos' shape."""
        flat = (tpos - 1).clamp(max=ids_BT.shape[1] - 1).view(ids_BT.shape[0], -1)
        return ids_BT.gather(1, flat).view_as(tpos)

    def corrected_logits(self, h_RH: torch.Tensor, prev_R: torch.Tensor) -> torch.Tensor:
        """z = U + markov bias: the slot's logits [R, V] given its predecessor token."""
        z = self.logits(h_RH)
        return z + self.markov_head.bias(prev_R).to(z.dtype)

    def slot_logits(self, h_RH: torch.Tensor, prev_R: torch.Tensor, temperature: float) -> torch.Tensor:
        """Tempered corrected logits: their softmax is what sampled drafting draws slot by slot."""
        return self.corrected_logits(h_RH, prev_R) / temperature

    # -- training ----------------------------------------------------------------------------
    def forward(self, batch: dict[str, Any], generator: torch.Generator | None = None) -> LossOutput:
        cfg = self.config
        anchors, vblk = self._anchors(batch, generator)
        h = self.block_hidden(batch["input_ids"], self.context(batch["taps"]), anchors)  # [Bs, N, B, H]
        labels, valid, tpos = self._targets(batch, anchors, vblk)
        h_rows, y = h[valid], labels[valid]
        prev = self.predecessors(batch["input_ids"], tpos)[valid]
        w = self.weights_k.to(h.device).expand_as(valid)[valid]
        teacher, t_w = self.kd_teacher(batch, valid, tpos, w)
        emb = self.markov_head.embed(prev)
        ce_sum, l1_sum, _, tv, correct = dspark_row_losses(
            h_rows, emb, self.markov_head.markov_w2.weight, self.frozen_draft_head()[0], y, w, t_w, teacher,
            head=self.head_spec, chunk_rows=cfg.chunk_rows, weights=(cfg.ce_weight, cfg.tv_weight))
        # every trainable parameter stays in the graph when no row carries a loss (DDP waits on all grads)
        anchor = 0.0 * h.sum() + 0.0 * sum(p.sum() for p in self.markov_head.parameters())
        terms = {"ce": (ce_sum + anchor, w.sum().detach(), cfg.ce_weight),
                 "l1": (l1_sum, t_w.sum().detach(), cfg.tv_weight)}
        if self.confidence_head is not None:
            c = self.confidence_head(h_rows, emb)
            bce = F.binary_cross_entropy_with_logits(c.float(), (1.0 - tv).clamp(0.0, 1.0).float(), reduction="none")
            anchor_c = 0.0 * sum(p.sum() for p in self.confidence_head.parameters())
            terms["confidence"] = ((t_w * bce).sum() + anchor_c, t_w.sum().detach(), cfg.confidence_weight)
        corr = torch.zeros(valid.shape, dtype=torch.bool, device=h.device)
        corr[valid] = correct
        return LossOutput(terms=terms, metrics=acceptance_metrics(acceptance_counts(corr, valid)))

    # -- drafting and evaluation ---------------------------------------------------------------
    @torch.no_grad()
    def draft_slots(self, batch: dict[str, Any], ctx_BTH: torch.Tensor, anchors_BN: torch.Tensor) -> torch.Tensor:
        """Teacher-forced greedy drafts long [Bs, N, B]: slot k's argmax given the reply's token at a + k (what the
        walk drafts while every earlier slot was right, so replayed rounds equal greedy decoding's)."""
        h = self.block_hidden(batch["input_ids"], ctx_BTH, anchors_BN)
        tpos = anchors_BN[:, :, None] + torch.arange(1, self.config.block_size + 1, device=anchors_BN.device)
        prev = self.predecessors(batch["input_ids"], tpos).reshape(-1)
        rows = h.reshape(-1, h.shape[-1])
        step = self.logits_chunk_rows()
        pred = [self.corrected_logits(r, p).argmax(-1) for r, p in zip(rows.split(step), prev.split(step))]
        return (torch.cat(pred) if pred else prev.new_zeros(0)).view(h.shape[:3])

    @torch.no_grad()
    def propose(self, ids_T: torch.Tensor, taps_PnH: torch.Tensor, *, temperature: float = 0.0,
                generator: torch.Generator | None = None,
                extras: Mapping[str, torch.Tensor] | None = None,
                drafts: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One block anchored at P: the Markov walk from ids[P] over its B slots (K = B drafts)."""
        self.draft_count(drafts)
        b, anchors = self._live_block(ids_T, taps_PnH)
        h = self.block_hidden(b["input_ids"], self.context(b["taps"]), anchors)[0, 0]  # [B, H]
        tokens, q = walk(self.markov_head, self.logits(h)[None], b["input_ids"][0, anchors[0]],
                         temperature=temperature, generator=generator)
        return tokens[0].cpu(), (q[0] if q is not None else None)

    @property
    def trained_drafts(self) -> int:
        return self.config.block_size

    @torch.no_grad()
    def confidence(self, h_RH: torch.Tensor, prev_R: torch.Tensor) -> torch.Tensor:
        """The confidence head's acceptance estimate sigmoid(c) [R] (vLLM's ``compute_confidence``)."""
        if self.confidence_head is None:
            raise ValueError("this DSpark draft has no confidence head (train with drafter.confidence_head=true)")
        return torch.sigmoid(self.confidence_head(h_RH, self.markov_head.embed(prev_R)))

    @torch.no_grad()
    def sampled_acceptance(self, batch: dict[str, Any], temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """sum_v min(p_v, q_v) per slot k (p: the target's exact row a + k; q: slot k's corrected distribution given
        the reply's token at a + k), over every eligible anchor's valid slots; ([B], [B]) float64."""
        if temperature <= 0:
            raise ValueError(f"sampled acceptance needs a temperature > 0, got {temperature}")
        ids = batch["input_ids"]
        Bs = ids.shape[0]
        K = self.config.block_size
        anchors, vblk = self.eval_anchors(batch)
        _, valid, tpos = self._targets(batch, anchors, vblk)
        last = last_hidden(batch, self.last_tap)
        ctx = self.context(batch["taps"])
        sums, counts = torch.zeros(K, dtype=torch.float64), torch.zeros(K, dtype=torch.float64)
        for c in self.anchor_chunks(anchors):
            v, tp = valid[:, c], tpos[:, c]
            if not bool(v.any()):
                continue
            h = self.block_hidden(ids, ctx, anchors[:, c])[v]  # [R, H]
            b = torch.arange(Bs, device=ids.device)[:, None, None].expand_as(v)[v]
            row = tp[v] - 1

            def alpha(hq, ht, pv):
                p = self.target.logits(ht) / temperature
                q = self.slot_logits(hq, pv, temperature)
                return (1.0 - tv_full(p.to(q.dtype), q),)

            (a,) = map_row_chunks(alpha, [h, last[b, row], ids[b, row]], self.logits_chunk_rows())
            slot = torch.arange(K, device=ids.device).expand_as(v)[v]
            sums.index_add_(0, slot.cpu(), a.double().cpu())
            counts.index_add_(0, slot.cpu(), torch.ones_like(a, dtype=torch.float64).cpu())
        return sums, counts

    # -- export ------------------------------------------------------------------------------
    @classmethod
    def export_layout(cls, weights: dict[str, torch.Tensor], config: dict[str, Any], layout: str | None, *,
                      verifier: str | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Native (``Qwen3DSparkModel``) or ``qwen3_omni``: the same tensors and fields under
        ``Qwen3OmniDSparkModel``, which vLLM requires of a DSpark draft for a Qwen3-Omni target (its validator
        refuses the generic name there: "generic Qwen3DSparkModel checkpoints must be converted first")."""
        if layout is None:
            return weights, config
        if layout == "qwen3_omni":
            doc = dict(config, architectures=["Qwen3OmniDSparkModel"])
            doc["tapdraft"] = dict(config.get("tapdraft", {}), layout=layout)
            return weights, doc
        raise ValueError(f"unknown layout {layout!r} for a {cls.family} draft: its layouts are the native one (no "
                         f"--layout, Qwen3DSparkModel) and {', '.join(LAYOUTS)}")

    def export_config(self) -> dict[str, Any]:
        """DFlash's config under vLLM's ``Qwen3DSparkModel`` with the fields its DSpark path reads (block_size =
        num_speculative_tokens, markov_rank, markov_head_type, the confidence head's switches, anchor-as-first
        alignment) and those ``_validate_qwen3_omni_dspark`` checks (target_hidden_size, use_aux_hidden_state,
        dspark_bonus_anchor); no ``auto_map``: no shipped modeling file walks the Markov head."""
        doc = super().export_config()
        cfg = self.config
        B = cfg.block_size
        doc["architectures"] = ["Qwen3DSparkModel"]
        doc.pop("auto_map", None)
        doc.update({
            "dspark_block_size": B,
            "target_hidden_size": self.hidden_size,
            "use_aux_hidden_state": True,
            "markov_rank": cfg.markov_rank,
            "markov_head_type": cfg.markov_head_type,
            "sample_from_anchor": True,
            "dspark_bonus_anchor": False,
            "enable_confidence_head": cfg.confidence_head,
            "confidence_head_with_markov": cfg.confidence_head,
        })
        doc["dflash_config"]["use_aux_hidden_state"] = True
        doc["tapdraft"]["family"] = self.family
        doc["tapdraft"]["decode"] = ("slot k of a block at anchor a predicts a + k + 1 (K = block_size drafts); drawn "
                                     "left to right from lm_head(h_k) + markov_w2(markov_w1[previous token]), the "
                                     "anchor before slot 0")
        doc["tapdraft"]["serve_with"] = {"vllm": {"method": "dspark", "num_speculative_tokens": B}}
        doc["tapdraft"]["block_size"] = {"vllm": B}  # vLLM's DSpark block is num_speculative_tokens
        return doc


CONFIG = DSparkConfig
DRAFTER = DSparkDrafter
