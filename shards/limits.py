"""What a dataset sent by someone else may claim: paths confined to its root, sizes bounded before allocation.

A manifest, a shard index, a bundle.json and a WebDataset member are all written by whoever made the
dataset; their checksums prove the bytes were not damaged, not that the writer meant well. So every
path read from them is checked to stay inside the dataset (``safe_relpath``: relative, no ``..``, no
drive, scheme or backslash), and every size or count read from them is checked against ONE table of
bounds (this one; docs/reliability.md repeats it) before anything of that size is read or allocated:

    claim                          bound                    why (real sizes)
    manifest.json                  MAX_MANIFEST_BYTES 128 MiB  ~250 bytes a shard (30k shards, 30 TB at 1 GiB
                                   by stat, before a byte    shards: ~8 MB) and ~250 a skipped input (500k of
                                   is read                   them fit); json parses it at ~3.5x its size, so
                                                             ~0.5 GB at the bound (1 GiB reached 3.5 GB)
    target/bundle.json             MAX_BUNDLE_DOC_BYTES 64 MiB  config, chat template, file records: a few KB-1 MB
    any other bundle file but the  MAX_BUNDLE_FILE_BYTES 64 MiB  the largest known tokenizer.json (Gemma 3's) is
    weights (tokenizer/, processor  recorded size and file    33 MB; Qwen3's 11 MB, Llama 3's 9 MB; checked
    configs)                       size, before read or copy before train/inspect read it, derive/pull copy it
    weights.safetensors            its recorded size         its tensors are [vocab, hidden]: bounded below
    a shard                        MAX_SHARD_BYTES 64 GiB    the writer rolls at ShardConfig.shard_bytes (1 GiB)
    a shard's index file           MAX_INDEX_BYTES 64 MiB    ~60 bytes a record batch: 1M batches
    a shard's samples              <= its bytes              a sample stores at least one byte
    a shard's (supervised) tokens  <= its bytes x MAX_RATIO  a token stores at least one byte of taps, and no
                                   (supervised <= tokens)    stored byte decompresses past MAX_RATIO
    a shard's audio_seconds        finite, >= 0
    a split's samples, tokens,     the sum of its shards'    what readers index by (``inspect --sample``,
    supervised tokens, bytes,      (audio within 1e-6)       derive's counts, the order's units)
    audio_seconds
    zstd member / Arrow buffer     max(MAX_RATIO x its compressed size, RATIO_FLOOR): real fields compress
                                   1.3-3x (taps) and up to a few hundred x (masks of long samples, under 64 MiB)
    hidden_size                    MAX_HIDDEN 131072         the largest real targets: 16384-18432 (Llama 3.1
                                                             405B, Nemotron-4 340B)
    num_hidden_layers              MAX_LAYERS 4096           real: up to 126
    num_attention_heads, kv heads  MAX_HEADS 4096            real: up to 128
    head_dim                       MAX_HEAD_DIM 8192         real: 64-256
    intermediate_size              MAX_FFN_RATIO x hidden    real ratios 2.5-8 (Gemma: 8); the one width no
                                   (16x), at most 2**20      weight backs, so the drafter's MLP is bounded by
                                                             the hidden size the weights prove
    vocab_size, token ids          MAX_VOCAB 2**24           real: up to 262144 (Gemma 3)
    max_position_embeddings        MAX_POSITIONS 2**30       real: up to 10M (Llama 4 Scout)
    a layout's top_k               MAX_TOP_K 4096            capture stores 8-64

The widths are the target config schema's bounds (``shards.target_config`` applies them with the rules across
fields); the layout in a manifest is held to the same ones (``shards.schema.Layout``). A claim past a bound is a
``CorruptShardError`` (or the schema's ``ValueError``) naming the file, the field and the bound, one line the CLI
prints as ``error: ...`` (exit 2), not an allocation that ends in an OOM kill; so is a document of the wrong shape
(``check_manifest_shape``: a fixed walk of the parts readers use, never a TypeError or a recursion).
And every file read from a local dataset is a regular file reached through real directories
(``regular_file``): a link is refused, never followed (``shards.members`` says which files those are).
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any

import zstandard

from tapdraft.common.errors import CorruptShardError
from tapdraft.common.files import file_kind

MAX_SHARD_BYTES = 64 << 30
MAX_INDEX_BYTES = 64 << 20
MAX_MANIFEST_BYTES = 128 << 20
MAX_BUNDLE_DOC_BYTES = 64 << 20
MAX_BUNDLE_FILE_BYTES = 64 << 20
MAX_RATIO = 1024
RATIO_FLOOR = 64 << 20
MAX_HIDDEN = 1 << 17
MAX_LAYERS = 4096
MAX_HEADS = 4096
MAX_HEAD_DIM = 8192
MAX_FFN_RATIO = 16
MAX_INTERMEDIATE = 1 << 20
MAX_VOCAB = 1 << 24
MAX_POSITIONS = 1 << 30
MAX_TOP_K = 4096
_DRIVE = re.compile(r"^[A-Za-z]:")
_PLAIN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*(?:/[A-Za-z0-9_][A-Za-z0-9_.+-]*)*")
"""Names every part of which starts with a letter, digit or underscore (never ``.``, ``..``, ``~``, a drive)."""


def safe_relpath(name: Any, where: str, under: str | None = None) -> str:
    """``name`` when it is a plain relative path inside the dataset (optionally under the folder ``under``);
    otherwise ValueError naming ``where``. Refuses absolute paths, ``..`` parts, ``~``, drives, URLs,
    backslashes and empty parts, so a manifest cannot make a reader open a file outside the dataset."""
    if isinstance(name, str) and _PLAIN.fullmatch(name) and (under is None or name.startswith(under + "/")):
        return name  # the common case in one regex (30k shard names: 0.1 s less to open)
    parts = name.split("/") if isinstance(name, str) else []
    ok = (isinstance(name, str) and bool(name) and "\\" not in name and "\0" not in name and "://" not in name
          and not name.startswith(("/", "~")) and not _DRIVE.match(name)
          and all(p not in ("", ".", "..") for p in parts)
          and (under is None or (len(parts) > 1 and parts[0] == under)))
    if not ok:
        inside = f" inside {under}/" if under else ""
        raise ValueError(f"{where} names the path {name!r}, which is not a relative path{inside} of the dataset: "
                         "refusing to read outside the dataset directory (the manifest was edited or crafted)")
    return name


def check_size(n: Any, limit: int, where: str, what: str = "bytes") -> int:
    """``n`` as an int when 0 <= n <= limit; otherwise CorruptShardError naming ``where``."""
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= limit:
        raise CorruptShardError(f"{where} claims {n!r} {what}, outside 0..{limit}: refusing it (the manifest or "
                                "index was damaged or crafted); re-copy the dataset from its source")
    return n


def check_file_size(n: int, limit: int, path: str, name: str) -> int:
    """``n``, the size of the file at ``path`` (from a stat or a record), when at most ``limit``; otherwise
    CorruptShardError naming the file and the bound ``name`` (a constant of this module's table)."""
    if n > limit:
        raise CorruptShardError(f"{path} is {n} bytes, more than the bound {limit} ({name}, shards.limits): refusing "
                                "to read or copy it (no real dataset's is that large: damaged or crafted); re-copy "
                                "the dataset from its source")
    return n


def check_count(n: Any, limit: int | float, where: str, what: str) -> None:
    """A count (``what``) claimed at ``where``: an int in 0..limit, or for ``audio_seconds`` a finite number
    >= 0; otherwise CorruptShardError naming it and the bound."""
    if what == "audio_seconds":
        ok = isinstance(n, (int, float)) and not isinstance(n, bool) and 0 <= n < float("inf")
        bound = "a finite number >= 0"
    else:
        ok = isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= limit
        bound = f"0..{limit}"
    if not ok:
        raise CorruptShardError(f"{where} claims {what} = {json.dumps(n)[:40]}, outside {bound}: refusing it (the "
                                "manifest was damaged or crafted); re-copy the dataset from its source")


def decompress_bounded(blob: bytes, where: str) -> bytes:
    """zstd-decompress one member, refusing a frame whose declared or actual size passes the bound
    (``frame_content_size`` reads the frame header; without a declared size the output is capped)."""
    limit = max(MAX_RATIO * len(blob), RATIO_FLOOR)
    try:
        declared = zstandard.frame_content_size(blob)
    except zstandard.ZstdError as e:
        raise CorruptShardError(f"{where} is not a zstd frame ({e}); the shard is damaged") from e
    if declared > limit:
        raise CorruptShardError(f"{where} declares {declared} bytes decompressed from {len(blob)}, more than the "
                                f"bound {limit}: refusing to allocate it (the shard is damaged or crafted)")
    try:
        out = zstandard.ZstdDecompressor().decompress(blob, max_output_size=limit if declared < 0 else 0)
    except zstandard.ZstdError as e:
        raise CorruptShardError(f"{where} is corrupted ({e})") from e
    if len(out) > limit:
        raise CorruptShardError(f"{where} decompresses to {len(out)} bytes, more than the bound {limit}")
    return out


def refused_link(path: str, what: str) -> CorruptShardError:
    """The one refusal of a link or special file inside a dataset (``what``: :func:`tapdraft.common.files.file_kind`)."""
    return CorruptShardError(f"{path} is {what}: a dataset holds regular files only and tapdraft never follows a "
                             "link out of one (it could lead to any file of this machine); replace it with the "
                             "file itself (cp -L) if you trust its source, or re-copy the dataset")


def regular_file(root: str | os.PathLike, rel: str) -> int:
    """The size of ``root/rel``, a regular file reached through real directories (no part of ``rel`` a link);
    FileNotFoundError when absent, CorruptShardError for a link or a special file. ``root`` itself is the
    user's own path and may be a link."""
    path = Path(root)
    parts = rel.split("/")
    for i, part in enumerate(parts):
        path = path / part
        st = os.lstat(path)
        last = i == len(parts) - 1
        if stat.S_ISLNK(st.st_mode) or (last and not stat.S_ISREG(st.st_mode)) \
                or (not last and not stat.S_ISDIR(st.st_mode)):
            raise refused_link(str(path), file_kind(st.st_mode))
    return st.st_size


def parse_json(raw: bytes | str, where: str) -> Any:
    """JSON that a dataset carries (manifest, index), parsed into a CorruptShardError naming ``where`` for invalid
    JSON or UTF-8, and for nesting deep enough to exhaust the parser (``[[[[...``: RecursionError otherwise)."""
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptShardError(f"{where} is not valid JSON ({e}); it may be truncated: re-copy the dataset (or re-run "
                                "finalize)") from e
    except RecursionError:
        raise CorruptShardError(f"{where} nests deeper than any tapdraft document: refusing it (damaged or crafted); "
                                "re-copy the dataset") from None


_NUMBER = (int, float)
_SHARD_SHAPE = {"name": str, "bytes": int, "samples": int, "sha256": str, "tokens": int, "supervised_tokens": int,
                "audio_seconds": _NUMBER, "index": list, "inline_index": dict}
_SPLIT_SHAPE = {"samples": int, "tokens": int, "supervised_tokens": int, "audio_seconds": _NUMBER, "bytes": int,
                "shards": list}
_MANIFEST_SHAPE = {"schema_version": str, "format": str, "complete": bool, "fingerprint": str, "layout": dict,
                   "field_meta": dict, "splits": dict, "skipped": dict, "extra": (dict, type(None)),
                   "integrity": dict, "shard_config": dict, "card": dict, "bundle": dict}


def _kind_name(t: Any) -> str:
    names = [x.__name__ for x in (t if isinstance(t, tuple) else (t,))]
    return {"dict": "an object", "list": "a list", "str": "a string", "int": "an integer", "bool": "true or false",
            "float": "a number", "NoneType": "null"}.get(names[0], names[0]) if len(names) == 1 else " or ".join(names)


def _fields(doc: Any, shape: dict[str, Any], where: str, what: str) -> None:
    if not isinstance(doc, dict):
        raise CorruptShardError(f"{where}: {what} is {type(doc).__name__}, not an object: not a tapdraft manifest "
                                "(damaged or crafted); re-copy the dataset (or re-run finalize)")
    for key, t in shape.items():
        v = doc.get(key)
        if key in doc and (not isinstance(v, t) or (t is int and isinstance(v, bool))):
            raise CorruptShardError(f"{where}: {what}.{key} is {json.dumps(v)[:40]}, not {_kind_name(t)}: not a "
                                    "tapdraft manifest (damaged or crafted); re-copy the dataset (or re-run finalize)")


def check_manifest_shape(doc: Any, where: str) -> dict[str, Any]:
    """``doc`` when every part a reader walks has its declared type (the document, each split, each shard entry;
    keys may be absent, which the checks after this one name); otherwise CorruptShardError naming ``where`` and the
    part. A fixed walk three levels deep, so a crafted document cannot make it recurse or raise a TypeError."""
    _fields(doc, _MANIFEST_SHAPE, where, "the document")
    for split, d in (doc.get("splits") or {}).items():
        _fields(d, _SPLIT_SHAPE, where, f"split {split}")
        for i, sh in enumerate(d.get("shards") or []):
            _fields(sh, _SHARD_SHAPE, where, f"split {split} shard {i}")
    for split, skipped in (doc.get("skipped") or {}).items():
        if not isinstance(skipped, list) or not all(isinstance(s, dict) for s in skipped):
            raise CorruptShardError(f"{where}: skipped.{split} is not a list of objects: not a tapdraft manifest; "
                                    "re-copy the dataset (or re-run finalize)")
    return doc
