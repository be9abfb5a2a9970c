"""Load a frozen target from its directory: picks the adapter from what the directory holds.

Its own module so that the adapters (capture.targets, capture.salm, capture.hf_native, capture.voxtral,
capture.granite_speech, capture.nemo) import nothing back: this module sits above all of them.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from capture.granite_speech import load_granite_speech
from capture.hf_native import load_qwen2_audio, load_qwen3_asr
from capture.nemo import is_nemo_salm, load_nemo_target
from capture.salm import SALM
from capture.targets import CausalLMTarget, SALMTarget, Target
from capture.voxtral import load_voxtral

NATIVE_LOADERS = {
    "qwen2_audio": load_qwen2_audio,
    "qwen3_asr": load_qwen3_asr,
    "voxtral": load_voxtral,
    "granite_speech": load_granite_speech,
}
"""``config.json`` model types of the speech LLMs read with their own processor (capture.hf_native)."""


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
                template_kwargs: dict[str, Any] | None = None) -> Target:
    """A SALM directory (salm_config.json), a NeMo SALM checkpoint, an HF-native speech LLM or an HF causal LM.

    A NeMo speechlm2 SALM is recognised by config.json's content (:func:`capture.nemo.is_nemo_salm`), its
    LLM config and tokenizer taken from the checkpoint or ``llm_config``. Otherwise the kind comes from
    ``model_type``: one of :data:`NATIVE_LOADERS` loads with its processor, a causal-LM model type with its
    tokenizer; anything else is refused in one line that names what is supported. ``template``: chat-template
    text replacing the tokenizer's; ``template_kwargs``: the variables it is rendered with (``Target.use_template``).
    """
    with quiet_loading():
        target = _load(Path(path), dtype=dtype, device=device, llm_config=llm_config)
    target.use_template(template, template_kwargs)  # a tokenizer without a template is refused here, at load
    return target


def _load(root: Path, *, dtype: torch.dtype, device: str, llm_config: str | Path | None) -> Target:
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
            raise ValueError(
                f"{root}: model type {model_type!r} is not supported; capture reads a SALM directory, a NeMo SALM "
                f"checkpoint, the speech LLMs {', '.join(NATIVE_LOADERS)}, or a text causal LM"
            )
        lm = AutoModelForCausalLM.from_pretrained(root, local_files_only=True, dtype=dtype).to(device)
        tok = AutoTokenizer.from_pretrained(root, local_files_only=True)
        return CausalLMTarget(lm, tok, root)
    raise FileNotFoundError(
        f"{root} is neither a SALM directory (salm_config.json) nor an HF model directory (config.json)"
    )
