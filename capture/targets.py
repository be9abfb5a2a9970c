"""Frozen targets behind one interface, and the one function that turns a batch into sample tensors.

A :class:`Target` knows how to (1) turn a parsed conversation into CPU inputs with a known expanded
length (:meth:`Target.prepare`: tokenization, audio decoding, frame counting; all input errors
surface here, before any compute) and (2) embed a batch of them into expanded input embeddings
(:meth:`Target.embed`). Everything after that is shared (:func:`run_batch`):

- taps come from forward hooks on the decoder layers (capture.hooks): the residual stream BEFORE the final norm,
  for every tapped layer including the last. HF's ``hidden_states[-1]`` is post-norm and is never
  used. Only the base decoder runs, so [B, T, vocab] logits are never built.
- teacher rows: for each row t with loss_mask[t + 1], the top-k ids and log-probs under the FULL
  softmax of the target's head applied to h_t (``Target.head``: derived from the model and checked
  against its own forward when the target loads, capture.head), computed ``row_chunk`` rows at a
  time (peak [row_chunk, vocab] float32, 0.6 GB for 1024 x 152k).

Adapters: :class:`SALMTarget` (capture.salm), :class:`CausalLMTarget` (any HF causal LM,
text-only conversations), :class:`capture.hf_native.HFSpeechTarget` (HF-native speech LLMs whose
processor expands the audio token: Qwen2-Audio, Granite Speech).
Shapes: B batch, T expanded length, H width, n taps, R teacher rows.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from capture.head import LiveHead, check_head, derive_head
from capture.hooks import LayerTaps
from capture.inputs import Conversation, load_audio
from capture.salm import DEFAULT_PLACEHOLDER, SALM, Expanded, expand_placeholders
from capture.template import ChatTemplate, Tokenized
from shards.head import row_spans
from shards.schema import teacher_rows


@dataclass
class Prepared:
    """One conversation ready for the target: tokens, audio at the encoder rate, expanded length."""

    index: int
    sample_id: str
    source: str
    token_ids: torch.Tensor  # int64 [L]
    assistant_mask: torch.Tensor  # bool [L]
    waveforms: list[np.ndarray] = field(default_factory=list)
    features: list[torch.Tensor] = field(default_factory=list)  # per audio [F_i, mel], computed in prepare
    audio_seconds: float = 0.0
    length: int = 0  # expanded T
    line: int | None = None
    unsupervised_turns: int = 0  # assistant turns the chat template leaves unsupervised (capture.template)


class Target(ABC):
    """A frozen model whose decoder layers can be tapped."""

    lm: nn.Module
    tokenizer: Any
    _template: ChatTemplate | None = None
    placeholder: str | None = None
    audio_token_id: int = 0
    sample_rate: int | None = None

    # -------------------------------------------------------------- adapter-specific
    @abstractmethod
    def prepare(self, conv: Conversation, index: int) -> Prepared:
        """Tokenize and load audio; ValueError (with the reason) for any unusable input."""

    @abstractmethod
    def embed(self, batch: Sequence[Prepared]) -> list[Expanded]:
        """Expanded ids / is_audio / loss_mask / inputs_embeds per sample, on the target's device."""

    def expand_tokens(self, batch: Sequence[Prepared]) -> list[Expanded]:
        """:meth:`embed`'s ids / is_audio / loss_mask, for an engine that embeds by itself (capture.vllm_engine);
        an adapter whose embeddings cost an encoder run leaves ``inputs_embeds`` None."""
        return self.embed(batch)

    @abstractmethod
    def audio_bundle(self) -> dict[str, Any]:
        """The bundle's audio dict (empty for a text-only target)."""

    _path: Path | None = None
    _head: LiveHead | None = None
    checkpoint_dtype: torch.dtype | None = None
    """The dtype the checkpoint stores its weights in (the bundle keeps it); None: the loaded dtype."""
    forward_scales_logits: bool = True
    """Whether the model's own forward applies its LM's ``logits_scaling`` (for :func:`capture.head.check_head`)."""
    tokenizer_subdir: str | None = "tokenizer"
    """Where the tokenizer files sit inside ``model_dir``; None: in ``model_dir`` itself (HF layout)."""

    @property
    def model_dir(self) -> Path | None:
        """Directory the target was loaded from (for the tokenizer files)."""
        return self._path

    @property
    def tokenizer_dir(self) -> Path | None:
        if self._path is None:
            return None
        return self._path if self.tokenizer_subdir is None else self._path / self.tokenizer_subdir

    # -------------------------------------------------------------- shared
    @property
    def decoder(self) -> nn.Module:
        return self.lm.get_decoder()

    @property
    def layers(self) -> nn.ModuleList:
        return self.decoder.layers

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def lm_config(self) -> Any:
        """The decoder's config (the text config of a composite speech-LLM config)."""
        return self.lm.config.get_text_config()

    @property
    def hidden_size(self) -> int:
        return int(self.lm_config.hidden_size)

    @property
    def max_positions(self) -> int | None:
        """The decoder's ``max_position_embeddings`` (None when its config has none): longer samples are
        skipped and counted, since the target's states past it are outside what it was trained on."""
        v = getattr(self.lm_config, "max_position_embeddings", None)
        return int(v) if v else None

    @property
    def head(self) -> LiveHead:
        """The target's head, derived from the model and proven on its own forward (once; raises
        ``capture.head.UnsupportedHead`` for a head the bundle cannot describe)."""
        if self._head is None:
            h = derive_head(self.lm)
            if not self.decoder_elsewhere:
                check_head(self.lm, h, forward_scales_logits=self.forward_scales_logits)
            self._head = h
        return self._head

    @property
    def decoder_elsewhere(self) -> bool:
        """Whether the decoder layers are not in this process (``capture.head_only``): the head is then proven by
        the engine that runs them."""
        return any(p.device.type == "meta" for p in self.layers.parameters())

    @property
    def logits_scaling(self) -> float:
        return self.head.spec.logits_scaling

    @property
    def device(self) -> torch.device:
        return self.lm.get_input_embeddings().weight.device  # in memory even when the decoder is not

    @property
    def input_placeholder(self) -> str:
        """The string that marks an audio in input conversations (a text-only target: the default, so that
        audio in its inputs is counted and refused rather than every text taken for placeholders)."""
        return self.placeholder or DEFAULT_PLACEHOLDER

    @property
    def template(self) -> ChatTemplate:
        """How conversations become tokens and which are supervised: the tokenizer's own chat template unless
        :meth:`use_template` set another (or kwargs)."""
        if self._template is None:
            self.use_template()
        assert self._template is not None
        return self._template

    def use_template(self, text: str | None = None, kwargs: dict[str, Any] | None = None) -> None:
        """Tokenize with ``text`` (None: the tokenizer's own template) rendered with ``kwargs``."""
        self._template = ChatTemplate(self.tokenizer, text, kwargs, end_ids=self.end_token_ids())

    def end_token_ids(self) -> list[int]:
        """Ids that end an assistant turn: the tokenizer's eos and the model's (config and generation config)."""
        ids: list[int] = []
        gen = getattr(self.lm, "generation_config", None)
        for v in (self.tokenizer.eos_token_id, getattr(self.lm_config, "eos_token_id", None),
                  getattr(gen, "eos_token_id", None)):
            ids += [int(x) for x in (v if isinstance(v, (list, tuple)) else [v]) if x is not None]
        return sorted(set(ids))

    def prepare_prompt(self, conv: Conversation, index: int) -> Prepared:
        """:meth:`prepare` for a conversation that ends before the reply to generate: rendered with the
        template's generation prompt; earlier assistant turns keep their supervision."""
        return self.prepare(dataclasses.replace(conv, generation_prompt=True), index)

    def reply_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The supervised ids of the last assistant turn as the template renders it (content + end of turn):
        a generated reply survives the text round trip when these equal the ids it was generated as."""
        tok = self.template.tokenize(messages)
        ids, mask = tok.ids.tolist(), tok.mask.tolist()
        if not any(mask):
            return []
        end = max(i for i, m in enumerate(mask) if m) + 1
        start = end
        while start > 0 and mask[start - 1]:
            start -= 1
        return ids[start:end]

    def _tokenize(self, conv: Conversation) -> Tokenized:
        if not conv.generation_prompt:
            return self.template.tokenize(conv.messages)
        ids = self.template.encode(self.template.render(conv.messages, add_generation_prompt=True))
        mask = torch.zeros(len(ids), dtype=torch.bool)
        if any(m["role"] == "assistant" for m in conv.messages):  # earlier turns stay supervised where they can
            try:
                done = self.template.tokenize(conv.messages)
            except ValueError:  # none of them can be: the prompt is all unsupervised
                done = None
            n = 0 if done is None else int(done.ids.shape[0])
            if done is not None and ids[:n] == done.ids.tolist():
                mask[:n] = done.mask
        return Tokenized(torch.tensor(ids, dtype=torch.long), mask)

    def bundle_config(self) -> dict[str, Any]:
        c = self.lm_config
        rope = getattr(c, "rope_parameters", None) or {}
        eos = getattr(c, "eos_token_id", None)
        if eos is None:
            eos = self.tokenizer.eos_token_id
        return {
            "model_type": c.model_type,
            "hidden_size": int(c.hidden_size),
            "num_hidden_layers": self.num_layers,
            "vocab_size": int(self.lm.get_output_embeddings().weight.shape[0]),
            "num_attention_heads": int(c.num_attention_heads),
            "num_key_value_heads": int(getattr(c, "num_key_value_heads", None) or c.num_attention_heads),
            "head_dim": int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads),
            "intermediate_size": int(c.intermediate_size),
            "rope_theta": float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))),
            "rms_norm_eps": float(getattr(c, "rms_norm_eps", None) or self.head.spec.eps),
            "logits_scaling": self.logits_scaling,
            "bos_token_id": getattr(c, "bos_token_id", None),
            "eos_token_id": eos,
            "pad_token_id": getattr(c, "pad_token_id", None) if getattr(c, "pad_token_id", None) is not None
            else self.tokenizer.pad_token_id,
            # serving facts (shards.bundle.SERVING_KEYS), repeated in draft exports
            "max_position_embeddings": getattr(c, "max_position_embeddings", None),
            "rope_parameters": dict(rope) or None,
            "layer_types": list(getattr(c, "layer_types", None) or []) or None,
        }

    def bundle_parts(self) -> dict[str, Any]:
        """Keyword arguments for ``shards.bundle.write_bundle`` (minus ``out_dir``)."""
        return {
            "config": self.bundle_config(),
            "audio": self.audio_bundle(),
            "chat_template": self.template.text,
            "template_kwargs": self.template.kwargs,
            "tokenizer_dir": self.tokenizer_dir,
            "dtype": self.checkpoint_dtype,
            **self.head.bundle_parts(),
        }


class SALMTarget(Target):
    """A :class:`capture.salm.SALM` directory."""

    def __init__(self, salm: SALM, path: str | Path | None = None):
        self.salm = salm.eval()
        self.lm = salm.lm
        self.tokenizer = salm.tokenizer
        self.placeholder = salm.config.audio.placeholder
        self.audio_token_id = salm.audio_token_id
        self.sample_rate = salm.config.audio.sample_rate
        self._path = None if path is None else Path(path)

    def prepare(self, conv: Conversation, index: int) -> Prepared:
        tok = self._tokenize(conv)
        ids, mask = tok.ids, tok.mask
        n_ph = int((ids == self.salm.placeholder_id).sum())
        if n_ph != len(conv.audios):
            raise ValueError(f"has {n_ph} audio placeholder(s) after tokenization but {len(conv.audios)} audio(s)")
        waves, feats, seconds, frames = [], [], 0.0, 0
        acfg = self.salm.config.audio
        for ref in conv.audios:
            w, s = load_audio(ref, target_sr=acfg.sample_rate, min_sr=acfg.min_sample_rate)
            n = self.salm.num_frames(w.shape[0])
            if n < 1:
                raise ValueError(f"audio {ref.path or '<array>'} is {s:.3f}s: too short for one encoder frame")
            # log-mel here, on the prefetch thread (normalisation is per utterance, so this equals batched)
            f, fm = self.salm.featurize([w])
            waves.append(w)
            feats.append(f[0, : int(fm[0].sum())])
            seconds += s
            frames += n
        return Prepared(index, conv.sample_id, conv.source, ids, mask, waves, feats, seconds,
                        int(ids.shape[0]) - n_ph + frames, conv.line, len(tok.unsupervised))

    def embed(self, batch: Sequence[Prepared]) -> list[Expanded]:
        feats = [f for p in batch for f in p.features]
        if len(feats) != sum(len(p.waveforms) for p in batch):  # built without prepare(): featurize now
            audio = self.salm.encode_audio([w for p in batch for w in p.waveforms])
        elif feats:
            F = max(f.shape[0] for f in feats)
            padded = torch.stack([torch.nn.functional.pad(f, (0, 0, 0, F - f.shape[0])) for f in feats])
            fmask = torch.arange(F)[None, :] < torch.tensor([f.shape[0] for f in feats])[:, None]
            audio = self.salm.encode_features(padded, fmask)
        else:
            audio = []
        out, k = [], 0
        for p in batch:
            n = len(p.waveforms)
            out.append(self.salm.expand(p.token_ids, p.assistant_mask, audio[k : k + n]))
            k += n
        return out

    def audio_bundle(self) -> dict[str, Any]:
        a = self.salm.config.audio
        return {
            "sample_rate": a.sample_rate,
            "frame_seconds": a.frame_seconds,
            "placeholder": a.placeholder,
            "placeholder_token_id": self.salm.placeholder_id,
            "audio_token_id": self.audio_token_id,
            "encoder": "ParakeetEncoder",
        }


class CausalLMTarget(Target):
    """Any HF causal LM on text-only conversations, with its tokenizer's chat template (or an override)."""

    tokenizer_subdir = None  # HF layout: tokenizer files beside the weights

    def __init__(self, lm: nn.Module, tokenizer, path: str | Path | None = None):
        self.lm = lm.eval()
        self.tokenizer = tokenizer
        self.audio_token_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
        self._path = None if path is None else Path(path)

    def prepare(self, conv: Conversation, index: int) -> Prepared:
        if conv.audios:
            raise ValueError(f"has {len(conv.audios)} audio(s) but the target is a text-only causal LM")
        tok = self._tokenize(conv)
        return Prepared(index, conv.sample_id, conv.source, tok.ids, tok.mask, [], [], 0.0, int(tok.ids.shape[0]),
                        conv.line, len(tok.unsupervised))

    def embed(self, batch: Sequence[Prepared]) -> list[Expanded]:
        emb = self.lm.get_input_embeddings()
        return [
            expand_placeholders(p.token_ids.to(self.device), p.assistant_mask.to(self.device), [],
                                placeholder_id=-1, audio_token_id=self.audio_token_id, embed=emb)
            for p in batch
        ]

    def audio_bundle(self) -> dict[str, Any]:
        return {}


# ------------------------------------------------------------------------------------------ compute
def topk_teacher(
    last_RH: torch.Tensor, head: LiveHead, k: int, *, row_chunk: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k ids (int32 [R, k]) and full-softmax log-probs (float32 [R, k]) of the pre-norm rows."""
    R = last_RH.shape[0]
    ids = torch.empty(R, k, dtype=torch.int32, device=last_RH.device)
    lps = torch.empty(R, k, dtype=torch.float32, device=last_RH.device)
    for s, e in row_spans(R, row_chunk):
        logits = head.logits(last_RH[s:e])  # [r, V], ours to overwrite
        v, i = torch.topk(logits, k, dim=-1)  # top-k of the logits = top-k of the log-probs: no [r, V] log_softmax
        top = v[:, :1]  # the row max (sorted top-k), so exp never overflows
        # logsumexp in place, reusing the logits' memory: 2.5x faster than topk + torch.logsumexp on CPU
        # (0.56 vs 1.42 s for 1024 rows x 152k, one thread; equal to the last bit), no [r, V] temporary
        lse = top + logits.sub_(top).exp_().sum(dim=-1, keepdim=True).log_()
        ids[s:e] = i.to(torch.int32)
        lps[s:e] = v - lse
    return ids, lps


@torch.no_grad()
def run_batch(
    target: Target,
    batch: Sequence[Prepared],
    *,
    tap_ids: Sequence[int],
    top_k: int,
    final_hidden: bool = False,
    audio_embeds: bool = False,
    row_chunk: int = 1024,
) -> list[dict[str, torch.Tensor]]:
    """One padded forward of the base decoder -> per-sample tensor fields (on the target's device).

    Finiteness is checked once, by the writer on the host copy (``shards.schema.all_finite``, on the
    exponent bits), which raises ``NonFiniteError`` for the capture to count as a skip.
    """
    L = target.num_layers
    if any(i < 0 or i >= L for i in tap_ids):
        raise ValueError(f"tap ids {list(tap_ids)} out of range for a target of {L} decoder layers")
    exps = target.embed(batch)
    dev = target.device
    B, Tmax = len(exps), max(int(e.input_ids.shape[0]) for e in exps)
    H = exps[0].inputs_embeds.shape[-1]
    emb = torch.zeros(B, Tmax, H, dtype=exps[0].inputs_embeds.dtype, device=dev)
    attn = torch.zeros(B, Tmax, dtype=torch.long, device=dev)
    for b, e in enumerate(exps):
        T = e.input_ids.shape[0]
        emb[b, :T] = e.inputs_embeds
        attn[b, :T] = 1
    with LayerTaps(target.layers, sorted(set(tap_ids) | {L - 1})) as hooks:
        target.decoder(inputs_embeds=emb, attention_mask=attn, use_cache=False)
    states = []
    for b, (p, e) in enumerate(zip(batch, exps)):
        T = int(e.input_ids.shape[0])
        if T != p.length:
            raise AssertionError(f"expanded length {T} != predicted {p.length} for {p.sample_id}")
        states.append((torch.stack([hooks.out[i][b, :T] for i in tap_ids], dim=1), hooks.out[L - 1][b, :T]))
    return sample_fields(target, exps, states, top_k=top_k, final_hidden=final_hidden, audio_embeds=audio_embeds,
                         row_chunk=row_chunk)


def sample_fields(
    target: Target,
    exps: Sequence[Expanded],
    states: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    top_k: int,
    final_hidden: bool = False,
    audio_embeds: bool = False,
    row_chunk: int = 1024,
) -> list[dict[str, torch.Tensor]]:
    """Per-sample stored fields from each sample's (taps [T, n, H], last layer pre-norm [T, H]).

    The one home of what a sample holds (teacher rows, bf16 casts), shared by the padded forward
    (:func:`run_batch`) and fused capture (states gathered during generation). Finiteness is the
    writer's check.
    """
    head = target.head
    dev = target.device
    samples = []
    for e, (tap_TnH, last_TH) in zip(exps, states):
        s: dict[str, torch.Tensor] = {
            "input_ids": e.input_ids.to(torch.int32),
            "is_audio": e.is_audio,
            "loss_mask": e.loss_mask,
            "taps": tap_TnH,
        }
        if final_hidden:
            s["final_hidden"] = last_TH
        if audio_embeds:
            s["audio_embeds"] = e.inputs_embeds[e.is_audio]
        if top_k > 0:
            rows = teacher_rows(e.loss_mask.cpu()).to(dev)
            ids, lps = topk_teacher(last_TH[rows.long()], head, top_k, row_chunk=row_chunk)
            s.update(topk_rows=rows, topk_ids=ids, topk_logprobs=lps)
        for name in ("taps", "final_hidden", "audio_embeds"):
            if name in s:
                s[name] = s[name].to(torch.bfloat16)
        samples.append(s)
    return samples
