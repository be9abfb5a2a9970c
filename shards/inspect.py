"""One-screen summaries of a dataset and of one sample (what ``tapdraft inspect`` prints)."""

from __future__ import annotations

import json
from typing import Any

import torch

from tapdraft.shards.manifest import fmt_bytes
from tapdraft.shards.reader import Dataset
from tapdraft.shards.taps import TAPS_CODECS


def summary(ds: Dataset) -> dict[str, Any]:
    """Plain numbers (for tests and JSON); ``render_summary`` formats them."""
    m = ds.manifest
    splits = {}
    for s, d in m["splits"].items():
        splits[s] = {k: d[k] for k in ("samples", "tokens", "supervised_tokens", "audio_seconds", "bytes")}
        splits[s]["shards"] = len(d["shards"])
        splits[s]["bytes_per_token"] = d["bytes"] / d["tokens"] if d["tokens"] else 0.0
    lay = ds.layout
    b = ds.bundle()
    return {
        "path": ds.url, "format": m["format"], "schema_version": m["schema_version"], "fingerprint": ds.fingerprint,
        "code_version": m.get("code_version"), "splits": splits,
        "tap_ids_hf": list(lay.tap_ids), "tap_ids_vllm": lay.vllm_tap_ids, "hidden_size": lay.hidden_size,
        "num_layers": lay.num_layers, "top_k": lay.top_k, "dtypes": m["dtypes"], "codec": m["codec"],
        "skipped": sum(len(v) for v in m.get("skipped", {}).values()),
        "chat_template": (m.get("extra") or {}).get("chat_template"),
        "target": {"model_type": b.config.get("model_type"), "vocab_size": b.vocab_size, "head": b.head.to_dict(),
                   "weights_dtype": str(b.embed_tokens.dtype).removeprefix("torch.")},
    }


def _head_line(t: dict[str, Any]) -> str:
    h = t["head"]
    parts = [f"{h['norm']} eps={h['eps']:g}"]
    if h["embed_scale"] != 1.0:
        parts.append(f"embeddings x{h['embed_scale']:g}")
    if h["lm_head_bias"]:
        parts.append("lm_head bias")
    if h["logits_scaling"] != 1.0:
        parts.append(f"logits / {h['logits_scaling']:g}")
    if h["final_logit_softcap"] is not None:
        parts.append(f"soft cap {h['final_logit_softcap']:g}")
    parts.append("tied" if h["tied"] else "untied")
    return (f"target       {t['model_type']}, vocab {t['vocab_size']}, {t['weights_dtype']} weights; head: "
            + ", ".join(parts))


def render_summary(info: dict[str, Any]) -> str:
    layout_field = TAPS_CODECS[info["codec"]["taps_codec"]].layout_field  # fp8's byte layout; bf16 has none
    lines = [
        f"dataset      {info['path']}",
        f"format       {info['format']}  schema {info['schema_version']}  written by tapdraft {info['code_version']}",
        f"fingerprint  {info['fingerprint']}",
        _head_line(info["target"]),
        f"taps         HF {info['tap_ids_hf']}  vLLM {info['tap_ids_vllm']}  (pre-final-norm)  "
        f"H={info['hidden_size']} of {info['num_layers']} layers",
        f"top-k        k={info['top_k']} on rows t with loss_mask[t+1]",
        f"codec        taps {info['codec']['taps_codec']}{' (LOSSY)' if info['codec']['lossy'] else ''}"
        f"{' ' + info['codec'].get(layout_field, 'bytes') if layout_field else ''}, "
        f"bf16 {info['codec']['bf16_layout']}, {info['codec']['container']} "
        f"{'level ' + str(info['codec']['zstd_level']) if info['codec']['zstd_level'] else '(uncompressed)'}",
        "dtypes       " + ", ".join(f"{k}={v}" for k, v in info["dtypes"].items()),
        "template     " + _template_line(info.get("chat_template")),
        "",
        f"{'split':<10}{'samples':>10}{'tokens':>12}{'supervised':>12}{'audio s':>10}{'shards':>8}{'size':>12}"
        f"{'B/token':>10}",
    ]
    for s, d in info["splits"].items():
        lines.append(f"{s:<10}{d['samples']:>10}{d['tokens']:>12}{d['supervised_tokens']:>12}"
                     f"{d['audio_seconds']:>10.1f}{d['shards']:>8}{fmt_bytes(d['bytes']):>12}"
                     f"{d['bytes_per_token']:>10.1f}")
    lines.append(f"skipped inputs: {info['skipped']}")
    return "\n".join(lines)


def _template_line(t: dict[str, Any] | None) -> str:
    if not t:
        return "not recorded (captured before template settings were: the bundle's template, no kwargs)"
    sha = t.get("sha256") or ""
    return (f"chat template sha256 {sha[:12]}, kwargs {json.dumps(t.get('kwargs') or {}, sort_keys=True)} "
            f"(--template-kwarg), assistant mask from {t.get('assistant_mask')}")


def describe_sample(sample: dict[str, Any]) -> str:
    """Each field with dtype, shape and a few values."""
    lines = []
    for k, v in sample.items():
        if isinstance(v, torch.Tensor):
            head = v.flatten()[:6]
            vals = head.tolist() if v.dtype != torch.bfloat16 else [round(x, 4) for x in head.float().tolist()]
            extra = ""
            if v.is_floating_point() and v.numel():
                f = v.float()
                extra = f"  min {f.min().item():.4g} max {f.max().item():.4g} mean {f.mean().item():.4g}"
            elif v.dtype == torch.bool:
                extra = f"  true {int(v.sum())}"
            lines.append(f"{k:<15}{str(v.dtype).replace('torch.', ''):<10}{str(list(v.shape)):<18}{vals}{extra}")
        else:
            lines.append(f"{k:<15}{type(v).__name__:<10}{'':<18}{v!r}")
    return "\n".join(lines)
