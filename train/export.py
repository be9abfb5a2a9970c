"""Export a trained draft for serving: draft-only ``model.safetensors`` + ``config.json``.

The draft's frozen target pieces (input embedding, final norm, lm_head) are NOT exported: serving
engines share the target's own. The files and the logits rule are ``train.drafters.common.export_files``;
each family owns its layouts (``Drafter.export_layout``: MTP heads ``mtp.export``, DFlash / DFlash2
``speculators`` beside the native one) and its writer (``Drafter.write_export``: ``mtp_native`` writes a copy of
the target checkpoint with its ``mtp.*`` tensors replaced). This module finds the family from the checkpoint's
export config through the registry and knows no family by name.
``config.json`` carries the architecture fields (Qwen3 names),
``block_size``, ``mask_token_id``, ``target_layer_ids`` in HF numbering (output of decoder layer i)
and ``target_layer_ids_vllm`` (= i + 1), ``draft_vocab_size`` with ``d2t`` / ``t2d`` in the weights when the
draft has a reduced vocabulary (EAGLE-3's convention, ``common.draft_vocab``), plus ``dflash_config`` in the
reference release's layout
and a ``tapdraft`` section (family, target fingerprint, source checkpoint, and the chat-template
settings the draft was trained under: template sha256 and kwargs, which serving must use too).

The export needs no dataset and no trainer: the checkpoint keeps the drafter's ``export_config``. What that config
repeats of the target (sizes, heads, context length, RoPE, layer kinds) is checked against the target config schema
(``shards.target_config.check_export_config``) before anything is written: a serving engine trusts config.json, and
a checkpoint trained from a bundle an older tapdraft did not check may carry any value.

An export is one unit (``commit_export``): written whole into a fresh folder and committed in one rename under
``<out>.lock``, so a kill -9 or a second export at any point leaves the old export or the new one. Non-finite
weights are never exported (``check_finite``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from tapdraft.common.atomic import staged
from tapdraft.common.lock import exclusive_lock
from tapdraft.common.template import template_sha
from tapdraft.shards.target_config import check_export_config
from tapdraft.train.checkpoints import check_finite
from tapdraft.train.drafters.base import Drafter, get_family
from tapdraft.train.drafters.common.export_files import export_names


RETRAIN = ("nothing was exported: the draft was built from a target bundle holding it; retrain from a dataset that "
           "`tapdraft verify` passes")


def family_of(cfg: dict[str, Any]) -> type[Drafter]:
    """The drafter class of an export config (its ``tapdraft.family``)."""
    family = cfg.get("tapdraft", {}).get("family")
    if not family:
        raise ValueError("the export config names no drafter family (tapdraft.family): it was not written by a drafter")
    return get_family(family)[1]


def commit_export(out_dir: str | os.PathLike, write: Callable[[Path], Any], *, run: Path | None = None) -> Path:
    """Write an export with ``write(folder)`` into a fresh folder and commit it as ``out_dir`` in one rename
    (``common.atomic.staged``: an existing export is swapped out whole), holding ``<out_dir>.lock``
    (``common.lock``) throughout, so a kill or a second export at any point leaves the old export or the new one,
    never one's weights under the other's config; a second export meanwhile is refused at once.

    ``out_dir`` is new, empty or an earlier export; what an earlier export did not write (a model card, ``.git``)
    is carried into the new one (hard links, a copy where the filesystem has none). Anything else (a file, another
    non-empty directory, the run itself or a folder holding it) is refused before anything is written."""
    out = Path(os.path.abspath(out_dir))
    if run is not None and (out.resolve() == run.resolve() or out.resolve() in run.resolve().parents):
        raise ValueError(f"--out {out} is the run {run} (or holds it): export into another directory")
    with exclusive_lock(Path(str(out) + ".lock"), "an export", guards=out):
        keep = _kept_names(out)
        with staged(out) as tmp:
            tmp.mkdir()
            write(tmp)
            for name in sorted(keep - {p.name for p in tmp.iterdir()}):
                _link_copy(out / name, tmp / name)
    return out


def _kept_names(out: Path) -> set[str]:
    """What of ``out`` a new export there carries over; ValueError when ``out`` is no place for an export."""
    if not out.exists() and not out.is_symlink():
        return set()
    if out.is_symlink() or not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory: export into a new or empty directory")
    names = {p.name for p in out.iterdir()}
    if not names:
        return set()
    own = export_names(out)
    if own is None:
        raise ValueError(f"--out {out} is a non-empty directory that is not a draft export; export into a new or empty "
                         "directory (nothing in it was changed)")
    return names - own


def _link_copy(src: Path, dst: Path) -> None:
    """``src`` (a file, link or directory tree) at ``dst``: hard links where the filesystem allows, else copies."""
    def link(a: str, b: str) -> None:
        try:
            os.link(a, b, follow_symlinks=False)
        except OSError:
            shutil.copy2(a, b, follow_symlinks=False)

    if src.is_dir() and not src.is_symlink():
        shutil.copytree(src, dst, symlinks=True, copy_function=link)
    else:
        link(str(src), str(dst))


def export_drafter(model: Drafter, out_dir: str | os.PathLike, meta: dict[str, Any], *,
                   layout: str | None = None) -> Path:
    """Export a drafter in memory: its trainable weights and ``export_config()`` plus ``meta``."""
    native, config = model.trainable_state_dict(), model.export_config()
    native = {**native, **type(model).head_rows(native, config, lambda: model.target.lm_head)}
    weights, cfg = type(model).export_layout(native, config, layout)
    check_export_config(cfg, "the drafter's export config", RETRAIN)
    check_finite(weights, "the drafter", "exported")
    return commit_export(out_dir, lambda tmp: type(model).write_export(tmp, weights, cfg, meta))


def export_run(run_dir: str | os.PathLike, out_dir: str | os.PathLike, *, checkpoint: str | None = None,
               layout: str | None = None, verifier: str | None = None,
               data: str | os.PathLike | None = None) -> dict[str, Any]:
    """Export a run's latest (or the given) checkpoint; returns a summary dict.

    ``layout``: one of the family's layouts (``Drafter.export_layout``; None: its default; ``speculators`` names the
    target: ``verifier``). ``data``: a dataset of the run's target, read only when the export must carry frozen target
    rows itself (``Drafter.head_rows``: a DFlash draft vocabulary's lm_head rows)."""
    from tapdraft.train.checkpoints import STATE_FILE, load_checkpoint, load_latest

    run = Path(run_dir)
    if checkpoint and not (Path(checkpoint) / STATE_FILE).is_file():
        raise FileNotFoundError(f"--checkpoint {checkpoint} holds no {STATE_FILE}: give one of {run}/checkpoints/step-N")
    found = (Path(checkpoint), load_checkpoint(checkpoint)) if checkpoint else load_latest(run)
    if found is None:
        raise FileNotFoundError(f"{run} has no checkpoint (expected {run}/checkpoints/step-*/state.pt); train first")
    ck, state = found
    cfg = state.export_config
    if not cfg:
        raise ValueError(f"{ck} holds no export_config: its drafter family cannot be exported")
    here = ck.resolve()  # recorded relative to the run (an export travels; a local absolute path means nothing)
    source = here.relative_to(run.resolve()).as_posix() if here.is_relative_to(run.resolve()) else here.name
    meta: dict[str, Any] = {"source_checkpoint": source, "step": int(state.step)}
    if state.template is not None:  # checkpoints written before template settings were recorded lack it
        meta["chat_template"] = {"sha256": template_sha(state.template["text"]), "kwargs": state.template["kwargs"]}
    native = cfg
    family = family_of(native)
    rows = family.head_rows(state.draft, native, lambda: target_lm_head(data, native, run))
    weights, cfg = family.export_layout({**state.draft, **rows}, native, layout, verifier=verifier)
    check_export_config(cfg, f"{ck} (its export config)", RETRAIN)
    check_finite(weights, str(ck), "exported")
    out = commit_export(out_dir, lambda tmp: family.write_export(tmp, weights, cfg, meta), run=run)
    n = sum(v.numel() for v in weights.values() if v.is_floating_point())  # not the d2t / t2d id tables
    return {"out": str(out), "step": int(state.step), "parameters": n, "tensors": len(weights),
            "layout": layout or family.default_layout,
            "block_size": native.get("block_size"), "target_layer_ids": native.get("target_layer_ids"),
            "target_layer_ids_vllm": native.get("target_layer_ids_vllm"), "mask_token_id": native.get("mask_token_id")}


def target_lm_head(data: str | os.PathLike | None, native: dict[str, Any], run: Path) -> torch.Tensor:
    """The lm_head [V, H] of the target a run's draft was trained for, from a dataset of that target (``data``);
    ValueError when none is given or the dataset is of another target."""
    if data is None:
        raise ValueError(f"the draft in {run} drafts from a subset of the target's lm_head rows, which the export must "
                         "carry for vLLM: pass --data DATASET, a dataset of the target it was trained for")
    from tapdraft.shards.reader import open_dataset

    bundle = open_dataset(str(data)).bundle()
    want = native.get("tapdraft", {}).get("target_fingerprint")
    if want and bundle.fingerprint != want:
        raise ValueError(f"{data} was captured from target {bundle.fingerprint[:12]}, but the draft in {run} was "
                         f"trained for {want[:12]}: pass a dataset of the same target")
    return bundle.lm_head


def format_export(res: dict[str, Any]) -> str:
    """One readable screen for ``tapdraft export`` (``--json`` prints ``res`` itself)."""
    return "\n".join([
        f"exported step {res['step']} to {res['out']}: {res['parameters']:,} parameters in {res['tensors']} tensors",
        f"  target layers (HF) {res['target_layer_ids']}  vLLM {res['target_layer_ids_vllm']}"
        + (f"  block size {res['block_size']}  mask token {res['mask_token_id']}" if res.get("block_size") else ""),
    ])
