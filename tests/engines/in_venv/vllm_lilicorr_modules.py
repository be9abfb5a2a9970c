"""vLLM's own LiLiCorr head on a LiLiCorr export, on a CPU: run INSIDE the vLLM venv.

    python vllm_lilicorr_modules.py EXPORT_DIR JOB.json OUT.json

vLLM serves LiLiCorr only through its V2 model runner (Triton: GPU only), so the served check is
``benchmarks/gpu.sh``'s. What a CPU can check is vLLM's own code, from vllm/model_executor/models/lilicorr.py:

modules     ``LiLiCorrHead`` is built from the export's ``config.json`` exactly as ``LiLiCorr.__init__`` builds it
            (model hidden size, the ``dflash_config`` block size and ``lilicorr_*`` fields, rms_norm_eps), and every
            export tensor under ``lilicorr.`` is copied into the matching parameter, which must exist with the same
            shape; OUT lists what was loaded, left unset, mismatched or not taken (``load_weights``' coverage rule).
walk        JOB's ``walks`` (each ``token_embeddings`` [S, k, H], ``log_probs`` [S, k], ``pass_hidden`` [S, H],
            ``anchor_hidden`` [H], ``anchor_valid``, ``candidates`` [S, k]) are scored by the head's ``forward``
            after ``materialize_inference_buffers`` (the module cast to float64, so OUT is vLLM's arithmetic, not
            its rounding) and walked as ``_selector_walk_kernel`` walks greedily (vllm/v1/worker/gpu/spec_decode/
            dflash2/speculator.py): previous index 0, then the argmax of row [step, previous].
"""

import json
import os
import sys

from vllm_load import load_into, single_process


def build(cfg: dict, LiLiCorrHead):
    dcfg = cfg["dflash_config"]
    return LiLiCorrHead(model_hidden_size=int(cfg["hidden_size"]), block_size=int(dcfg["block_size"]),
                        rms_norm_eps=float(cfg["rms_norm_eps"]), config=dcfg, prefix="lilicorr")


def walk(torch, head, jobs: list) -> list:
    head.double()
    for sub in head.modules():  # as vLLM's loader finishes every layer (CPU: picks its GEMM)
        method = getattr(sub, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(sub)
    head.materialize_inference_buffers(torch.device("cpu"), torch.float64)
    out = []
    for w in jobs:
        t = {k: torch.tensor(w[k], dtype=torch.float64)[None]
             for k in ("token_embeddings", "log_probs", "pass_hidden", "anchor_hidden")}
        scores = head(t["token_embeddings"], t["log_probs"], t["pass_hidden"], t["anchor_hidden"],
                      torch.tensor([bool(w["anchor_valid"])]))[0].double()
        cand, previous, tokens = w["candidates"], 0, []
        for step in range(scores.shape[0]):
            previous = int(scores[step, previous].argmax())
            tokens.append(int(cand[step][previous]))
        out.append({"tokens": tokens, "scores": scores.tolist()})
    return out


def main(export: str, job_path: str, out_path: str) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from safetensors.torch import load_file
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.config.compilation import CompilationMode
    from vllm.model_executor.models.lilicorr import LiLiCorrHead

    cfg = json.load(open(os.path.join(export, "config.json")))
    weights = load_file(os.path.join(export, "model.safetensors"))
    job = json.load(open(job_path))
    vllm_config = VllmConfig(compilation_config=CompilationConfig(mode=CompilationMode.NONE))
    with set_current_vllm_config(vllm_config):
        single_process(out_path)
        head = build(cfg, LiLiCorrHead)
        doc = load_into({"lilicorr": head}, weights)
        with torch.no_grad():
            doc["walks"] = walk(torch, head, job.get("walks", []))
    with open(out_path, "w") as f:
        json.dump(doc, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
