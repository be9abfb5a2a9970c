"""The files of a draft export: ``model.safetensors`` + ``config.json`` (+ shipped modeling files), written and read.

A family's export (``Drafter.write_export``) ends here unless it owns another format (``mtp_native`` writes a copy
of the target checkpoint). Engines compute draft logits with the target's lm_head ONLY; a config with
``logits_scaling_folded_into`` names the draft's last norm weight, which is written divided by the target's
``logits_scaling`` so those logits are exactly tapdraft's (weights named in ``logits_scaling_compensated_in``, which
read that norm's output too, are multiplied by it). A config with ``auto_map`` gets its modeling files from the
family's ``serving_dir``. A config that says how engines serve it (``tapdraft.serve_with``) states, per engine, the
block size as that engine counts it (``tapdraft.block_size``). :func:`load_export` reads an export back with nothing but json and safetensors.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from tapdraft.common.atomic import staged

WEIGHTS = "model.safetensors"
CONFIG = "config.json"


def write_export(out_dir: str | os.PathLike, state: dict[str, torch.Tensor], config: dict[str, Any],
                 meta: dict[str, Any] | None = None, *, serving_dir: Path | None = None) -> Path:
    """Write weights (floating tensors as float32; integer and bool tables, such as a draft vocabulary's ``d2t`` /
    ``t2d``, in their own dtype; contiguous) and config into ``out_dir``; the modules the config names in ``auto_map``
    are copied from ``serving_dir``. ``train.export`` gives a fresh directory and commits it whole."""
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
        if serving_dir is None:
            raise ValueError(f"the export config names {module!r} in auto_map but its family ships no modeling files")
        src = serving_dir / f"{module}.py"
        with staged(out / src.name) as tmp:
            tmp.write_bytes(src.read_bytes())
    with staged(out / WEIGHTS) as tmp:
        save_file(sd, str(tmp), metadata={"format": "pt"})
    doc = json.loads(json.dumps(config))
    doc.setdefault("tapdraft", {}).update(meta or {})
    serve = doc["tapdraft"].get("serve_with")
    # engines count a "block" differently (vLLM's DFlash: num_speculative_tokens + 1; SGLang: its draft-token count),
    # so every engine an export names gets the block size as that engine counts it
    assert serve is None or set(doc["tapdraft"].get("block_size") or {}) == set(serve), \
        "an export that says how to serve it states its block size for each of those engines (tapdraft.block_size)"
    with staged(out / CONFIG) as tmp:
        tmp.write_text(json.dumps(doc, indent=2, sort_keys=True))
    return out


def load_export(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config dict, weights) of an export directory: json + safetensors only, no trainer code."""
    from safetensors.torch import load_file

    root = Path(path)
    if not (root / CONFIG).is_file() or not (root / WEIGHTS).is_file():
        raise FileNotFoundError(f"{root} is not a draft export: it needs {CONFIG} and {WEIGHTS}")
    return json.loads((root / CONFIG).read_text()), load_file(str(root / WEIGHTS))


def export_names(root: Path) -> set[str] | None:
    """The names an earlier export at ``root`` wrote (config, weights and their index, shipped modeling files); None
    when ``root`` holds no export (no ``config.json`` with a ``tapdraft`` section)."""
    try:
        doc = json.loads((root / CONFIG).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("tapdraft"), dict):
        return None
    names = {CONFIG, WEIGHTS, "model.safetensors.index.json"}
    try:
        names.update(weight_files(root))
    except (OSError, ValueError, KeyError):
        pass
    auto_map = doc.get("auto_map") if isinstance(doc.get("auto_map"), dict) else {}
    return names | {f"{str(ref).split('.')[0]}.py" for ref in auto_map.values()}


def weight_files(root: Path) -> list[str]:
    """The safetensors files of a model checkpoint directory (one file or those its index names)."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    if (root / "model.safetensors").is_file():
        return ["model.safetensors"]
    raise FileNotFoundError(f"{root} has no model.safetensors(.index.json)")
