"""MTP heads (DeepSeek-V3 style multi-token prediction), trained head-only from a dataset.

Depth k = 1..D at position t predicts the token at t + k + 1 from

    h^0_t   = FinalNorm_target(last decoder layer output at t)      (stored pre-norm, normed here)
    e       = RMSNorm_k(Emb(x_{t+k}))                                (frozen target embedding)
    h       = RMSNorm_k(h^{k-1}_t)
    h^k     = Block_k(W_k [e ; h])                                   (embedding FIRST, 2H -> H)
    logits  = head(FinalNorm_k(h^k))        (the frozen target head: lm_head, bias, scaling, soft cap)

with one causal Qwen3 decoder block per depth (``train.drafters.common.layers.DecoderLayer``), or one physical
head serving every depth (``use_repeated_layer``). The chain (``chain``): ``sequence`` runs depth k causally over
the whole sequence of depth k-1 states (DeepSeek-V3); ``rerun`` runs depth k >= 2 of the chain anchored at row t at
position t + k - 1 over the depth-1 keys of rows <= t and its own chain's keys (the mask of EAGLE-3's training-time
test, ``common.mask``), which is what vLLM's proposer computes when it drafts past the first token. The recursion (``recursion``) feeds depth k + 1
either h^k (the block's output, before FinalNorm_k) as DeepSeek-V3 does (``pre_norm``, default), or
FinalNorm_k(h^k) as the Qwen3-Next / NeMo Automodel MTP modules do (``post_norm``); a head with more
than one depth exports to those layouts only when it was trained with their recursion
(``train.drafters.mtp.export``).

Alignment (``train.drafters.common.chain``): depth k's target at t is the token at t + k + 1 when it is
supervised and inside t's sequence. Audio positions' input embeddings come from the dataset's
``audio_embeds`` when it stores them; otherwise a row whose input x_{t+k} is an audio frame is
masked and counted (the metric ``rows_audio_masked`` is their share of the supervised rows);
its input is then the sentinel id's embedding, which later rows still attend to (the only
approximation, and only without audio_embeds).

Losses (``train.drafters.mtp.loss``, a mixin of the drafter): ``ce`` on the dataset's labels or ``lk`` against
the frozen target, one term per depth.

Training mode: ``head_only`` (the heads train; the embedding, final norm and lm_head from the
bundle are frozen buffers). The dataset holds no backbone, so a mode that trains it is refused.

Names (``train.drafters.mtp.heads``): DeepSeek-V3's MTP parameter names at ``model.layers.{L + i}``.

Serving: stock vLLM's ``method: "mtp"`` builds the MTP module from the TARGET's own config (a Qwen3 target has
none: ``Qwen3NextMTP`` over a ``Qwen3Config`` fails on ``num_experts``), and NeMo's speechlm2 has no MTP. A
one-depth head exported with ``--layout tapdraft-vllm`` is served by vLLM through the project's plugin
(``engines/vllm_plugin``: ``TapdraftMTPForCausalLM``), with ``tapdraft speculate``'s acceptance round by round
(``tests/engines/test_vllm_mtp_head.py``); the other layouts are for converters and offline study. A target that ships its own MTP module (Qwen3.5) trains that module instead,
which vLLM serves as the target's MTP: family ``mtp_native`` (``train.drafters.mtp_native.model``).

Shapes: Bs batch, T positions, H hidden, V vocab, D depths, n valid rows.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn

from tapdraft.shards.bundle import TargetBundle
from tapdraft.shards.head import embed, final_norm, head_spec, project
from tapdraft.shards.schema import Layout
from tapdraft.train.acceptance import AcceptanceCounts
from tapdraft.train.drafters.base import Drafter, FrozenHead, layer_shape, one_sequence_batch, pick_tokens
from tapdraft.train.drafters.common.chain import (IGNORE, chain_acceptance, depth_labels, doc_end_from_lengths,
                                         next_token_labels, shift_left)
from tapdraft.train.drafters.common.chunks import map_row_chunks
from tapdraft.train.drafters.common.divergences import tv_full
from tapdraft.train.drafters.common.draft_vocab import subset_head_rows
from tapdraft.train.drafters.common.export_files import load_export
from tapdraft.train.drafters.common.layers import RotaryEmbedding
from tapdraft.train.drafters.common.mask import eagle3_dense_mask
from tapdraft.train.drafters.common.teacher import exact_last_tap, last_hidden, last_hidden_source, require_last_hidden
from tapdraft.train.drafters.mtp import DEFAULT_LAYOUT
from tapdraft.train.drafters.mtp.config import MTPConfig
from tapdraft.train.drafters.mtp.heads import MTPHead, _Model
from tapdraft.train.drafters.mtp.export import convert
from tapdraft.train.drafters.mtp.loss import MTPLoss


class MTPDrafter(MTPLoss, Drafter):
    family = "mtp"
    fewer_drafts = True  # depth k reads depths < k only: N drafts are the chain's first N
    default_layout = DEFAULT_LAYOUT

    def __init__(self, config: MTPConfig, bundle: TargetBundle, layout: Layout) -> None:
        super().__init__(config, bundle, layout)
        c = bundle.config
        H, heads, kv, hd, inter = layer_shape(bundle, config)
        eps = head_spec(bundle).eps
        self.arch = {"hidden_size": H, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd,
                     "intermediate_size": inter, "rms_norm_eps": eps, "rope_theta": float(c["rope_theta"])}
        n_phys = 1 if config.use_repeated_layer else config.num_depths
        self.first_layer = int(layout.num_layers)
        self.model = _Model(
            {str(self.first_layer + i): MTPHead(H, heads, kv, hd, inter, eps) for i in range(n_phys)}
        )
        self.rope = RotaryEmbedding(hd, float(c["rope_theta"]))
        self._frozen_target(config, bundle, layout)
        with torch.no_grad():
            for m in self.model.modules():
                if isinstance(m, nn.Linear):
                    nn.init.normal_(m.weight, std=config.init_std)
            for h in self.model.layers.values():  # start each output norm where the target's is
                h.shared_head.norm.weight.copy_(bundle.norm_weight.float())

    def _frozen_target(self, config: MTPConfig, bundle: TargetBundle, layout: Layout) -> None:
        """The bundle's frozen embedding, final norm and lm_head as buffers, and what the dataset feeds h^0."""
        self.head_spec = head_spec(bundle)
        self.eps = self.head_spec.eps
        self.logits_scaling = self.head_spec.logits_scaling
        self.target = FrozenHead(bundle, dtype=None)  # in the bundle's dtype
        self.vocab_size = int(bundle.lm_head.shape[0])
        self.register_draft_vocab()
        self.fingerprint = bundle.fingerprint
        self.max_positions = int(bundle.config.get("max_position_embeddings") or 32768)
        self.last_tap = exact_last_tap(layout)
        self.uses_audio_embeds = bool(getattr(layout, "has_audio_embeds", False))
        self.teacher_kind = self._pick_teacher(config, layout)

    @staticmethod
    def _pick_teacher(config: MTPConfig, layout: Layout) -> str | None:
        if config.loss_type != "lk":
            return None
        exact_ok = last_hidden_source(layout) is not None
        if config.teacher == "exact" or (config.teacher == "auto" and exact_ok):
            return "exact"
        return "topk"

    @classmethod
    def check_dataset(cls, config: MTPConfig, bundle: TargetBundle, layout: Layout) -> None:
        require_last_hidden(layout, "MTP heads (h^0 is the target's last hidden state)")
        if int(bundle.config["hidden_size"]) != layout.hidden_size:
            raise ValueError(f"bundle hidden_size {bundle.config['hidden_size']} != dataset's {layout.hidden_size}")
        if config.loss_type == "lk" and config.teacher == "topk" and layout.top_k <= 0:
            raise ValueError("teacher 'topk' needs a dataset with stored top-k rows (top_k > 0); use teacher: exact")

    def head(self, k: int) -> MTPHead:
        """The physical head serving depth k (1-based)."""
        return self.model.layers[str(self.first_layer + (0 if self.config.use_repeated_layer else k - 1))]

    # -- pieces ---------------------------------------------------------------------------

    def last_hidden(self, batch: dict[str, Any]) -> torch.Tensor:
        """Pre-norm last decoder-layer output [Bs, T, H] (final_hidden or the last-layer tap)."""
        return last_hidden(batch, self.last_tap)

    def input_embeds(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Input embedding at every position [Bs, T, H] and a bool [Bs, T]: position's embedding unknown."""
        ids = batch["input_ids"]
        emb = embed(ids, self.target.embed_tokens, self.head_spec)
        is_audio = batch["is_audio"]
        if "audio_embeds" in batch:
            emb = torch.where(is_audio[..., None], batch["audio_embeds"].to(emb.dtype), emb)
            return emb, torch.zeros_like(is_audio)
        return emb, is_audio

    def teacher(self, h_RH: torch.Tensor) -> torch.Tensor:
        """The target's logits of pre-norm last-layer rows (the exact teacher)."""
        return self.target.logits(h_RH)

    def out_norm(self, k: int, h: torch.Tensor) -> torch.Tensor:
        """Depth k's output norm (before the shared lm_head)."""
        return self.head(k).shared_head.norm(h)

    def step(self, k: int, emb: torch.Tensor, h_prev: torch.Tensor, pos: torch.Tensor, **attend):
        """Depth k: input embeddings of x_{t+k} and h^{k-1}_t [Bs, T, H], positions [Bs, T] -> h^k [Bs, T, H]
        (``attend``: ``MTPHead.step``'s mask, cache and return_kv)."""
        return self.head(k).step(emb, h_prev, self.rope(pos), **attend)

    def logits(self, k: int, h: torch.Tensor) -> torch.Tensor:
        """Head logits from depth-k block outputs [n, H] -> [n, V] (float32 or wider), as the target scales them; with
        a draft vocabulary its rows only, -inf at every other target id (never proposed)."""
        lm_head, bias = self.frozen_draft_head()
        return self.to_target_logits(project(self.out_norm(k, h), lm_head, self.head_spec, bias))

    def run_depths(self, batch: dict[str, Any]) -> dict[str, Any]:
        """All depths' block outputs and labels; nothing vocabulary-sized is built here."""
        ids = batch["input_ids"]
        Bs, T = ids.shape
        doc_end = doc_end_from_lengths(batch["lengths"].to(ids.device), T)
        labels = next_token_labels(ids, batch["loss_mask"], doc_end)
        emb, emb_unknown = self.input_embeds(batch)
        dtype = next(self.parameters()).dtype
        pos = torch.arange(T, device=ids.device)[None].expand(Bs, T)
        t = self.target
        nb = None if t.norm_bias is None else t.norm_bias.to(dtype)
        h_in = final_norm(self.last_hidden(batch).to(dtype), t.norm_weight.to(dtype), self.head_spec, nb)  # h^0
        outs, step_labels, audio_masked = [], [], []
        rows, cache = torch.arange(T, device=ids.device), None
        for k in range(1, self.config.num_depths + 1):
            e = shift_left(emb, k).to(dtype)
            if self.config.chain == "sequence":
                h = self.step(k, e, h_in, pos)
            else:  # rerun: depth k >= 2 at row t sits at position t + k - 1 over [depth-1 keys | its own chain's]
                h, kv = self.step(k, e, h_in, pos + (k - 1), mask=eagle3_dense_mask(rows, T, k - 1), cache=cache,
                                  return_kv=True)
                cache = kv if cache is None else (torch.cat([cache[0], kv[0]], 2), torch.cat([cache[1], kv[1]], 2))
            h_in = h if self.config.recursion == "pre_norm" else self.out_norm(k, h)
            lab = depth_labels(labels, doc_end, k)
            unknown = shift_left(emb_unknown, k) & (lab != IGNORE)
            audio_masked.append(unknown.sum())
            lab = torch.where(unknown, torch.full_like(lab, IGNORE), lab)
            outs.append(h)
            step_labels.append(lab)
        return {"h": outs, "labels": step_labels, "audio_masked": audio_masked}

    # -- eval -----------------------------------------------------------------------------

    @torch.no_grad()
    def propose(self, ids_T: torch.Tensor, taps_PnH: torch.Tensor, *, temperature: float = 0.0,
                generator: torch.Generator | None = None,
                extras: Mapping[str, torch.Tensor] | None = None,
                drafts: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Depth k at row P-1 reads the drafted token of depth k-1 as its input: K = num_depths drafts.

        ``extras``: the prefix's ``is_audio`` / ``audio_embeds`` (used as training used them: the frame
        embeddings when the dataset stored them, else the sentinel id's embedding) and ``final_hidden``
        (h^0's source when the dataset stored it instead of tapping the last layer).
        """
        P = taps_PnH.shape[0]
        p = next(self.parameters())
        extras = dict(extras or {})
        if not self.uses_audio_embeds:
            extras.pop("audio_embeds", None)
        if self.last_tap is None and "final_hidden" not in extras:
            raise ValueError("this MTP head reads h^0 from final_hidden: the live decoder must give the target's "
                             "last-layer states as extras['final_hidden']")
        drafted, dists = [], []
        for k in range(1, self.draft_count(drafts) + 1):
            ids = torch.cat([ids_T, torch.tensor(drafted, dtype=ids_T.dtype)])  # positions 0..P+k-1
            batch = one_sequence_batch(ids, taps_PnH, dtype=p.dtype, device=p.device, extras=extras)
            h = self.run_depths(batch)["h"][k - 1][0, P - 1]
            tok, q = pick_tokens(self.logits(k, h[None]), temperature, generator)
            drafted.append(int(tok[0]))
            if q is not None:
                dists.append(q[0])
        return torch.tensor(drafted), (torch.stack(dists) if dists else None)

    @property
    def trained_drafts(self) -> int:
        return self.config.num_depths

    @torch.no_grad()
    def acceptance(self, batch: dict[str, Any], generator: torch.Generator | None = None,
                   drafts: int | None = None) -> AcceptanceCounts:
        """Teacher-forced chain over depths: a row counts at depth k only if depths 1..k all agree; with
        ``drafts``, over the first that many (as ``propose`` drafts them).

        Position k of the counts is depth k (the draft's k-th token after the target's own).
        ``blocks`` counts rows valid at depth 1 (each such row is one draft opportunity).
        """
        n = self.draft_count(drafts)
        run = self.run_depths(batch)
        hits = []
        for k in range(1, n + 1):
            lab = run["labels"][k - 1]
            rows = (lab != IGNORE).nonzero(as_tuple=True)
            hit = torch.zeros_like(lab, dtype=torch.bool)
            if rows[0].numel():
                (p,) = map_row_chunks(lambda a, k=k: (self.logits(k, a).argmax(-1),), [run["h"][k - 1][rows]],
                                      self.config.chunk_rows)
                hit[rows] = p == lab[rows]
            hits.append(hit)
        return chain_acceptance(run["labels"][:n], hits, batch["loss_mask"])

    @torch.no_grad()
    def sampled_acceptance(self, batch: dict[str, Any], temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Sampled-decoding acceptance per depth: (sum over valid rows of sum_v min(p_v, q_v), row count), [D] each.

        p is the exact target distribution at row t + k (the row predicting the same token), q the
        head's, both at ``temperature``. This is what speculative SAMPLING accepts per draft token (greedy
        acceptance is ``acceptance``); at T = 1 the LK loss optimises it directly. Rows are teacher-forced.
        """
        if temperature <= 0:
            raise ValueError(f"sampled acceptance needs a temperature > 0, got {temperature}")
        run = self.run_depths(batch)
        last = self.last_hidden(batch)
        sums, counts = [], []
        for k in range(1, self.config.num_depths + 1):
            lab = run["labels"][k - 1]
            rows = (lab != IGNORE).nonzero(as_tuple=True)
            t_h = last[(rows[0], rows[1] + k)]

            def fn(a, b, k=k):
                q = self.logits(k, a) / temperature
                p = self.teacher(b) / temperature
                return (1.0 - tv_full(p.to(q.dtype), q),)

            (alpha,) = map_row_chunks(fn, [run["h"][k - 1][rows], t_h], self.config.chunk_rows)
            sums.append(alpha.double().sum())
            counts.append(torch.tensor(float(alpha.numel()), dtype=torch.float64))
        return torch.stack(sums).cpu(), torch.stack(counts)

    # -- export ---------------------------------------------------------------------------

    @classmethod
    def export_layout(cls, weights: dict[str, torch.Tensor], config: dict[str, Any], layout: str | None, *,
                      verifier: str | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The head in a loader's names (``mtp.export``; None: ``deepseek``, the checkpoint's own)."""
        return convert(weights, config, layout or cls.default_layout)

    @classmethod
    def head_rows(cls, weights: dict[str, torch.Tensor], config: dict[str, Any],
                  lm_head: Callable[[], torch.Tensor]) -> dict[str, torch.Tensor]:
        """A draft vocabulary's N frozen lm_head rows as the export's own ``lm_head.weight``
        (``common.draft_vocab.subset_head_rows``): vLLM's MTP proposer shares the target's whole head with the draft,
        so the plugin projects on these rows instead and scatters them to target ids through ``d2t``."""
        return subset_head_rows(weights, config, lm_head)

    def export_config(self) -> dict[str, Any]:
        """DeepSeek-V3 MTP config; the weights' names already are DeepSeek's (``model.layers.{L + i}.*``).

        The frozen embedding and lm_head are the target's and are not exported (the fingerprint names
        them). ``eh_proj`` takes ``concat[enorm(embedding), hnorm(previous hidden)]``: the order is
        recorded as ``mtp_concat_order``.
        """
        return {
            "architectures": ["DeepseekV3MTP"],
            "model_type": "tapdraft_mtp",
            **self.arch,
            "vocab_size": int(self.target.lm_head.shape[0]),
            "num_hidden_layers": self.first_layer,
            "num_nextn_predict_layers": len(self.model.layers),  # the layers exported, never more
            "num_speculative_steps": self.config.num_depths,
            "use_repeated_layer": self.config.use_repeated_layer,
            "mtp_recursion": self.config.recursion,
            "mtp_chain": self.config.chain,
            "num_physical_mtp_layers": len(self.model.layers),
            "first_mtp_layer_index": self.first_layer,
            "mtp_concat_order": "embedding_first",
            "eh_proj_input": "concat([enorm(embed(x[t+k])), hnorm(h[k-1][t])], dim=-1)",
            "h0": "the target's final norm applied to its last decoder layer output",
            "shared_weights": {"embed_tokens": "target embed_tokens", "shared_head.head": "target lm_head"},
            "logits_scaling": self.logits_scaling,
            "target_head": self.head_spec.to_dict(),
            "max_position_embeddings": self.max_positions,
            "mtp_config": asdict(self.config),
            **({} if self.config.draft_vocab is None else {
                "draft_vocab_size": self.config.draft_vocab,
                "draft_vocab": "logits only at target ids arange(draft_vocab_size) + d2t, from the export's own "
                               "lm_head rows (the target's, frozen)"}),
            "tapdraft": {"family": self.family, "target_fingerprint": self.fingerprint,
                         "audio_embeds": self.uses_audio_embeds},
        }


def load_exported(export_dir: str | Path, bundle: TargetBundle, layout: Layout) -> MTPDrafter:
    """Rebuild an MTP drafter from an export directory and the target bundle (round-trip check)."""

    cfg, weights = load_export(export_dir)
    if cfg.get("model_type") != "tapdraft_mtp":
        raise ValueError(f"{export_dir} is not an exported MTP draft (model_type {cfg.get('model_type')!r})")
    drafter = MTPDrafter(MTPConfig(**cfg["mtp_config"]), bundle, layout)
    drafter.load_state_dict(weights)
    return drafter


CONFIG = MTPConfig
DRAFTER = MTPDrafter
