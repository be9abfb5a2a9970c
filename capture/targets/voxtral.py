"""Voxtral: the processor's 30 s chunks of Whisper features, the model's own encoder, projector and merge.

Voxtral's processor delegates chat templating and audio-token expansion to mistral-common (whose
``numpy<2.4`` pin on Python <= 3.12 conflicts with this project's numpy), so the adapter takes
the pieces that do not need it and does the expansion by mistral-common's rule
(``mistral_common/tokens/tokenizers/audio.py``: ``AudioEncoder.pad`` pads each audio to a multiple
of ``chunk_length_s``; ``_encode_audio_tokens`` emits ``[BEGIN_AUDIO]`` then one ``[AUDIO]`` per
``sampling_rate / frame_rate`` samples):

    tokenizer   tekken.json, converted by transformers itself (``integrations/mistral/tokenizer.py``);
                the chat template from a ``chat_template.jinja`` beside it
    features    ``VoxtralProcessor._retrieve_input_features``: WhisperFeatureExtractor padded to a
                multiple of 30 s, cut into [chunks, 128, 3000]
    frames      per chunk ``max_source_positions * d_model / intermediate_size`` (1500 * 1280 / 5120 =
                375: the projector joins 4 encoder frames), 80 ms each; checked against tekken.json's
                ``audio`` section (``chunk_length_s * frame_rate``) when it has one
    merge       ``VoxtralModel.get_audio_features`` (encoder over all chunks, projector), scattered at
                the ``[AUDIO]`` ids as ``VoxtralModel.forward`` does

A placeholder ``[AUDIO]`` not already preceded by ``[BEGIN_AUDIO]`` gets it, as mistral-common
encodes an audio chunk. Longer audio is more chunks, never cut.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tapdraft.capture.targets.hf_speech import HFSpeechTarget

BEGIN_AUDIO = "[BEGIN_AUDIO]"


class VoxtralTarget(HFSpeechTarget):
    """``VoxtralForConditionalGeneration``: Whisper encoder over 30 s chunks, 80 ms frames, no limit."""

    model_type = "voxtral"
    kind = "voxtral"
    vllm_refused = ("vLLM runs Voxtral only with --tokenizer-mode mistral (mistral_common's tokenizer and audio "
                    "encoding), while tapdraft tokenizes with the checkpoint's HF tokenizer and chat template; the "
                    "two were never proven to give the same ids")

    def __init__(self, model, processor, path: str | Path | None = None):
        super().__init__(model, processor, path)
        if BEGIN_AUDIO not in self.tokenizer.get_vocab():
            raise ValueError(f"the tokenizer has no {BEGIN_AUDIO} token; a Voxtral tekken.json lists it")
        a = model.config.audio_config
        self.frames_per_chunk = a.max_source_positions * a.hidden_size // a.intermediate_size
        kw = processor._merge_kwargs(return_tensors="pt")["audio_kwargs"]
        self._mel_per_chunk = int(kw.pop("max_source_positions"))
        self._feature_kwargs = kw
        chunk_s = int(kw["pad_to_multiple_of"]) / self.sample_rate
        tekken = None if path is None else Path(path) / "tekken.json"
        audio = json.loads(tekken.read_text()).get("audio") if tekken is not None and tekken.is_file() else None
        if audio and round(audio["chunk_length_s"] * audio["frame_rate"]) != self.frames_per_chunk:
            raise ValueError(
                f"tekken.json's audio section gives {audio['chunk_length_s'] * audio['frame_rate']:g} tokens per "
                f"{audio['chunk_length_s']:g} s chunk but the model's encoder gives {self.frames_per_chunk}"
            )
        self._chunk_seconds = chunk_s

    def _wrap(self, messages):
        tok = self.placeholder
        out = []
        for m in messages:
            text = m["content"]
            if tok in text and BEGIN_AUDIO + tok not in text:
                text = text.replace(tok, BEGIN_AUDIO + tok)
            out.append({**m, "content": text})
        return out

    def _process(self, text, waves):
        ids = torch.tensor(self.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
        feats = [self.processor._retrieve_input_features([w], self._mel_per_chunk, **self._feature_kwargs)
                 for w in waves]  # per audio [chunks, M, 3000]
        n_frames = [int(f.shape[0]) * self.frames_per_chunk for f in feats]
        reps = torch.ones_like(ids)
        if waves:
            is_audio = ids == self.audio_token_id
            if int(is_audio.sum()) != len(waves):
                raise ValueError(f"the text has {int(is_audio.sum())} {self.placeholder} tokens for "
                                 f"{len(waves)} audio(s)")
            reps[is_audio] = torch.tensor(n_frames, dtype=reps.dtype)
        return ids.repeat_interleave(reps), n_frames, feats, []

    def _audio_frames(self, feats, fmasks):
        dev, dtype = self.device, self.lm.dtype
        chunks = [int(f.shape[0]) for f in feats]
        emb = self.model.model.get_audio_features(torch.cat(feats).to(dev, dtype), return_dict=True).pooler_output
        return list(torch.split(emb, [c * self.frames_per_chunk for c in chunks]))

    def _frame_seconds(self) -> float:
        return self._chunk_seconds / self.frames_per_chunk


def load_voxtral(root: Path, *, dtype: torch.dtype, device: str) -> VoxtralTarget:
    """``VoxtralForConditionalGeneration`` + ``VoxtralProcessor`` (tekken.json tokenizer) from one directory."""
    from transformers import AutoProcessor, VoxtralForConditionalGeneration

    if not (root / "tekken.json").is_file() and not (root / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{root} has no tekken.json (nor tokenizer.json): a Voxtral checkpoint ships one")
    processor = AutoProcessor.from_pretrained(root, local_files_only=True)
    model = VoxtralForConditionalGeneration.from_pretrained(root, local_files_only=True, dtype=dtype)
    return VoxtralTarget(model.to(device), processor, root)
