"""Load a frozen target from its directory: picks the adapter from what the directory holds.

Its own module so that the adapters (every other module under capture/targets/) import nothing back: this
module sits above all of them.
"""

from __future__ import annotations

import json
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from tapdraft.capture.targets.base import Target
from tapdraft.capture.targets.causal_lm import CausalLMTarget
from tapdraft.capture.targets.granite_speech import load_granite_speech
from tapdraft.capture.targets.head_only import load_head_only
from tapdraft.capture.targets.hf_speech import load_qwen2_audio, load_qwen3_asr
from tapdraft.capture.targets.nemo.salm import is_nemo_salm, load_nemo_target
from tapdraft.capture.targets.salm.model import SALM
from tapdraft.capture.targets.salm.target import SALMTarget
from tapdraft.capture.targets.voxtral import load_voxtral

NATIVE_LOADERS = {
    "qwen2_audio": load_qwen2_audio,
    "qwen3_asr": load_qwen3_asr,
    "voxtral": load_voxtral,
    "granite_speech": load_granite_speech,
}
"""``config.json`` model types of the speech LLMs read with their own processor (capture.targets.hf_speech)."""

TESTED_LM_FAMILIES = ("qwen3", "qwen2", "llama", "mistral", "gemma", "gemma2", "gemma3_text", "phi3", "phi",
                      "granite", "qwen3_moe", "olmoe")
"""Causal-LM model types tested end to end (tests/capture/targets/test_families.py). Any other type transformers
loads as a causal LM is accepted when its head passes ``capture.head.check_head``."""

LEGACY_TARGET_KINDS = {
    "CausalLMTarget": "causal_lm",
    "SALMTarget": "salm",
    "NeMoSALMTarget": "nemo_salm",
    "Qwen2AudioTarget": "qwen2_audio",
    "Qwen3ASRTarget": "qwen3_asr",
    "VoxtralTarget": "voxtral",
    "GraniteSpeechTarget": "granite_speech",
}
"""The manifest's ``target_kind`` as captures before the kind strings recorded it (the adapter's class name) ->
the adapter's ``Target.kind``. Frozen: a class renamed later keeps its old name here."""


def manifest_target_kind(extra: dict[str, Any]) -> str | None:
    """The target kind a capture's manifest ``extra`` records (``Target.kind``), a manifest that recorded the
    adapter's class name included (:data:`LEGACY_TARGET_KINDS`); None when it records none."""
    kind = extra.get("target_kind")
    return None if kind is None else LEGACY_TARGET_KINDS.get(kind, kind)


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def checkpoint_dtype(root: Path) -> torch.dtype | None:
    """The dtype a saved model stores its weights in: config.json's ``dtype``/``torch_dtype`` (or its text
    config's), else the first floating tensor's in ``model.safetensors`` (a NeMo checkpoint's config does
    not say); None when neither tells."""
    doc = json.loads((root / "config.json").read_text()) if (root / "config.json").is_file() else {}
    for d in (doc, doc.get("text_config") or {}):
        name = d.get("dtype") or d.get("torch_dtype")
        if isinstance(name, str) and name in _DTYPES:
            return _DTYPES[name]
    weights = root / "model.safetensors"
    if weights.is_file():
        from safetensors import safe_open

        with safe_open(str(weights), "pt") as f:
            for name in f.keys():
                dtype = f.get_slice(name).get_dtype()
                if dtype in ("F32", "BF16", "F16"):
                    return {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}[dtype]
    return None


def _unsupported(root: Path, model_type: Any) -> ValueError:
    return ValueError(
        f"{root}: model type {model_type!r} is not supported; capture reads a SALM directory, a NeMo SALM "
        f"checkpoint, the speech LLMs "
        f"{', '.join(NATIVE_LOADERS)}, or a text causal LM that transformers loads (tested: "
        f"{', '.join(TESTED_LM_FAMILIES)}). To add a speech LLM, register its loader in "
        "capture.targets.load.NATIVE_LOADERS; "
        "a causal LM needs a transformers release that knows its model type"
    )


@contextmanager
def quiet_loading() -> Iterator[None]:
    """transformers' own progress bars ("Loading weights") off while a target loads, then as they were:
    the command shows its own progress, and a second bar only adds noise to logs."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def load_target(path: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
                llm_config: str | Path | None = None, template: str | None = None,
                template_kwargs: dict[str, Any] | None = None, head_only: bool = False) -> Target:
    """A SALM directory (salm_config.json), a NeMo SALM checkpoint, an HF-native speech LLM or an HF causal LM.

    A NeMo speechlm2 SALM is recognised by config.json's content (:func:`capture.nemo.is_nemo_salm`), its
    LLM config and tokenizer taken from the checkpoint or ``llm_config``. Otherwise the kind comes from
    ``model_type``: one of :data:`NATIVE_LOADERS` loads with its processor, a causal-LM model type with its
    tokenizer; anything else is refused in one line that names what is supported and how to add it.
    ``template``: chat-template text replacing the tokenizer's; ``template_kwargs``: the variables it is
    rendered with (``Target.use_template``). The target's head is derived and proven here
    (``Target.head``), so a head the bundle cannot describe is refused at load, not mid-capture.
    ``head_only``: a causal LM's decoder layers stay on the meta device (``capture.targets.head_only``: for an engine
    that runs the forward elsewhere); its head is then derived here and proven by that engine.
    """
    root = Path(path)
    with quiet_loading():
        target = _load(root, dtype=dtype, device=device, llm_config=llm_config, head_only=head_only)
    target.use_template(template, template_kwargs)  # a tokenizer without a template is refused here, at load
    target.checkpoint_dtype = checkpoint_dtype(root / "lm" if (root / "salm_config.json").is_file() else root)
    target.head  # derive and check now
    return target


def _load(root: Path, *, dtype: torch.dtype, device: str, llm_config: str | Path | None,
          head_only: bool = False) -> Target:
    if not root.is_dir():
        raise FileNotFoundError(f"target directory {root} does not exist")
    if (root / "salm_config.json").is_file():
        return SALMTarget(SALM.from_pretrained(root, dtype=dtype, device=device), root)
    if (root / "config.json").is_file():
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        config = json.loads((root / "config.json").read_text())
        if is_nemo_salm(config):
            return load_nemo_target(root, llm_config=llm_config, dtype=dtype, device=device)
        model_type = config.get("model_type")
        if model_type in NATIVE_LOADERS:
            return NATIVE_LOADERS[model_type](root, dtype=dtype, device=device)
        if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            raise _unsupported(root, model_type)
        lm = load_head_only(root, dtype=dtype, device=device) if head_only else None
        if head_only and lm is None:
            warnings.warn(f"{root}: its head cannot be loaded alone (its checkpoint names the head tensors otherwise, "
                          "or the head holds a buffer); loading the whole model", stacklevel=3)
        if lm is None:
            lm = AutoModelForCausalLM.from_pretrained(root, local_files_only=True, dtype=dtype).to(device)
        tok = AutoTokenizer.from_pretrained(root, local_files_only=True)
        return CausalLMTarget(lm, tok, root)
    raise FileNotFoundError(
        f"{root} is neither a SALM directory (salm_config.json) nor an HF model directory (config.json)"
    )
