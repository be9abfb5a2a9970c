"""DFlash: a block-diffusion drafter that predicts B-1 tokens in one forward from the target's taps.

Model:
    context_BTH = RMSNorm(W_fc concat(taps at target_layer_ids))            computed once per batch
    block j: slot 0 = token at anchor_j, slots 1..B-1 = mask token, positions anchor_j + k,
             embedded with the target's FROZEN embedding
    n Qwen3-style pre-norm layers, NON-causal within a block; each layer projects the context with
             its own k/v and prepends it to the block's K/V (context rows are never queried)
    final RMSNorm -> the target's FROZEN head (lm_head, bias, scaling, soft cap: shards.head) -> slot k
             predicts input_ids[a + k]; block tokens are embedded as the target embeds them (embed_scale)
Visibility (``train.drafters.common.mask``): block j sees context positions < anchor_j and its own block; with
``sliding_window`` W, slot k sees only the context above anchor_j + k - W.

Settings are ``dflash.config``, anchors ``dflash.anchors``, and the training loss, with its
loss-row budget and the reduced draft vocabulary, ``train.drafters.dflash.loss`` (a mixin of the drafter);
this module is the model, its evaluation and its export.

Module names match the DFlash reference release (``fc``, ``hidden_norm``, ``layers.N.self_attn.q_proj``,
``norm``), so exported weights load in serving engines.

Shapes: Bs batch, T positions, N blocks per sequence, B block size, H hidden, V vocab, R loss rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn

from tapdraft.shards.bundle import TargetBundle
from tapdraft.shards.head import embed, head_spec, project
from tapdraft.shards.manifest import code_version
from tapdraft.shards.schema import Layout
from tapdraft.shards.taps import TAP_NUMBERING, to_vllm
from tapdraft.train.acceptance import AcceptanceCounts, acceptance_counts, with_rounds
from tapdraft.train.drafters.base import Drafter, FrozenHead, one_sequence_batch, pick_tokens
from tapdraft.train.drafters.common.chunks import map_row_chunks
from tapdraft.train.drafters.common.divergences import tv_full
from tapdraft.train.drafters.common.draft_vocab import subset_head_rows
from tapdraft.train.drafters.common.layers import DecoderLayer, RMSNorm, RotaryEmbedding
from tapdraft.train.drafters.common.losses import slot_weights
from tapdraft.train.drafters.common.mask import dense_mask, flex_block_mask
from tapdraft.train.drafters.common.teacher import exact_last_tap, last_hidden, require_last_hidden
from tapdraft.train.drafters.dflash.anchors import sample_anchors
from tapdraft.train.drafters.dflash.config import MASK_TOKEN, DFlashConfig, tokenizer_ids
from tapdraft.train.drafters.dflash.loss import DFlashLoss
from tapdraft.train.drafters.dflash.export import open_spec_block, to_speculators


class DFlashDrafter(DFlashLoss, Drafter):
    family = "dflash"
    fewer_drafts = True  # vLLM's DFlash proposer drafts N from a block of N + 1 (its query: the anchor, N masks)
    serving_dir = Path(__file__).parent / "serving"

    def __init__(self, config: DFlashConfig, bundle: TargetBundle, layout: Layout) -> None:
        super().__init__(config, bundle, layout)
        cfg = config.resolve(bundle, layout)
        self.config = cfg
        tc = bundle.config
        H = int(tc["hidden_size"])
        self.head_spec = head_spec(bundle)
        eps = self.head_spec.eps
        self.eps = eps
        self.hidden_size = H
        self.scaling = self.head_spec.logits_scaling
        self.target_num_layers = layout.num_layers
        self.fingerprint = bundle.fingerprint
        self.rope_theta = float(tc.get("rope_theta") or 10000.0)
        rope = tc.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"the target uses {rope.get('rope_type')!r} RoPE scaling; the drafters implement "
                             "plain RoPE (rope_theta) only, so their positions would not mean the target's")
        self.max_positions = int(tc.get("max_position_embeddings") or 32768)
        self.target_layer_types = tc.get("layer_types")  # the draft itself attends its whole context
        self.vocab_size = int(bundle.lm_head.shape[0])
        used = tokenizer_ids(bundle)
        # named <|MASK|> when the id is the one adding that token to the tokenizer gives
        self.mask_token = MASK_TOKEN if used is not None and cfg.mask_token_id == max(used) + 1 else None
        self.last_tap = exact_last_tap(layout)
        self.register_buffer(
            "tap_index", torch.tensor([layout.tap_ids.index(i) for i in cfg.target_layer_ids]), persistent=False
        )
        n = len(cfg.target_layer_ids)
        self.fc = nn.Linear(n * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, eps)
        self.layers = nn.ModuleList(
            DecoderLayer(H, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size, eps)
            for _ in range(cfg.num_layers)
        )
        self.norm = RMSNorm(H, eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, self.rope_theta)
        self.target = FrozenHead(bundle)
        self.register_buffer("weights_k", slot_weights(cfg.block_size, cfg.gamma), persistent=False)
        self.register_draft_vocab()
        self._init_weights(cfg.init_std)
        self._stack = self._run_layers
        if cfg.compile:
            self._stack = torch.compile(self._run_layers, dynamic=None)

    @classmethod
    def check_dataset(cls, config: DFlashConfig, bundle: TargetBundle, layout: Layout) -> None:
        cfg = config.resolve(bundle, layout)
        if cfg.kd == "exact":
            require_last_hidden(layout, "kd='exact'")
        if cfg.kd == "topk" and layout.top_k == 0:
            raise ValueError("kd='topk' needs a dataset with top-k teacher rows (captured with top_k > 0)")

    def _init_weights(self, std: float) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)

    # -- model -------------------------------------------------------------------------------
    def context(self, taps_BTnH: torch.Tensor) -> torch.Tensor:
        """Fused context [Bs, T, H] = RMSNorm(fc(concat of the chosen taps))."""
        x = taps_BTnH.index_select(2, self.tap_index.to(taps_BTnH.device))
        x = x.reshape(*x.shape[:2], -1).to(self.fc.weight.dtype)
        return self.hidden_norm(self.fc(x))

    def _run_layers(self, x, rope, mask, ctx, ctx_rope):
        for layer in self.layers:
            x = layer(x, rope, mask=mask, context=ctx, context_rope=ctx_rope)
        return self.norm(x)

    def block_hidden(
        self, input_ids_BT: torch.Tensor, ctx_BTH: torch.Tensor, anchors_BN: torch.Tensor, block: int | None = None
    ) -> torch.Tensor:
        """Draft hidden states [Bs, N, B, H] (after the final norm) for blocks at ``anchors``, of ``block`` slots
        (default: the trained block size)."""
        cfg = self.config
        Bs, T = input_ids_BT.shape
        N, B = anchors_BN.shape[1], block or cfg.block_size
        dev = input_ids_BT.device
        ids = torch.full((Bs, N, B), cfg.mask_token_id, dtype=torch.long, device=dev)
        ids[:, :, 0] = input_ids_BT.gather(1, anchors_BN.clamp(max=T - 1))
        x = embed(ids.view(Bs, N * B), self.target.embed_tokens, self.head_spec).to(ctx_BTH.dtype)
        pos = (anchors_BN[:, :, None] + torch.arange(B, device=dev)).view(Bs, N * B)
        rope = self.rotary(pos)
        ctx_rope = self.rotary(torch.arange(T, device=dev)[None].expand(Bs, T))
        if cfg.attention == "flex":
            mask = flex_block_mask(anchors_BN, T, B, cfg.flex_block_size, cfg.sliding_window)
        else:
            mask = dense_mask(anchors_BN, T, B, cfg.sliding_window)
        h = self._stack(x, rope, mask, ctx_BTH, ctx_rope)
        return h.view(Bs, N, B, -1)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Draft logits over the target vocabulary for hidden rows (through the target's frozen head); with a
        draft vocabulary, its rows only and -inf at every other target id (never proposed)."""
        lm_head, bias = self.frozen_draft_head()
        return self.to_target_logits(project(h, lm_head, self.head_spec, bias))

    # -- targets -----------------------------------------------------------------------------
    def _targets(self, batch: dict[str, Any], anchors: torch.Tensor, valid_blocks: torch.Tensor):
        """Slot targets for k = 1..B-1: labels, validity, positions; each [Bs, N, B-1]."""
        B = self.config.block_size
        ids, lm, L = batch["input_ids"], batch["loss_mask"], batch["lengths"].to(anchors.device)
        T = ids.shape[1]
        tpos = anchors[:, :, None] + torch.arange(1, B, device=anchors.device)
        inside = tpos < L[:, None, None]
        tc = tpos.clamp(max=T - 1)
        Bs = ids.shape[0]
        flat = tc.view(Bs, -1)
        labels = ids.gather(1, flat).view_as(tpos)
        sup = lm.gather(1, flat).view_as(tpos)
        valid = valid_blocks[:, :, None] & inside & sup
        return labels, valid, tpos

    @torch.no_grad()
    def propose(self, ids_T: torch.Tensor, taps_PnH: torch.Tensor, *, temperature: float = 0.0,
                generator: torch.Generator | None = None,
                extras: Mapping[str, torch.Tensor] | None = None,
                drafts: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One block anchored at P (slot 0 = ids[P], slots 1..K masked): K = B - 1 drafts, or ``drafts`` from a
        block of drafts + 1."""
        b, anchors = self._live_block(ids_T, taps_PnH)
        h = self.block_hidden(b["input_ids"], self.context(b["taps"]), anchors, self.draft_count(drafts) + 1)
        tokens, q = pick_tokens(self.logits(h[0, 0, 1:]), temperature, generator)
        return tokens.cpu(), q

    @property
    def trained_drafts(self) -> int:
        return self.config.block_size - 1

    def _live_block(self, ids_T: torch.Tensor, taps_PnH: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor]:
        """The one-sequence batch of a live prefix and its single anchor P [1, 1]."""
        p = next(self.parameters())
        b = one_sequence_batch(ids_T, taps_PnH, dtype=p.dtype, device=p.device)
        return b, torch.tensor([[taps_PnH.shape[0]]], device=p.device)

    def eval_anchors(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Every eligible anchor of every sequence, in order [Bs, N] (evaluation measures all of them: the
        training caps ``num_anchors`` / ``max_total_anchors`` bound memory, not what is measured)."""
        Bs, T = batch["input_ids"].shape
        cfg = self.config
        return sample_anchors(batch["loss_mask"], batch["lengths"], block_size=cfg.block_size, num_anchors=T,
                              max_total_anchors=Bs * T, full_blocks_only=cfg.full_blocks_only, take_all=True)

    def anchor_chunks(self, anchors_BN: torch.Tensor) -> list[slice]:
        """Column slices of the anchors holding at most ``max_total_anchors`` blocks each (bounded eval memory)."""
        Bs, N = anchors_BN.shape
        step = max(1, self.config.max_total_anchors // max(Bs, 1))
        return [slice(s, s + step) for s in range(0, N, step)]

    @torch.no_grad()
    def draft_slots(self, batch: dict[str, Any], ctx_BTH: torch.Tensor, anchors_BN: torch.Tensor,
                    block: int | None = None) -> torch.Tensor:
        """Greedy drafts long [Bs, N, B-1] of slots 1..B-1 for blocks of ``block`` slots (default: the trained size)
        at ``anchors`` (argmax of the draft logits)."""
        h = self.block_hidden(batch["input_ids"], ctx_BTH, anchors_BN, block)[:, :, 1:]
        rows = h.reshape(-1, h.shape[-1])
        pred = [self.logits(r).argmax(-1) for r in rows.split(self.logits_chunk_rows())]
        return (torch.cat(pred) if pred else rows.new_zeros(0, dtype=torch.long)).view(h.shape[:3])

    @torch.no_grad()
    def acceptance(self, batch: dict[str, Any], generator: torch.Generator | None = None,
                   drafts: int | None = None) -> AcceptanceCounts:
        """Teacher-forced greedy acceptance at every eligible anchor, in order, ``max_total_anchors`` blocks
        at a time; with ``drafts`` from blocks of drafts + 1, as ``propose`` drafts them."""
        K = self.draft_count(drafts)
        fewer = {} if K == self.trained_drafts else {"block": K + 1}  # the subclasses draft their trained block only
        anchors, vblk = self.eval_anchors(batch)
        ctx = self.context(batch["taps"])
        pred = torch.cat([self.draft_slots(batch, ctx, anchors[:, c], **fewer) for c in self.anchor_chunks(anchors)], 1)
        labels, valid, _ = self._targets(batch, anchors, vblk)
        if fewer:
            labels, valid = labels[..., :K], valid[..., :K]
        corr = (pred == labels) & valid
        return with_rounds(acceptance_counts(corr, valid), batch, anchors, corr, valid)

    def _logits_rule(self) -> dict[str, Any]:
        """How an engine turns the exported draft's output into tapdraft's logits. Engines apply the target's
        lm_head only, so a pure division (logits_scaling) is folded into ``norm.weight`` at export; a head
        with an lm_head bias cannot take the fold (the bias would be divided too) and says so instead."""
        if self.head_spec.lm_head_bias:
            return {"logits": "target lm_head(draft output) with its bias, then the target head's logits_scaling "
                              "and softcap (target_head); nothing is folded into norm.weight"}
        cap = " then the target head's final_logit_softcap" if self.head_spec.final_logit_softcap else ""
        return {"logits_scaling_folded_into": "norm.weight",
                "logits": f"target lm_head(draft output){cap}: the target's logits_scaling is folded into "
                          "norm.weight (exported norm.weight = trained norm.weight / logits_scaling)"}

    def logits_chunk_rows(self) -> int:
        """Rows whose [rows, V] logits evaluation builds at a time (``chunk_rows``; <= 0: 2048)."""
        return self.config.chunk_rows if self.config.chunk_rows > 0 else 2048

    def slot_logits(self, h_RH: torch.Tensor, prev_R: torch.Tensor, temperature: float) -> torch.Tensor:
        """Tempered draft logits [R, V] of slots whose hidden rows are ``h_RH``: softmax of them is what
        sampled drafting draws from (``prev_R``, each slot's predecessor token, is unused by DFlash)."""
        return self.logits(h_RH) / temperature

    @torch.no_grad()
    def sampled_acceptance(self, batch: dict[str, Any], temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """sum_v min(p_v, q_v) per slot k (p: the target's exact row a + k - 1; q: the slot's sampling distribution),
        summed over every eligible anchor's valid slots, teacher-forced; ([B-1], [B-1]) float64."""
        if temperature <= 0:
            raise ValueError(f"sampled acceptance needs a temperature > 0, got {temperature}")
        ids = batch["input_ids"]
        Bs, T = ids.shape
        K = self.config.block_size - 1
        anchors, vblk = self.eval_anchors(batch)
        _, valid, tpos = self._targets(batch, anchors, vblk)
        last = last_hidden(batch, self.last_tap)
        ctx = self.context(batch["taps"])
        sums, counts = torch.zeros(K, dtype=torch.float64), torch.zeros(K, dtype=torch.float64)
        for c in self.anchor_chunks(anchors):
            v, tp = valid[:, c], tpos[:, c]
            if not bool(v.any()):
                continue
            h = self.block_hidden(ids, ctx, anchors[:, c])[:, :, 1:][v]  # [R, H]
            b = torch.arange(Bs, device=ids.device)[:, None, None].expand_as(v)[v]
            row = tp[v] - 1  # the target row predicting the slot's token
            prev = ids[b, row]  # the slot's teacher-forced predecessor

            def alpha(hq, ht, pv):
                p = self.target.logits(ht) / temperature
                q = self.slot_logits(hq, pv, temperature)
                return (1.0 - tv_full(p.to(q.dtype), q),)

            (a,) = map_row_chunks(alpha, [h, last[b, row], prev], self.logits_chunk_rows())
            slot = torch.arange(K, device=ids.device).expand_as(v)[v]
            sums.index_add_(0, slot.cpu(), a.double().cpu())
            counts.index_add_(0, slot.cpu(), torch.ones_like(a, dtype=torch.float64).cpu())
        return sums, counts

    # -- export ------------------------------------------------------------------------------
    @classmethod
    def export_layout(cls, weights: dict[str, torch.Tensor], config: dict[str, Any], layout: str | None, *,
                      verifier: str | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The native layout (None: the reference release's names, ``auto_map`` to the shipped modeling file) or
        ``speculators`` (``dflash.export``, naming the ``verifier``)."""
        if layout is None:
            if cls is DFlashDrafter:  # the 0.0.0 block describes DFlash drafts; the subclasses add heads it lacks
                return weights, {**config, **open_spec_block(config, code_version())}
            return weights, config
        if layout == "speculators":
            return to_speculators(weights, config, verifier=verifier)
        raise ValueError(f"unknown layout {layout!r} for a {cls.family} draft: its layouts are the native one (no "
                         "--layout) and speculators")

    @classmethod
    def head_rows(cls, weights: dict[str, torch.Tensor], config: dict[str, Any],
                  lm_head: Callable[[], torch.Tensor]) -> dict[str, torch.Tensor]:
        """A draft vocabulary's N frozen lm_head rows as the export's own ``lm_head.weight``
        (``common.draft_vocab.subset_head_rows``): vLLM 0.32's ``qwen3_dflash.py`` shares the target's whole head with
        a draft that ships none and keeps its first N logits (``LogitsProcessor(draft_vocab_size)``)."""
        return subset_head_rows(weights, config, lm_head)

    def export_config(self) -> dict[str, Any]:
        cfg = self.config
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "auto_map": {"AutoModel": "modeling_dflash.DFlashDraftModel"},
            "hidden_size": self.hidden_size,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim,
            "intermediate_size": cfg.intermediate_size,
            "hidden_act": "silu",
            "rms_norm_eps": self.eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rope_scaling": None,
            "max_position_embeddings": self.max_positions,
            "layer_types": ["full_attention"] * cfg.num_layers,
            "use_sliding_window": False,
            "sliding_window": None,
            "vocab_size": self.vocab_size,
            "attention_bias": False,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            "block_size": cfg.block_size,
            "num_target_layers": self.target_num_layers,
            "target_layer_ids": list(cfg.target_layer_ids),
            "target_layer_ids_vllm": to_vllm(cfg.target_layer_ids),
            "mask_token_id": cfg.mask_token_id,
            "logits_scaling": self.scaling,
            "target_head": self.head_spec.to_dict(),
            **self._logits_rule(),
            "dflash_config": {
                "mask_token_id": cfg.mask_token_id,
                **({"mask_token": self.mask_token} if self.mask_token else {}),
                "target_layer_ids": list(cfg.target_layer_ids),
                **self._window_config(),
            },
            **self._draft_vocab_config(),
            "tapdraft": {
                "family": self.family,
                "target_fingerprint": self.fingerprint,
                "tap_numbering": TAP_NUMBERING,
                **self._last_layer_note(),
                "uses_target_embedding_and_lm_head": True,
                "target_layer_types": self.target_layer_types,
                **self._serve_with(),
            },
        }

    def _serve_with(self) -> dict[str, Any]:
        """How engines serve the export, and its block size as each counts it: vLLM's DFlash / DFlash2 block is
        1 + num_speculative_tokens; SGLang's DFLASH block is its draft-token count (``--speculative-num-draft-tokens``,
        read from ``block_size``), named for plain DFlash only (the subclasses' heads are not SGLang's DFLASH)."""
        B = self.config.block_size
        serve: dict[str, Any] = {"vllm": {"method": "dflash", "num_speculative_tokens": B - 1}}
        if type(self) is DFlashDrafter:
            serve["sglang"] = {"speculative_algorithm": "DFLASH", "speculative_num_draft_tokens": B}
        return {"serve_with": serve, "block_size": {engine: B for engine in serve}}

    def _last_layer_note(self) -> dict[str, Any]:
        """What a loader that reads HF ``hidden_states`` would feed a draft that taps the target's last layer."""
        last = self.target_num_layers - 1
        if last not in self.config.target_layer_ids:
            return {}
        return {"last_layer_tap": f"tap {last} is the last decoder layer's output BEFORE the final norm (vLLM's "
                f"layer id {last + 1} is the same tensor); HF hidden_states[-1] is after the final norm, so a trainer "
                "or loader that reads hidden_states (NeMo Automodel's DFlash) would feed this draft post-norm states"}

    def _window_config(self) -> dict[str, Any]:
        """A sliding window as vLLM 0.32's ``qwen3_dflash.py`` reads it (``_resolve_layer_attention``): ``use_swa`` makes
        every layer sliding while ``layer_types`` stays full attention, so the blocks stay non-causal (a
        ``sliding_attention`` layer type would make them causal there); ``swa_window_size`` is W. {} when off."""
        if self.config.sliding_window is None:
            return {}
        return {"use_swa": True, "swa_window_size": int(self.config.sliding_window)}

    def _draft_vocab_config(self) -> dict[str, Any]:
        """EAGLE-3's config key for a reduced draft vocabulary (``d2t`` / ``t2d`` ride in the weights); {} when off."""
        if self.config.draft_vocab is None:
            return {}
        return {"draft_vocab_size": self.config.draft_vocab,
                "draft_vocab": "logits only at target ids arange(draft_vocab_size) + d2t (EAGLE-3's "
                               "draft_id_to_target_id), from those lm_head rows; -inf at every other target id; "
                               "t2d[v]: target id v is drafted (modeling_dflash.DFlashDraftModel.compute_logits)"}


CONFIG = DFlashConfig
DRAFTER = DFlashDrafter
