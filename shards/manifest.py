"""The dataset directory: file naming, manifest.json (written last, atomically) and the README card.

    manifest.json                      complete: true only once every shard is final
    README.md                          dataset card generated from the manifest
    target/                            target bundle (shards.bundle)
    data/train-00000-of-00012.arrow    final shard names (.tar for WebDataset)
    _parts/train-rank00000.json        a writer rank's partial index (resume + finalize input)

A reader refuses a directory without manifest.json, with ``complete`` not true, or with a schema
major version it does not know (``check_manifest``).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import fsspec

from shards.schema import SCHEMA_VERSION

MANIFEST = "manifest.json"
CARD = "README.md"
DATA_DIR = "data"
PARTS_DIR = "_parts"
TARGET_DIR = "target"
EXTENSIONS = {"arrow": "arrow", "wds": "tar"}
_SPLIT_RE = re.compile(r"^[A-Za-z0-9_]+$")

TAP_CONVENTION = (
    "tap i = output of decoder layer i (residual stream before the final norm); "
    "HF hidden_states[i + 1]; vLLM layer id i + 1"
)
TOPK_ROWS = "row t is stored when loss_mask[t + 1] (topk_rows, ascending); log-probs under the full softmax"


def check_split(split: str) -> str:
    if not _SPLIT_RE.match(split):
        raise ValueError(f"split name {split!r} must be letters, digits or underscores")
    return split


def rank_shard_name(split: str, rank: int, seq: int, fmt: str) -> str:
    """Name of a finished shard before finalize: data/<split>-rank<rank>-<seq>.<ext>."""
    return f"{DATA_DIR}/{split}-rank{rank:05d}-{seq:05d}.{EXTENSIONS[fmt]}"


def final_shard_name(split: str, i: int, n: int, fmt: str) -> str:
    return f"{DATA_DIR}/{split}-{i:05d}-of-{n:05d}.{EXTENSIONS[fmt]}"


def part_name(split: str, rank: int) -> str:
    return f"{PARTS_DIR}/{split}-rank{rank:05d}.json"


def join(root: str, rel: str) -> str:
    return root.rstrip("/") + "/" + rel


def write_json_atomic(fs: fsspec.AbstractFileSystem, path: str, doc: Any) -> None:
    """Write to a temp name, then rename: a reader sees the old file or the new one, never half."""
    tmp = path + ".tmp"
    with fs.open(tmp, "wb") as f:
        f.write(json.dumps(doc, indent=1, sort_keys=True, default=str).encode())
    if fs.exists(path):
        fs.rm(path)
    fs.mv(tmp, path)


def code_version() -> str:
    """Package version plus the git commit of the code when it runs from a checkout."""
    try:
        from importlib.metadata import version

        v = version("tapdraft")
    except Exception:  # not installed: running from the source tree
        v = "0.1.0"
    try:
        here = Path(__file__).resolve().parent
        sha = subprocess.run(["git", "-C", str(here), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5).stdout.strip()
        if sha:
            v += f"+g{sha}"
    except (OSError, subprocess.SubprocessError):
        pass
    return v


def check_manifest(doc: dict[str, Any], where: str) -> dict[str, Any]:
    """Refuse incomplete manifests and unknown schema majors; return the manifest."""
    if doc.get("complete") is not True:
        raise ValueError(
            f"{where} says complete: false: the capture that writes it has not finished. "
            "Resume the capture (it picks up finished shards), then finalize the dataset."
        )
    version = str(doc.get("schema_version", ""))
    major = version.split(".")[0]
    if major != SCHEMA_VERSION.split(".")[0]:
        raise ValueError(
            f"{where} has schema_version {version!r}; this tapdraft reads major "
            f"{SCHEMA_VERSION.split('.')[0]}. Use a tapdraft release for that major version, or migrate the dataset."
        )
    return doc


def read_manifest(fs: fsspec.AbstractFileSystem, root: str) -> dict[str, Any]:
    path = join(root, MANIFEST)
    if not fs.exists(path):
        raise FileNotFoundError(
            f"{path} not found: {root} is not a finished tapdraft dataset. If a capture is writing it, "
            "let it finish (or resume it) and finalize; manifest.json is written last."
        )
    with fs.open(path, "rb") as f:
        raw = f.read()
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); it may be truncated: re-run finalize") from e
    return check_manifest(doc, path)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def render_card(m: dict[str, Any]) -> str:
    """The dataset card: what target, which data, how to load it three ways."""
    lay = m["layout"]
    fmt = m["format"]
    rows = "\n".join(
        f"| {s} | {d['samples']} | {d['tokens']} | {d['supervised_tokens']} | {d['audio_seconds']:.1f} | "
        f"{len(d['shards'])} | {_fmt_bytes(d['bytes'])} |"
        for s, d in m["splits"].items()
    )
    first = next(iter(m["splits"]), "train")
    ext = EXTENSIONS[fmt]
    if fmt == "arrow":
        stock = f"""```python
import datasets, json
from shards.arrow_io import decode_row
manifest = json.load(open("manifest.json"))
ds = datasets.load_dataset("arrow", data_files={{"{first}": "data/{first}-*.arrow"}}, split="{first}")
# or, memory-mapped without a copy: datasets.Dataset.from_file("data/{first}-00000-of-....arrow")
sample = decode_row(ds[0], manifest["field_meta"])   # bf16 tensors, as tapdraft returns them
```"""
    else:
        stock = f"""```python
import glob, webdataset as wds
from shards.wds_io import decode_wds_sample
ds = wds.WebDataset(sorted(glob.glob("data/{first}-*.tar")), shardshuffle=False).map(decode_wds_sample)
sample = next(iter(ds))   # each sample's meta.json carries what the decoder needs
```"""
    codec = lay["taps_codec"]
    lossy = "LOSSY fp8 e4m3, one float32 scale per (token, tap) row" if codec == "fp8" else "lossless bf16"
    return f"""# tapdraft dataset

Hidden states of a target model captured for training speculative-decoding drafters.

- Target fingerprint: `{m['fingerprint']}` (the bundle in `target/` hashes to it)
- Format: {fmt} (`data/*.{ext}`), schema version {m['schema_version']}, written by tapdraft {m['code_version']}
- Taps (HF decoder-layer ids): {lay['tap_ids']}; vLLM numbering: {lay['vllm_tap_ids']}. {TAP_CONVENTION}.
- Hidden size {lay['hidden_size']}, target layers {lay['num_layers']}, taps stored as {lossy}
  (bf16 byte layout: {m['field_meta']['bf16_layout']})
- Teacher top-k: k = {lay['top_k']}; {TOPK_ROWS}
- Audio frames carry token id {lay['audio_token_id']} in `input_ids`; positions are in the expanded sequence.

| split | samples | tokens | supervised tokens | audio seconds | shards | bytes |
| --- | --- | --- | --- | --- | --- | --- |
{rows}

Skipped inputs: {sum(len(v) for v in m.get('skipped', {}).values())} (listed in manifest.json).

## Load with tapdraft

```python
from shards.reader import open_dataset
ds = open_dataset("path/or/fsspec-url")
ds.sample("{first}", 0)                                       # random access (Arrow)
for s in ds.stream("{first}", seed=0, rank=0, world_size=1): ...   # streaming, resumable
bundle = ds.bundle()                                          # embeddings, final norm, lm_head, tokenizer
```

## Load with the stock libraries

{stock}

Check integrity: `tapdraft verify <dir>`; summary: `tapdraft inspect <dir>`.
"""
