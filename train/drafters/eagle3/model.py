"""EAGLE-3: one decoder layer over [embedding ; fused target feature], unrolled over K steps, served by vLLM.

Model (EAGLE-3, Li et al. 2025; the layout vLLM's ``llama_eagle3.py`` / ``qwen3_eagle3.py`` load):

    f_t     = fc(concat of the target's taps at target_layer_ids, ascending)       (k*H -> H, no bias)
    step 0  at position t: e = Emb(x_{t+1}), h = f_t
    step j  at position t + j (the chain anchored at row t): e = Emb(x_{t+j+1}), h = r^{j-1}_t
    layer   x = [input_layernorm(e) ; hidden_norm(h)]                              (embedding FIRST, 2H)
            r = h + Attn(x)          (q/k/v take 2H, o_proj gives H; Qwen3 QK-norm, or plain Llama)
            r = r + MLP(post_attention_layernorm(r))                               r^j_t: the next step's h
    logits  = lm_head(norm(r^j_t))   (the draft's OWN head [N, H], initialised from the target's rows;
                                      N = the draft vocabulary, ``common.draft_vocab``) -> predicts x_{t+j+2}

Embeddings are the target's frozen table looked up raw (vLLM's drafter embeds without any scale; its
RMSNorm makes a scale irrelevant). The training-time test (``train.drafters.common.mask``, EAGLE-3 section): step j's
chain at row t attends the step-0 keys of positions <= t (fed by the target) and its own keys of steps
1..j, exactly what live drafting sees, so teacher-forced acceptance is the live one; tokens are the
dataset's (a greedy chain only goes on while its drafts equal them), hidden states the draft's own.

Taps (``shards.taps.eagle3_tap_ids``): by default the low / middle / high triple of the capture's default
spread, so the default dataset trains EAGLE-3 beside DFlash and MTP; a dataset without it trains on the
first, middle and last of its stored taps below the last layer (with a warning), or ``target_layer_ids``.

Alignment is MTP's (``train.drafters.common.chain``): step j at row t predicts the token at t + j + 2, valid when it
is supervised and inside the sequence; its teacher row is t + j + 1. Rows whose input token is an audio
frame the dataset cannot embed (no ``audio_embeds``) are masked, as MTP masks them.

Losses (``train.drafters.eagle3.loss``): forward KL against the teacher rows (default; EAGLE-3's own objective), CE
on the dataset's labels, or LK; step j weighs ``step_decay ** j`` (EAGLE-3: 0.8), each step its own term.

Shapes: Bs batch, T positions, Q chain rows, H hidden, V target vocab, N draft vocab, K steps.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from tapdraft.shards.bundle import TargetBundle
from tapdraft.shards.head import head_spec
from tapdraft.shards.schema import Layout
from tapdraft.shards.taps import TAP_NUMBERING, to_vllm
from tapdraft.train.acceptance import AcceptanceCounts
from tapdraft.train.drafters.base import Drafter, FrozenHead, one_sequence_batch, pick_tokens
from tapdraft.train.drafters.common.chain import (IGNORE, chain_acceptance, depth_labels, doc_end_from_lengths,
                                         next_token_labels, shift_left)
from tapdraft.train.drafters.common.chunks import map_row_chunks
from tapdraft.train.drafters.common.divergences import tv_full
from tapdraft.train.drafters.common.draft_vocab import DraftVocab
from tapdraft.train.drafters.common.layers import Attention, RMSNorm, RotaryEmbedding, SwiGLU
from tapdraft.train.drafters.common.mask import eagle3_block_mask, eagle3_dense_mask
from tapdraft.train.drafters.common.teacher import exact_last_tap, last_hidden, last_hidden_source, require_last_hidden
from tapdraft.train.drafters.eagle3.config import Eagle3Config
from tapdraft.train.drafters.eagle3.loss import Eagle3Loss

class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer (vLLM's ``midlayer`` / ``layers.0``): its names are the checkpoint's."""

    def __init__(self, H: int, heads: int, kv: int, head_dim: int, inter: int, eps: float, qk_norm: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(H, eps)
        self.hidden_norm = RMSNorm(H, eps)
        self.self_attn = Attention(H, heads, kv, head_dim, eps, qk_norm, input_size=2 * H)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = SwiGLU(H, inter)

    def forward(self, emb: torch.Tensor, h: torch.Tensor, rope, mask: torch.Tensor,
                cache: tuple[torch.Tensor, torch.Tensor] | None):
        """emb, h [Bs, Q, H] -> (r [Bs, Q, H] before the final norm, this step's (keys, values))."""
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(h)], dim=-1)
        a, kv = self.self_attn(x, rope, mask=mask, kv_prefix=cache, return_kv=True)
        r = h + a
        return r + self.mlp(self.post_attention_layernorm(r)), kv


class Eagle3Drafter(Eagle3Loss, Drafter):
    family = "eagle3"
    fewer_drafts = True  # step j reads steps < j only: N drafts are the chain's first N

    def __init__(self, config: Eagle3Config, bundle: TargetBundle, layout: Layout) -> None:
        super().__init__(config, bundle, layout)
        cfg = config.resolve(bundle, layout)
        self.config = cfg
        tc = bundle.config
        H = int(tc["hidden_size"])
        self.head_spec = head_spec(bundle)
        self.eps = self.head_spec.eps
        self.hidden_size = H
        self.vocab_size = int(bundle.lm_head.shape[0])
        self.fingerprint = bundle.fingerprint
        self.target_num_layers = int(layout.num_layers)
        self.rope_theta = float(tc.get("rope_theta") or 10000.0)
        if (tc.get("rope_parameters") or {}).get("rope_type", "default") != "default":
            raise ValueError("the target uses RoPE scaling; the drafters implement plain RoPE (rope_theta) only")
        self.max_positions = int(tc.get("max_position_embeddings") or 32768)
        self.register_buffer("tap_index", torch.tensor([layout.tap_ids.index(i) for i in cfg.target_layer_ids]),
                             persistent=False)
        self.fc = nn.Linear(len(cfg.target_layer_ids) * H, H, bias=False)
        self.midlayer = Eagle3Layer(H, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                                    self.eps, cfg.qk_norm)
        self.norm = RMSNorm(H, self.eps)
        self.rope = RotaryEmbedding(cfg.head_dim, self.rope_theta)
        self.target = FrozenHead(bundle)  # the embedding, and the exact teacher
        # the draft's own head: the target's rows (divided by its logits scaling) to start from
        N = cfg.draft_vocab or self.vocab_size
        self.lm_head = nn.Linear(H, N, bias=False)
        self.lm_head.weight.requires_grad_(cfg.train_lm_head)
        self.register_draft_vocab()
        with torch.no_grad():
            for m in (self.fc, *self.midlayer.modules()):
                if isinstance(m, nn.Linear):
                    nn.init.normal_(m.weight, std=cfg.init_std)
            self.norm.weight.copy_(bundle.norm_weight.float())  # start where the target's final norm is
            self.lm_head.weight.copy_(self.target.lm_head[:N] / self.head_spec.logits_scaling)
        self.last_tap = exact_last_tap(layout)
        self.uses_audio_embeds = bool(getattr(layout, "has_audio_embeds", False))
        exact_ok = last_hidden_source(layout) is not None
        self.teacher_kind = None if cfg.loss_type == "ce" else (
            "exact" if cfg.teacher == "exact" or (cfg.teacher == "auto" and exact_ok) else "topk")

    @classmethod
    def check_dataset(cls, config: Eagle3Config, bundle: TargetBundle, layout: Layout) -> None:
        cfg = config.resolve(bundle, layout)
        if cfg.loss_type == "ce":
            return
        if cfg.teacher == "exact":
            require_last_hidden(layout, "EAGLE-3's exact teacher")
        topk = cfg.teacher == "topk" or (cfg.teacher == "auto" and last_hidden_source(layout) is None)
        if topk and layout.top_k <= 0:
            raise ValueError(f"loss_type {cfg.loss_type!r} needs teacher rows: this dataset has neither the target's "
                             "last hidden state nor stored top-k rows; capture with final_hidden or top_k > 0, or "
                             "use loss_type: ce")
        if topk and cfg.draft_vocab is not None:
            raise ValueError("a draft vocabulary restricts the teacher to its tokens, and the stored top-k's tail has "
                             "no known share of them: use teacher: exact (a dataset with the last hidden state), or "
                             "loss_type: ce, or drop draft_vocab")

    # -- draft vocabulary ---------------------------------------------------------------------------
    def set_draft_vocab(self, vocab: DraftVocab) -> None:
        """Install the draft vocabulary and start the draft's head on the target's rows of it."""
        super().set_draft_vocab(vocab)
        with torch.no_grad():
            self.lm_head.weight.copy_(self.target.lm_head[vocab.ids.to(self.target.lm_head.device)]
                                      / self.head_spec.logits_scaling)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target ids of draft ids (identity without a draft vocabulary)."""
        ids = self.draft_ids()
        return draft_ids if ids is None else ids[draft_ids]

    # -- model ----------------------------------------------------------------------------------------
    def feature(self, taps_BTnH: torch.Tensor) -> torch.Tensor:
        """f [Bs, T, H] = fc(concat of the chosen taps, ascending)."""
        x = taps_BTnH.index_select(2, self.tap_index.to(taps_BTnH.device))
        return self.fc(x.reshape(*x.shape[:2], -1).to(self.fc.weight.dtype))

    def input_embeds(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Input embedding at every position [Bs, T, H] (raw table rows; audio frames from ``audio_embeds`` when
        the dataset stored them) and a bool [Bs, T]: the position's embedding is unknown (an audio frame)."""
        emb = F.embedding(batch["input_ids"].long(), self.target.embed_tokens)
        is_audio = batch["is_audio"]
        if "audio_embeds" in batch and self.uses_audio_embeds:
            emb = torch.where(is_audio[..., None], batch["audio_embeds"].to(emb.dtype), emb)
            return emb, torch.zeros_like(is_audio)
        return emb, is_audio

    def step(self, j: int, emb_BQH: torch.Tensor, h_BQH: torch.Tensor, rows_Q: torch.Tensor, T: int, cache):
        """Step j for the chains anchored at ``rows_Q`` (step 0: every row, Q = T): (r [Bs, Q, H], grown cache)."""
        Bs, Q = emb_BQH.shape[:2]
        rope = self.rope((rows_Q + j)[None].expand(Bs, Q))
        if self.config.attention == "flex":
            mask = eagle3_block_mask(rows_Q, T, j, self.config.flex_block_size)
        else:
            mask = eagle3_dense_mask(rows_Q, T, j)
        r, kv = self.midlayer(emb_BQH.to(h_BQH.dtype), h_BQH, rope, mask, cache)
        grown = kv if cache is None else (torch.cat([cache[0], kv[0]], 2), torch.cat([cache[1], kv[1]], 2))
        return r, grown

    def run_steps(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Every step's outputs r^j [Bs, T, H] and labels [Bs, T] (IGNORE = invalid), teacher-forced tokens."""
        ids = batch["input_ids"]
        Bs, T = ids.shape
        doc_end = doc_end_from_lengths(batch["lengths"].to(ids.device), T)
        labels = next_token_labels(ids, batch["loss_mask"], doc_end)
        emb, unknown_emb = self.input_embeds(batch)
        rows = torch.arange(T, device=ids.device)
        h, cache = self.feature(batch["taps"]), None
        outs, step_labels, audio_masked = [], [], []
        for j in range(self.config.num_steps):
            h, cache = self.step(j, shift_left(emb, j + 1), h, rows, T, cache)
            lab = depth_labels(labels, doc_end, j + 1)
            unknown = shift_left(unknown_emb, j + 1) & (lab != IGNORE)
            audio_masked.append(unknown.sum())
            step_labels.append(torch.where(unknown, torch.full_like(lab, IGNORE), lab))
            outs.append(h)
        return {"h": outs, "labels": step_labels, "audio_masked": audio_masked}

    def draft_logits(self, r_RH: torch.Tensor) -> torch.Tensor:
        """[R, N] logits over the draft vocabulary (draft ids) of step outputs: lm_head(norm(r)), as vLLM computes."""
        w = self.lm_head.weight
        return torch.matmul(self.norm(r_RH).to(w.dtype), w.T).float()

    def logits(self, r_RH: torch.Tensor) -> torch.Tensor:
        """[R, V] logits over the target vocabulary: -inf at target ids outside the draft vocabulary."""
        return self.to_target_logits(self.draft_logits(r_RH))

    def teacher(self, h_RH: torch.Tensor) -> torch.Tensor:
        """The target's exact logits [R, V] of pre-norm last-layer rows."""
        return self.target.logits(h_RH)

    # -- eval -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def propose(self, ids_T: torch.Tensor, taps_PnH: torch.Tensor, *, temperature: float = 0.0,
                generator: torch.Generator | None = None,
                extras: Mapping[str, torch.Tensor] | None = None,
                drafts: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Chain drafting after a verified prefix: step 0 over every verified row, then steps 1..K-1 on the chain
        anchored at row P - 1, each fed its own previous output and the token it drafted: K = num_steps drafts."""
        P = taps_PnH.shape[0]
        p = next(self.parameters())
        extras = {k: v for k, v in (extras or {}).items() if k == "is_audio" or (k == "audio_embeds"
                                                                                  and self.uses_audio_embeds)}
        batch = one_sequence_batch(ids_T, taps_PnH, dtype=p.dtype, device=p.device, extras=extras)
        T = ids_T.shape[0]
        emb, _ = self.input_embeds(batch)
        h, cache = self.step(0, shift_left(emb, 1), self.feature(batch["taps"]), torch.arange(T, device=p.device), T,
                             None)
        r = h[:, P - 1 : P]
        row = torch.tensor([P - 1], device=p.device)
        drafted, dists = [], []
        for j in range(self.draft_count(drafts)):
            if j > 0:
                e = F.embedding(torch.tensor([[drafted[-1]]], device=p.device), self.target.embed_tokens)
                r, cache = self.step(j, e, r, row, T, cache)
            tok, q = pick_tokens(self.logits(r[0]), temperature, generator)
            drafted.append(int(tok[0]))
            if q is not None:
                dists.append(q[0])
        return torch.tensor(drafted), (torch.stack(dists) if dists else None)

    @property
    def trained_drafts(self) -> int:
        return self.config.num_steps

    @torch.no_grad()
    def acceptance(self, batch: dict[str, Any], generator: torch.Generator | None = None,
                   drafts: int | None = None) -> AcceptanceCounts:
        """Teacher-forced chains over the steps (a row counts at step k only if steps 1..k all agree; with
        ``drafts``, the first that many), and the greedy rounds replayed on them
        (``train.drafters.common.chain.chain_acceptance``)."""
        n = self.draft_count(drafts)
        run = self.run_steps(batch)
        hits = []
        for h, lab in zip(run["h"][:n], run["labels"][:n]):
            rows = (lab != IGNORE).nonzero(as_tuple=True)
            hit = torch.zeros_like(lab, dtype=torch.bool)
            if rows[0].numel():
                (pred,) = map_row_chunks(lambda a: (self.draft_to_target(self.draft_logits(a).argmax(-1)),),
                                         [h[rows]], self.config.chunk_rows)
                hit[rows] = pred == lab[rows]
            hits.append(hit)
        return chain_acceptance(run["labels"][:n], hits, batch["loss_mask"])

    @torch.no_grad()
    def sampled_acceptance(self, batch: dict[str, Any], temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Per step k: (sum over valid rows of sum_v min(p_v, q_v), rows), [K] each; p the exact target row t + k,
        q the draft's sampling distribution, both at ``temperature``, every step teacher-forced on the tokens."""
        if temperature <= 0:
            raise ValueError(f"sampled acceptance needs a temperature > 0, got {temperature}")
        run = self.run_steps(batch)
        last = last_hidden(batch, self.last_tap)
        sums, counts = [], []
        for j, (h, lab) in enumerate(zip(run["h"], run["labels"])):
            rows = (lab != IGNORE).nonzero(as_tuple=True)

            def fn(a, b):
                q = self.logits(a) / temperature
                return (1.0 - tv_full(self.teacher(b) / temperature, q),)

            (alpha,) = map_row_chunks(fn, [h[rows], last[(rows[0], rows[1] + j + 1)]], self.config.chunk_rows)
            sums.append(alpha.double().sum())
            counts.append(torch.tensor(float(alpha.numel()), dtype=torch.float64))
        return torch.stack(sums).cpu(), torch.stack(counts)

    # -- export ---------------------------------------------------------------------------------------
    def export_config(self) -> dict[str, Any]:
        """vLLM's EAGLE-3 config (``eagle_config`` with the aux layer ids in vLLM numbering, ascending); the
        weights' names already are vLLM's (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t`` / ``t2d``)."""
        cfg = self.config
        N = cfg.draft_vocab or self.vocab_size
        arch = "Qwen3ForCausalLM" if cfg.qk_norm else "LlamaForCausalLM"
        return {
            "architectures": [arch],
            "model_type": "qwen3" if cfg.qk_norm else "llama",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": 1,
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
            "vocab_size": self.vocab_size,
            "draft_vocab_size": N,
            "target_hidden_size": self.hidden_size,
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": to_vllm(cfg.target_layer_ids),
                             "use_aux_hidden_state": True, "norm_before_fc": False},
            "norm_before_residual": False,
            "num_target_layers": self.target_num_layers,
            "target_layer_ids": list(cfg.target_layer_ids),
            "target_layer_ids_vllm": to_vllm(cfg.target_layer_ids),
            "num_speculative_tokens": cfg.num_steps,
            "logits": "lm_head(norm(r)) with the draft's own lm_head [draft_vocab_size, H]; with a draft vocabulary, "
                      "draft id i is target id i + d2t[i] (-inf at every other target id), as vLLM's EAGLE-3 "
                      "compute_logits places them",
            "eagle3_config": asdict(cfg),
            "tapdraft": {
                "family": self.family,
                "target_fingerprint": self.fingerprint,
                "tap_numbering": TAP_NUMBERING,
                "uses_target_embedding": True,
                "serve_with": {"vllm": {"method": "eagle3", "num_speculative_tokens": cfg.num_steps}},
                "block_size": {"vllm": cfg.num_steps + 1},  # a chain: the tokens one verification scores
            },
        }


CONFIG = Eagle3Config
DRAFTER = Eagle3Drafter
