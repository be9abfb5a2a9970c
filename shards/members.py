"""What a dataset is, file by file: the members readers, ``verify``, ``derive``, ``push`` and ``pull`` touch.

    manifest.json, README.md          fixed names (the card may be absent)
    data/<shard>, index/<shard>.json  what the manifest lists (an index file where the shard entry names one)
    target/bundle.json                and the files it lists (weights.safetensors, tokenizer/<file>; a bundle
                                      of schema 1.0 lists none: its weights and allow-listed tokenizer files)

The capture's working state stays where it was written and is never read as data, copied or uploaded:
``_parts/`` (finalize journal, locks), ``capture_config.json`` (the capture's resume record; the manifest
carries the same config) and hidden names (``.git``, the Hub's ``.cache/``). Anything else is a stray:
``verify`` reports it, and nothing copies it.

Every member is a regular file reached through real directories. A symlink, FIFO or device inside a
dataset is refused, never followed: a dataset is data someone else wrote, and a link in it can lead to a
credentials file or ``/proc/self/environ``, which a copy would then turn into plain bytes and an upload
would send away. That holds for shards too, so a Hub cache snapshot (its files are links into ``blobs/``)
is not a dataset: download with ``local_dir=`` (real files) or copy with ``cp -rL`` a dataset you trust.
Object stores have no links; there the members are what one listing finds under the listed names.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, Iterable

from tapdraft.shards import manifest as mf
from tapdraft.shards.bundle import bundle_files, check_member_size
from tapdraft.common.files import file_kind
from tapdraft.shards.limits import refused_link, regular_file
from tapdraft.shards.remote import is_local
from tapdraft.shards.shard_index import index_name

CAPTURE_RECORD = "capture_config.json"
"""The capture's resume record beside its dataset (``capture.pipeline`` writes it): working state, not data."""
WORKING_STATE = (mf.PARTS_DIR, CAPTURE_RECORD)
"""Top-level names a capture keeps for itself; verify does not flag them, nothing copies them."""


def member_names(fs: Any, root: str, doc: dict[str, Any], *, strict: bool = True) -> list[str]:
    """Every member's name but manifest.json, whether present or not: the card, the listed shards and index files,
    the bundle's files. ``strict=False`` leaves out the bundle's when its bundle.json cannot be read."""
    names = [mf.CARD]
    for d in doc["splits"].values():
        for sh in d["shards"]:
            names.append(sh["name"])
            if "index" in sh:
                names.append(index_name(sh["name"]))
    try:
        names += [f"{mf.TARGET_DIR}/{n}" for n in bundle_files(fs, mf.join(root, mf.TARGET_DIR))]
    except (OSError, ValueError):
        if strict:
            raise
    return names


def dataset_members(fs: Any, root: str, doc: dict[str, Any], *, sizes: dict[str, int] | None = None
                    ) -> dict[str, int]:
    """relative path -> size of every member of the finished dataset ``doc`` at ``root`` but manifest.json, which
    a copy writes last. Local members are checked to be regular files (CorruptShardError for a link); remote
    sizes come from ``sizes`` (one listing: relative path -> size). FileNotFoundError for a missing shard,
    index file or bundle file; CorruptShardError for a bundle file past its bound (``shards.limits``)."""
    out: dict[str, int] = {}
    for rel in member_names(fs, root, doc):
        try:
            if sizes is not None:
                out[rel] = sizes[rel]
            else:
                out[rel] = regular_file(fs._strip_protocol(root), rel)
        except (KeyError, FileNotFoundError):
            if rel == mf.CARD:
                continue
            raise FileNotFoundError(f"{mf.join(root, rel)} is part of the dataset (its manifest or bundle lists it) "
                                    "but missing; re-copy the dataset or re-capture it") from None
        if rel.startswith(mf.TARGET_DIR + "/"):  # a bundle file past the bound is neither sent nor fetched
            check_member_size(rel.split("/", 1)[1], out[rel], None, mf.join(root, rel))
    return out


def refuse_links(fs: Any, root: str, doc: dict[str, Any]) -> None:
    """What a reader opens of a local dataset: manifest.json and the listed shards and index files are regular
    files (one ``scandir`` per folder, no per-file call); CorruptShardError naming the first that is not."""
    if not is_local(fs):
        return
    base = Path(fs._strip_protocol(root))
    regular_file(base, mf.MANIFEST)
    wanted: dict[str, set[str]] = {}
    for d in doc["splits"].values():
        for sh in d["shards"]:
            for rel in (sh["name"], index_name(sh["name"])) if "index" in sh else (sh["name"],):
                folder, _, name = rel.rpartition("/")
                wanted.setdefault(folder, set()).add(name)
    for folder, names in sorted(wanted.items()):
        path = base / folder
        if not path.exists():
            continue  # the reader names what is missing
        if path.is_symlink() or not path.is_dir():
            raise refused_link(str(path), file_kind(os.lstat(path).st_mode))
        for e in os.scandir(path):
            if e.name in names and not e.is_file(follow_symlinks=False):
                raise refused_link(e.path, file_kind(e.stat(follow_symlinks=False).st_mode))


def _skipped(rel: str) -> bool:
    """Working state and hidden names: never data, never flagged."""
    parts = rel.split("/")
    return parts[0] in WORKING_STATE or any(p.startswith(".") for p in parts)


def _walk(base: Path) -> Iterable[tuple[str, int]]:
    """(relative path, lstat mode) of everything under ``base`` but skipped names; links are not followed."""
    for dirpath, dirnames, filenames in os.walk(base):
        rel_dir = Path(dirpath).relative_to(base).as_posix()
        rel_dir = "" if rel_dir == "." else rel_dir + "/"
        keep = []
        for name in sorted(dirnames + filenames):
            rel = rel_dir + name
            if _skipped(rel):
                continue
            mode = os.lstat(base / rel).st_mode
            if stat.S_ISDIR(mode):
                keep.append(name)
            else:
                yield rel, mode
        dirnames[:] = keep


def strays(fs: Any, root: str, doc: dict[str, Any]) -> list[str]:
    """Problems (one line each, the path first) for everything under the dataset at ``root`` that is not a member,
    manifest.json, the working state or a hidden name, and for every link or special file (never followed)."""
    members = set(member_names(fs, root, doc, strict=False)) | {mf.MANIFEST}
    if is_local(fs):
        found = list(_walk(Path(fs._strip_protocol(root))))
    else:
        base = root.rstrip("/")
        found = [(p[len(base):].lstrip("/"), stat.S_IFREG) for p, i in fs.find(root, detail=True).items()
                 if i.get("type") != "directory"]
    out = []
    for rel, mode in found:
        if _skipped(rel):
            continue
        if not stat.S_ISREG(mode):
            out.append(f"{mf.join(root, rel)}: {file_kind(mode)} inside the dataset, not followed; a dataset holds "
                       "regular files only: delete it (or replace it with the file it leads to, if you trust it)")
        elif rel not in members:
            out.append(f"{mf.join(root, rel)}: not listed in the manifest or the bundle (a leftover temp file or a "
                       "foreign file), so nothing reads or copies it; delete it (or re-run finalize)")
    return out
