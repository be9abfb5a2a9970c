"""vLLM's own DFlash2 code on DFlash2 exports, on a CPU, in float64: run INSIDE the vLLM venv.

    python vllm_dflash2_modules.py JOB.json OUT.json

vLLM serves DFlash2 only through its V2 model runner (Triton: GPU only; on a CPU ``VllmConfig`` refuses the V1
runner for it, ``_get_v1_model_runner_unsupported_features``: "DFlash candidate-head drafts"), so the served
check is ``benchmarks/gpu.sh``'s. What a CPU can run is vLLM's DFlash2 model itself. JOB names the target
(``target``: the HF directory whose embedding and lm_head vLLM shares with the draft), the exports
(``exports``: name -> export directory), the live blocks (``blocks``) and the exports drafted a second time with
vLLM's float32 spots lifted (``lifted``: names); OUT has, per export name:

modules     vLLM's ``DFlashGroupedConv`` (per layer, attention and MLP) and ``CandidateSelector`` built from the
            export's ``config.json`` exactly as ``DFlash2Qwen3DecoderLayer`` / ``DFlash2Qwen3Model`` build them
            (vllm/model_executor/models/qwen3_dflash2.py), every export tensor of theirs copied into the matching
            parameter, which must exist with the same shape (``loaded``, ``unset``, ``mismatched``,
            ``export_keys_not_in_vllm``, as ``vllm_load.load_into`` reports them).
model       The whole ``DFlash2Qwen3ForCausalLM``, resolved from the export's ``architectures`` by vLLM's registry
            (``get_model_architecture``), built by ``initialize_model`` under the default dtype float64 (as
            ``BaseModelLoader.load_model`` builds it under the model dtype), every parameter first filled with
            NaN, then loaded by its own ``load_weights`` (q/k/v stacked into ``qkv_proj``, gate/up into
            ``gate_up_proj``, ...), the target's embedding and lm_head shared in as ``load_dflash_model``
            shares them (vllm/v1/worker/gpu/spec_decode/dflash/utils.py, eagle/utils.py ``_should_share``: the
            export declares neither ``has_own_embed_tokens`` nor ``has_own_lm_head``), then
            ``process_weights_after_loading`` (CPU: float64 has no oneDNN GEMM, so ``F.linear``).
            ``model_unset``: parameters still NaN that vLLM would read.
blocks      Each JOB block (``aux`` [P, n*H]: the target's concatenated aux hidden states of the prompt's P
            positions, vLLM's ``aux_hidden_states`` cat; ``anchor``: the token at position P) is drafted as
            ``DFlash2Speculator._generate_draft`` drafts it (vllm/v1/worker/gpu/spec_decode/dflash2/speculator.py),
            all blocks in ONE forward, as a batch of requests:
              context    ``combine_hidden_states`` (fc), then per layer the context K/V of
                         ``DFlashQwen3Model.precompute_and_store_context_kv`` (see :func:`context_kv`);
              query      ``prepare_dflash_inputs``' rows: the anchor then ``get_parallel_drafting_token_id``'s
                         mask token at positions P .. P+B-1, B = 1 + num_speculative_tokens, requests end to end;
              forward    ``DFlash2Qwen3ForCausalLM.forward``: ``embed_input_ids`` (x ``input_embedding_scale``),
                         each ``DFlash2Qwen3DecoderLayer`` (``attention_conv.prepare`` / ``finish`` around its
                         ``self_attn``, ``mlp_conv`` around its MLP, vLLM's fused add + RMSNorms), final norm;
              sampling   rows 1 .. B-1 of each block (the speculator's ``sample_indices``): ``compute_logits``
                         (the full draft logits, reported for comparison), ``compute_candidates`` (top-k ids
                         and unary logits through ``candidate_logits_processor.get_top_k_tokens``), the
                         ``candidate_selector`` edge scores [R, K, top_k (predecessor), top_k] with the anchors
                         (``_score_candidates``), and the greedy walk of ``_selector_walk_kernel`` (:func:`walk`).
            Per block OUT gives ``logits`` [K, V], ``candidates`` / ``unary`` [K, top_k], ``scores`` [K, top_k]
            (the walk's realized score rows, the kernel's ``realized_scores``) and ``tokens`` [K].
lifted_blocks  For the ``lifted`` exports: the same blocks again after :func:`lift_float32`.

Float64: the parameters are float64, but vLLM's RMSNorm computes in float32 by its own definition
(vllm/ir/ops/layernorm.py ``rms_norm`` / ``fused_add_rms_norm``: ``x.to(torch.float32)``, the residual stream
rounded back through it), its RoPE tables are float32 values (``RotaryEmbeddingBase._compute_cos_sin_cache``
computes them in ``torch.float``) and ``get_top_k_tokens`` returns float32 unary logits (``values.float()``): so
``blocks`` carry float32-level rounding where vLLM's code puts it, nowhere else. ``lifted_blocks`` replace those
three spots by their float64 formulas (:func:`lift_float32`), to show that the float32 rounding is all there is.

What is not vLLM's code, and why:
- the attention kernel. ``DFlashQwen3Attention.forward`` calls ``self.attn(q, k, v)``, vLLM's ``Attention``
  layer, which reads the forward context's metadata and KV cache, and whose CPU backend (``CPUAttentionBackendImpl``,
  vllm/v1/attention/backends/cpu_attn.py) runs float32/bfloat16/float16 only. :class:`ContextAttention` takes its
  place: each block's queries attend its context K/V then its own keys, non-causally (the layer's ``causal``,
  from ``_resolve_layer_attention``), at the layer's ``scaling``, key/value heads grouped as vLLM groups them. A
  causal or sliding-window layer is refused here (DFlash2 exports are neither).
- the context K/V. ``precompute_and_store_context_kv`` runs the C++ ops ``ops.rms_norm`` and
  ``ops.rotary_embedding``, which have no float64 kernels ("rms_norm_impl" not implemented for 'Double');
  :func:`context_kv` runs the same steps through the same weights with the native forward of vLLM's modules.
- the walk. ``_selector_walk_kernel`` is Triton, and this CPU build has no Triton backend (vllm/triton_utils/
  importing.py: "Triton is installed, but doesn't include CPU backend", so ``triton.jit`` is a placeholder);
  :func:`walk` restates its greedy branch (temperature 0: ``gumbel_noised_argmax`` is ``tl.max`` with its
  first index).
The first two are DFlash's, shared with DFlash 1, which vLLM serves on this CPU through its real backend and
precompute (tests/engines/test_vllm_dflash.py). The walk is DFlash2's but holds no arithmetic: it indexes the
scores vLLM computed. Every other DFlash2-specific computation (the convolutions, where the layer applies them,
the candidates and their unary logits, the selector's scores) is vLLM's own code.

Shapes: R blocks (requests), B block size, K = B - 1 drafted slots, P prompt positions, H hidden, V vocab,
nh / nkv query / key-value heads, hd head dim.
"""

import copy
import glob
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

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


class ContextAttention(nn.Module):
    """Stands in for one draft layer's vLLM ``Attention`` (``self_attn.attn``): the KV cache holds each request's
    context K/V (:meth:`set_context`), and ``forward(q, k, v)`` on the batch's query rows (R requests of B rows,
    q [R*B, nh*hd], k / v [R*B, nkv*hd], already normed and rotated by ``DFlashQwen3Attention``) returns
    softmax(q [ctx K; k]^T * scaling) [ctx V; v] per request, [R*B, nh*hd], in the inputs' dtype."""

    def __init__(self, self_attn: nn.Module) -> None:
        super().__init__()
        if self_attn.causal or self_attn.sliding_window is not None:
            raise ValueError(f"{self_attn.layer_name}: causal={self_attn.causal}, sliding_window="
                             f"{self_attn.sliding_window}; this stand-in runs non-causal full attention only")
        self.num_heads, self.num_kv_heads = self_attn.num_heads, self_attn.num_kv_heads
        self.head_dim, self.scaling = self_attn.head_dim, self_attn.scaling
        self.ctx_k: list[torch.Tensor] = []
        self.ctx_v: list[torch.Tensor] = []

    def set_context(self, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> None:
        """Per request, context keys and values [P_r, nkv, hd]."""
        self.ctx_k, self.ctx_v = ks, vs

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        R = len(self.ctx_k)
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = q.view(R, -1, nh, hd), k.view(R, -1, nkv, hd), v.view(R, -1, nkv, hd)
        out = []
        for r in range(R):
            keys = torch.cat([self.ctx_k[r], k[r]]).repeat_interleave(nh // nkv, dim=1)  # [P+B, nh, hd]
            vals = torch.cat([self.ctx_v[r], v[r]]).repeat_interleave(nh // nkv, dim=1)
            p = torch.softmax(torch.einsum("qhd,khd->hqk", q[r], keys) * self.scaling, dim=-1)
            out.append(torch.einsum("hqk,khd->qhd", p, vals))
        return torch.cat(out).reshape(-1, nh * hd)


def context_kv(model: nn.Module, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the context's keys and values [P, nkv, hd] for context states ``ctx`` [P, H] (after
    ``combine_hidden_states``), the steps of ``DFlashQwen3Model.precompute_and_store_context_kv`` /
    ``_project_context_kv`` / ``_normalize_context_k`` (vllm/model_executor/models/qwen3_dflash.py) with vLLM's
    modules in place of its C++ ops: ``hidden_norm`` (for ``ops.rms_norm`` with ``_hidden_norm_weight``), one GEMM
    with the fused K/V weight ``_build_fused_kv_buffers`` stacked from every layer's ``qkv_proj``, each layer's
    ``k_norm`` (for the grouped ``ops.rms_norm`` with ``_k_norm_weights``), its ``rotary_emb`` with the keys in
    the query slot (as ``ops.rotary_embedding(positions, all_k, None, ...)``), and ``v_scale`` when set."""
    inner = model.model
    L, nkv, hd = inner._num_attn_layers, inner._num_kv_heads, inner._head_dim
    normed = inner.hidden_norm(ctx)
    all_kv = F.linear(normed, inner._fused_kv_weight, inner._fused_kv_bias).view(ctx.shape[0], L, 2, nkv, hd)
    out = []
    for i, layer in enumerate(inner.layers):
        attn = layer.self_attn
        k = attn.k_norm(all_kv[:, i, 0].contiguous())
        k, _ = attn.rotary_emb(positions, k.reshape(ctx.shape[0], nkv * hd), None)
        v = all_kv[:, i, 1]
        if attn.v_scale is not None:
            v = v * attn.v_scale
        out.append((k.view(-1, nkv, hd), v))
    return out


def walk(scores: torch.Tensor, candidate_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy branch of ``_selector_walk_kernel`` (vllm/v1/worker/gpu/spec_decode/dflash2/speculator.py): per
    request, ``previous`` = 0 (step 0's predecessor rows all hold the anchor), then per step the score row
    ``scores[r, step, previous]`` over the step's candidates, its first maximum's index (``gumbel_noised_argmax``
    at temperature 0), that candidate's token, and the index becomes ``previous``. ``scores`` [R, K, top_k,
    top_k], ``candidate_ids`` [R, K, top_k] -> tokens [R, K], realized score rows [R, K, top_k]."""
    R, K, top_k, _ = scores.shape
    tokens = torch.empty(R, K, dtype=torch.long)
    realized = torch.empty(R, K, top_k, dtype=scores.dtype)
    for r in range(R):
        previous = 0
        for step in range(K):
            row = scores[r, step, previous]
            index = int(row.argmax())
            realized[r, step] = row
            tokens[r, step] = candidate_ids[r, step, index]
            previous = index
    return tokens, realized


def lift_float32(model: nn.Module) -> None:
    """Lift the three places where vLLM's float64 model keeps float32 values to float64, for the ``lifted`` blocks
    (module docstring): each layer's RoPE table recomputed as ``RotaryEmbeddingBase._compute_cos_sin_cache``
    computes it, from vLLM's own float32 inverse frequencies (``_compute_inv_freq``), with the position products
    and cos/sin in float64; every vLLM ``RMSNorm`` (with its fused residual add) computed in the input's float64,
    the formula of vllm/ir/ops/layernorm.py ``rms_norm`` / ``fused_add_rms_norm`` without their float32 casts;
    ``compute_candidates`` as the top-k of ``compute_logits`` (``get_top_k_tokens`` without its ``values.float()``).
    What then still differs from tapdraft is not precision but its RoPE inverse frequencies (float64 pow rounded
    to float32, against vLLM's float32 pow: one ulp apart in some entries)."""
    from vllm.model_executor.layers.layernorm import RMSNorm

    for layer in model.model.layers:  # a copy: ``get_rope`` hands every model the same cached RotaryEmbedding
        rope = layer.self_attn.rotary_emb = copy.deepcopy(layer.self_attn.rotary_emb)
        t = torch.arange(rope.max_position_embeddings, dtype=torch.float64)
        freqs = torch.einsum("i,j -> ij", t, rope._compute_inv_freq(rope.base).double())
        rope.cos_sin_cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    for mod in model.modules():
        if isinstance(mod, RMSNorm):
            def forward(x, residual=None, mod=mod):
                if residual is not None:
                    x = x + residual
                    residual = x
                y = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + mod.variance_epsilon) * mod.weight
                return y if residual is None else (y, residual)
            mod.forward = forward
    top_k = model.model.candidate_selector.top_k

    def compute_candidates(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values, ids = model.compute_logits(hidden).topk(top_k, dim=-1)
        return ids, values
    model.compute_candidates = compute_candidates


def load_model(export: str, target: str) -> tuple[nn.Module, dict]:
    """vLLM's DFlash2 model for ``export`` in float64 with the target's embedding and lm_head, and its load report."""
    from safetensors.torch import load_file
    from vllm.config import CompilationConfig, ModelConfig, SpeculativeConfig, VllmConfig
    from vllm.config.compilation import CompilationMode
    from vllm.model_executor.model_loader.utils import (get_model_architecture, initialize_model,
                                                        process_weights_after_loading)
    from vllm.utils.torch_utils import set_default_torch_dtype

    target_mc = ModelConfig(model=target, dtype=torch.float64, skip_tokenizer_init=True)
    config = VllmConfig(model_config=target_mc, compilation_config=CompilationConfig(
        mode=CompilationMode.NONE, custom_ops=["none"]))  # eager, and CustomOps' native (float64-capable) forwards
    hf = json.load(open(os.path.join(export, "config.json")))
    k = int(hf["tapdraft"]["serve_with"]["vllm"]["num_speculative_tokens"])
    # Set after construction: the draft's speculative config would make __post_init__ refuse the V1 runner.
    config.speculative_config = SpeculativeConfig(
        method="dflash", model=export, num_speculative_tokens=k, target_model_config=target_mc,
        target_parallel_config=config.parallel_config)
    draft_mc = config.speculative_config.draft_model_config
    model_class, arch = get_model_architecture(draft_mc)
    with set_default_torch_dtype(draft_mc.dtype):
        model = initialize_model(vllm_config=config, model_config=draft_mc)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
            model.load_weights(load_file(os.path.join(export, "model.safetensors")).items())
            shared = {}  # the target checkpoint's tensors (HF Qwen names), every shard
            for f in sorted(glob.glob(os.path.join(target, "*.safetensors"))):
                shared.update(load_file(f))
            embed = shared["model.embed_tokens.weight"]
            head = shared.get("lm_head.weight", embed)  # a tied target's head is its embedding
            model.model.embed_tokens.weight.copy_(embed)
            model.lm_head.weight.copy_(head)
    unused = set() if model.model.has_separate_mask_embedding else {"model.mask_embedding"}
    unset = [n for n, p in model.named_parameters() if n not in unused and bool(torch.isnan(p).any())]
    process_weights_after_loading(model, draft_mc, torch.device("cpu"))
    for layer in model.model.layers:
        layer.self_attn.attn = ContextAttention(layer.self_attn)
    report = {"architecture": arch, "model_class": model_class.__name__, "num_speculative_tokens": k,
              "dtype": str(draft_mc.dtype), "model_unset": unset,
              "model_dtypes": sorted({str(p.dtype) for p in model.parameters()})}
    return model, report


@torch.no_grad()
def draft(model: nn.Module, blocks: list[dict], mask_token: int, block_size: int) -> list[dict]:
    """All ``blocks`` drafted in one batch, as ``DFlash2Speculator._generate_draft`` drafts them (module docstring)."""
    B, K = block_size, block_size - 1
    dtype = next(model.parameters()).dtype
    ctx_kv, ids, pos = [], [], []
    for blk in blocks:
        aux = torch.tensor(blk["aux"], dtype=dtype)  # [P, n*H]
        P = aux.shape[0]
        ctx_kv.append(context_kv(model, model.combine_hidden_states(aux), torch.arange(P)))
        ids.append(torch.tensor([int(blk["anchor"])] + [mask_token] * K))
        pos.append(torch.arange(P, P + B))
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.attn.set_context([kv[i][0] for kv in ctx_kv], [kv[i][1] for kv in ctx_kv])
    hidden = model(torch.cat(ids), torch.cat(pos))  # [R*B, H]
    R = len(blocks)
    h = hidden.view(R, B, -1)[:, 1:]  # [R, K, H]: the sampled rows
    logits = model.compute_logits(h.flatten(0, 1)).view(R, K, -1)
    cand, unary = model.compute_candidates(h.flatten(0, 1))
    top_k = model.model.candidate_selector.top_k
    cand, unary = cand.view(R, K, top_k), unary.view(R, K, top_k)
    anchors = torch.stack([i[0] for i in ids])
    scores = model.model.candidate_selector(cand, unary, h, anchors)  # [R, K, top_k, top_k]
    tokens, realized = walk(scores, cand)
    return [{"tokens": tokens[r].tolist(), "logits": logits[r].tolist(), "candidates": cand[r].tolist(),
             "unary": unary[r].double().tolist(), "scores": realized[r].double().tolist(),
             "dtypes": {"hidden": str(hidden.dtype), "logits": str(logits.dtype), "unary": str(unary.dtype),
                        "scores": str(scores.dtype)}}
            for r in range(R)]


def main(job_path: str, out_path: str) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from safetensors.torch import load_file
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.models.qwen3_dflash2 import CandidateSelector, DFlashGroupedConv
    from vllm.v1.worker.gpu.spec_decode.utils import get_parallel_drafting_token_id

    job = json.load(open(job_path))
    out = {}
    with set_current_vllm_config(VllmConfig()):
        single_process(out_path)
    for name, export in job["exports"].items():
        cfg = json.load(open(os.path.join(export, "config.json")))
        with set_current_vllm_config(VllmConfig()):
            doc = load_into(build(cfg, torch, CandidateSelector, DFlashGroupedConv),
                            load_file(os.path.join(export, "model.safetensors")))
        model, doc["model"] = load_model(export, job["target"])
        mask, B = get_parallel_drafting_token_id(model.config), 1 + doc["model"]["num_speculative_tokens"]
        doc["blocks"] = draft(model, job.get("blocks", []), mask, B)
        if name in job.get("lifted", []):
            lift_float32(model)
            doc["lifted_blocks"] = draft(model, job.get("blocks", []), mask, B)
        out[name] = doc
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
