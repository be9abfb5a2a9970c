"""vLLM's own DSpark code on a DSpark export, on a CPU: run INSIDE the vLLM venv.

    python vllm_dspark_modules.py EXPORT_DIR JOB.json OUT.json

vLLM serves DSpark only through its V2 model runner (Triton: GPU only), so the served check is
``benchmarks/gpu.sh``'s. What a CPU can check is vLLM's own code, from vllm/model_executor/models/qwen3_dspark.py
and vllm/config/speculative.py:

modules     ``DSparkMarkovHead`` and (with ``enable_confidence_head``) ``DSparkConfidenceHead`` are built from the
            export's ``config.json`` exactly as ``Qwen3DSparkModel`` builds them, and every export tensor under
            ``markov_head.`` / ``confidence_head.`` is copied into the matching parameter, which must exist with
            the same shape; OUT lists what was loaded, left unset, mismatched or not taken.
walk        JOB's ``walks`` (each ``base_logits`` [K, V], ``anchor``, ``hidden`` [K, H]) are drafted as
            ``DSparkSpeculator._sample_sequential`` drafts greedily (vllm/v1/worker/gpu/spec_decode/dspark/
            speculator.py): prev = the anchor; per slot, ``markov_embed(prev)``, ``markov_bias`` through a
            ``LogitsProcessor`` at the config's ``logit_scale``, added to the base logits, argmax, fed back; and
            ``compute_confidence``'s sigmoid(confidence_head(hidden, markov_embed)). The Markov head runs in float64
            (cast), so OUT's tokens are vLLM's arithmetic, not its rounding; the confidence head in float32, as
            vLLM builds and runs it (``params_dtype=torch.float32``, its input cast to float32).
validate    JOB's ``validate`` cases call ``_validate_qwen3_omni_dspark(target, draft, num_speculative_tokens)``
            with a Qwen3-Omni target whose thinker ``text_config`` is JOB's ``target_text_config`` and the export
            (or ``draft_config_overrides`` on it) as the draft; OUT gives "ok" or vLLM's ValueError per case.
"""

import json
import os
import sys
from types import SimpleNamespace

from vllm_load import load_into, single_process


def build(cfg: dict, DSparkMarkovHead, DSparkConfidenceHead) -> dict:
    """vLLM's DSpark head modules for this config, keyed by the export's name prefix (``Qwen3DSparkModel``'s)."""
    vocab = int(cfg["vocab_size"])
    draft_vocab = int(cfg.get("draft_vocab_size") or vocab)
    modules = {"markov_head": DSparkMarkovHead(vocab, draft_vocab, int(cfg["markov_rank"]), prefix="markov_head")}
    if cfg.get("enable_confidence_head"):
        with_markov = bool(cfg.get("confidence_head_with_markov"))
        dim = int(cfg["hidden_size"]) + (int(cfg["markov_rank"]) if with_markov else 0)
        modules["confidence_head"] = DSparkConfidenceHead(dim, prefix="confidence_head", bias=True,
                                                          with_markov=with_markov)
    return modules


def walk(torch, modules: dict, cfg: dict, LogitsProcessor, job: dict) -> list[dict]:
    """vLLM's greedy sequential Markov sampling, float64, on the given base logits; confidences when it has the head."""
    modules["markov_head"].double()  # the confidence head stays float32: its forward casts its input to float32
    for module in modules.values():
        for sub in module.modules():  # as vLLM's loader finishes every layer (CPU: picks its GEMM)
            method = getattr(sub, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(sub)
    markov, conf = modules["markov_head"], modules.get("confidence_head")
    vocab = int(cfg.get("draft_vocab_size") or cfg["vocab_size"])
    lp = LogitsProcessor(vocab, scale=float(cfg.get("logit_scale", 1.0)))
    out = []
    for w in job:
        base = torch.tensor(w["base_logits"], dtype=torch.float64)
        prev = torch.tensor([int(w["anchor"])])
        tokens, embeds = [], []
        for i in range(base.shape[0]):
            e = markov.embed(prev)
            embeds.append(e)
            logits_i = base[i][None] + markov.bias(e, lp)
            prev = logits_i.argmax(dim=-1)
            tokens.append(int(prev[0]))
        res = {"tokens": tokens}
        if conf is not None and w.get("hidden") is not None:
            hidden = torch.tensor(w["hidden"], dtype=torch.float64)
            res["confidence"] = torch.sigmoid(conf(hidden, torch.cat(embeds))).double().tolist()
        out.append(res)
    return out


def validate(cfg: dict, job: dict, validator) -> list[str]:
    """vLLM's Qwen3-Omni DSpark contract check on the export, once per case."""
    from transformers import PretrainedConfig

    text = PretrainedConfig(**job["target_text_config"])
    hf = SimpleNamespace(model_type="qwen3_omni_moe", architectures=["Qwen3OmniMoeForConditionalGeneration"],
                         thinker_config=SimpleNamespace(text_config=text))
    target = SimpleNamespace(
        hf_config=hf, architectures=hf.architectures, hf_text_config=text,
        get_hidden_size=lambda: text.hidden_size, get_total_num_hidden_layers=lambda: text.num_hidden_layers,
        get_vocab_size=lambda: text.vocab_size)
    results = []
    for case in job["validate"]:
        doc = dict(cfg, **case.get("draft_config_overrides", {}))
        draft_hf = PretrainedConfig(**doc)
        draft = SimpleNamespace(hf_config=draft_hf, architectures=list(doc.get("architectures") or []))
        try:
            validator(target, draft, int(case["num_speculative_tokens"]))
            results.append("ok")
        except ValueError as e:
            results.append(f"ValueError: {e}")
    return results


def main(export: str, job_path: str, out_path: str) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from safetensors.torch import load_file
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.config.speculative import _validate_qwen3_omni_dspark
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.models.qwen3_dspark import DSparkConfidenceHead, DSparkMarkovHead

    cfg = json.load(open(os.path.join(export, "config.json")))
    weights = load_file(os.path.join(export, "model.safetensors"))
    job = json.load(open(job_path))
    with set_current_vllm_config(VllmConfig()):
        single_process(out_path)
        modules = build(cfg, DSparkMarkovHead, DSparkConfidenceHead)
        doc = load_into(modules, weights, ("markov_head", "confidence_head"))  # one vLLM did not build, too
        with torch.no_grad():
            doc["walks"] = walk(torch, modules, cfg, LogitsProcessor, job.get("walks", []))
    if job.get("validate"):
        doc["validate"] = validate(cfg, job, _validate_qwen3_omni_dspark)
    with open(out_path, "w") as f:
        json.dump(doc, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
