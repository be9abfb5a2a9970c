"""Import a NeMo speechlm2 SALM checkpoint (Canary-Qwen layout) as a capture target, without NeMo.

The layout is what NeMo's ``PyTorchModelHubMixin`` writes (``SALM.save_pretrained`` / ``to_hf.py``)::

    config.json          the model cfg: pretrained_llm, pretrained_asr, audio_locator_tag, prompt_format,
                         lora {r, lora_alpha, target_modules, ...}, perception {preprocessor, encoder,
                         modality_adapter, output_dim}; save_pretrained (3.0.0) adds model_type
                         "nemo_speechlm" and architectures ["NeMoSpeechLMForConditionalGeneration"]
    model.safetensors    embed_tokens.weight (moved out of the LLM); the LLM under llm. or, with LoRA,
                         llm.base_model.model. (PEFT: ...base_layer.weight, ...lora_A[.default].weight,
                         ...lora_B[.default].weight); a tied lm_head absent (save_pretrained: deduplicated,
                         the file metadata naming the kept embed_tokens.weight); perception.preprocessor
                         .featurizer.{window,fb}, perception.encoder.*, perception.modality_adapter.*,
                         perception.proj.*
    llm_backbone/        (newer exports) the LLM's HF config; tokenizer files may sit at the root

``SALMAutomodel`` checkpoints (NeMo Automodel's LLM) keep the embedding inside the LLM
(``llm.model.embed_tokens.weight``, or the tied ``llm.lm_head.weight`` it was deduplicated into) and
Automodel's own LoRA (``...q_proj.weight`` + ``...q_proj.lora_{A,B}.weight``, config ``dim``/``alpha``).

Otherwise ``pretrained_llm`` names the LLM, and nothing is downloaded here: its config and tokenizer
come from a local directory, the one the user gives (``--llm-config DIR``, e.g. a local copy of
Qwen/Qwen3-1.7B) or ``pretrained_llm`` (and ``tokenizer_path``) itself when that is one. The import
maps every part onto the project's own SALM (:mod:`capture.targets.salm.model`):

- LLM: ``AutoModelForCausalLM`` from that config, ``embed_tokens`` put back, LoRA merged in float32
  as W + scale * B @ A (scale = lora_alpha / r, or / sqrt(r) with use_rslora), tied head when the
  checkpoint has no lm_head;
- audio: :mod:`capture.targets.nemo.audio` (NeMo's mel front end with its stored buffers, the FastConformer
  on ParakeetEncoder, the conformer adapter and projection);
- prompt: NeMo's ``qwen`` format (user/assistant turns only, no BOS) or ``qwen3`` (system turns too,
  the think block: :data:`QWEN3_PROMPT_TEMPLATE`) as a chat template; the locator tag
  (``<|audioplaceholder|>``) is added to the tokenizer as NeMo does and replaced by the clip's frames.
  One frame per hop * subsampling samples (80 ms): feature frames n // hop, then floor((L - 1) / 2 + 1)
  per stride-2 stage. The supervised mask covers each assistant reply and its ``<|im_end|>`` (what
  decoding generates); NeMo's training mask also covers the ``<|im_start|>assistant\\n`` prefix.

Detection is by ``config.json`` content (``pretrained_llm`` + ``perception.encoder``): transformers
5.24 maps ``model_type: nemo_speechlm`` to its own Nemotron transcription classes, so the type alone
cannot decide. Sources (github.com/NVIDIA/NeMo, 2025-09, and the nemo-toolkit 3.0.0 wheel):
``nemo/collections/speechlm2/models/salm.py`` (embedding moved out, placeholder replacement, generation
prompt), ``models/salm_automodel.py`` (embedding kept in the LLM), ``parts/lora.py`` (PEFT LoRA on the
LLM), ``parts/automodel_lora.py`` (Automodel's), ``parts/hf_hub.py`` (config.json + model.safetensors
through huggingface_hub's mixin, i.e. ``safetensors.torch.save_model``), ``parts/pretrained.py`` (LLM
from its config, float32), ``nemo/collections/common/prompts/qwen.py`` and ``formatter.py`` (the
prompt formats).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tapdraft.capture.inputs import Conversation
from tapdraft.capture.targets.nemo.audio import (MelSettings, NeMoAdapter, NeMoMelFrontEnd, build_conformer, load_exactly,
                                no_init)
from tapdraft.capture.targets.base import Prepared
from tapdraft.capture.targets.salm.model import SALM, AdapterConfig, AudioConfig, SALMConfig
from tapdraft.capture.targets.salm.target import SALMTarget

WEIGHTS_FILE = "model.safetensors"
LLM_BACKBONE_DIR = "llm_backbone"
PEFT_PREFIX = "llm.base_model.model."
PLAIN_PREFIX = "llm."

QWEN_PROMPT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ '<|im_start|>user\n' + m['content'] + '<|im_end|>\n' }}"
    "{% elif m['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ raise_exception(\"NeMo's qwen prompt format has only user and assistant turns, not '\" "
    "+ m['role'] + \"'\") }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""NeMo's QwenPromptFormatter (user and assistant templates, INFERENCE_PREFIX) as a chat template."""

QWEN3_PROMPT_TEMPLATE = (
    "{% for m in messages %}{% set text = m['content'] %}"
    "{% if m['role'] == 'system' %}"
    "{% if not (loop.first and text | trim == '') %}{{ '<|im_start|>system\n' + text + '<|im_end|>\n' }}{% endif %}"
    "{% elif m['role'] == 'user' %}{{ '<|im_start|>user\n' + text + '<|im_end|>\n' }}"
    "{% elif m['role'] == 'assistant' %}"
    "{% if not loop.last %}"
    "{% if '</think>' in text %}{% set text = text.split('</think>')[1] | trim %}{% endif %}"
    "{% elif '<think>' not in text %}"
    "{% if '</think>' in text %}{{ raise_exception('an assistant turn has </think> without <think>') }}{% endif %}"
    "{% set text = '<think>\n\n</think>\n\n' + text %}"
    "{% else %}"
    "{% if not text.startswith('<think>') or '</think>' not in text %}"
    "{{ raise_exception('an assistant turn with <think> must start with it and close it with </think>') }}"
    "{% endif %}"
    "{% set text = '<think>\n' + (text.split('<think>')[1].split('</think>')[0] | trim) + '\n</think>\n\n' "
    "+ text.split('</think>')[1].lstrip('\n') %}"
    "{% endif %}"
    "{% if loop.last %}{{ '<|im_start|>assistant\n' }}{% generation %}{{ text + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\n' }}{% else %}{{ '<|im_start|>assistant\n' + text + '<|im_end|>\n' }}{% endif %}"
    "{% else %}{{ raise_exception(\"NeMo's qwen3 prompt format has only system, user and assistant turns, not '\" "
    "+ m['role'] + \"'\") }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}"
)
"""NeMo's Qwen3PromptFormatter (``nemo/collections/common/prompts/qwen.py``, nemo-toolkit 3.0.0) as a chat
template, its deterministic part: an empty leading system turn is dropped; earlier assistant turns keep
only the text after ``</think>``, stripped; the last assistant turn becomes ``<think>`` + newline +
reasoning + newline + ``</think>`` + two newlines + answer (an empty think block when it has none); the
generation prompt gains the empty block with ``enable_thinking=False`` (a template kwarg; NeMo's default
is thinking on). Only the last assistant turn is supervised, as in NeMo's mask: earlier ones are rendered
without the think block the model wrote them with. NeMo's training also adds ``/no_think`` (or
``/think``) to a randomly chosen user or system turn; that augmentation is random and NeMo's ``generate``
does not add it, so it is not rendered here (text that carries the tag keeps it)."""

PROMPT_TEMPLATES = {"qwen": QWEN_PROMPT_TEMPLATE, "qwen3": QWEN3_PROMPT_TEMPLATE}
PROMPT_ROLES = {"qwen": ("user", "assistant"), "qwen3": ("system", "user", "assistant")}
"""The turn roles each prompt format renders."""


def is_nemo_salm(config: dict[str, Any]) -> bool:
    """Whether a parsed ``config.json`` is a NeMo speechlm2 SALM's."""
    perception = config.get("perception")
    return "pretrained_llm" in config and isinstance(perception, dict) and isinstance(perception.get("encoder"), dict)


@dataclass(frozen=True)
class LoRASettings:
    """The checkpoint's ``lora`` block (PEFT LoraConfig fields that decide the merge)."""

    r: int = 8
    """Rank."""
    lora_alpha: float = 8.0
    """Scaling numerator."""
    use_rslora: bool = False
    """Scale by alpha / sqrt(r) instead of alpha / r."""

    def __post_init__(self) -> None:
        if self.r < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.r}")

    @property
    def scale(self) -> float:
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    @classmethod
    def from_nemo(cls, d: dict[str, Any], *, automodel: bool = False) -> "LoRASettings":
        """PEFT's LoraConfig fields (SALM), or Automodel's PeftConfig ones (SALMAutomodel: ``dim``, ``alpha``,
        defaults 8 and 32, scale alpha / dim; ``nemo_automodel/components/_peft/lora.py``)."""
        for key in ("use_dora", "lora_bias"):
            if d.get(key):
                raise ValueError(f"LoRA with {key}=true cannot be merged by this importer")
        if automodel:
            return cls(r=int(d.get("dim", 8)), lora_alpha=float(d.get("alpha", 32)))
        return cls(r=int(d.get("r", 8)), lora_alpha=float(d.get("lora_alpha", 8)),
                   use_rslora=bool(d.get("use_rslora", False)))


_LORA_KEY = re.compile(r"^(.*)\.lora_([AB])(?:\.default)?\.weight$")


def is_automodel_layout(weights: dict[str, torch.Tensor]) -> bool:
    """SALMAutomodel keeps the embedding inside the LLM (``llm.model.embed_tokens.weight``, Automodel's LoRA
    unwrapped: ``...q_proj.weight`` beside ``...q_proj.lora_A.weight``); SALM moves it to ``embed_tokens.weight``."""
    return "embed_tokens.weight" not in weights and f"{PLAIN_PREFIX}model.embed_tokens.weight" in weights


def restore_shared(weights: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> dict[str, torch.Tensor]:
    """The names ``safetensors.torch.save_model`` (NeMo's hub mixin) dropped as aliases of a kept tensor: it keeps
    the alphabetically first name of each shared group and records ``{dropped: kept}`` in the file metadata
    (a tied SALM head: ``llm...lm_head.weight -> embed_tokens.weight``; a tied SALMAutomodel:
    ``llm.model.embed_tokens.weight -> llm.lm_head.weight``)."""
    out = dict(weights)
    for dropped, kept in (metadata or {}).items():
        if dropped not in out and kept in out:
            out[dropped] = out[kept]
    return out


def llm_state_dict(weights: dict[str, torch.Tensor], lora: LoRASettings | None) -> dict[str, torch.Tensor]:
    """The LLM's HF state dict (float32) from a SALM checkpoint: prefixes stripped, LoRA merged, embedding back
    (SALM; a SALMAutomodel's is already there)."""
    prefix = PEFT_PREFIX if any(k.startswith(PEFT_PREFIX) for k in weights) else PLAIN_PREFIX
    base: dict[str, torch.Tensor] = {}
    factors: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in weights.items():
        if not key.startswith(prefix):
            continue
        name = key[len(prefix):]
        m = _LORA_KEY.match(name)
        if m:
            factors.setdefault(m.group(1), {})[m.group(2)] = value
        else:
            base[name.replace(".base_layer.", ".")] = value.float()
    if factors and lora is None:
        raise ValueError("the checkpoint holds LoRA weights but config.json has no 'lora' block to scale them")
    for module, ab in factors.items():
        if set(ab) != {"A", "B"} or f"{module}.weight" not in base:
            raise ValueError(f"LoRA on {module} is incomplete (need base_layer, lora_A and lora_B weights)")
        base[f"{module}.weight"] = base[f"{module}.weight"] + lora.scale * (ab["B"].float() @ ab["A"].float())
    if "embed_tokens.weight" in weights:
        base["model.embed_tokens.weight"] = weights["embed_tokens.weight"].float()
    elif "model.embed_tokens.weight" not in base:
        raise ValueError("the checkpoint has neither embed_tokens.weight (SALM) nor llm.model.embed_tokens.weight "
                         "(SALMAutomodel): not a NeMo SALM export")
    return base


def _local(name: Any, file: str) -> Path | None:
    """``name`` (a config path, as NeMo passes it to transformers) when it is a local directory holding ``file``."""
    return Path(name) if isinstance(name, str) and name and (Path(name) / file).is_file() else None


def _llm_dirs(root: Path, llm_config: str | Path | None) -> tuple[Path, Path]:
    """(LLM config dir, tokenizer dir): inside the checkpoint when it has them, else ``llm_config``, else the
    local directories the config names (``tokenizer_path``, then ``pretrained_llm``, as NeMo reads them)."""
    given = None if llm_config is None else Path(llm_config)
    if given is not None and not (given / "config.json").is_file():
        raise FileNotFoundError(f"--llm-config {given} has no config.json; point it at a local copy of the LLM")
    cfg = json.loads((root / "config.json").read_text())
    name = cfg.get("pretrained_llm")
    cfg_dir = root / LLM_BACKBONE_DIR if (root / LLM_BACKBONE_DIR / "config.json").is_file() else (
        given or _local(name, "config.json"))
    tok_dir = root if (root / "tokenizer_config.json").is_file() else (
        given or _local(cfg.get("tokenizer_path"), "tokenizer_config.json") or _local(name, "tokenizer_config.json"))
    if cfg_dir is None or tok_dir is None:
        raise FileNotFoundError(
            f"{root} is a NeMo SALM checkpoint that names its LLM ({name!r}, not a local directory with them) "
            f"without including its {'config' if cfg_dir is None else 'tokenizer'}; "
            f"pass --llm-config DIR with a local copy of {name} "
            "(its config.json and tokenizer files)")
    return cfg_dir, tok_dir


def _tokenizer(tok_dir: Path, tag: str, prompt_format: str):
    # the formats: nemo/collections/common/prompts/qwen.py (nemo-toolkit 3.0.0: QwenPromptFormatter "qwen",
    # Qwen3PromptFormatter "qwen3")
    from transformers import AutoTokenizer

    if prompt_format not in PROMPT_TEMPLATES:
        raise ValueError(f"NeMo prompt format {prompt_format!r} is not supported "
                         f"(supported: {sorted(PROMPT_TEMPLATES)})")
    tok = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    if tag not in tok.get_vocab():
        tok.add_tokens([tag], special_tokens=True)  # NeMo: add_special_tokens({'additional_special_tokens': [tag]})
    tok.chat_template = PROMPT_TEMPLATES[prompt_format]
    return tok


def _llm(cfg_dir: Path, state: dict[str, torch.Tensor]) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(cfg_dir, local_files_only=True)
    with no_init():
        lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tied = bool(getattr(config.get_text_config(), "tie_word_embeddings", False))
    load_exactly(lm, state, what="LLM", may_miss=("lm_head.weight",) if tied else ())
    if "lm_head.weight" not in state and not tied:
        raise ValueError("the checkpoint has no lm_head.weight and the LLM config does not tie it to the embedding")
    if tied:
        lm.tie_weights()
    return lm.eval()


def _sub(weights: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}


def _adapter(perception: dict[str, Any], weights: dict[str, torch.Tensor], enc_width: int) -> tuple[NeMoAdapter, int]:
    """perception.modality_adapter + perception.proj, and the width they output."""
    ma = perception.get("modality_adapter") or {}
    kind = str(ma.get("_target_", ""))
    if kind.endswith("ConformerEncoder"):
        if int(ma.get("subsampling_factor", 4)) != 1:
            raise ValueError("a modality adapter that subsamples again is not supported (subsampling_factor must be 1)")
        conformer = build_conformer(ma, _sub(weights, "perception.modality_adapter."), what="modality adapter")
        width = int(ma["d_model"])
    elif kind.endswith("IdentityConnector"):
        conformer, width = None, enc_width
    else:
        raise ValueError(f"modality adapter {kind!r} is not supported (ConformerEncoder or IdentityConnector)")
    proj_w = _sub(weights, "perception.proj.")
    if proj_w:
        proj = nn.Linear(proj_w["weight"].shape[1], proj_w["weight"].shape[0], bias="bias" in proj_w)
        load_exactly(proj, proj_w, what="perception.proj")
        width = proj.out_features
    else:
        proj = nn.Identity()
    return NeMoAdapter(conformer, proj), width


def load_nemo_salm(root: Path, *, llm_config: str | Path | None = None) -> tuple[SALM, Path]:
    """The checkpoint as a float32 :class:`SALM` on CPU, and the directory its tokenizer files come from."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    cfg = json.loads((root / "config.json").read_text())
    if not (root / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"{root / WEIGHTS_FILE} not found: a NeMo SALM checkpoint keeps its weights there")
    cfg_dir, tok_dir = _llm_dirs(root, llm_config)
    with safe_open(str(root / WEIGHTS_FILE), "pt") as f:
        metadata = f.metadata()
    weights = restore_shared(load_file(str(root / WEIGHTS_FILE)), metadata)
    tag = cfg.get("audio_locator_tag", "<|audioplaceholder|>")
    tok = _tokenizer(tok_dir, tag, cfg.get("prompt_format", "qwen"))
    lora = LoRASettings.from_nemo(cfg["lora"], automodel=is_automodel_layout(weights)) if cfg.get("lora") else None
    lm = _llm(cfg_dir, llm_state_dict(weights, lora))

    perception = cfg["perception"]
    mel = MelSettings.from_nemo(perception.get("preprocessor") or {})
    fb, window = (weights.get(f"perception.preprocessor.featurizer.{n}") for n in ("fb", "window"))
    if fb is None or window is None:
        raise ValueError("the checkpoint lacks perception.preprocessor.featurizer.fb/window (NeMo's stored mel "
                         "filterbank and window), which the model was trained with")
    front = NeMoMelFrontEnd(mel, window, fb)
    enc_cfg = perception["encoder"]
    if int(enc_cfg.get("feat_in", mel.n_mels)) != mel.n_mels:
        raise ValueError(f"encoder feat_in {enc_cfg.get('feat_in')} != preprocessor features {mel.n_mels}")
    encoder = build_conformer(enc_cfg, _sub(weights, "perception.encoder."), what="encoder")
    adapter, width = _adapter(perception, weights, encoder.config.hidden_size)
    H = lm.get_input_embeddings().weight.shape[1]
    if width != H:
        raise ValueError(f"the audio path outputs width {width} but the LLM's embeddings are {H} wide")
    audio = AudioConfig(sample_rate=mel.sample_rate, hop_length=mel.hop_length,
                        subsampling_factor=encoder.config.subsampling_factor, placeholder=tag)
    salm_cfg = SALMConfig(audio=audio, adapter=AdapterConfig(encoder_hidden=encoder.config.hidden_size, lm_hidden=H))
    return SALM(salm_cfg, lm, encoder, tok, front, adapter=adapter).eval(), tok_dir


class NeMoSALMTarget(SALMTarget):
    """A NeMo SALM checkpoint; its tokenizer files live beside it or in the ``--llm-config`` directory."""

    kind = "nemo_salm"
    vllm_refused = "vLLM does not load NeMo SALM checkpoints (PEFT prefixes, LoRA to merge, NeMo encoder names)"

    def __init__(self, salm: SALM, path: str | Path, tokenizer_dir: Path, prompt_format: str = "qwen"):
        super().__init__(salm, path)
        self._tokenizer_dir = Path(tokenizer_dir)
        self.prompt_format = prompt_format

    @property
    def tokenizer_dir(self) -> Path:
        return self._tokenizer_dir

    def prepare(self, conv: Conversation, index: int) -> Prepared:
        allowed = PROMPT_ROLES[self.prompt_format]
        roles = sorted({m["role"] for m in conv.messages} - set(allowed))
        if roles:
            raise ValueError(f"has {roles} turn(s): NeMo's {self.prompt_format} prompt format has only "
                             f"{', '.join(allowed[:-1])} and {allowed[-1]} turns")
        return super().prepare(conv, index)


def load_nemo_target(root: str | Path, *, llm_config: str | Path | None = None, dtype: torch.dtype = torch.float32,
                     device: str = "cpu") -> NeMoSALMTarget:
    """:func:`load_nemo_salm` moved to ``dtype`` on ``device`` (the mel front end stays float32 on CPU)."""
    salm, tok_dir = load_nemo_salm(Path(root), llm_config=llm_config)
    prompt_format = json.loads((Path(root) / "config.json").read_text()).get("prompt_format", "qwen")
    return NeMoSALMTarget(salm.to(device=device, dtype=dtype), root, tok_dir, prompt_format)
