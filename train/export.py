"""Export a trained draft for serving: draft-only ``model.safetensors`` + ``config.json``.

The draft's frozen target pieces (input embedding, final norm, lm_head) are NOT exported: serving
engines share the target's own. Engines compute draft logits with the target's lm_head ONLY; a config
with ``logits_scaling_folded_into`` names the draft's last norm weight, which is exported divided by
the target's ``logits_scaling`` so those logits are exactly tapdraft's (weights named in
``logits_scaling_compensated_in``, which read that norm's output too, are multiplied by it). A config
with ``auto_map`` gets its modeling file from ``drafters/dflash/serving/`` (DFlash: ``AutoModel`` builds the drafter).
``config.json`` carries the architecture fields (Qwen3 names),
``block_size``, ``mask_token_id``, ``target_layer_ids`` in HF numbering (output of decoder layer i)
and ``target_layer_ids_vllm`` (= i + 1), ``draft_vocab_size`` with ``d2t`` / ``t2d`` in the weights when the
draft has a reduced vocabulary (EAGLE-3's convention, ``common.draft_vocab``), plus ``dflash_config`` in the
reference release's layout
and a ``tapdraft`` section (family, target fingerprint, source checkpoint, and the chat-template
settings the draft was trained under: template sha256 and kwargs, which serving must use too).

The target's own MTP module (family ``mtp_native``) exports as a copy of the target checkpoint with its
``mtp.*`` tensors replaced (:func:`export_native`), which engines serve as the target's MTP.

The export needs no dataset and no trainer: the checkpoint keeps the drafter's ``export_config``,
and :func:`load_export` reads an export back with nothing but json and safetensors.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from shards.atomic import staged
from shards.template import template_sha
from train.drafters.dflash.speculators import to_speculators
from train.drafters.mtp.layouts import convert

SERVING_DIR = Path(__file__).parent / "drafters" / "dflash" / "serving"
"""Self-contained modeling files (torch + transformers only) copied into exports whose config names them in
``auto_map``, so ``AutoModel.from_pretrained(export, trust_remote_code=True)`` builds the exact drafter."""
WEIGHTS = "model.safetensors"
CONFIG = "config.json"


def write_export(out_dir: str | os.PathLike, state: dict[str, torch.Tensor], config: dict[str, Any],
                 meta: dict[str, Any] | None = None) -> Path:
    """Write weights (floating tensors as float32; integer and bool tables, such as a draft vocabulary's ``d2t`` /
    ``t2d``, in their own dtype; contiguous) and config atomically-per-file into ``out_dir``."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: (v.detach().float() if v.is_floating_point() else v.detach()).cpu().contiguous() for k, v in state.items()}
    fold = config.get("logits_scaling_folded_into")
    if fold:  # engines apply the target's lm_head only: the logits' divisor moves into the last norm
        sd[fold] = sd[fold] / float(config["logits_scaling"])
        for key in config.get("logits_scaling_compensated_in") or []:  # other readers of that norm's output
            sd[key] = sd[key] * float(config["logits_scaling"])
    for module in sorted({ref.split(".")[0] for ref in (config.get("auto_map") or {}).values()}):
        src = SERVING_DIR / f"{module}.py"
        with staged(out / src.name) as tmp:
            tmp.write_bytes(src.read_bytes())
    with staged(out / WEIGHTS) as tmp:
        save_file(sd, str(tmp), metadata={"format": "pt"})
    doc = json.loads(json.dumps(config))
    doc.setdefault("tapdraft", {}).update(meta or {})
    with staged(out / CONFIG) as tmp:
        tmp.write_text(json.dumps(doc, indent=2, sort_keys=True))
    return out


def in_layout(weights: dict[str, torch.Tensor], cfg: dict[str, Any], layout: str | None, *,
              verifier: str | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Weights and config in the requested loader layout: MTP heads ``mtp.layouts``; DFlash / DFlash2 their
    native layout or ``speculators`` (``train.drafters.dflash.speculators``, naming the ``verifier``)."""
    family = cfg.get("tapdraft", {}).get("family")
    if family == "mtp":
        return convert(weights, cfg, layout or "deepseek")
    if layout is None:
        return weights, cfg
    if family in ("dflash", "dflash2"):
        if layout == "speculators":
            return to_speculators(weights, cfg, verifier=verifier)
        raise ValueError(f"unknown layout {layout!r} for a {family} draft: its layouts are the native one (no "
                         "--layout) and speculators")
    raise ValueError(f"a {family!r} draft has one export layout: drop --layout")


def export_drafter(model: Any, out_dir: str | os.PathLike, meta: dict[str, Any], *, layout: str | None = None) -> Path:
    """Export a drafter in memory: its trainable weights and ``export_config()`` plus ``meta``."""
    return write_export(out_dir, *in_layout(model.trainable_state_dict(), model.export_config(), layout), meta)


def export_run(run_dir: str | os.PathLike, out_dir: str | os.PathLike, *, checkpoint: str | None = None,
               layout: str | None = None, verifier: str | None = None) -> dict[str, Any]:
    """Export a run's latest (or the given) checkpoint; returns a summary dict.

    ``layout``: for MTP heads, the loader's layout (``train.drafters.mtp.layouts.LAYOUTS``; default ``deepseek``);
    DFlash and DFlash2: the native layout, or ``speculators`` (which names the target: ``verifier``)."""
    from train.checkpoints import latest_checkpoint, load_checkpoint

    run = Path(run_dir)
    ck = Path(checkpoint) if checkpoint else latest_checkpoint(run)
    if ck is None:
        raise FileNotFoundError(f"{run} has no checkpoint (expected {run}/checkpoints/step-*/state.pt); train first")
    state = load_checkpoint(ck)
    cfg = state.get("export_config")
    if not cfg:
        raise ValueError(f"{ck} holds no export_config: its drafter family cannot be exported")
    here = ck.resolve()  # recorded relative to the run (an export travels; a local absolute path means nothing)
    source = here.relative_to(run.resolve()).as_posix() if here.is_relative_to(run.resolve()) else here.name
    meta: dict[str, Any] = {"source_checkpoint": source, "step": int(state["step"])}
    if state.get("template") is not None:  # checkpoints written before template settings were recorded lack it
        meta["chat_template"] = {"sha256": template_sha(state["template"]["text"]),
                                 "kwargs": state["template"]["kwargs"]}
    native = cfg
    weights, cfg = in_layout(state["draft"], native, layout, verifier=verifier)
    if cfg.get("tapdraft", {}).get("family") == "mtp_native":  # a copy of the target with its mtp.* replaced
        out = export_native(weights, cfg, out_dir, meta)
    else:
        out = write_export(out_dir, weights, cfg, meta)
    n = sum(v.numel() for v in weights.values() if v.is_floating_point())  # not the d2t / t2d id tables
    return {"out": str(out), "step": int(state["step"]), "parameters": n, "tensors": len(weights),
            "layout": cfg.get("mtp_layout") or layout,
            "block_size": native.get("block_size"), "target_layer_ids": native.get("target_layer_ids"),
            "target_layer_ids_vllm": native.get("target_layer_ids_vllm"), "mask_token_id": native.get("mask_token_id")}


def format_export(res: dict[str, Any]) -> str:
    """One readable screen for ``tapdraft export`` (``--json`` prints ``res`` itself)."""
    return "\n".join([
        f"exported step {res['step']} to {res['out']}: {res['parameters']:,} parameters in {res['tensors']} tensors",
        f"  target layers (HF) {res['target_layer_ids']}  vLLM {res['target_layer_ids_vllm']}"
        + (f"  block size {res['block_size']}  mask token {res['mask_token_id']}" if res.get("block_size") else ""),
    ])


def load_export(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config dict, weights) of an export directory: json + safetensors only, no trainer code."""
    from safetensors.torch import load_file

    root = Path(path)
    if not (root / CONFIG).is_file() or not (root / WEIGHTS).is_file():
        raise FileNotFoundError(f"{root} is not a draft export: it needs {CONFIG} and {WEIGHTS}")
    return json.loads((root / CONFIG).read_text()), load_file(str(root / WEIGHTS))


def weight_files(root: Path) -> list[str]:
    """The safetensors files of a model checkpoint directory (one file or those its index names)."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    if (root / "model.safetensors").is_file():
        return ["model.safetensors"]
    raise FileNotFoundError(f"{root} has no model.safetensors(.index.json)")


def export_native(weights: dict[str, torch.Tensor], cfg: dict[str, Any], out_dir: str | Path,
                  meta: dict[str, Any]) -> Path:
    """Family ``mtp_native``: a copy of the target checkpoint (``cfg["tapdraft"]["mtp_config"]["checkpoint"]``)
    with the fine-tuned ``mtp.*`` tensors in place of its own, in each tensor's stored dtype; every other file
    copied unchanged; the config is the target's plus a ``tapdraft`` section, with no local paths."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src = Path(cfg["tapdraft"]["mtp_config"]["checkpoint"])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = weight_files(src)
    placed: set[str] = set()
    for f in files:
        with safe_open(str(src / f), "pt") as st:
            keys = list(st.keys())
            if not any(k.startswith("mtp.") for k in keys):
                shutil.copyfile(src / f, out / f)
                continue
            sd = {}
            for k in keys:
                t = st.get_tensor(k)
                if k.startswith("mtp."):
                    t = weights[k].to(t.dtype)
                    placed.add(k)
                sd[k] = t.contiguous()
            meta_st = st.metadata() or {"format": "pt"}
        with staged(out / f) as tmp:
            save_file(sd, str(tmp), metadata=meta_st)
    left = sorted(set(weights) - placed)
    assert not left, f"tensors with no place in the checkpoint: {left[:4]}"
    for p in src.iterdir():
        if p.is_file() and p.name not in files and p.name != "config.json":
            shutil.copyfile(p, out / p.name)
    doc = json.loads((src / "config.json").read_text())
    t = dict(cfg["tapdraft"])
    t["mtp_config"] = {k: v for k, v in t["mtp_config"].items() if k != "checkpoint"}  # no local paths
    doc["tapdraft"] = {**t, **{k: v for k, v in meta.items() if k != "source_checkpoint"}}
    with staged(out / "config.json") as tmp:
        tmp.write_text(json.dumps(doc, indent=2, sort_keys=True))
    return out
