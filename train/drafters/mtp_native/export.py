"""Family ``mtp_native``'s one export: a copy of the target checkpoint with its ``mtp.*`` tensors replaced, which
engines serve as the target's own MTP (vLLM: ``speculative_config={"method": "mtp", "model": EXPORT}``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from tapdraft.common.atomic import staged
from tapdraft.train.drafters.common.export_files import weight_files


def export_native(weights: dict[str, torch.Tensor], cfg: dict[str, Any], out_dir: str | Path,
                  meta: dict[str, Any]) -> Path:
    """A copy of the target checkpoint (``cfg["tapdraft"]["mtp_config"]["checkpoint"]``) with the fine-tuned
    ``mtp.*`` tensors in place of its own, in each tensor's stored dtype; every other file copied unchanged; the
    config is the target's plus a ``tapdraft`` section, with no local paths."""
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
