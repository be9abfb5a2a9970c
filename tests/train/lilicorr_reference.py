"""vLLM 0.32's LiLiCorr scorer and walk re-implemented in float64 on an export's tensors alone.

Written from vllm/model_executor/models/lilicorr.py (``LiLiCorrHead.materialize_inference_buffers``, ``score``,
``forward``: the factor projection split in three weight blocks, the fused out/in edge projection, the attention bias
built from ``relative_slot_bias`` and ``same_slot_bias``) and the greedy ``_selector_walk_kernel``
(vllm/v1/worker/gpu/spec_decode/dflash2/speculator.py: predecessor index 0 at the first step, scores read at
[step, previous index]). Attention is written out as softmax(q k^T / sqrt(d) + bias) v.
"""

from __future__ import annotations

import math

import torch


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _lin(x, W, name):
    return x @ W[f"{name}.weight"].T + W[f"{name}.bias"]


def _mlp(x, W, name):
    h = _lin(x, W, f"{name}.up_proj")
    return _lin(h * torch.sigmoid(h), W, f"{name}.down_proj")


def vllm_scores(weights: dict[str, torch.Tensor], dcfg: dict, eps: float, tok_SkH, logp_Sk, pass_SH, anchor_H,
                anchor_valid: bool) -> torch.Tensor:
    """One request's scores [S, k, k] (float64), as ``LiLiCorrHead.forward`` returns them."""
    W = {k.removeprefix("lilicorr."): v.double() for k, v in weights.items() if k.startswith("lilicorr.")}
    S, k = logp_Sk.shape
    B = dcfg["block_size"]
    H = dcfg["lilicorr_hidden_size"]
    nh, f_dim = dcfg["lilicorr_num_heads"], dcfg["lilicorr_factor_dim"]
    veps, scale = dcfg["lilicorr_vector_eps"], dcfg["lilicorr_logit_scale"]
    tok = tok_SkH.double()
    if "token_proj.weight" in W:
        tok = _lin(tok, W, "token_proj")
    x = tok + _lin(pass_SH.double(), W, "pass_hidden_proj")[:, None, :]
    lp = logp_Sk.double()
    rank = torch.arange(k, dtype=torch.float64) / (k - 1)
    top1 = torch.zeros(k, dtype=torch.float64)
    top1[0] = 1
    feats = torch.stack([lp, lp.exp(), lp - lp.max(-1, keepdim=True).values, rank.expand_as(lp),
                         top1.expand_as(lp)], -1)
    mu, var = feats.mean(-1, keepdim=True), feats.var(-1, unbiased=False, keepdim=True)
    fn = (feats - mu) / torch.sqrt(var + 1e-5) * W["feature_norm.weight"] + W["feature_norm.bias"]
    x = x + _mlp(fn, W, "feature_mlp") + W["slot_embedding"][0, 0, :S] + W["rank_embedding"][0, 0]
    x = x.reshape(S * k, H)
    slot = [s for s in range(S) for _ in range(k)]
    bias = torch.empty(nh, S * k, S * k, dtype=torch.float64)
    for i in range(S * k):
        for j in range(S * k):
            bias[:, i, j] = W["relative_slot_bias"][:, slot[i] - slot[j] + B - 1] + \
                W["same_slot_bias"] * float(slot[i] == slot[j])
    d = H // nh
    n = 0
    while f"layers.{n}.attn_norm.weight" in W:
        p = f"layers.{n}"
        hn = _rms(x, W[f"{p}.attn_norm.weight"], eps)
        q, kk, v = (hn @ W[f"{p}.attn.in_proj_weight"].T + W[f"{p}.attn.in_proj_bias"]).chunk(3, -1)
        q, kk, v = (t.view(S * k, nh, d).transpose(0, 1) for t in (q, kk, v))
        att = torch.softmax(q @ kk.transpose(-1, -2) / math.sqrt(d) + bias, -1) @ v
        x = x + _lin(att.transpose(0, 1).reshape(S * k, H), W, f"{p}.attn.out_proj")
        x = x + _mlp(_rms(x, W[f"{p}.mlp_norm.weight"], eps), W, f"{p}.mlp")
        n += 1
    y = _rms(x, W["output_norm.weight"], eps).reshape(S, k, H)
    a = _lin(anchor_H.double(), W, "context_proj") * float(anchor_valid)
    a = _rms(a, W["anchor_norm.weight"], eps)
    Wf = W["factor_input_proj.weight"]
    pre = y @ Wf[:, :H].T + W["factor_input_proj.bias"] + a @ Wf[:, H:2 * H].T + (y * a) @ Wf[:, 2 * H:].T
    g = pre * torch.sigmoid(pre)
    edges = g @ torch.cat([W["out_head.weight"], W["in_head.weight"]]).T + \
        torch.cat([W["out_head.bias"], W["in_head.bias"]])

    def unit(t):
        return t / t.norm(dim=-1, keepdim=True).clamp_min(veps)

    out_v, in_v = unit(edges[..., :f_dim]), unit(edges[..., f_dim:])
    anchor_out = unit(_lin(a, W, "anchor_out_head"))
    start = (anchor_out[None] * in_v[0]).sum(-1)
    pairs = out_v[:-1] @ in_v[1:].transpose(-1, -2)
    return scale * torch.cat([start[None, None].expand(1, k, k), pairs], 0)


def vllm_greedy_walk(scores_Skk: torch.Tensor, cand_Sk: torch.Tensor) -> list[int]:
    """``_selector_walk_kernel`` at temperature 0: previous = 0, then the argmax index of row [step, previous]."""
    previous, out = 0, []
    for s in range(scores_Skk.shape[0]):
        previous = int(scores_Skk[s, previous].argmax())
        out.append(int(cand_Sk[s, previous]))
    return out
