"""DFlash2: DFlash plus in-block two-tap dynamic convolutions and a path selector.

Two additions to the DFlash drafter (``train.drafters.dflash.model``), everything else (context fusion, KV
injection, anchors, visibility mask, slot weights, KD, checkpointing, export layout) is inherited:

(a) Around every attention and MLP sublayer, a two-tap DYNAMIC depthwise convolution along the
    block's slots, before the sublayer (on its normed input x) and after it (on its output, before
    the residual add), both with taps predicted from x:

        y_t = (b0 + d0(x_t)) * v_t + (b1 + d1(x_t)) * v_{t-1}     v_{t-1} = 0 at slot 0 of every block

    b: a per-channel static base kernel; d: a correction shared by each group of
    ``conv_group_size`` = 16 channels, from ONE bias-free projection of x per sublayer
    (H -> 2 sides x 2 taps x H / group_size). Initialised to b = (1, 0), d = 0 exactly: a fresh
    DFlash2 computes the same function as DFlash with the same weights. Slot t-1 is always in the
    same block (the flattened row of blocks is never convolved across a block boundary), so the
    draft still sees nothing outside its block and context.

(b) A path selector (``train.drafters.dflash2.selector``) over each slot's top-16 candidates of the full draft
    logits, scored by the teacher-forced predecessor token. Its CE, weighted by the slot's position
    decay like the backbone CE, is its own loss term:
    total = backbone (CE [+ KD]) + selector_loss_weight x selector, each normalised by its own
    (weighted) count over the data-parallel group (``train.drafters.base.combine_terms``).

Structure, parameter names and initialisation follow the public reference DFlash2 draft
(NVIDIA-NeMo/Automodel, nemo_automodel/components/speculative/dflash/draft_qwen3_dflash2.py:
``layers.N.{attention_conv, mlp_conv}.{base_kernel, kernel_projection.weight}``,
``candidate_selector.{predecessor_codebook, successor_codebook, hidden_projection.weight}``) and
its loss (dflash2_core.py: the selector term shares the backbone's position weights), so an export
loads in its ``Qwen3DFlash2DraftModel`` with no missing or unexpected keys.

The selector reads each row's full draft logits, so DFlash2 computes them densely, shared by the
backbone CE, the KD term and the selector, but one checkpointed chunk of rows at a time
(``train.drafters.common.chunks.map_row_chunks``): at V = 152k the recipe's 4096 anchors x 15 slots would otherwise
hold ~37 GB of float32 logits; a chunk is sized from the vocabulary (``logits_budget_mib``).
Drafting walks the selector from slot 0: greedily at eval and in greedy decoding, by sampling its
candidate distribution in sampled decoding (``train.drafters.dflash2.selector.walk``).

Shapes: Bs batch, T positions, N blocks per sequence, B block size, H hidden, V vocab, R loss rows,
G channel groups.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from tapdraft.shards.bundle import TargetBundle
from tapdraft.shards.schema import Layout
from tapdraft.train.acceptance import acceptance_counts, acceptance_metrics
from tapdraft.train.drafters.base import LossOutput
from tapdraft.train.drafters.common.chunks import map_row_chunks
from tapdraft.train.drafters.common.divergences import kl_tv_full, kl_tv_topk
from tapdraft.train.drafters.common.layers import DecoderLayer
from tapdraft.train.drafters.common.losses import weighted_terms
from tapdraft.train.drafters.dflash.model import DFlashDrafter
from tapdraft.train.drafters.dflash2.selector import PathSelector, greedy_walk, selector_loss, walk
from tapdraft.train.drafters.dflash2.config import DFlash2Config


class SublayerConv(nn.Module):
    """The two dynamic depthwise convolutions around one sublayer, the one before it and the one after it.

    Tap o of channel c at slot t has the coefficient base_kernel[side, o, c] + dynamic[side, o, g(c)]: a
    per-channel static base plus a correction shared by the channel's group, predicted from the SUBLAYER'S
    INPUT (its normed input x) by one bias-free projection H -> 2 sides x kernel x groups, so the post-sublayer
    convolution's taps also come from x. Identity at initialisation: base = (1, 0, ...), projection 0.
    Names, shapes, the (side, tap, group) order of the projection's outputs and the initialisation are the
    public reference's ``GroupedDynamicCausalConv`` (NVIDIA-NeMo/Automodel,
    nemo_automodel/components/speculative/dflash/draft_qwen3_dflash2.py), so its weights load there as they are.
    """

    def __init__(self, hidden_size: int, block_size: int, group_size: int, kernel_size: int = 2) -> None:
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"conv_group_size {group_size} must divide the hidden size {hidden_size}")
        self.block_size, self.group_size, self.kernel_size = block_size, group_size, kernel_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))  # [side (0 before, 1 after), tap, H]
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        self.reset_identity()

    def reset_identity(self) -> None:
        nn.init.zeros_(self.kernel_projection.weight)
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0

    def _convolve(self, x: torch.Tensor, dyn: torch.Tensor, side: int) -> torch.Tensor:
        """y_t = sum_o (base[side, o] + dyn_t[o]) * x_{t-o}, x_{t-o} = 0 before the slot's block start.
        x [Bs, L, H] (whole blocks end to end), dyn [Bs, L, kernel, G] -> [Bs, L, H]."""
        Bs, L, H = x.shape
        B, G = self.block_size, self.groups
        xb = x.view(Bs, L // B, B, G, self.group_size)
        d = dyn.reshape(Bs, L // B, B, self.kernel_size, G, 1)
        y = torch.zeros_like(xb)
        for o in range(self.kernel_size):
            shifted = xb if o == 0 else F.pad(xb[:, :, : B - o], (0, 0, 0, 0, o, 0))  # shift inside each block
            coef = self.base_kernel[side, o].view(G, self.group_size).to(x.dtype) + d[:, :, :, o]
            y = y + coef * shifted
        return y.view(Bs, L, H)

    def before(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The convolved sublayer input, and the after-sublayer taps [Bs, L, kernel, G] predicted from x."""
        dyn = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)
        return self._convolve(x, dyn[..., 0, :, :], 0), dyn[..., 1, :, :]

    def after(self, y: torch.Tensor, dyn: torch.Tensor) -> torch.Tensor:
        """The convolved sublayer output (before the residual add), with the taps :meth:`before` returned."""
        return self._convolve(y, dyn, 1)


class ConvDecoderLayer(DecoderLayer):
    """The DFlash draft layer with a SublayerConv around its attention and one around its MLP."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate_size: int,
                 eps: float, *, block_size: int, group_size: int, kernel_size: int) -> None:
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size, eps)
        self.attention_conv = SublayerConv(hidden_size, block_size, group_size, kernel_size)
        self.mlp_conv = SublayerConv(hidden_size, block_size, group_size, kernel_size)

    def forward(self, x, rope, *, mask=None, is_causal=False, context=None, context_rope=None):
        prefix = None
        if context is not None:
            if context_rope is None:
                raise ValueError("context needs context_rope (the RoPE tables of the context positions)")
            prefix = self.self_attn.project_kv(context, context_rope)
        a_in, a_dyn = self.attention_conv.before(self.input_layernorm(x))
        a = self.self_attn(a_in, rope, mask=mask, is_causal=is_causal, kv_prefix=prefix)
        x = x + self.attention_conv.after(a, a_dyn)
        m_in, m_dyn = self.mlp_conv.before(self.post_attention_layernorm(x))
        return x + self.mlp_conv.after(self.mlp(m_in), m_dyn)


class DFlash2Drafter(DFlashDrafter):
    family = "dflash2"
    fewer_drafts = False  # its walk is over the trained block; no engine drafts a shorter one of it

    def __init__(self, config: DFlash2Config, bundle: TargetBundle, layout: Layout) -> None:
        super().__init__(config, bundle, layout)
        cfg = self.config
        H = self.hidden_size
        # same layers (and weights, same init draws) as DFlash, re-housed with the convolutions
        convs = []
        for layer in self.layers:
            new = ConvDecoderLayer(H, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size, self.eps,
                                   block_size=cfg.block_size, group_size=cfg.conv_group_size,
                                   kernel_size=cfg.conv_kernel_size)
            missing, unexpected = new.load_state_dict(layer.state_dict(), strict=False)
            assert not unexpected and all("conv" in m for m in missing), (missing, unexpected)
            convs.append(new)
        self.layers = nn.ModuleList(convs)
        self.candidate_selector = PathSelector(self.vocab_size, H, rank=cfg.selector_rank,
                                               num_candidates=cfg.selector_candidates)

    @classmethod
    def check_dataset(cls, config: DFlash2Config, bundle: TargetBundle, layout: Layout) -> None:
        super().check_dataset(config, bundle, layout)
        H = int(bundle.config["hidden_size"])
        if H % config.conv_group_size:
            raise ValueError(f"conv_group_size {config.conv_group_size} must divide the target hidden size {H}")
        V = int(bundle.lm_head.shape[0])
        if config.selector_candidates > V:
            raise ValueError(f"selector_candidates {config.selector_candidates} exceeds the vocabulary size {V}")

    # -- training ----------------------------------------------------------------------------
    def forward(self, batch: dict[str, Any], generator: torch.Generator | None = None) -> LossOutput:
        cfg = self.config
        anchors, vblk = self._anchors(batch, generator)
        h = self.block_hidden(batch["input_ids"], self.context(batch["taps"]), anchors)  # [Bs, N, B, H]
        labels, valid, tpos = self._targets(batch, anchors, vblk)
        h_rows = h[:, :, 1:][valid]  # [R, H]
        y = labels[valid]
        w = self.weights_k.to(h.device).expand_as(valid)[valid]
        teacher, kd_w = self.kd_teacher(batch, valid, tpos, w)
        T = batch["input_ids"].shape[1]
        prev_pos = (tpos - 1).clamp(max=T - 1).view(tpos.shape[0], -1)
        prev = batch["input_ids"].gather(1, prev_pos).view_as(tpos)[valid]  # teacher-forced predecessor
        extra = [] if teacher is None else (
            [teacher.hidden_RH] if cfg.kd == "exact" else [teacher.ids_Rk, teacher.logprobs_Rk])
        ce, kd, sel_sum, sel_n, path, gold_in, sel_ok, bb_ok = map_row_chunks(
            self._row_losses, [h_rows, y, prev, w, *extra], self.logits_chunk_rows())
        terms = weighted_terms(ce, w, kd if cfg.kd != "none" else None, kd_w, ce_weight=cfg.ce_weight,
                               kd_weight=cfg.kd_weight)
        terms["ce"] = (terms["ce"][0] + 0.0 * h.sum(), terms["ce"][1], terms["ce"][2])
        # 0 * sum(params) keeps the codebooks in the graph on a rank whose rows all missed
        anchor = 0.0 * sum(p.sum() for p in self.candidate_selector.parameters())
        n_rows = torch.tensor(int(y.numel()), device=y.device)
        terms["selector"] = (sel_sum.sum() + anchor, sel_n.sum(), cfg.selector_loss_weight)
        # acc@k / alpha@k follow the selector's path (teacher-forced predecessor), as drafting does
        corr = torch.zeros(valid.shape, dtype=torch.bool, device=h.device)
        corr[valid] = path == y
        metrics = acceptance_metrics(acceptance_counts(corr, valid))
        metrics["selector_candidate_recall"] = (gold_in.sum(), n_rows)
        metrics["selector_path_acc"] = (sel_ok.sum(), n_rows)
        metrics["backbone_argmax_acc"] = (bb_ok.sum(), n_rows)
        return LossOutput(terms=terms, metrics=metrics)

    def logits_chunk_rows(self) -> int:
        """Rows per checkpointed chunk of the dense loss: ``chunk_rows``, or (0) as many as keep a chunk's
        [rows, V] float32 logits and their ~3 same-sized temporaries within ``logits_budget_mib``."""
        if self.config.chunk_rows > 0:
            return self.config.chunk_rows
        return max(1, (self.config.logits_budget_mib << 20) // (4 * 4 * self.vocab_size))

    def _row_losses(self, h: torch.Tensor, y: torch.Tensor, prev: torch.Tensor, w: torch.Tensor,
                    *teacher: torch.Tensor):
        """Per-row CE and KD, the selector's decay-weighted CE sum and weight sum, and counts, for one chunk of
        rows (logits built here only). ``w``: each row's slot weight, the backbone CE's position decay."""
        cfg = self.config
        z = self.logits(h)
        ce = F.cross_entropy(z, y, reduction="none")
        if cfg.kd == "exact":
            p = self.target.logits(teacher[0])
            kd = kl_tv_full(p.to(z.dtype), z)[0]
        elif cfg.kd == "topk":
            kd = kl_tv_topk(teacher[0], teacher[1], z)[0]
        else:
            kd = torch.zeros_like(ce)
        sel = selector_loss(self.candidate_selector, z, h, prev, y, torch.ones_like(y, dtype=torch.bool),
                            gold_miss=cfg.selector_gold_miss, weight=w)
        return (ce, kd, sel.loss_sum.reshape(1), sel.count.reshape(1), sel.path, sel.gold_in_candidates.reshape(1),
                sel.selector_correct.reshape(1), sel.backbone_correct.reshape(1))

    # -- eval --------------------------------------------------------------------------------
    @torch.no_grad()
    def draft_blocks(self, batch: dict[str, Any], anchors: torch.Tensor,
                     ctx: torch.Tensor | None = None) -> torch.Tensor:
        """Drafted tokens long [Bs, N, B]: slot 0 = the anchor token, then the selector's greedy walk."""
        ids = batch["input_ids"]
        h = self.block_hidden(ids, self.context(batch["taps"]) if ctx is None else ctx, anchors)
        Bs, N, B, H = h.shape
        first = ids.gather(1, anchors.clamp(max=ids.shape[1] - 1)).reshape(-1)
        hb = h.reshape(Bs * N, B, H)
        step = max(1, self.logits_chunk_rows() // B)  # blocks per chunk: [step, B, V] logits at a time
        sel = self.candidate_selector
        (out,) = map_row_chunks(lambda hc, fc: (greedy_walk(sel, self.logits(hc), hc, fc),), [hb, first], step)
        return out.view(Bs, N, B)

    @torch.no_grad()
    def draft_slots(self, batch: dict[str, Any], ctx_BTH: torch.Tensor, anchors_BN: torch.Tensor) -> torch.Tensor:
        """Greedy drafts [Bs, N, B-1]: the selector's walk (what DFlash2 drafts), not the backbone's argmax."""
        return self.draft_blocks(batch, anchors_BN, ctx_BTH)[:, :, 1:]

    @torch.no_grad()
    def propose(self, ids_T: torch.Tensor, taps_PnH: torch.Tensor, *, temperature: float = 0.0,
                generator: torch.Generator | None = None,
                extras: Mapping[str, torch.Tensor] | None = None,
                drafts: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The selector's walk over the block from slot 0 = ids[P]: greedy (as eval drafts) or sampled from
        the selector's distribution over each slot's candidates (which is then the drafts' q)."""
        self.draft_count(drafts)
        b, anchors = self._live_block(ids_T, taps_PnH)
        h = self.block_hidden(b["input_ids"], self.context(b["taps"]), anchors)[0]  # [1, B, H]
        first = b["input_ids"][0, anchors[0]]
        tokens, q = walk(self.candidate_selector, self.logits(h), h, first, temperature=temperature,
                         generator=generator)
        return tokens[0, 1:].cpu(), (q[0, 1:] if q is not None else None)

    def slot_logits(self, h_RH: torch.Tensor, prev_R: torch.Tensor, temperature: float) -> torch.Tensor:
        """The selector's tempered scores S(prev, b) / T on each slot's candidates, -inf elsewhere: sampled
        drafting draws from their softmax (``train.drafters.dflash2.selector.walk``)."""
        z = self.logits(h_RH)
        cand, U = self.candidate_selector.candidates(z)
        S = self.candidate_selector.scores(prev_R, h_RH, cand, U)
        return torch.full_like(z, float("-inf")).scatter_(-1, cand, (S / temperature).to(z.dtype))

    # -- export ------------------------------------------------------------------------------
    def _logits_rule(self) -> dict[str, Any]:
        """DFlash's rule (the target's logits_scaling folded into ``norm.weight``), and, since the selector reads
        the same normed hidden state, that scaling multiplied back into its hidden projection: the engine's
        lm_head(h / s) and hidden_projection(h / s) are then tapdraft's logits and gate exactly."""
        rule = super()._logits_rule()
        if "logits_scaling_folded_into" in rule:
            rule["logits_scaling_compensated_in"] = ["candidate_selector.hidden_projection.weight"]
        return rule

    def export_config(self) -> dict[str, Any]:
        """DFlash's config in the reference DFlash2 layout under the architecture name engines key on,
        ``DFlash2DraftModel`` (vLLM registers it and switches to its V2 runner for it alone, exllamav3 gates on it;
        Automodel's ``Qwen3DFlash2DraftModel.from_pretrained`` loads by class, whatever the name), its
        ``dflash_config`` fields (conv_kernel_size, conv_group_size, selector_rank, selector_top_k; no
        projector_type, which it refuses) beside DFlash's; no ``auto_map``: the shipped modeling file is
        DFlash's."""
        doc = super().export_config()
        cfg = self.config
        doc["architectures"] = ["DFlash2DraftModel"]
        doc.pop("auto_map", None)
        doc["dflash_config"].update({"conv_kernel_size": cfg.conv_kernel_size, "conv_group_size": cfg.conv_group_size,
                                     "selector_rank": cfg.selector_rank, "selector_top_k": cfg.selector_candidates})
        doc["tapdraft"]["family"] = self.family
        doc["tapdraft"]["decode"] = ("the selector's walk from slot 0 over each slot's selector_top_k candidates: "
                                     "greedy, or sampled from its softmax (the drafts' q)")
        return doc


CONFIG = DFlash2Config
DRAFTER = DFlash2Drafter
