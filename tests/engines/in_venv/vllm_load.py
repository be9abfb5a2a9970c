"""What the in-venv module checks share, run INSIDE the vLLM venv (``python vllm_X_modules.py`` finds this module
beside it): vLLM's single-process parallel state, and the export's tensors copied into vLLM's modules with a report
of what was loaded, left unset, mismatched in shape, or exported for a module vLLM does not have."""

from __future__ import annotations

import os


def single_process(out_path: str) -> None:
    """vLLM's tensor/pipeline-parallel groups of size 1 (its layers ask for them); inside ``set_current_vllm_config``."""
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"file://{os.path.abspath(out_path)}.init")
    initialize_model_parallel(1, 1)


def load_into(modules: dict, weights: dict, prefixes: tuple[str, ...] = ()) -> dict:
    """Copy ``weights[f"{prefix}.{name}"]`` into each module's parameter ``name`` (``modules``: prefix -> module);
    an export tensor under one of ``prefixes`` (default: the modules') that nothing loaded is reported."""
    loaded, unset, mismatched = [], [], []
    for prefix, module in modules.items():
        for name, param in module.named_parameters():
            key = f"{prefix}.{name}"
            if key not in weights:
                unset.append(key)
            elif tuple(weights[key].shape) != tuple(param.shape):
                mismatched.append([key, list(weights[key].shape), list(param.shape)])
            else:
                param.data.copy_(weights[key])
                loaded.append(key)
    covered = [k for k in weights if any(k.startswith(p + ".") for p in prefixes or modules)]
    return {"loaded": sorted(loaded), "unset": unset, "mismatched": mismatched,
            "export_keys_not_in_vllm": sorted(set(covered) - set(loaded))}
