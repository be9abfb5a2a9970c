"""A causal LM with only its head in memory: the decoder layers stay on the meta device.

``capture --engine vllm`` runs the forward in vLLM; tapdraft's own process needs only the tokenizer and
the frozen pieces the bundle stores and the teacher rows use: the input embedding, the final norm and the
lm_head (``capture.head``). Loading the whole model there would cost a 70B target's 140 GB of host memory
and minutes of reading for weights nothing uses. So the model is built on the meta device from its
config and just those tensors are read from its safetensors files (one file, or the shards named by
``model.safetensors.index.json``), by the names the model's own ``named_parameters`` gives them; a tied
lm_head is the embedding tensor again. The head is then proven against the engine's own forward
(``capture.vllm.engine``), since the decoder that ``capture.head.check_head`` runs is not here.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from tapdraft.capture.head import final_norm_module

INDEX = "model.safetensors.index.json"


def head_modules(lm: nn.Module) -> list[nn.Module]:
    """The input embedding, final norm and output embedding of a causal LM (the bundle's pieces)."""
    config = lm.config.get_text_config()
    norm = final_norm_module(lm.get_decoder(), int(config.hidden_size))
    return [lm.get_input_embeddings(), norm, lm.get_output_embeddings()]


def checkpoint_files(root: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it; {} when the directory has no safetensors weights."""
    if (root / INDEX).is_file():
        weight_map = json.loads((root / INDEX).read_text())["weight_map"]
        return {name: root / f for name, f in weight_map.items()}
    single = root / "model.safetensors"
    if not single.is_file():
        return {}
    from safetensors import safe_open

    with safe_open(str(single), "pt") as f:
        return {name: single for name in f.keys()}


def load_head_only(root: Path, *, dtype: torch.dtype, device: str) -> nn.Module | None:
    """The causal LM at ``root`` with its head tensors loaded and everything else on the meta device; None
    when its checkpoint does not name those tensors as the model does (the caller loads it whole)."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    files = checkpoint_files(root)
    config = AutoConfig.from_pretrained(root, local_files_only=True)
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config, dtype=dtype)
    names: dict[int, list[str]] = {}
    for n, p in lm.named_parameters(remove_duplicate=False):  # a tied tensor has two names, one stored
        names.setdefault(id(p), []).append(n)
    wanted = [(m, attr, p) for m in head_modules(lm) for attr, p in m.named_parameters(recurse=False)]
    stored = {id(p): next((n for n in names[id(p)] if n in files), None) for _, _, p in wanted}
    if None in stored.values() or any(True for m in head_modules(lm) for _ in m.buffers()):
        return None  # a buffer (Gemma's embed_scale) is not in the checkpoint: only the whole model makes it
    loaded: dict[int, nn.Parameter] = {}
    for m, attr, p in wanted:
        if id(p) not in loaded:  # a tied lm_head is the embedding's tensor, read once
            name = stored[id(p)]
            with safe_open(str(files[name]), "pt", device="cpu") as f:
                t = f.get_tensor(name)
            loaded[id(p)] = nn.Parameter(t.to(device=device, dtype=dtype), requires_grad=False)
        setattr(m, attr, loaded[id(p)])
    return lm.eval()


def resident_bytes(lm: nn.Module) -> int:
    """Bytes of the model's parameters that are in memory (not on the meta device), each tensor once."""
    seen = {id(p): p for p in lm.parameters() if p.device.type != "meta"}
    return sum(p.numel() * p.element_size() for p in seen.values())
