"""Adapter for HF-native speech LLMs (Qwen2-Audio today): use the processor, then hook the decoder.

These models keep audio inside the token stream: the processor turns each ``<|AUDIO|>`` into N
copies of itself (N = the encoder frames of that audio: 40 ms each for Qwen2-Audio, 30 s max) and the
model scatters its projected encoder frames into those positions. So, unlike the SALM, expansion
happens in :meth:`HFSpeechTarget.prepare` (the processor's ``input_ids`` ARE the expanded ids) and
:meth:`HFSpeechTarget.embed` only reproduces the model's own merge:

    waveform --WhisperFeatureExtractor--> log-mel [M, 3000] (padded to 30 s) + feature mask
        --audio_tower + multi_modal_projector--> [N, H] --masked_scatter at <|AUDIO|> ids--> [T, H]

The supervised mask comes from the tokenizer's chat template (``{% generation %}``) on the
unexpanded text, repeated over each audio run; the adapter checks that this expansion equals the
processor's ids token for token, so the two can never drift apart silently.

A conversation's placeholder is the model's audio token; one not already inside
``<|audio_bos|> ... <|audio_eos|>`` is wrapped in them, as the model was trained.
Shapes: A audios, M mel bins, F feature frames, N audio frames, T expanded length, H LM width.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from capture.inputs import Conversation, load_audio
from capture.salm import Expanded
from capture.targets import Prepared, Target

NATIVE_MODEL_TYPES = ("qwen2_audio",)
"""``config.json`` model types this adapter loads."""

MIN_SAMPLE_RATE = 8000
"""Inputs sampled below this are refused (as for the SALM)."""


@dataclass
class NativePrepared(Prepared):
    """:class:`Prepared` whose ``token_ids``/``assistant_mask`` are already expanded, plus feature masks."""

    feature_masks: list[torch.Tensor] = field(default_factory=list)  # per audio bool [F]


def qwen2_audio_features(model: nn.Module, feats_AMF: torch.Tensor, fmask_AF: torch.Tensor) -> list[torch.Tensor]:
    """Per-audio projected frames [N_a, H], computed exactly as ``Qwen2AudioModel.forward`` does."""
    from transformers.masking_utils import create_bidirectional_mask

    inner = model.model
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


class HFSpeechTarget(Target):
    """A ``Qwen2AudioForConditionalGeneration`` directory (model + processor files)."""

    tokenizer_subdir = None  # HF layout: tokenizer files beside the weights

    def __init__(self, model: nn.Module, processor, path: str | Path | None = None):
        if model.config.model_type not in NATIVE_MODEL_TYPES:
            raise ValueError(f"model type {model.config.model_type!r} is not one of {NATIVE_MODEL_TYPES}")
        self.model = model.eval()
        self.lm = self.model
        self.processor = processor
        self.tokenizer = processor.tokenizer
        if self.tokenizer.chat_template is None:
            raise ValueError("the tokenizer has no chat template; capture needs one that marks assistant turns")
        self.placeholder = processor.audio_token
        self.audio_token_id = int(model.config.audio_token_id)
        if int(processor.audio_token_id) != self.audio_token_id:
            raise ValueError(
                f"processor audio token id {processor.audio_token_id} != model config audio_token_id "
                f"{self.audio_token_id}; the processor and the model come from different checkpoints"
            )
        self.sample_rate = int(processor.feature_extractor.sampling_rate)
        self._path = None if path is None else Path(path)

    def _wrap(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        bos, eos, tok = self.processor.audio_bos_token, self.processor.audio_eos_token, self.placeholder
        out = []
        for m in messages:
            text = m["content"]
            if tok in text and bos + tok not in text:
                text = text.replace(tok, bos + tok + eos)
            out.append({**m, "content": text})
        return out

    def prepare(self, conv: Conversation, index: int) -> NativePrepared:
        wrapped = Conversation(conv.sample_id, conv.source, self._wrap(conv.messages), conv.audios, conv.line)
        ids, mask = self._tokenize(wrapped)
        n_ph = int((ids == self.audio_token_id).sum())
        if n_ph != len(conv.audios):
            raise ValueError(f"has {n_ph} audio token(s) {self.placeholder!r} but {len(conv.audios)} audio(s)")
        waves, seconds = [], 0.0
        for ref in conv.audios:
            w, s = load_audio(ref, target_sr=self.sample_rate, min_sr=MIN_SAMPLE_RATE)
            limit = int(self.processor.feature_extractor.n_samples)
            if w.shape[0] > limit:  # the feature extractor would silently cut it
                raise ValueError(f"audio {ref.path or '<array>'} is {s:.1f}s; the encoder takes at most "
                                 f"{limit / self.sample_rate:.0f}s per audio: split it")
            waves.append(w)
            seconds += s
        text = self.tokenizer.apply_chat_template(wrapped.messages, tokenize=False)
        out = self.processor(text=text, audio=waves or None, sampling_rate=self.sample_rate, return_tensors="pt")
        exp_ids = out["input_ids"][0]
        # repeat the template's mask over each audio run; must reproduce the processor's ids exactly
        reps = torch.ones_like(ids)
        if waves:
            lens = out["feature_attention_mask"].sum(-1)
            _, n_frames = self.model.model.audio_tower._get_feat_extract_output_lengths(lens)
            reps[ids == self.audio_token_id] = n_frames.to(reps.dtype)
        if not torch.equal(ids.repeat_interleave(reps), exp_ids):
            raise ValueError(
                "the processor's expanded tokens differ from the chat template's tokens with audio runs; "
                "the tokenizer must keep the audio tokens as single special tokens"
            )
        mask = mask.repeat_interleave(reps) & (exp_ids != self.audio_token_id)
        feats = [out["input_features"][a] for a in range(len(waves))]
        fmasks = [out["feature_attention_mask"][a].bool() for a in range(len(waves))]
        return NativePrepared(index, conv.sample_id, conv.source, exp_ids, mask, waves, feats, seconds,
                              int(exp_ids.shape[0]), conv.line, fmasks)

    def embed(self, batch: Sequence[Prepared]) -> list[Expanded]:
        dev = self.device
        feats = [f for p in batch for f in p.features]
        if feats:
            fm = [m for p in batch for m in p.feature_masks]  # type: ignore[attr-defined]
            audio = qwen2_audio_features(self.model, torch.stack(feats).to(dev, self.lm.dtype),
                                         torch.stack(fm).to(dev))
        else:
            audio = []
        emb = self.lm.get_input_embeddings()
        out, k = [], 0
        for p in batch:
            ids = p.token_ids.to(dev).long()
            is_audio = ids == self.audio_token_id
            x = emb(ids)
            n = len(p.features)
            if n:
                frames = torch.cat(audio[k : k + n]).to(x.dtype)
                if frames.shape[0] != int(is_audio.sum()):
                    raise AssertionError(f"{frames.shape[0]} audio frames for {int(is_audio.sum())} audio tokens")
                x = x.masked_scatter(is_audio[:, None], frames)
            k += n
            out.append(Expanded(ids, is_audio, p.assistant_mask.to(dev) & ~is_audio, x))
        return out

    def audio_bundle(self) -> dict[str, Any]:
        fe = self.processor.feature_extractor
        return {
            "sample_rate": self.sample_rate,
            "frame_seconds": fe.hop_length * 4 / self.sample_rate,  # conv stride 2, then avg-pool 2
            "placeholder": self.placeholder,
            "placeholder_token_id": self.audio_token_id,
            "audio_token_id": self.audio_token_id,
            "encoder": type(self.model.model.audio_tower).__name__,
        }


def load_native(root: Path, *, dtype: torch.dtype, device: str) -> HFSpeechTarget:
    """Model + processor from one local directory (``save_pretrained`` of both)."""
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

    model = Qwen2AudioForConditionalGeneration.from_pretrained(root, local_files_only=True, dtype=dtype).to(device)
    processor = AutoProcessor.from_pretrained(root, local_files_only=True)
    return HFSpeechTarget(model, processor, root)
