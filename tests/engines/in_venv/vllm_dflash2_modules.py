"""Build vLLM's own DFlash2 modules for an export and load the export's tensors into them: run INSIDE the vLLM venv.

    python vllm_dflash2_modules.py EXPORT_DIR OUT.json

vLLM serves DFlash2 only through its V2 model runner (Triton: GPU only), so on a CPU the served check is
``benchmarks/gpu.sh``'s. What a CPU can check is vLLM's own code: its ``DFlashGroupedConv`` (per layer,
attention and MLP) and ``CandidateSelector`` are built from the export's ``config.json`` exactly as
``DFlash2Qwen3DecoderLayer`` / ``DFlash2Qwen3Model`` build them, and every export tensor of theirs is copied
into the matching parameter, which must exist with the same shape. OUT lists what was loaded and what of the
modules' parameters the export left unset.
"""

import json
import os
import sys

from vllm_load import load_into, single_process


def build(cfg: dict, torch, CandidateSelector, DFlashGroupedConv) -> dict:
    """vLLM's DFlash2 modules for this config, keyed by the export's name prefix."""
    d = cfg["dflash_config"]
    modules = {}
    for i in range(cfg["num_hidden_layers"]):
        for part in ("attention_conv", "mlp_conv"):
            modules[f"layers.{i}.{part}"] = DFlashGroupedConv(
                hidden_size=cfg["hidden_size"], taps=int(d["conv_kernel_size"]), group_size=int(d["conv_group_size"]),
                block_size=int(cfg["block_size"]), params_dtype=torch.float32, prefix=part)
    modules["candidate_selector"] = CandidateSelector(
        hidden_size=cfg["hidden_size"], vocab_size=cfg["vocab_size"], rank=int(d["selector_rank"]),
        top_k=int(d["selector_top_k"]), params_dtype=torch.float32, prefix="candidate_selector")
    return modules


def main(export: str, out_path: str) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from safetensors.torch import load_file
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.models.qwen3_dflash2 import CandidateSelector, DFlashGroupedConv

    cfg = json.load(open(os.path.join(export, "config.json")))
    weights = load_file(os.path.join(export, "model.safetensors"))
    with set_current_vllm_config(VllmConfig()):
        single_process(out_path)
        modules = build(cfg, torch, CandidateSelector, DFlashGroupedConv)
    doc = load_into(modules, weights)
    with open(out_path, "w") as f:
        json.dump(doc, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
