"""The interface every frozen target implements, and the inputs it hands to the forward.

A :class:`Target` knows how to (1) turn a parsed conversation into CPU inputs with a known expanded
length (:meth:`Target.prepare`: tokenization, audio decoding, frame counting; all input errors
surface here, before any compute) and (2) embed a batch of them into expanded input embeddings
(:meth:`Target.embed`). Everything after that is shared (capture.forward). Each adapter also declares
what it is outside this process: its stable ``kind`` (the manifest's ``target_kind``, never a class name)
and whether ``--engine vllm`` captures it (:attr:`Target.vllm`).

Adapters, one family a module under capture/targets/ (capture.targets.load picks one): causal_lm (any HF
causal LM, text-only conversations), salm/ (tapdraft's own SALM directories), nemo/ (NeMo speechlm2 SALM
checkpoints), hf_speech (Qwen2-Audio, Qwen3-ASR), voxtral, granite_speech.
Shapes: T expanded length, H width, L tokens.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Sequence

import numpy as np
import torch
from torch import nn
from transformers import PretrainedConfig

from tapdraft.capture.head import LiveHead, check_head, derive_head
from tapdraft.capture.inputs import Conversation
from tapdraft.capture.template import ChatTemplate, Tokenized

DEFAULT_PLACEHOLDER = "<|audioplaceholder|>"
"""The audio marker of input conversations unless a target names its own."""


@dataclass
class Expanded:
    """One conversation after placeholder expansion (all [T] or [T, H])."""

    input_ids: torch.Tensor  # int64 [T], audio rows carry the sentinel id
    is_audio: torch.Tensor  # bool [T]
    loss_mask: torch.Tensor  # bool [T]
    inputs_embeds: torch.Tensor  # [T, H]


def expand_placeholders(
    token_ids: torch.Tensor,
    assistant_mask: torch.Tensor,
    audio_embeds: Sequence[torch.Tensor],
    *,
    placeholder_id: int,
    audio_token_id: int,
    embed: nn.Module,
) -> Expanded:
    """Replace the i-th placeholder in ``token_ids`` [L] by ``audio_embeds[i]`` [N_i, H].

    The count of placeholders must equal ``len(audio_embeds)``; audio rows are never supervised.
    """
    token_ids = token_ids.long()
    where = torch.nonzero(token_ids == placeholder_id, as_tuple=False).flatten().tolist()
    if len(where) != len(audio_embeds):
        raise ValueError(
            f"the text has {len(where)} audio placeholder(s) but {len(audio_embeds)} audio(s) were given; "
            "put exactly one placeholder per audio in the conversation"
        )
    text_emb = embed(token_ids)
    dev = token_ids.device  # the new rows are made beside the ids: torch.cat refuses a CPU row among CUDA ones
    ids, aud, mask, embs = [], [], [], []
    start = 0
    for pos, a in zip(where, audio_embeds):
        n = int(a.shape[0])
        ids += [token_ids[start:pos], torch.full((n,), audio_token_id, dtype=torch.long, device=dev)]
        aud += [torch.zeros(pos - start, dtype=torch.bool, device=dev), torch.ones(n, dtype=torch.bool, device=dev)]
        mask += [assistant_mask[start:pos].bool(), torch.zeros(n, dtype=torch.bool, device=dev)]
        embs += [text_emb[start:pos], a.to(text_emb.dtype)]
        start = pos + 1
    ids.append(token_ids[start:])
    aud.append(torch.zeros(len(token_ids) - start, dtype=torch.bool, device=dev))
    mask.append(assistant_mask[start:].bool())
    embs.append(text_emb[start:])
    return Expanded(torch.cat(ids), torch.cat(aud), torch.cat(mask), torch.cat(embs))


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


NOT_PROVEN_ON_VLLM = "it is not among the targets whose vLLM capture is proven equal to the in-process one"


class Target(ABC):
    """A frozen model whose decoder layers can be tapped.

    Each concrete adapter declares, in its own class body, what it is outside this process: ``kind`` and
    ``vllm_refused``. Neither is inherited: a subclass that declares no ``vllm_refused`` is refused by
    ``--engine vllm`` (Qwen3-ASR subclasses Qwen2-Audio, whose vLLM capture is proven; its own is not).
    """

    kind: ClassVar[str] = ""
    """The family's stable name, recorded as the manifest's ``target_kind`` (a class rename must not change what is
    on disk; capture.targets.load.LEGACY_TARGET_KINDS reads manifests that recorded class names)."""
    vllm_refused: ClassVar[str | None] = NOT_PROVEN_ON_VLLM
    """Why ``capture --engine vllm`` does not capture this family; None: it does, proven equal to the in-process
    engine (tests/engines; docs/capture-engines.md)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.kind = cls.__dict__.get("kind", "")
        cls.vllm_refused = cls.__dict__.get("vllm_refused", NOT_PROVEN_ON_VLLM)

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
        """:meth:`embed`'s ids / is_audio / loss_mask, for an engine that embeds by itself (capture.vllm.engine);
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
    def lm_config(self) -> PretrainedConfig:
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
        """Whether the decoder layers are not in this process (``capture.targets.head_only``): the head is then
        proven by the engine that runs them."""
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
        """The supervised ids of the last assistant turn as the template renders it (content + end of turn; a
        reply carrying its ``token_ids`` keeps them): capture stores a generated reply as the target produced
        it when these equal the ids it was generated as."""
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
        self.template.check_text_size(conv.messages, self.max_positions)  # before the tokenizer sees it
        if not conv.generation_prompt:
            return self.template.tokenize(conv.messages)
        ids = self.template.encode_prompt(conv.messages)
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
