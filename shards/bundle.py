"""The target bundle: the frozen pieces of the target a drafter needs, so training never loads it.

    target/
      bundle.json            schema version, config, head spec, audio front-end config, chat template,
                             template kwargs, fingerprint, and the sha256 and size of every file below
      weights.safetensors    embed_tokens [V, H], norm_weight [H], lm_head [V, H] (absent when the head is
                             tied: it IS embed_tokens), norm_bias [H] (LayerNorm heads), lm_head_bias [V]
                             (heads with a bias); in the checkpoint's dtype, not the compute dtype
      tokenizer/             the tokenizer's own files, by an allow-list (TOKENIZER_FILES): never weights

The head spec (``shards.head.HeadSpec``) says how those weights turn hidden rows into logits and ids
into input embeddings. Bundles written before it was declared (schema 1.0: no ``head`` key, lm_head
always stored) are read through :func:`migrate_bundle_doc`.

Fingerprint = sha256 over canonical JSON of (config's CONFIG_KEYS, head spec, audio, chat template, template
kwargs when any, sha256 of every tokenizer file, sha256 of every stored weight tensor's bytes). It is a pure
function of the target: two captures of the same target agree, any change to weights, tokenizer, template or its
kwargs, or head changes it (bundles without kwargs hash as they did before kwargs were recorded). Content is
hashed once, when the bundle is written, and bundle.json records every file's and tensor's sha256; opening a
bundle recomputes the fingerprint from those records (canonical JSON, no weight read) and checks each file's size;
``load_bundle(verify=True)`` re-hashes every file (``tapdraft verify``).

The fingerprint is the target's identity, not a checksum of bundle.json: the serving keys (SERVING_KEYS) and the
file records are outside it. A dataset's manifest records bundle.json's own bytes (``shards.manifest.BUNDLE_KEY``,
as it records the card's), and every reader of a dataset passes that record as ``expect``, so an edit of any byte
of bundle.json (a serving key, a file record) is refused before a value of it is used; manifests written before
the record have none, and their bundles are checked as before. The values themselves are checked against the
target config schema (``shards.target_config``) when a bundle is written and when it is loaded.

A bundle is bundle.json and the files it lists, nothing else: a reader reads only those (an extra file
in tokenizer/ is ignored, and reported by ``verify``), ``copy_bundle`` copies only those, and a link
among them is refused, never followed (``shards.members``). Reading never writes: a ``target.old`` left
by an interrupted rewrite is recovered by the next writer (``common.atomic.staged``), not by a reader.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch
import fsspec
from fsspec.implementations.local import LocalFileSystem
from safetensors.torch import load_file, save_file

from tapdraft.common.atomic import OLD_SUFFIX, is_local as _is_local, staged
from tapdraft.common.errors import CorruptShardError
from tapdraft.shards.head import HeadSpec
from tapdraft.shards.integrity import matches_record
from tapdraft.shards.limits import (MAX_BUNDLE_DOC_BYTES, MAX_BUNDLE_FILE_BYTES, check_file_size, check_size,
                                    regular_file, safe_relpath)
from tapdraft.shards.schema import SCHEMA_VERSION, check_schema_version
from tapdraft.shards.target_config import check_target_config
from tapdraft.common.template import template_kwargs as canonical_kwargs

BUNDLE_FILE = "bundle.json"
WEIGHTS_FILE = "weights.safetensors"
TOKENIZER_DIR = "tokenizer"
WEIGHT_NAMES = ("embed_tokens", "norm_weight", "lm_head", "norm_bias", "lm_head_bias")
"""Every tensor a bundle may store; which ones it does store follows from its head spec (:func:`stored_names`)."""

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "spiece.model", "*.tiktoken", "tekken.json", "vocab.json", "vocab.txt", "merges.txt",
    "chat_template.jinja", "chat_template.json", "processor_config.json", "preprocessor_config.json",
)
"""What of a tokenizer directory goes into the bundle (fnmatch patterns): tokenizer, special tokens, chat
template, processor configs. Model weights and configs never do, even when the tokenizer sits beside them."""
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
SERVING_KEYS = ("max_position_embeddings", "rope_parameters", "layer_types")
"""Target facts a draft's serving config repeats (context length, RoPE type and scaling, attention kind per
layer). Recorded when the target has them, outside the fingerprint: no tensor a drafter trains on depends
on them, and bundles written before they were recorded keep their fingerprint. The manifest's record of
bundle.json covers them (``expect``), and ``shards.target_config`` bounds them."""
STALE_BUNDLE = "re-capture the dataset with this tapdraft, or re-copy target/ from the original dataset"
"""What to do about a bundle whose config breaks the schema."""



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
    """The lm_head [V, H]; the very tensor ``embed_tokens`` when ``head.tied``."""
    head: HeadSpec = field(default_factory=HeadSpec)
    norm_bias: torch.Tensor | None = None
    lm_head_bias: torch.Tensor | None = None
    fingerprint: str = ""
    path: Path | None = None
    tokenizer_files: dict[str, bytes] = field(default_factory=dict, repr=False)
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Kwargs the chat template was rendered with at capture (``enable_thinking``, ...); common.template."""

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


def _file_sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _tensor_sha(t: torch.Tensor) -> str:
    t = t.detach().cpu().contiguous()
    raw = t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)
    return _sha(raw.numpy().tobytes() + f"{t.dtype}{tuple(t.shape)}".encode())


def stored_names(head: HeadSpec) -> tuple[str, ...]:
    """The tensors a bundle with this head stores (a tied lm_head is not stored again)."""
    names = ["embed_tokens", "norm_weight"]
    if not head.tied:
        names.append("lm_head")
    if head.norm_bias:
        names.append("norm_bias")
    if head.lm_head_bias:
        names.append("lm_head_bias")
    return tuple(names)


def fingerprint_of(
    config: dict[str, Any],
    audio: dict[str, Any],
    chat_template: str | None,
    tokenizer_sha: dict[str, str],
    tensor_sha: dict[str, str],
    template_kwargs: dict[str, Any] | None = None,
    head: HeadSpec | None = None,
) -> str:
    """The fingerprint from the content's hashes (what bundle.json records): canonical JSON, sha256."""
    doc = {
        "config": {k: config.get(k) for k in CONFIG_KEYS},
        "audio": audio,
        "chat_template": chat_template,
        "tokenizer": dict(sorted(tokenizer_sha.items())),
        "weights": dict(sorted(tensor_sha.items())),
    }
    if template_kwargs:  # absent when empty, so bundles written before kwargs existed keep their fingerprint
        doc["template_kwargs"] = canonical_kwargs(template_kwargs)
    if head is not None:
        doc["head"] = head.to_dict()
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return _sha(canonical.encode())


def compute_fingerprint(
    config: dict[str, Any],
    audio: dict[str, Any],
    chat_template: str | None,
    weights: dict[str, torch.Tensor],
    tokenizer_files: dict[str, bytes],
    template_kwargs: dict[str, Any] | None = None,
    head: HeadSpec | None = None,
) -> str:
    """sha256 of the bundle's content; ``head`` None is a bundle written before heads were declared."""
    return fingerprint_of(config, audio, chat_template, {n: _sha(d) for n, d in tokenizer_files.items()},
                          {n: _tensor_sha(t) for n, t in weights.items()}, template_kwargs, head)


def _read_tokenizer_files(tokenizer_dir: str | os.PathLike | None) -> dict[str, bytes]:
    """The allow-listed files (TOKENIZER_FILES) of a tokenizer directory."""
    if tokenizer_dir is None:
        return {}
    root = Path(tokenizer_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"tokenizer directory {root} does not exist")
    files = [p for p in sorted(root.iterdir())
             if p.is_file() and any(fnmatch.fnmatchcase(p.name, pat) for pat in TOKENIZER_FILES)]
    for p in files:  # a file no reader could take is refused when the bundle is written, not after a capture
        check_member_size(f"{TOKENIZER_DIR}/{p.name}", p.stat().st_size, None, str(p))
    return {p.name: p.read_bytes() for p in files}


def _bundle_weights(
    config: dict[str, Any], head: HeadSpec, embed_tokens: torch.Tensor, norm_weight: torch.Tensor,
    lm_head: torch.Tensor, norm_bias: torch.Tensor | None, lm_head_bias: torch.Tensor | None,
    dtype: torch.dtype | None,
) -> dict[str, torch.Tensor]:
    """The tensors to store, on CPU, in ``dtype`` (the checkpoint's; None keeps theirs), checked against the head."""
    given = {"embed_tokens": embed_tokens, "norm_weight": norm_weight, "lm_head": lm_head,
             "norm_bias": norm_bias, "lm_head_bias": lm_head_bias}
    names = stored_names(head)
    extra = [n for n in ("norm_bias", "lm_head_bias") if given[n] is not None and n not in names]
    absent = [n for n in names if given[n] is None]
    if extra or absent:
        raise ValueError(f"bundle weights disagree with the head spec {head}: given {extra} it does not declare, "
                         f"missing {absent}")
    same = lm_head.data_ptr() == embed_tokens.data_ptr() and lm_head.shape == embed_tokens.shape
    if head.tied and not (same or torch.equal(lm_head.detach().cpu(), embed_tokens.detach().cpu())):
        raise ValueError("the head spec says the lm_head is tied, but it differs from embed_tokens")
    weights = {}
    for n in names:
        t = given[n].detach().cpu()
        weights[n] = (t if dtype is None else t.to(dtype)).contiguous()
    H = int(weights["embed_tokens"].shape[1])
    V = int(lm_head.shape[0])
    bad = (tuple(lm_head.shape) != (V, H) or tuple(weights["norm_weight"].shape) != (H,)
           or ("norm_bias" in weights and tuple(weights["norm_bias"].shape) != (H,))
           or ("lm_head_bias" in weights and tuple(weights["lm_head_bias"].shape) != (V,)))
    if bad:
        raise ValueError("bundle weights disagree: " + ", ".join(
            f"{n} {tuple(t.shape)}" for n, t in given.items() if t is not None))
    if H != int(config["hidden_size"]):
        raise ValueError(f"bundle config hidden_size {config['hidden_size']} != weights' {H}")
    return weights


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
    head: HeadSpec = HeadSpec(),
    norm_bias: torch.Tensor | None = None,
    lm_head_bias: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> str:
    """The fingerprint ``write_bundle`` would record for these parts (e.g. of a live target)."""
    weights = _bundle_weights(config, head, embed_tokens, norm_weight, lm_head, norm_bias, lm_head_bias, dtype)
    return compute_fingerprint(config, audio, chat_template, weights, _read_tokenizer_files(tokenizer_dir),
                               template_kwargs, head=head)


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
    head: HeadSpec = HeadSpec(),
    norm_bias: torch.Tensor | None = None,
    lm_head_bias: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> str:
    """Write ``out_dir`` (staged beside it, swapped in atomically) and return the fingerprint.

    ``head`` describes the weights (a tied lm_head is stored once, as embed_tokens); ``dtype`` is the
    checkpoint's, which the weights are stored in (None: as given).
    """
    missing = [k for k in CONFIG_KEYS if k not in config]
    if missing:
        raise ValueError(f"bundle config is missing {missing}")
    recorded = {**{k: config.get(k) for k in CONFIG_KEYS},
                **{k: config[k] for k in SERVING_KEYS if config.get(k) is not None}}
    check_target_config(recorded, f"the target config for {Path(out_dir) / BUNDLE_FILE}",
                        "fix the target's config (tapdraft records only values a target can have)")
    weights = _bundle_weights(config, head, embed_tokens, norm_weight, lm_head, norm_bias, lm_head_bias, dtype)
    tok = _read_tokenizer_files(tokenizer_dir)
    kwargs = canonical_kwargs(template_kwargs)
    tensor_sha = {n: _tensor_sha(t) for n, t in weights.items()}
    fp = fingerprint_of(config, audio, chat_template, {n: _sha(d) for n, d in tok.items()}, tensor_sha, kwargs, head)
    with staged(out_dir) as tmp:
        (tmp / TOKENIZER_DIR).mkdir(parents=True)
        with staged(tmp / WEIGHTS_FILE) as w:  # the ordinary mode of a new file: safetensors creates it 0600
            save_file(weights, str(w))
        for name, data in tok.items():
            (tmp / TOKENIZER_DIR / name).write_bytes(data)
        weights_path = tmp / WEIGHTS_FILE
        tok_files = {f"{TOKENIZER_DIR}/{n}": d for n, d in tok.items()}
        files = {WEIGHTS_FILE: _file_sha(weights_path)} | {n: _sha(d) for n, d in tok_files.items()}
        sizes = {WEIGHTS_FILE: weights_path.stat().st_size} | {n: len(d) for n, d in tok_files.items()}
        doc = {
            "schema_version": SCHEMA_VERSION,
            "config": recorded,
            "head": head.to_dict(),
            "audio": audio,
            "chat_template": chat_template,
            "template_kwargs": kwargs,
            "fingerprint": fp,
            "files": {n: {"sha256": files[n], "bytes": sizes[n]} for n in sorted(files)},
            "tensor_sha256": tensor_sha,
        }
        (tmp / BUNDLE_FILE).write_text(json.dumps(doc, indent=2, sort_keys=True))
    return fp


def migrate_bundle_doc(doc: dict[str, Any]) -> dict[str, Any]:
    """Bring a bundle.json written before heads were declared (schema 1.0) to today's keys; ``doc`` is not changed.

    Such a bundle has no ``head``: its head is an untied RMSNorm with ``rms_norm_eps`` whose logits are
    divided by ``logits_scaling`` (all that could be captured then), and it stores lm_head always.
    Its fingerprint was computed without a head and stays as recorded; it records no per-file hashes.
    """
    if "head" in doc:
        return dict(doc)
    return {**doc, "schema_version": doc.get("schema_version", "1.0"),
            "head": HeadSpec.from_config(doc.get("config", {})).to_dict(), "files": doc.get("files", {})}


def check_member_size(rel: str, size: int | None, rec: dict[str, Any] | None, path: str) -> None:
    """A bundle file's size (by stat, before it is read or copied): what bundle.json records (``rec``; None for
    schema 1.0) and, but for the weights (sized by their tensors), at most MAX_BUNDLE_FILE_BYTES (shards.limits:
    a 1.2 GB tokenizer.json was read whole by train and inspect and copied whole by derive)."""
    if rel not in (BUNDLE_FILE, WEIGHTS_FILE) and size is not None:
        check_file_size(size, MAX_BUNDLE_FILE_BYTES, path, "MAX_BUNDLE_FILE_BYTES")
    if rec is not None and size != rec["bytes"]:
        raise ValueError(f"target bundle {path.rsplit('/', 1)[0]} is corrupted or was edited: {rel} does not match "
                         "what bundle.json records; re-copy the dataset's target/ directory")


def _check_files(root: Path, files: dict[str, dict[str, Any]], *, rehash: bool) -> None:
    for name, rec in files.items():
        p = root / safe_relpath(name, f"{root / BUNDLE_FILE}")
        try:
            size = regular_file(root, name)  # a link is refused, never followed (shards.members)
        except FileNotFoundError:
            size = None
        if size is not None:
            check_member_size(name, size, None, str(p))  # the bound first: nothing past it is hashed or read
        bad = size != rec["bytes"] or (rehash and _file_sha(p) != rec["sha256"])
        if bad:
            raise ValueError(
                f"target bundle {root} is corrupted or was edited: {name} does not match what bundle.json "
                "records; re-copy the dataset's target/ directory"
            )


def bundle_doc_bytes(fs: Any, tdir: str) -> bytes:
    """target/bundle.json's bytes (bounded, a regular file); FileNotFoundError when there is none."""
    path = f"{str(tdir).rstrip('/')}/{BUNDLE_FILE}"
    if _is_local(fs):
        regular_file(fs._strip_protocol(tdir), BUNDLE_FILE)
    with fs.open(path, "rb") as f:
        raw = f.read(MAX_BUNDLE_DOC_BYTES + 1)
    check_size(len(raw), MAX_BUNDLE_DOC_BYTES, path)
    return raw


def check_doc_record(raw: bytes, expect: dict[str, Any] | None, path: str) -> None:
    """Refuse bundle.json bytes that are not the ones the dataset's manifest records (``expect``; None: a manifest
    written before the record, nothing to check)."""
    if expect is not None and not matches_record(raw, expect):
        raise CorruptShardError(f"{path} is not the bundle.json the dataset's manifest records (edited or damaged "
                                "since the dataset was finalized); re-copy target/ from the original dataset")


def read_bundle_doc(fs: Any, tdir: str, expect: dict[str, Any] | None = None) -> dict[str, Any]:
    """target/bundle.json as a dict (bounded, a regular file, its bytes the manifest's record ``expect`` when given);
    FileNotFoundError when there is none."""
    path = f"{str(tdir).rstrip('/')}/{BUNDLE_FILE}"
    raw = bundle_doc_bytes(fs, tdir)
    check_doc_record(raw, expect, path)
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as e:
        raise CorruptShardError(f"{path} is not valid JSON ({e}); re-copy the dataset's target/ directory") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("files", {}), dict):
        raise CorruptShardError(f"{path} is not a bundle document; re-copy the dataset's target/ directory")
    for name, rec in doc.get("files", {}).items():
        if not (isinstance(rec, dict) and isinstance(rec.get("sha256"), str) and isinstance(rec.get("bytes"), int)
                and not isinstance(rec["bytes"], bool) and rec["bytes"] >= 0):
            raise CorruptShardError(f"{path}: files.{name} is {json.dumps(rec)[:60]}, not a record of bytes and "
                                    "sha256; re-copy the dataset's target/ directory")
    return doc


def bundle_names(doc: dict[str, Any], tokenizer_listing: Iterable[str] = ()) -> list[str]:
    """Relative to target/: bundle.json and every file it lists (checked to stay inside). A bundle of schema 1.0
    lists none: its weights, and the names of ``tokenizer_listing`` that the tokenizer allow-list admits."""
    where = "target/bundle.json"
    if "head" in doc:
        return [BUNDLE_FILE] + [safe_relpath(n, where) for n in sorted(doc.get("files", {}))]
    tok = [n for n in sorted(tokenizer_listing) if any(fnmatch.fnmatchcase(n, p) for p in TOKENIZER_FILES)]
    return [BUNDLE_FILE, WEIGHTS_FILE] + [f"{TOKENIZER_DIR}/{safe_relpath(n, where)}" for n in tok]


def _tokenizer_listing(fs: fsspec.AbstractFileSystem, tdir: str) -> list[str]:
    tok = f"{str(tdir).rstrip('/')}/{TOKENIZER_DIR}"
    if _is_local(fs):
        local = Path(fs._strip_protocol(tok))
        if not local.is_dir() or local.is_symlink():
            return []
        return [e.name for e in os.scandir(local) if e.is_file(follow_symlinks=False)]
    return [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(tok, detail=False)] if fs.exists(tok) else []


def bundle_files(fs: Any, tdir: str, doc: dict[str, Any] | None = None) -> list[str]:
    """The bundle's members at ``tdir``, relative to it (see :func:`bundle_names`)."""
    doc = read_bundle_doc(fs, tdir) if doc is None else doc
    return bundle_names(doc, () if "head" in doc else _tokenizer_listing(fs, tdir))


def _interrupted(path: str) -> str:
    """Readers never write: recovering an interrupted directory swap is the next writer's (common.atomic.staged)."""
    name = path.rstrip("/").rsplit("/", 1)[-1]
    return (f"{path} not found, but {name}{OLD_SUFFIX} is there: a rewrite of the bundle was interrupted; rerun the "
            f"command that wrote it, or rename {name}{OLD_SUFFIX} to {name} (tapdraft does not write while reading)")


def _read_regular(root: Path, rel: str) -> bytes:
    check_member_size(rel, regular_file(root, rel), None, str(root / rel))
    return (root / rel).read_bytes()


def copy_bundle(fs: fsspec.AbstractFileSystem, path: str, dest: str | os.PathLike,
                expect: dict[str, Any] | None = None) -> None:
    """Copy the bundle at ``path`` (any filesystem) into the new local directory ``dest``: bundle.json and the files
    it lists, nothing else; a local link among them is refused, never followed (``shards.members``). ``expect``: the
    manifest's record of bundle.json, which the copy must match (an edited bundle.json is not carried on)."""
    doc = read_bundle_doc(fs, path, expect)  # bundle.json as the manifest records it, before anything is copied
    names = bundle_names(doc, () if "head" in doc else _tokenizer_listing(fs, path))
    local = _is_local(fs)
    for rel in names:  # each file's size (stat) checked against its record and the bound before it is copied
        src = f"{path.rstrip('/')}/{rel}"
        size = regular_file(fs._strip_protocol(path), rel) if local else fs.size(src)
        check_member_size(rel, size, doc.get("files", {}).get(rel), src)
    for rel in names:
        out = Path(dest) / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        src = f"{path.rstrip('/')}/{rel}"
        if local:
            regular_file(fs._strip_protocol(path), rel)
            shutil.copyfile(fs._strip_protocol(src), out, follow_symlinks=False)
        else:
            fs.get_file(src, str(out))
    check_doc_record((Path(dest) / BUNDLE_FILE).read_bytes(), expect, f"{path.rstrip('/')}/{BUNDLE_FILE}")


def load_bundle(path: str | os.PathLike, *, verify: bool = False, expect: dict[str, Any] | None = None
                ) -> TargetBundle:
    """Read a bundle directory without hashing its weights: every file's size is checked, the recorded
    fingerprint is recomputed from bundle.json's fingerprinted fields and recorded hashes, and the config is
    checked against the schema (``shards.target_config``); ``expect``, the dataset manifest's record of
    bundle.json, covers every other byte of it (serving keys, file records): any edit shows. With ``verify``
    every file is also re-hashed against what bundle.json records. Only listed files are read, each a regular
    file (CorruptShardError for a link); nothing is written."""
    root = Path(path)
    meta_path = root / BUNDLE_FILE
    if not meta_path.exists() and not meta_path.is_symlink():
        if Path(str(root) + OLD_SUFFIX).is_dir():
            raise FileNotFoundError(_interrupted(str(root)))
        raise FileNotFoundError(f"{meta_path} not found: {root} is not a tapdraft target bundle")
    doc = read_bundle_doc(LocalFileSystem(), str(root), expect)
    check_schema_version(doc.get("schema_version", "1.0"), str(meta_path))
    legacy = "head" not in doc
    # only what bundle.json lists; a schema-1.0 bundle lists nothing: its allow-listed regular files
    members = bundle_names(doc, _tokenizer_listing(LocalFileSystem(), str(root)) if legacy else ())
    doc = migrate_bundle_doc(doc)
    head = HeadSpec.from_dict(doc["head"])
    _check_files(root, doc["files"], rehash=verify)
    if not legacy:  # bundle.json's own fields against its fingerprint, from the recorded hashes: no weight read
        tok_sha = {n.split("/", 1)[1]: r["sha256"] for n, r in doc["files"].items()
                   if n.startswith(TOKENIZER_DIR + "/")}
        fp = fingerprint_of(doc["config"], doc.get("audio", {}), doc.get("chat_template"), tok_sha,
                            doc["tensor_sha256"], doc.get("template_kwargs"), head)
        if fp != doc["fingerprint"]:
            raise ValueError(f"target bundle {root} is corrupted or was edited: bundle.json's fields hash to "
                             f"{fp[:12]}, it says {doc['fingerprint'][:12]}; re-copy the dataset's target/ directory")
    check_target_config(doc["config"], str(meta_path), STALE_BUNDLE)
    regular_file(root, WEIGHTS_FILE)
    open(root / WEIGHTS_FILE, "rb").close()  # unreadable: PermissionError naming it (safetensors says "No such file")
    weights = load_file(str(root / WEIGHTS_FILE))
    names = ("embed_tokens", "norm_weight", "lm_head") if legacy else stored_names(head)
    missing = [n for n in names if n not in weights]
    if missing:
        raise ValueError(f"{root / WEIGHTS_FILE} lacks tensors {missing}")
    tok = {n.split("/", 1)[1]: _read_regular(root, n) for n in members if n.startswith(TOKENIZER_DIR + "/")}
    bundle = TargetBundle(
        config=doc["config"],
        audio=doc.get("audio", {}),
        chat_template=doc.get("chat_template"),
        embed_tokens=weights["embed_tokens"],
        norm_weight=weights["norm_weight"],
        lm_head=weights["embed_tokens"] if head.tied else weights["lm_head"],
        head=head,
        norm_bias=weights.get("norm_bias"),
        lm_head_bias=weights.get("lm_head_bias"),
        fingerprint=doc["fingerprint"],
        path=root,
        tokenizer_files=tok,
        template_kwargs=canonical_kwargs(doc.get("template_kwargs")),
    )
    if verify and legacy:  # no per-file hashes recorded: recompute the fingerprint from the content
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
    return read_bundle_doc(fs, path).get("fingerprint")


def open_bundle(fs: fsspec.AbstractFileSystem, path: str, *, verify: bool = False,
                expect: dict[str, Any] | None = None) -> TargetBundle:
    """``load_bundle`` on any fsspec filesystem: a remote bundle is first copied to a local temp directory
    (kept, because ``TargetBundle.tokenizer_dir`` points into it). ``expect``: the manifest's record of
    bundle.json (``load_bundle``)."""
    if not fs.exists(path):
        if fs.exists(path.rstrip("/") + OLD_SUFFIX):
            raise FileNotFoundError(_interrupted(path))
        raise FileNotFoundError(f"{path} not found: the dataset lacks its target bundle; re-run capture")
    if "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
        return load_bundle(path, verify=verify, expect=expect)
    local = tempfile.mkdtemp(prefix="tapdraft-bundle-") + "/target"
    copy_bundle(fs, path, local)
    return load_bundle(local, verify=verify, expect=expect)
