"""A SALM (speech-augmented language model): audio front end + encoder + adapter + any HF causal LM.

    waveform (16 kHz) --ParakeetFeatureExtractor--> log-mel [F, 80] (10 ms hop)
        --ParakeetEncoder (FastConformer, 8x subsampling)--> [N, He]   (N frames of 80 ms)
        --ModalityAdapter (MLP projection, optional transformer layers)--> [N, H]
    token ids with one ``<|audioplaceholder|>`` per audio --expand--> inputs_embeds [T, H]
        --causal LM (default Qwen3ForCausalLM)--> logits

Expansion replaces each placeholder token by its audio's N frame embeddings, so the expanded length
is T = tokens - placeholders + sum(N). Audio positions carry the sentinel id ``audio_token_id``
(the placeholder's own id unless configured), are marked in ``is_audio`` and are never supervised;
``loss_mask`` covers assistant turns as the chat template gives them (capture.template).

Everything lives in ONE local directory, each part in the format its library loads natively:

    salm_config.json        SALMConfig (audio front end + adapter)
    lm/                     the causal LM (HF save_pretrained)
    encoder/                the ParakeetEncoder (HF save_pretrained)
    feature_extractor/      ParakeetFeatureExtractor (preprocessor_config.json)
    adapter.safetensors     the modality adapter
    tokenizer/              tokenizer.json + tokenizer_config.json + chat_template.jinja

Shapes: ``N`` audio frames, ``T`` expanded positions, ``H`` LM width, ``He`` encoder width.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from tapdraft.capture.targets.base import DEFAULT_PLACEHOLDER, Expanded, expand_placeholders

SALM_CONFIG_FILE = "salm_config.json"
ADAPTER_FILE = "adapter.safetensors"

CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\n' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ m['content'] + '<|im_end|>' }}{% endif %}"
    "{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML with the assistant content (and its end token) inside ``{% generation %}``: capture takes the
supervised mask from these markers and checks it against prefix rendering (capture.template)."""

SPECIAL_TOKENS = ("<|pad|>", "<|unk|>", "<|im_start|>", "<|im_end|>", DEFAULT_PLACEHOLDER)


@dataclass(frozen=True)
class AudioConfig:
    """The audio front end: what rate the encoder takes and how a placeholder becomes frames."""

    sample_rate: int = 16000
    """Rate the feature extractor and encoder were built for; inputs are resampled to it."""
    hop_length: int = 160
    """Feature hop in samples (10 ms at 16 kHz)."""
    subsampling_factor: int = 8
    """Encoder time subsampling: one frame per ``hop_length * subsampling_factor`` samples (80 ms)."""
    placeholder: str = DEFAULT_PLACEHOLDER
    """Token string standing for one audio in the text (NeMo's default)."""
    audio_token_id: int | None = None
    """Sentinel id carried by audio positions in expanded ``input_ids``; None = the placeholder's id."""
    min_sample_rate: int = 8000
    """Inputs sampled below this are refused: upsampling cannot restore the band the encoder expects."""

    def __post_init__(self) -> None:
        if self.sample_rate <= 0 or self.hop_length <= 0 or self.subsampling_factor <= 0:
            raise ValueError(f"audio config needs positive rates and factors, got {self}")
        if self.subsampling_factor & (self.subsampling_factor - 1):
            raise ValueError(f"subsampling_factor must be a power of two, got {self.subsampling_factor}")

    @property
    def frame_seconds(self) -> float:
        return self.hop_length * self.subsampling_factor / self.sample_rate


@dataclass(frozen=True)
class AdapterConfig:
    """Modality adapter: encoder frames -> LM input embeddings."""

    encoder_hidden: int
    """Width He of the encoder output."""
    lm_hidden: int
    """Width H of the LM embeddings."""
    num_layers: int = 0
    """Transformer layers (pre-norm, bidirectional over one audio's frames) after the projection."""
    num_heads: int = 4
    """Attention heads of those layers."""
    ffn_mult: int = 2
    """MLP width multiple of those layers and of the projection's hidden layer."""

    def __post_init__(self) -> None:
        if self.encoder_hidden <= 0 or self.lm_hidden <= 0 or self.num_layers < 0:
            raise ValueError(f"bad adapter sizes: {self}")
        if self.num_layers and self.lm_hidden % self.num_heads:
            raise ValueError(f"lm_hidden {self.lm_hidden} is not divisible by num_heads {self.num_heads}")


@dataclass(frozen=True)
class SALMConfig:
    """What the directory's ``salm_config.json`` holds (the LM and encoder keep their own HF configs)."""

    audio: AudioConfig = field(default_factory=AudioConfig)
    """Audio front end."""
    adapter: AdapterConfig = field(default_factory=lambda: AdapterConfig(encoder_hidden=1, lm_hidden=1))
    """Modality adapter sizes."""

    def to_dict(self) -> dict[str, Any]:
        return {"audio": dataclasses.asdict(self.audio), "adapter": dataclasses.asdict(self.adapter)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SALMConfig":
        return cls(audio=AudioConfig(**d["audio"]), adapter=AdapterConfig(**d["adapter"]))


class ModalityAdapter(nn.Module):
    """Two-layer MLP projection He -> H, then optional transformer layers over each audio's frames."""

    def __init__(self, cfg: AdapterConfig):
        super().__init__()
        hid = cfg.lm_hidden * cfg.ffn_mult
        self.proj = nn.Sequential(nn.Linear(cfg.encoder_hidden, hid), nn.GELU(), nn.Linear(hid, cfg.lm_hidden))
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(
                cfg.lm_hidden, cfg.num_heads, cfg.lm_hidden * cfg.ffn_mult, dropout=0.0, batch_first=True,
                norm_first=True,
            )
            for _ in range(cfg.num_layers)
        )

    def forward(self, x_BNE: torch.Tensor, valid_BN: torch.Tensor) -> torch.Tensor:
        h = self.proj(x_BNE)
        for layer in self.layers:
            h = layer(h, src_key_padding_mask=~valid_BN)
        return h


def _subsampled_length(n_feat: torch.Tensor, factor: int, kernel: int = 3) -> torch.Tensor:
    """Encoder output frames for ``n_feat`` feature frames (ParakeetEncoder's own rule)."""
    lengths = n_feat.to(torch.float)
    add_pad = (kernel - 1) // 2 * 2 - kernel
    for _ in range(int(math.log2(factor))):
        lengths = torch.floor((lengths + add_pad) / 2 + 1.0)
    return lengths.to(torch.long)


class SALM(nn.Module):
    """Speech LLM = feature extractor + ParakeetEncoder + ModalityAdapter + causal LM + tokenizer."""

    def __init__(self, config: SALMConfig, lm: nn.Module, encoder: nn.Module, tokenizer, feature_extractor,
                 adapter: nn.Module | None = None):
        super().__init__()
        self.config = config
        self.lm = lm
        self.encoder = encoder
        # an imported SALM brings its own adapter (same call: frames [B, N, He] + validity [B, N] -> [B, N, H])
        self.adapter = ModalityAdapter(config.adapter) if adapter is None else adapter
        self.tokenizer = tokenizer
        self.feature_extractor = feature_extractor
        lm_hidden = int(lm.config.get_text_config().hidden_size)
        if config.adapter.lm_hidden != lm_hidden:
            raise ValueError(
                f"the SALM's adapter outputs {config.adapter.lm_hidden}-wide frames but its LM's hidden size is "
                f"{lm_hidden}; salm_config.json's adapter.lm_hidden must equal lm/config.json's hidden_size"
            )
        enc_hidden = getattr(getattr(encoder, "config", None), "hidden_size", None)
        if enc_hidden is not None and config.adapter.encoder_hidden != int(enc_hidden):
            raise ValueError(
                f"the SALM's adapter takes {config.adapter.encoder_hidden}-wide encoder frames but its encoder's "
                f"hidden size is {enc_hidden}; salm_config.json's adapter.encoder_hidden must equal "
                "encoder/config.json's"
            )
        if tokenizer.chat_template is None:
            raise ValueError("the SALM's tokenizer has no chat template; set tokenizer.chat_template first")
        pid = tokenizer.convert_tokens_to_ids(config.audio.placeholder)
        if pid is None or pid == tokenizer.unk_token_id:
            raise ValueError(
                f"placeholder {config.audio.placeholder!r} is not a token of the tokenizer; add it as a special token"
            )
        self.placeholder_id = int(pid)
        self.audio_token_id = int(config.audio.audio_token_id if config.audio.audio_token_id is not None else pid)
        if feature_extractor.sampling_rate != config.audio.sample_rate:
            raise ValueError(
                f"feature extractor rate {feature_extractor.sampling_rate} != audio config {config.audio.sample_rate}"
            )

    # ---------------------------------------------------------------- construction and files
    @classmethod
    def build(
        cls,
        *,
        lm_config,
        encoder_config,
        tokenizer,
        adapter_layers: int = 0,
        audio: AudioConfig | None = None,
        seed: int = 0,
    ) -> "SALM":
        """Random-init SALM from HF configs (an LM config of any causal-LM family, a ParakeetEncoderConfig)."""
        from transformers import AutoModelForCausalLM, ParakeetEncoder, ParakeetFeatureExtractor

        audio = audio or AudioConfig(subsampling_factor=encoder_config.subsampling_factor)
        if audio.subsampling_factor != encoder_config.subsampling_factor:
            raise ValueError("audio.subsampling_factor must equal the encoder's subsampling_factor")
        torch.manual_seed(seed)
        lm = AutoModelForCausalLM.from_config(lm_config)
        enc = ParakeetEncoder(encoder_config)
        fe = ParakeetFeatureExtractor(
            feature_size=encoder_config.num_mel_bins, sampling_rate=audio.sample_rate, hop_length=audio.hop_length
        )
        cfg = SALMConfig(
            audio=audio,
            adapter=AdapterConfig(
                encoder_hidden=encoder_config.hidden_size,
                lm_hidden=lm_config.hidden_size,
                num_layers=adapter_layers,
                num_heads=max(1, min(4, lm_config.hidden_size // 16)),
            ),
        )
        return cls(cfg, lm, enc, tokenizer, fe)

    def save_pretrained(self, path: str | Path) -> Path:
        from safetensors.torch import save_file

        root = Path(path)
        root.mkdir(parents=True, exist_ok=True)
        self.lm.save_pretrained(root / "lm")
        self.encoder.save_pretrained(root / "encoder")
        self.feature_extractor.save_pretrained(root / "feature_extractor")
        self.tokenizer.save_pretrained(root / "tokenizer")
        save_file({k: v.contiguous() for k, v in self.adapter.state_dict().items()}, str(root / ADAPTER_FILE))
        (root / SALM_CONFIG_FILE).write_text(json.dumps(self.config.to_dict(), indent=2, sort_keys=True))
        return root

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: torch.dtype | None = None,
                        device: str | None = None) -> "SALM":
        """Load a directory written by ``save_pretrained`` (local files only)."""
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM, AutoTokenizer, ParakeetEncoder, ParakeetFeatureExtractor

        root = Path(path)
        cfg_file = root / SALM_CONFIG_FILE
        if not cfg_file.is_file():
            raise FileNotFoundError(
                f"{cfg_file} not found: {root} is not a SALM directory (expected salm_config.json, lm/, encoder/, "
                "feature_extractor/, tokenizer/, adapter.safetensors, as written by SALM.save_pretrained)"
            )
        for sub in ("lm", "encoder", "feature_extractor", "tokenizer"):
            if not (root / sub).is_dir():
                raise FileNotFoundError(f"{root / sub} is missing: the SALM directory {root} is incomplete")
        cfg = SALMConfig.from_dict(json.loads(cfg_file.read_text()))
        lm = AutoModelForCausalLM.from_pretrained(root / "lm", local_files_only=True, dtype=dtype or torch.float32)
        enc = ParakeetEncoder.from_pretrained(root / "encoder", local_files_only=True, dtype=dtype or torch.float32)
        fe = ParakeetFeatureExtractor.from_pretrained(root / "feature_extractor", local_files_only=True)
        tok = AutoTokenizer.from_pretrained(root / "tokenizer", local_files_only=True)
        model = cls(cfg, lm, enc, tok, fe)
        model.adapter.load_state_dict(load_file(str(root / ADAPTER_FILE)))
        model.to(dtype=dtype or torch.float32)
        if device is not None:
            model.to(device)
        return model.eval()

    # ---------------------------------------------------------------- audio
    @property
    def device(self) -> torch.device:
        return next(self.lm.parameters()).device

    def num_frames(self, num_samples: int) -> int:
        """Encoder frames for an audio of ``num_samples`` samples at the encoder rate."""
        n_feat = torch.tensor([num_samples // self.config.audio.hop_length])
        return int(_subsampled_length(n_feat, self.config.audio.subsampling_factor)[0])

    def featurize(self, waveforms: Sequence[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-mel features [B, F, mel] and their validity mask [B, F] for mono waveforms at the encoder rate."""
        feats = self.feature_extractor(
            [np.asarray(w, dtype=np.float32) for w in waveforms],
            sampling_rate=self.config.audio.sample_rate,
            return_tensors="pt",
            return_attention_mask=True,
        )
        return feats["input_features"], feats["attention_mask"]

    def encode_features(self, feats_BFM: torch.Tensor, feat_mask_BF: torch.Tensor) -> list[torch.Tensor]:
        """Encoder + adapter on a padded feature batch -> one [N_i, H] tensor per audio."""
        dev = self.device
        dtype = next(self.encoder.parameters()).dtype
        out = self.encoder(feats_BFM.to(dev, dtype), attention_mask=feat_mask_BF.to(dev))
        h = out.last_hidden_state
        lengths = _subsampled_length(feat_mask_BF.sum(-1), self.config.audio.subsampling_factor).tolist()
        valid = torch.arange(h.shape[1], device=dev)[None, :] < torch.tensor(lengths, device=dev)[:, None]
        h = self.adapter(h, valid)
        return [h[i, : lengths[i]] for i in range(h.shape[0])]

    def encode_audio(self, waveforms: Sequence[np.ndarray]) -> list[torch.Tensor]:
        if not waveforms:
            return []
        return self.encode_features(*self.featurize(waveforms))

    # ---------------------------------------------------------------- text
    def tokenize(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = False):
        """Chat-template ``messages`` -> (token ids int64 [L], assistant mask bool [L])."""
        out = self.tokenizer.apply_chat_template(
            messages,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=not add_generation_prompt,
            add_generation_prompt=add_generation_prompt,
        )
        ids = torch.tensor(out["input_ids"], dtype=torch.long)
        if add_generation_prompt:
            return ids, torch.zeros_like(ids, dtype=torch.bool)
        return ids, torch.tensor(out["assistant_masks"], dtype=torch.bool)

    def expand(self, token_ids: torch.Tensor, assistant_mask: torch.Tensor,
               audio_embeds: Sequence[torch.Tensor]) -> Expanded:
        return expand_placeholders(
            token_ids.to(self.device),
            assistant_mask.to(self.device),
            audio_embeds,
            placeholder_id=self.placeholder_id,
            audio_token_id=self.audio_token_id,
            embed=self.lm.get_input_embeddings(),
        )

    def forward(self, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor | None = None, **kw):
        return self.lm(inputs_embeds=inputs_embeds, attention_mask=attention_mask, **kw)
