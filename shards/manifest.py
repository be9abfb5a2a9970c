"""The dataset directory: file naming, manifest.json (written last, atomically) and the README card.

    manifest.json                      complete: true only once every shard is final
    README.md                          dataset card generated from the manifest (its sha256 in the manifest's card)
    target/                            target bundle (shards.bundle; bundle.json's sha256 in the manifest's bundle)
    data/train-00000-of-00012.arrow    final shard names (.tar for WebDataset)
    index/train-00000-of-00012.arrow.json   each shard's record batches and checksums (shards.shard_index)
    _parts/train-rank00000.json        a writer rank's partial index (resume + finalize input)
    _parts/rank00000.lock              held by the capture (derive, pull) writing as that rank (``writer_lock``)

This module is the one home of the directory layout: code outside shards/ asks it for paths and
status (``complete_manifest``, ``dataset_fingerprint``, ``write_or_check_bundle``) and never names
these files itself. A reader refuses a directory without manifest.json, with ``complete`` not true,
or with a schema major version it does not know (``check_manifest``); older manifests' key names
are brought up to date by ``migrate_manifest``. The manifest is O(shards): per shard its name,
size, sha256, counts and ``index`` [bytes, xxh3] of its index file, nothing per record batch.
``check_manifest`` also confines every shard name to ``data/`` and bounds every declared size
(shards.limits) before anything reads it.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any, Callable

import fsspec

from tapdraft.common.atomic import is_local
from tapdraft.common.errors import CorruptShardError
from tapdraft.shards.bundle import BUNDLE_FILE, bundle_fingerprint, stored_fingerprint, write_bundle
from tapdraft.shards.formats import FORMATS, get_format
from tapdraft.shards.integrity import INTEGRITY, NO_INTEGRITY
from tapdraft.shards.limits import (MAX_MANIFEST_BYTES, MAX_RATIO, MAX_SHARD_BYTES, check_count, check_file_size,
                                    check_manifest_shape, check_size, parse_json, regular_file, safe_relpath)
from tapdraft.shards.codec import FieldMeta
from tapdraft.shards.schema import Layout, check_schema_version
from tapdraft.shards.taps import TAP_NUMBERING, TAPS_CODECS
from tapdraft.shards.shard_index import INDEX_DIR, migrate_inline_index

MANIFEST = "manifest.json"
CARD = "README.md"
DATA_DIR = "data"
PARTS_DIR = "_parts"
TARGET_DIR = "target"
_SPLIT_RE = re.compile(r"^[A-Za-z0-9_]+$")

TAP_CONVENTION = TAP_NUMBERING
TOPK_ROWS = "row t is stored when loss_mask[t + 1] (topk_rows, ascending); log-probs under the full softmax"


def check_split(split: str) -> str:
    if not _SPLIT_RE.match(split):
        raise ValueError(f"split name {split!r} must be letters, digits or underscores (e.g. --data validation=FILE)")
    return split


def rank_shard_name(split: str, rank: int, seq: int, fmt: str) -> str:
    """Name of a finished shard before finalize: data/<split>-rank<rank>-<seq>.<ext>."""
    return f"{DATA_DIR}/{split}-rank{rank:05d}-{seq:05d}.{FORMATS[fmt].extension}"


def is_rank_shard(name: str, rank: int) -> bool:
    """Whether ``name`` is a finished shard of writer rank ``rank`` before finalize (not a temp file)."""
    m = _RANK_SHARD_RE.match(name)
    return m is not None and int(m.group(1)) == rank


_EXTENSIONS = "|".join(f.extension for f in FORMATS.values())
_RANK_SHARD_RE = re.compile(rf"^{DATA_DIR}/[A-Za-z0-9_]+-rank(\d{{5}})-\d{{5}}\.({_EXTENSIONS})$")


def final_shard_name(split: str, i: int, n: int, fmt: str) -> str:
    return f"{DATA_DIR}/{split}-{i:05d}-of-{n:05d}.{FORMATS[fmt].extension}"


def part_name(split: str, rank: int) -> str:
    return f"{PARTS_DIR}/{split}-rank{rank:05d}.json"


def lock_name(rank: int) -> str:
    """The writer lock of rank ``rank``, relative to the dataset (a local file, or an object in a store: ``push``)."""
    return f"{PARTS_DIR}/rank{rank:05d}.lock"


def writer_lock(url: str, rank: int, what: str = "a capture"):
    """Context manager: the exclusive lock of rank ``rank`` on the dataset directory ``url`` (a local path);
    a second writer of the same rank is refused with ``common.lock.LockedError`` naming ``what`` holds it.
    Taking it creates ``_parts/``, the mark of a dataset being written (``foreign_directory``): every writer takes
    it before writing anything else."""
    from tapdraft.common.lock import exclusive_lock

    fs, root = fsspec.core.url_to_fs(str(url))
    if "file" not in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
        raise ValueError(f"{url}: capture writes to a local directory (copy the dataset to its final place after)")
    return exclusive_lock(join(root, lock_name(rank)), f"{what} (rank {rank})", guards=root)


def shard_names(doc: dict[str, Any]) -> list[str]:
    """Every shard a manifest lists (relative names, split by split)."""
    return [sh["name"] for d in doc["splits"].values() for sh in d["shards"]]


def join(root: str, rel: str) -> str:
    return root.rstrip("/") + "/" + rel


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
    """Refuse manifests of the wrong shape, incomplete ones and unknown schema majors; return the manifest."""
    check_manifest_shape(doc, where)
    if doc.get("complete") is not True:
        raise ValueError(
            f"{where} says complete: false: the capture that writes it has not finished. "
            "Resume the capture (it picks up finished shards), then finalize the dataset."
        )
    check_schema_version(doc.get("schema_version"), where)
    get_format(doc.get("format"), where)
    missing = [k for k in READER_KEYS if k not in doc]
    if missing:
        raise CorruptShardError(f"{where} lacks {', '.join(missing)}, which every reader needs: not a finished "
                                "tapdraft manifest (damaged or crafted); re-copy the dataset (or re-run finalize)")
    doc = migrate_manifest(doc)
    check_integrity(doc, where)
    check_shard_entries(doc, where)
    problems = split_total_problems(doc, where)
    if problems:
        raise CorruptShardError(problems[0])
    check_layout(doc, where)
    return doc


READER_KEYS = ("fingerprint", "layout", "field_meta", "splits")
"""What every reader of a manifest uses (``verify`` asks for more: ``shards.verify.REQUIRED_KEYS``)."""
COUNT_KEYS = ("samples", "tokens", "supervised_tokens", "audio_seconds", "bytes")
"""A split's totals, each the sum of its shards'."""


def check_integrity(doc: dict[str, Any], where: str) -> None:
    """A migrated manifest's ``integrity``: one of the two entries tapdraft writes (``{}`` was a KeyError)."""
    if doc["integrity"] not in (INTEGRITY, NO_INTEGRITY):
        raise CorruptShardError(f"{where}: integrity is {json.dumps(doc['integrity'])[:60]}, neither of the two this "
                                f"tapdraft writes ({json.dumps(INTEGRITY)}, or none for schema 1.0): damaged or "
                                "crafted; re-copy the dataset")


def check_layout(doc: dict[str, Any], where: str) -> None:
    """The manifest's layout and field_meta as the schema builds them (widths within the bounds of
    ``shards.limits``, typed): a ValueError naming the manifest and the field, never a TypeError."""
    try:
        Layout.from_dict(doc["layout"])
        FieldMeta.from_dict(doc["field_meta"])
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptShardError(f"{where}: layout or field_meta is invalid ({e}): damaged or crafted; re-copy the "
                                "dataset (or re-run finalize)") from None


def split_total_problems(doc: dict[str, Any], where: str) -> list[str]:
    """Each split total (COUNT_KEYS) that is not the sum of its shards' (audio seconds within 1e-6): readers index
    a split by its shards (a split claiming more samples than they hold was an IndexError in ``inspect --sample``
    and a derive that kept fewer samples than its lineage says), so readers refuse one and ``verify`` lists all."""
    out = []
    for split, d in doc["splits"].items():
        for k in COUNT_KEYS:
            got = sum(sh.get(k, 0) for sh in d.get("shards", []))
            claimed = d.get(k, 0)
            if abs(got - claimed) > 1e-6 * max(1.0, abs(got)):
                out.append(f"{where}: split {split} says {k}={claimed}, its shards add up to {got}: damaged or "
                           "crafted; re-copy the dataset (or re-run finalize)")
    return out


def check_shard_entries(doc: dict[str, Any], where: str) -> None:
    """Every split name plain, every shard name a relative path under ``data/``, every declared size and count
    a bounded non-negative int (shards.limits): a crafted manifest is refused before a byte of it is used."""
    splits = doc.get("splits")
    if not isinstance(splits, dict):
        raise ValueError(f"{where}: splits is not an object; re-run finalize")
    for split, d in splits.items():
        check_split(split)
        for i, sh in enumerate(d.get("shards", [])):
            at = f"{where}: split {split} shard {i}"
            safe_relpath(sh.get("name"), at, DATA_DIR)
            check_size(sh.get("bytes"), MAX_SHARD_BYTES, f"{at} ({sh['name']})")
            check_size(sh.get("samples"), max(sh["bytes"], 1), f"{at} ({sh['name']}, {sh['bytes']} bytes)", "samples")
            tokens = sh.get("tokens", 0)
            for k, bound in (("tokens", sh["bytes"] * MAX_RATIO), ("supervised_tokens", tokens), ("audio_seconds", 0)):
                if k in sh:  # tokens first: supervised_tokens is bounded by it
                    check_count(sh[k], bound, f"{at} ({sh['name']}, {sh['bytes']} bytes)", k)


RESPONSES_KEY = "responses_from_target"
"""``extra[RESPONSES_KEY]``: whether the assistant turns are the target's own replies (None: unknown)."""
_LEGACY_RESPONSES_KEYS = (RESPONSES_KEY, "regenerated", "regenerate")


def migrate_manifest(doc: dict[str, Any]) -> dict[str, Any]:
    """Bring an older manifest's keys to today's names; returns a new dict, ``doc`` is not changed.

    Older writers recorded whether the responses came from the target as ``regenerated`` or
    ``regenerate``, in ``extra`` or in ``capture_config``; the first non-null of
    (extra, capture_config) x (responses_from_target, regenerated, regenerate) becomes
    ``extra.responses_from_target``.

    Manifests without ``integrity`` (schema 1.0, written before checksums) get ``NO_INTEGRITY``:
    readers then check each shard's size and fingerprint but not its bytes (``tapdraft verify``
    still checks every shard's sha256).

    Shard entries of schema 1 listed their record batches inline (``batches``, ``head``, ``tail``):
    ``shards.shard_index.migrate_inline_index`` moves them under ``inline_index``, which readers use
    in place of an index file.
    """
    value = None
    for section in ("extra", "capture_config"):
        sec = doc.get(section) or {}
        value = next((sec[k] for k in _LEGACY_RESPONSES_KEYS if sec.get(k) is not None), None)
        if value is not None:
            break
    extra = dict(doc.get("extra") or {})
    if value is not None:
        extra[RESPONSES_KEY] = bool(value)
    splits = doc.get("splits") or {}
    if str(doc.get("schema_version", "")).split(".")[0] == "1":  # schema 2 shards must name their index file
        splits = {s: {**d, "shards": [migrate_inline_index(sh) for sh in d.get("shards", [])]}
                  for s, d in splits.items()}
    return {**doc, "extra": extra, "integrity": doc.get("integrity", dict(NO_INTEGRITY)), "splits": splits}


def responses_from_target(doc: dict[str, Any]) -> bool | None:
    """Whether the dataset's responses were generated by the target itself (None: the manifest does not say)."""
    return migrate_manifest(doc)["extra"].get(RESPONSES_KEY)


def read_manifest(fs: fsspec.AbstractFileSystem, root: str) -> dict[str, Any]:
    path = join(root, MANIFEST)
    if not fs.exists(root):
        raise FileNotFoundError(f"dataset {root} does not exist; check the path")
    if not fs.exists(path):
        raise FileNotFoundError(
            f"{path} not found: {root} is not a finished tapdraft dataset. If a capture is writing it, "
            "let it finish (or resume it) and finalize; manifest.json is written last."
        )
    # its size first, by stat: a 1 GB manifest was read and parsed (3.5 GB) before it was refused
    size = regular_file(fs._strip_protocol(root), MANIFEST) if is_local(fs) else fs.size(path)
    check_file_size(size, MAX_MANIFEST_BYTES, path, "MAX_MANIFEST_BYTES")
    with fs.open(path, "rb") as f:
        raw = f.read(MAX_MANIFEST_BYTES + 1)
    check_file_size(len(raw), MAX_MANIFEST_BYTES, path, "MAX_MANIFEST_BYTES")  # it grew since the stat
    return check_manifest(parse_json(raw, path), path)


def complete_manifest(url: str) -> dict[str, Any] | None:
    """The manifest of the finished dataset at ``url``; None while none is there or it says complete: false."""
    fs, root = fsspec.core.url_to_fs(str(url))
    path = join(root, MANIFEST)
    if not fs.exists(path) or fs.size(path) > MAX_MANIFEST_BYTES:
        return None
    doc = parse_json(fs.cat_file(path), path)
    if not isinstance(doc, dict) or doc.get("complete") is not True:
        return None
    return read_manifest(fs, root)


def foreign_directory(url: str, own: tuple[str, ...] = ()) -> bool:
    """Whether ``url`` is a non-empty directory that is not a tapdraft dataset (finished or being written),
    so that no writer may write into it (it would overwrite a README.md, for one).

    A directory is a dataset only by what tapdraft itself writes there first: manifest.json (a finished
    dataset) or ``_parts/`` (every writer's lock and partial indexes, created before any other file), or a name
    in ``own`` (the caller's own record), possibly under a temp or old name (a crash mid-write). A ``data/``,
    ``index/`` or ``target/`` folder proves nothing: a user's project has those too. Hidden entries (lock files,
    ``.git``) are not counted: a directory holding only those is treated as empty.
    """
    fs, root = fsspec.core.url_to_fs(str(url))
    if not fs.exists(root) or not fs.isdir(root):
        return False
    names = [p.rstrip("/").split("/")[-1] for p in fs.ls(root, detail=False)]
    names = [n for n in names if not n.startswith(".")]
    marks = {MANIFEST, PARTS_DIR, *own}
    base = {n.removesuffix(".tmp").removesuffix(".old") for n in names}
    return bool(names) and not (base & marks)


_OWN_SHARD_RE = re.compile(rf"^[A-Za-z0-9_]+-(rank\d{{5}}-\d{{5}}|\d{{5}}-of-\d{{5}})\.({_EXTENSIONS})(\.tmp)?$")
_OWN_INDEX_RE = re.compile(rf"^[A-Za-z0-9_]+-(rank\d{{5}}-\d{{5}}|\d{{5}}-of-\d{{5}})\.({_EXTENSIONS})\.json(\.tmp)?$")


def discard_dataset(root: str | Path, own: tuple[str, ...] = ()) -> None:
    """Remove from the local directory ``root`` what tapdraft's writers put there, and nothing else: the manifest
    and card, the shards and index files by the names writers give them (temp names included), the target bundle
    (a ``target/`` holding bundle.json, or its temp and old names), ``_parts/`` less its lock files (the writers
    running now hold them) and the caller's ``own`` names. A file tapdraft does not name (a user's input under
    ``data/``, say) is kept; ``data/`` and ``index/`` are removed only when that leaves them empty. Afterwards the
    directory holds what it held before the first writer came, so a new capture leaves what a fresh one does."""
    import shutil

    root = Path(root)
    for name in (MANIFEST, CARD, *own):
        for p in (root / name, root / (name + ".tmp")):
            p.unlink(missing_ok=True)
    for folder, own_re in ((DATA_DIR, _OWN_SHARD_RE), (INDEX_DIR, _OWN_INDEX_RE)):
        d = root / folder
        if d.is_dir() and not d.is_symlink():
            for p in d.iterdir():
                if own_re.match(p.name) and p.is_file() and not p.is_symlink():
                    p.unlink()
            try:
                d.rmdir()
            except OSError:
                pass  # something not ours is in it
    for p in (root / (TARGET_DIR + ".tmp"), root / (TARGET_DIR + ".old"), root / TARGET_DIR):
        if p.is_dir() and not p.is_symlink() and (p != root / TARGET_DIR or (p / BUNDLE_FILE).is_file()):
            shutil.rmtree(p)
    parts = root / PARTS_DIR
    if parts.is_dir() and not parts.is_symlink():
        for p in parts.iterdir():
            if not p.name.endswith(".lock"):
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


def dataset_fingerprint(url: str) -> str | None:
    """The target fingerprint recorded in the dataset's bundle (None before the bundle is written)."""
    fs, root = fsspec.core.url_to_fs(str(url))
    return stored_fingerprint(fs, join(root, TARGET_DIR))


def write_or_check_bundle(url: str, *, fingerprint: Callable[[], str] | None = None, **parts: Any) -> str:
    """Write the dataset's target bundle from ``parts`` (``write_bundle``'s arguments) when it is missing;
    otherwise refuse a bundle of another target. Returns the fingerprint.

    ``fingerprint``: the caller's (cached) fingerprint of the same parts, so a resume does not hash the
    weights again; by default it is computed from ``parts``."""
    fs, root = fsspec.core.url_to_fs(str(url))
    old = stored_fingerprint(fs, join(root, TARGET_DIR))
    if old is None:
        return write_bundle(join(root, TARGET_DIR), **parts)
    fp = fingerprint() if fingerprint is not None else bundle_fingerprint(**parts)
    if fp != old:
        raise ValueError(
            f"{url} holds a capture of another target (fingerprint {old[:12]}, this target {fp[:12]}); "
            "capture into a new --out directory"
        )
    return fp


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def card_front_matter(m: dict[str, Any]) -> str:
    """The card's YAML header in the Hugging Face dataset-card format: one ``default`` config whose
    ``data_files`` name each split's shards, so ``datasets.load_dataset(DATASET_DIR)`` (or of the Hub repo
    the directory is uploaded to) needs no arguments and never picks up ``index/`` or ``target/`` files.
    Split names are plain (``check_split``), so they need no YAML quoting."""
    ext = FORMATS[m["format"]].extension
    files = "".join(f"  - split: {s}\n    path: {DATA_DIR}/{check_split(s)}-*.{ext}\n" for s in m["splits"])
    return f"---\nconfigs:\n- config_name: default\n  data_files:\n{files}tags:\n- tapdraft\n---\n"


UPLOAD_IGNORE = ["manifest.json", "_parts/**", "**/*.tmp", "**/*.lock", ".*"]
"""What a first upload leaves out: the manifest goes last (the commit point), partial indexes and temp files never."""


CARD_KEY = "card"
"""Manifest key ``{bytes, sha256}`` (``integrity.file_record``) of README.md as finalize wrote it (absent from
manifests written before it was recorded: their card is not checked)."""
BUNDLE_KEY = "bundle"
"""Manifest key ``{bytes, sha256}`` of target/bundle.json as finalize found it: readers and ``verify`` refuse a
bundle.json of other bytes, so every key of it is covered (its serving keys are outside the target fingerprint).
Absent from manifests written before it was recorded: their bundle is checked by its fingerprint and file records
alone, as before."""


def render_card(m: dict[str, Any]) -> str:
    """The dataset card: HF front matter (``card_front_matter``), what target, which data, how to load it
    three ways, and how to share it on the Hugging Face Hub.

    The snippets name the dataset through one ``DATASET`` path, so they run from any working directory
    once it points at the dataset (the card cannot know where the dataset will be copied)."""
    lay = m["layout"]
    fmt = m["format"]
    rows = "\n".join(
        f"| {s} | {d['samples']} | {d['tokens']} | {d['supervised_tokens']} | {d['audio_seconds']:.1f} | "
        f"{len(d['shards'])} | {fmt_bytes(d['bytes'])} |"
        for s, d in m["splits"].items()
    )
    first = next(iter(m["splits"]), "train")
    ext = FORMATS[fmt].extension
    stock = FORMATS[fmt].reader.stock_snippet(first)
    codec = lay["taps_codec"]
    fp8_layout = m["field_meta"].get("fp8_layout", "bytes")
    split = " (sign+exponent bytes in `taps_exponent`, 3-bit mantissas in `taps_mantissa`)"
    lossy = (f"LOSSY fp8 e4m3, one float32 scale per (token, tap) row, fp8 byte layout {fp8_layout}"
             + (split if fp8_layout == "packed" else "") if not TAPS_CODECS[codec].lossless else f"lossless {codec}")
    return card_front_matter(m) + f"""
# tapdraft dataset

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
import tapdraft
ds = tapdraft.open_dataset("path/to/this/directory")          # or any fsspec URL of it
ds.sample("{first}", 0)                                       # one sample (random access with Arrow)
for s in ds.stream("{first}", seed=0, rank=0, world_size=1): ...   # streaming, resumable
bundle = ds.bundle()                                          # embeddings, final norm, lm_head, tokenizer
```

## Load with the stock libraries

{stock}

Check integrity: `tapdraft verify <dir>`; summary: `tapdraft inspect <dir>`.

## Share it on the Hugging Face Hub

The directory is already a dataset repository (the front matter above tells `datasets` where the
splits are). Upload it resumably with `huggingface_hub`'s `upload_large_folder`, shards first and
`manifest.json` last, so that a reader never sees a manifest whose shards are not all there yet:

```python
from huggingface_hub import HfApi
api = HfApi()
api.create_repo("ORG/NAME", repo_type="dataset", exist_ok=True)
api.upload_large_folder(repo_id="ORG/NAME", repo_type="dataset", folder_path="path/to/this/directory",
                        ignore_patterns={UPLOAD_IGNORE!r})
# (rerun it after an interruption: it resumes); then the commit point:
api.upload_file(path_or_fileobj="path/to/this/directory/manifest.json", path_in_repo="manifest.json",
                repo_id="ORG/NAME", repo_type="dataset")
```

Then `datasets.load_dataset("ORG/NAME")` reads it from the Hub.
"""
