"""The audio half of a NeMo speechlm2 SALM, rebuilt from its checkpoint without NeMo.

    waveform --NeMoMelFrontEnd (NeMo's FilterbankFeatures, its stored window and filterbank)--> [F, M]
        --perception.encoder: FastConformer, mapped onto transformers' ParakeetEncoder--> [N, He]
        --perception.modality_adapter: Conformer (no subsampling) or identity--> [N, Ha]
        --perception.proj: Linear(Ha, H) (or identity)--> [N, H]

Facts, from NeMo's public source (github.com/NVIDIA/NeMo, 2025-09 snapshot):
``nemo/collections/asr/parts/preprocessing/features.py`` (FilterbankFeatures: preemphasis over the valid
samples, centred STFT with zero padding, magnitude ** mag_power, ``fb @ spec``, log with an additive or
clamping guard, per-feature normalisation over valid frames with the unbiased std + 1e-5, frames past
``(n + 2 * (n_fft // 2) - n_fft) // hop`` set to ``pad_value``); ``modules/audio_preprocessing.py``
(AudioToMelSpectrogramPreprocessor: window_size/window_stride in seconds -> samples, ``features`` mel
bins, float32 compute); ``modules/conformer_encoder.py`` (ConformerEncoder: defaults, a Linear
``pre_encode`` when subsampling_factor is 1, d_ff = d_model * ff_expansion_factor);
``parts/submodules/subsampling.py`` (dw_striding: kernel 3, stride 2, padding 1, lengths
``floor((L + 2 - 3) / 2 + 1)`` per stage); ``speechlm2/modules/perception.py`` (encoder ->
modality_adapter -> proj, proj = Linear(d_model, output_dim) when the adapter has a d_model).
The FastConformer -> ParakeetEncoder names follow transformers'
``src/transformers/models/parakeet/convert_nemo_to_hf.py`` (NEMO_TO_HF_WEIGHT_MAPPING).

NeMo loads the mel filterbank ``fb`` and ``window`` from the checkpoint and uses them as stored (bf16
in exports), so this front end does too: recomputing them in float32 moves log-probs by ~0.09 on a
tiny model. Shapes: S samples, F feature frames, M mel bins, N encoder frames.
"""

from __future__ import annotations

import math
import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

NORMALIZE_EPS = 1e-5
"""NeMo's CONSTANT added to the feature std."""


@dataclass(frozen=True)
class MelSettings:
    """A NeMo ``AudioToMelSpectrogramPreprocessor`` config, in samples."""

    sample_rate: int = 16000
    """Rate the model was trained at."""
    win_length: int = 320
    """STFT window in samples (window_size * sample_rate)."""
    hop_length: int = 160
    """STFT hop in samples (window_stride * sample_rate): 10 ms at 16 kHz."""
    n_fft: int = 512
    """FFT size (NeMo: the next power of two above win_length unless given)."""
    n_mels: int = 64
    """Mel bins (``features``)."""
    preemph: float | None = 0.97
    """Preemphasis coefficient; None = off."""
    log: bool = True
    """Take the log of the mel energies."""
    log_zero_guard_type: str = "add"
    """'add' the guard value or 'clamp' at it before the log."""
    log_zero_guard_value: float = 2.0**-24
    """The guard (NeMo also accepts 'tiny' and 'eps', resolved for float32 here)."""
    normalize: str | None = "per_feature"
    """'per_feature', 'all_features' or None."""
    mag_power: float = 2.0
    """Power of the STFT magnitude."""

    def __post_init__(self) -> None:
        if self.sample_rate <= 0 or self.win_length <= 0 or self.hop_length <= 0 or self.n_mels <= 0:
            raise ValueError(f"the NeMo preprocessor config needs positive sizes, got {self}")
        if self.n_fft % 2 or self.n_fft < self.win_length:
            raise ValueError(f"n_fft {self.n_fft} must be even and >= the window ({self.win_length} samples)")
        if self.log_zero_guard_type not in ("add", "clamp"):
            raise ValueError(f"log_zero_guard_type must be 'add' or 'clamp', got {self.log_zero_guard_type!r}")
        if self.normalize not in ("per_feature", "all_features", None):
            raise ValueError(f"normalize {self.normalize!r} is not supported (per_feature, all_features or none)")

    @classmethod
    def from_nemo(cls, d: dict[str, Any]) -> "MelSettings":
        """From ``config.json``'s ``perception.preprocessor``; refuses settings this front end cannot honour."""
        sr = int(d.get("sample_rate", 16000))
        win = int(d["n_window_size"]) if d.get("n_window_size") else int(d.get("window_size", 0.02) * sr)
        hop = int(d["n_window_stride"]) if d.get("n_window_stride") else int(d.get("window_stride", 0.01) * sr)
        for key, ok in (("frame_splicing", 1), ("exact_pad", False), ("pad_value", 0), ("use_torchaudio", False),
                        ("window", "hann"), ("mel_norm", "slaney")):
            if key in d and d[key] != ok:
                raise ValueError(f"NeMo preprocessor {key}={d[key]!r} is not supported (only {ok!r})")
        guard = d.get("log_zero_guard_value", 2.0**-24)
        if isinstance(guard, str):
            guard = {"tiny": torch.finfo(torch.float32).tiny, "eps": torch.finfo(torch.float32).eps}[guard]
        norm = d.get("normalize", "per_feature")
        return cls(
            sample_rate=sr, win_length=win, hop_length=hop,
            n_fft=int(d.get("n_fft") or 2 ** math.ceil(math.log2(win))), n_mels=int(d.get("features", 64)),
            preemph=d.get("preemph", 0.97), log=bool(d.get("log", True)),
            log_zero_guard_type=d.get("log_zero_guard_type", "add"), log_zero_guard_value=float(guard),
            normalize=norm if norm in ("per_feature", "all_features") else None,
            mag_power=float(d.get("mag_power", 2.0)),
        )


class NeMoMelFrontEnd:
    """Log-mel features exactly as NeMo's ``FilterbankFeatures`` computes them at eval time (no dither).

    Called like a transformers feature extractor (what :class:`capture.targets.salm.model.SALM` expects): a list of
    mono float waveforms -> ``input_features`` [B, F, M] (zero past each length) and ``attention_mask`` [B, F].
    """

    def __init__(self, settings: MelSettings, window: torch.Tensor, fb: torch.Tensor):
        s = settings
        if tuple(window.shape) != (s.win_length,):
            raise ValueError(f"stored window has shape {tuple(window.shape)}, the config says {s.win_length} samples")
        if tuple(fb.shape[-2:]) != (s.n_mels, s.n_fft // 2 + 1):
            raise ValueError(f"stored mel filterbank has shape {tuple(fb.shape)}, the config says "
                             f"[{s.n_mels}, {s.n_fft // 2 + 1}]")
        self.settings = s
        self.sampling_rate = s.sample_rate
        self.window = window.detach().float().cpu()  # NeMo: window.to(float) at each STFT
        self.fb = fb.detach().reshape(s.n_mels, -1).float().cpu()  # NeMo: fb.to(x.dtype), x float32

    def num_frames(self, num_samples: torch.Tensor) -> torch.Tensor:
        """Valid feature frames for ``num_samples`` (NeMo's get_seq_len, centred STFT)."""
        s = self.settings
        return torch.div(num_samples + 2 * (s.n_fft // 2) - s.n_fft, s.hop_length, rounding_mode="floor").long()

    def __call__(self, waveforms: Sequence[np.ndarray], *, sampling_rate: int, return_tensors: str = "pt",
                 return_attention_mask: bool = True) -> dict[str, torch.Tensor]:
        s = self.settings
        if sampling_rate != s.sample_rate:
            raise ValueError(f"audio at {sampling_rate} Hz given to a front end built for {s.sample_rate} Hz")
        lens = torch.tensor([len(w) for w in waveforms], dtype=torch.long)
        x = torch.zeros(len(waveforms), int(lens.max()), dtype=torch.float32)
        for i, w in enumerate(waveforms):
            x[i, : len(w)] = torch.as_tensor(np.asarray(w, dtype=np.float32))
        feats, n_frames = self.features(x, lens)
        F = int(n_frames.max())
        mask = torch.arange(F)[None, :] < n_frames[:, None]
        return {"input_features": feats[:, :, :F].transpose(1, 2).contiguous(), "attention_mask": mask}

    def features(self, x_BS: torch.Tensor, lens_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, M, F'] features (zero past each valid length) and the valid frame counts [B]."""
        s = self.settings
        n_frames = self.num_frames(lens_B)
        if s.preemph is not None:
            valid = torch.arange(x_BS.shape[1])[None, :] < lens_B[:, None]
            x_BS = torch.cat([x_BS[:, :1], x_BS[:, 1:] - s.preemph * x_BS[:, :-1]], dim=1).masked_fill(~valid, 0.0)
        spec = torch.stft(x_BS, n_fft=s.n_fft, hop_length=s.hop_length, win_length=s.win_length, center=True,
                          window=self.window, return_complex=True, pad_mode="constant")
        mag = torch.view_as_real(spec).pow(2).sum(-1).sqrt()
        if s.mag_power != 1.0:
            mag = mag.pow(s.mag_power)
        mel = torch.matmul(self.fb, mag)  # [B, M, F']
        if s.log:
            g = s.log_zero_guard_value
            mel = torch.log(mel + g) if s.log_zero_guard_type == "add" else torch.log(mel.clamp(min=g))
        valid = torch.arange(mel.shape[-1])[None, :] < n_frames[:, None]  # [B, F']
        if s.normalize == "per_feature":
            cnt = valid.sum(1, keepdim=True).to(mel.dtype)  # [B, 1]
            mean = torch.where(valid[:, None], mel, 0.0).sum(2) / cnt
            var = torch.where(valid[:, None], mel - mean[..., None], 0.0).pow(2).sum(2) / (cnt - 1.0)
            std = var.sqrt().nan_to_num(0.0) + NORMALIZE_EPS
            mel = (mel - mean[..., None]) / std[..., None]
        elif s.normalize == "all_features":
            out = []
            for b in range(mel.shape[0]):
                v = mel[b, :, : int(n_frames[b])]
                out.append((mel[b] - v.mean()) / (v.std() + NORMALIZE_EPS))
            mel = torch.stack(out)
        return mel.masked_fill(~valid[:, None], 0.0), n_frames


# ------------------------------------------------------------------------------------- conformers
@contextmanager
def no_init():
    """Skip the random init of modules about to receive checkpoint weights (seconds for a 2B model)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers: initialise, only slower
        yield
        return
    with no_init_weights():
        yield


NEMO_TO_PARAKEET = (
    (r"^pre_encode\.conv\.", "subsampling.layers."),
    (r"^pre_encode\.out\.", "subsampling.linear."),
    (r"^pre_encode\.(weight|bias)$", r"subsampling.linear.\1"),  # the Linear pre_encode of an unsubsampled adapter
    (r"\.conv\.batch_norm\.", ".conv.norm."),
    (r"\.linear_([kv])\.", r".\1_proj."),
    (r"\.linear_out\.", ".o_proj."),
    (r"\.linear_q\.", ".q_proj."),
    (r"\.pos_bias_([uv])$", r".bias_\1"),
    (r"\.linear_pos\.", ".relative_k_proj."),
)
"""NeMo ConformerEncoder parameter names -> ParakeetEncoder names (after convert_nemo_to_hf.py)."""


def map_conformer_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a NeMo ConformerEncoder state dict (keys relative to the encoder) to ParakeetEncoder names.

    ``pos_enc.*`` (NeMo's cached sinusoid table) is dropped: ParakeetEncoder computes its own.
    """
    out = {}
    for key, value in state.items():
        if key.startswith("pos_enc."):
            continue
        for pattern, repl in NEMO_TO_PARAKEET:
            key = re.sub(pattern, repl, key)
        out[key] = value
    return out


def parakeet_config(d: dict[str, Any], *, what: str):
    """A ``ParakeetEncoderConfig`` for a NeMo ConformerEncoder config (NeMo's defaults where unset).

    Only the non-streaming FastConformer is supported: dw_striding subsampling (or none), rel_pos
    attention over the full context, batch-norm convolutions, no time reduction, no output projection.
    """
    from transformers import ParakeetEncoderConfig

    def need(key: str, ok, default) -> None:
        v = d.get(key, default)
        if (v not in ok) if isinstance(ok, tuple) else v != ok:
            raise ValueError(f"{what}: {key}={v!r} is not supported (supported: {ok!r})")

    factor = int(d.get("subsampling_factor", 4))
    if factor > 1:
        need("subsampling", "dw_striding", "striding")
    need("causal_downsampling", False, False)
    need("self_attention_model", "rel_pos", "rel_pos")
    need("conv_norm_type", "batch_norm", "batch_norm")
    need("feat_out", (-1, None, int(d["d_model"])), -1)
    need("reduction", (None, "none"), None)
    need("att_context_style", "regular", "regular")
    need("conv_context_size", (None, [(int(d.get("conv_kernel_size", 31)) - 1) // 2] * 2), None)
    ctx = d.get("att_context_size") or [-1, -1]
    if list(ctx) != [-1, -1]:
        raise ValueError(f"{what}: att_context_size={ctx} (limited context) is not supported, only [-1, -1]")
    d_model = int(d["d_model"])
    channels = int(d.get("subsampling_conv_channels", -1))
    use_bias = bool(d.get("use_bias", True))
    return ParakeetEncoderConfig(
        hidden_size=d_model, num_hidden_layers=int(d["n_layers"]), num_attention_heads=int(d.get("n_heads", 4)),
        intermediate_size=d_model * int(d.get("ff_expansion_factor", 4)), attention_bias=use_bias,
        convolution_bias=use_bias, conv_kernel_size=int(d.get("conv_kernel_size", 31)), subsampling_factor=factor,
        # no subsampling: build_conformer swaps in a Linear, so keep the unused conv stack minimal
        subsampling_conv_channels=1 if factor == 1 else d_model if channels == -1 else channels,
        num_mel_bins=int(d["feat_in"]),
        max_position_embeddings=int(d.get("pos_emb_max_len", 5000)), scale_input=bool(d.get("xscaling", True)),
        dropout=0.0, dropout_positions=0.0, layerdrop=0.0, activation_dropout=0.0, attention_dropout=0.0,
    )


class LinearPreEncode(nn.Module):
    """NeMo's ``pre_encode = Linear(feat_in, d_model)`` of a conformer without subsampling."""

    def __init__(self, feat_in: int, d_model: int):
        super().__init__()
        self.linear = nn.Linear(feat_in, d_model)

    def forward(self, input_features: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.linear(input_features)


def build_conformer(d: dict[str, Any], state: dict[str, torch.Tensor], *, what: str) -> nn.Module:
    """A ParakeetEncoder holding a NeMo ConformerEncoder's weights (``state`` in NeMo names, encoder-relative)."""
    from transformers import ParakeetEncoder

    cfg = parakeet_config(d, what=what)
    with no_init():
        enc = ParakeetEncoder(cfg)
        if cfg.subsampling_factor == 1:
            enc.subsampling = LinearPreEncode(cfg.num_mel_bins, cfg.hidden_size)
    load_exactly(enc, map_conformer_keys(state), what=what)
    return enc.float().eval()


def load_exactly(module: nn.Module, state: dict[str, torch.Tensor], *, what: str, may_miss: Sequence[str] = ()) -> None:
    """``load_state_dict`` that names every missing or unexpected key instead of loading half a model."""
    res = module.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()},
                                 strict=False)
    missing = [k for k in res.missing_keys if k not in may_miss]
    if missing or res.unexpected_keys:
        raise ValueError(f"{what}: the checkpoint does not match the architecture its config describes "
                         f"(missing {missing[:6]}, unexpected {res.unexpected_keys[:6]})")


class NeMoAdapter(nn.Module):
    """perception.modality_adapter (a conformer, or identity) then perception.proj (Linear or identity)."""

    def __init__(self, conformer: nn.Module | None, proj: nn.Module):
        super().__init__()
        self.conformer = conformer
        self.proj = proj

    def forward(self, x_BNE: torch.Tensor, valid_BN: torch.Tensor) -> torch.Tensor:
        if self.conformer is not None:
            x_BNE = self.conformer(x_BNE, attention_mask=valid_BN.long()).last_hidden_state
        return self.proj(x_BNE)
