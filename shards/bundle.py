"""The target bundle: the frozen pieces of the target a drafter needs, so training never loads it.

    target/
      bundle.json            config (below) + audio front-end config + chat template + template kwargs + fingerprint
      weights.safetensors    embed_tokens [V, H], norm_weight [H], lm_head [V, H]
      tokenizer/             the tokenizer's own files (tokenizer.json, tokenizer_config.json, ...)

Fingerprint = sha256 over canonical JSON of (config, audio, chat template, template kwargs when any,
sha256 of every tokenizer file, sha256 of every weight tensor's bytes). It is a pure function of the
content: two captures of the same target agree, any change to weights, tokenizer, template or its
kwargs changes it (bundles without kwargs hash as they did before kwargs were recorded).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import fsspec
from safetensors.torch import load_file, save_file

from shards.atomic import recover_dir, staged
from shards.template import template_kwargs as canonical_kwargs

BUNDLE_FILE = "bundle.json"
WEIGHTS_FILE = "weights.safetensors"
TOKENIZER_DIR = "tokenizer"
WEIGHT_NAMES = ("embed_tokens", "norm_weight", "lm_head")

CONFIG_KEYS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "vocab_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "rope_theta",
    "rms_norm_eps",
    "logits_scaling",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)
"""What a drafter reads of the target. ``logits_scaling``: the teacher divides logits by it (Granite)."""


@dataclass
class TargetBundle:
    config: dict[str, Any]
    """Keys of CONFIG_KEYS."""
    audio: dict[str, Any]
    """Audio front end: sample_rate, frame_seconds, placeholder, placeholder_token_id, audio_token_id."""
    chat_template: str | None
    embed_tokens: torch.Tensor
    norm_weight: torch.Tensor
    lm_head: torch.Tensor
    fingerprint: str = ""
    path: Path | None = None
    tokenizer_files: dict[str, bytes] = field(default_factory=dict, repr=False)
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Kwargs the chat template was rendered with at capture (``enable_thinking``, ...); shards.template."""

    @property
    def template_settings(self) -> tuple[str | None, dict[str, Any]]:
        """(chat template text, kwargs) the dataset's conversations were tokenized with."""
        return self.chat_template, self.template_kwargs

    @property
    def hidden_size(self) -> int:
        return int(self.config["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.lm_head.shape[0])

    @property
    def tokenizer_dir(self) -> Path | None:
        return None if self.path is None else self.path / TOKENIZER_DIR


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _tensor_sha(t: torch.Tensor) -> str:
    t = t.detach().cpu().contiguous()
    raw = t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)
    return _sha(raw.numpy().tobytes() + f"{t.dtype}{tuple(t.shape)}".encode())


def compute_fingerprint(
    config: dict[str, Any],
    audio: dict[str, Any],
    chat_template: str | None,
    weights: dict[str, torch.Tensor],
    tokenizer_files: dict[str, bytes],
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    doc = {
        "config": {k: config.get(k) for k in CONFIG_KEYS},
        "audio": audio,
        "chat_template": chat_template,
        "tokenizer": {name: _sha(data) for name, data in sorted(tokenizer_files.items())},
        "weights": {name: _tensor_sha(weights[name]) for name in WEIGHT_NAMES},
    }
    if template_kwargs:  # absent when empty, so bundles written before kwargs existed keep their fingerprint
        doc["template_kwargs"] = canonical_kwargs(template_kwargs)
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return _sha(canonical.encode())


def _read_tokenizer_files(tokenizer_dir: str | os.PathLike | None) -> dict[str, bytes]:
    if tokenizer_dir is None:
        return {}
    root = Path(tokenizer_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"tokenizer directory {root} does not exist")
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.is_file()}


def bundle_fingerprint(
    *,
    config: dict[str, Any],
    audio: dict[str, Any],
    chat_template: str | None,
    embed_tokens: torch.Tensor,
    norm_weight: torch.Tensor,
    lm_head: torch.Tensor,
    tokenizer_dir: str | os.PathLike | None,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The fingerprint ``write_bundle`` would record for these parts (e.g. of a live target)."""
    weights = {"embed_tokens": embed_tokens, "norm_weight": norm_weight, "lm_head": lm_head}
    return compute_fingerprint(config, audio, chat_template, weights, _read_tokenizer_files(tokenizer_dir),
                               template_kwargs)


def write_bundle(
    out_dir: str | os.PathLike,
    *,
    config: dict[str, Any],
    audio: dict[str, Any],
    chat_template: str | None,
    embed_tokens: torch.Tensor,
    norm_weight: torch.Tensor,
    lm_head: torch.Tensor,
    tokenizer_dir: str | os.PathLike | None,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """Write ``out_dir`` (staged beside it, swapped in atomically) and return the fingerprint."""
    missing = [k for k in CONFIG_KEYS if k not in config]
    if missing:
        raise ValueError(f"bundle config is missing {missing}")
    weights = {
        "embed_tokens": embed_tokens.detach().cpu().contiguous(),
        "norm_weight": norm_weight.detach().cpu().contiguous(),
        "lm_head": lm_head.detach().cpu().contiguous(),
    }
    if weights["lm_head"].data_ptr() == weights["embed_tokens"].data_ptr():  # tied head: safetensors refuses shared storage
        weights["lm_head"] = weights["lm_head"].clone()
    V, H = weights["lm_head"].shape
    if weights["embed_tokens"].shape[1] != H or tuple(weights["norm_weight"].shape) != (H,):
        raise ValueError(
            f"bundle weights disagree: embed {tuple(weights['embed_tokens'].shape)}, "
            f"norm {tuple(weights['norm_weight'].shape)}, lm_head {(V, H)}"
        )
    if H != int(config["hidden_size"]):
        raise ValueError(f"bundle config hidden_size {config['hidden_size']} != weights' {H}")
    tok = _read_tokenizer_files(tokenizer_dir)
    kwargs = canonical_kwargs(template_kwargs)
    fp = compute_fingerprint(config, audio, chat_template, weights, tok, kwargs)
    with staged(out_dir) as tmp:
        (tmp / TOKENIZER_DIR).mkdir(parents=True)
        save_file(weights, str(tmp / WEIGHTS_FILE))
        for name, data in tok.items():
            (tmp / TOKENIZER_DIR / name).write_bytes(data)
        doc = {
            "config": {k: config.get(k) for k in CONFIG_KEYS},
            "audio": audio,
            "chat_template": chat_template,
            "template_kwargs": kwargs,
            "fingerprint": fp,
        }
        (tmp / BUNDLE_FILE).write_text(json.dumps(doc, indent=2, sort_keys=True))
    return fp


def load_bundle(path: str | os.PathLike, *, verify: bool = True) -> TargetBundle:
    """Read a bundle directory; with ``verify`` the fingerprint is recomputed and must match."""
    root = Path(path)
    recover_dir(root)
    meta_path = root / BUNDLE_FILE
    if not meta_path.is_file():
        raise FileNotFoundError(f"{meta_path} not found: {root} is not a tapdraft target bundle")
    doc = json.loads(meta_path.read_text())
    weights = load_file(str(root / WEIGHTS_FILE))
    missing = [n for n in WEIGHT_NAMES if n not in weights]
    if missing:
        raise ValueError(f"{root / WEIGHTS_FILE} lacks tensors {missing}")
    tok_dir = root / TOKENIZER_DIR
    tok = _read_tokenizer_files(tok_dir) if tok_dir.is_dir() else {}
    bundle = TargetBundle(
        config=doc["config"],
        audio=doc.get("audio", {}),
        chat_template=doc.get("chat_template"),
        embed_tokens=weights["embed_tokens"],
        norm_weight=weights["norm_weight"],
        lm_head=weights["lm_head"],
        fingerprint=doc["fingerprint"],
        path=root,
        tokenizer_files=tok,
        template_kwargs=canonical_kwargs(doc.get("template_kwargs")),
    )
    if verify:
        fp = compute_fingerprint(bundle.config, bundle.audio, bundle.chat_template, weights, tok,
                                 bundle.template_kwargs)
        if fp != bundle.fingerprint:
            raise ValueError(
                f"target bundle {root} is corrupted or was edited: its content hashes to {fp[:12]}, "
                f"bundle.json says {bundle.fingerprint[:12]}; re-copy the dataset's target/ directory"
            )
    return bundle


def stored_fingerprint(fs: fsspec.AbstractFileSystem, path: str) -> str | None:
    """The fingerprint recorded in the bundle at ``path`` (None when there is no bundle there)."""
    meta = path.rstrip("/") + "/" + BUNDLE_FILE
    if not fs.exists(meta):
        return None
    with fs.open(meta, "rb") as f:
        return json.loads(f.read()).get("fingerprint")


def open_bundle(fs: fsspec.AbstractFileSystem, path: str, *, verify: bool = True) -> TargetBundle:
    """``load_bundle`` on any fsspec filesystem: a remote bundle is first copied to a local temp directory
    (kept, because ``TargetBundle.tokenizer_dir`` points into it)."""
    if not fs.exists(path):
        raise FileNotFoundError(f"{path} not found: the dataset lacks its target bundle; re-run capture")
    if "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
        return load_bundle(path, verify=verify)
    local = tempfile.mkdtemp(prefix="tapdraft-bundle-") + "/target"
    fs.get(path, local, recursive=True)
    return load_bundle(local, verify=verify)
