"""The finalize step that publishes a dataset once every rank's writer has closed.

``finalize_dataset`` checks every rank closed with the same config, layout and fingerprint and that
every split holds at least one sample (a split whose every input was skipped is refused, naming the
first reasons, and no manifest is written), removes ``manifest.json``, records each shard's final
name ``data/<split>-00000-of-00012.<ext>`` ((rank, seq) order) in the partial indexes (the journal),
renames the shards and their index files (``index/<final name>.json``), writes the card, then
``manifest.json`` last: O(shards), since the record batches stay in the index files. Every step is idempotent and the
journal is written before any rename, so a finalize killed at any instant is finished by running it
again (the capture's rerun does).
"""

from __future__ import annotations

import json
from typing import Any, Callable

import fsspec

from tapdraft.shards import manifest as mf
from tapdraft.common.atomic import is_local, commit, write_bytes_atomic, write_json_atomic
from tapdraft.shards.codec import shard_metadata
from tapdraft.shards.formats import FORMATS
from tapdraft.shards.bundle import BUNDLE_FILE, bundle_doc_bytes
from tapdraft.shards.integrity import INTEGRITY, file_record
from tapdraft.shards.limits import safe_relpath
from tapdraft.shards.schema import SCHEMA_VERSION, Layout, check_schema_version
from tapdraft.shards.shard_file import ShardConfig
from tapdraft.shards.shard_index import index_name
from tapdraft.shards.taps import TAPS_CODECS
from tapdraft.shards.writer import check_part_version


def _load_parts(fs: fsspec.AbstractFileSystem, root: str) -> list[tuple[str, dict[str, Any]]]:
    pdir = mf.join(root, mf.PARTS_DIR)
    paths = sorted(p for p in fs.ls(pdir, detail=False) if p.endswith(".json")) if fs.exists(pdir) else []
    if not paths:
        raise FileNotFoundError(f"no partial indexes under {pdir}: nothing was written to {root} by DatasetWriter")
    parts = []
    for p in paths:
        with fs.open(p, "rb") as f:
            parts.append((p, json.loads(f.read())))
    return parts


def _check_parts(parts: list[tuple[str, dict[str, Any]]], root: str, layout: Layout, fingerprint: str) -> None:
    """Every rank closed, with the same shard config, layout, target, part version and a known schema major."""
    problems = []
    cfg0 = parts[0][1]["shard_config"]
    for path, part in parts:
        try:
            check_part_version(part, path)
        except ValueError as e:
            problems.append(str(e))
            continue
        if not part["closed"]:
            problems.append(f"{path}: rank {part['rank']} of split {part['split']} was not closed (still running or "
                            "crashed); rerun that rank's capture to resume it")
        if part["shard_config"] != cfg0:
            problems.append(f"{path}: shard config {part['shard_config']} differs from {parts[0][0]}'s {cfg0}")
        if part["layout"] != layout.to_dict():
            problems.append(f"{path}: layout {part['layout']} differs from the dataset's {layout.to_dict()}")
        if part.get("fingerprint") not in (None, fingerprint):
            problems.append(f"{path}: shards carry target fingerprint {part['fingerprint'][:12]}, the dataset's is "
                            f"{fingerprint[:12]}; captures of different targets cannot be merged")
        try:
            check_schema_version(part.get("schema_version"), path)
        except ValueError as e:
            problems.append(str(e))
    if problems:
        raise ValueError("cannot finalize " + root + ":\n  " + "\n  ".join(problems))


def _split_skips(sparts: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """A split's recorded skips over all its ranks, in (rank, index) order."""
    return sorted((s for _, part in sparts for s in part["skipped"]), key=lambda s: (s["rank"], s["index"]))


def _check_not_empty(by_split: dict[str, list[tuple[str, dict[str, Any]]]], root: str) -> None:
    """A split in which no sample was written is not a dataset: refuse it, naming the first skip reasons."""
    problems = []
    for split, sparts in by_split.items():
        if any(e["samples"] for _, part in sparts for e in part["shards"]):
            continue
        skips = _split_skips(sparts)
        first = "; ".join(f"{s['sample_id']!r}: {s['reason']}" for s in skips[:3])
        problems.append(f"split {split!r} has no samples: all {len(skips)} input(s) were skipped (first: {first})"
                        if skips else f"split {split!r} has no samples: its input held none")
    if problems:
        raise ValueError(f"cannot finalize {root}: " + "; ".join(problems) + ". Fix the inputs or the target's chat "
                         "template, then capture into a new --out directory")


def _plan_final_names(split: str, entries: list[dict[str, Any]], fmt: str) -> None:
    """Record each shard's final name (``final``) in list order: the journal a restarted finalize replays.

    Final names (``<split>-00003-of-00012``) and rank names (``<split>-rank00000-00003``) never
    collide, and a name that two finalizes plan alike holds the same shard, so one rename per shard
    suffices; an earlier final name (a finalize of fewer shards) is kept as ``was`` to be found again.
    """
    n = len(entries)
    for i, e in enumerate(entries):
        final = mf.final_shard_name(split, i, n, fmt)
        if e.get("final") not in (None, final):
            e["was"] = e["final"]
        e["final"] = final


def _locate(fs: fsspec.AbstractFileSystem, root: str, e: dict[str, Any], rel: Callable[[str], str]) -> str | None:
    """Where the file ``rel(name)`` of ``e`` (its shard, or its index) is now, None when it is already at its final
    name. Shard names are confined to ``data/`` (``safe_relpath``): a crafted part cannot move files outside it."""
    final = rel(e["final"])
    if fs.exists(mf.join(root, final)):
        return None
    names = [rel(safe_relpath(x, "a partial index", mf.DATA_DIR)) for x in (e["name"], e.get("was")) if x]
    for cand in names:
        if fs.exists(mf.join(root, cand)):
            return cand
    raise FileNotFoundError(f"{mf.join(root, rel(e['name']))} is listed in a partial index but missing (nor is it at "
                            f"{final}); re-run the capture for its rank")


def _same(name: str) -> str:
    return name


def _move_to_final(fs: fsspec.AbstractFileSystem, root: str, entries: list[dict[str, Any]]) -> None:
    """Replay the journal: every shard, then its index, not yet at its ``final`` name is renamed there (idempotent)."""
    local = is_local(fs)
    for e in entries:
        for rel in (_same, index_name):
            cur = _locate(fs, root, e, rel)
            if cur is not None:
                commit(fs, mf.join(root, cur), mf.join(root, rel(e["final"])))
            if local:
                continue  # a local rename leaves no source behind: no 60k existence checks at 30k shards
            for old in (e["name"], e.get("was")):  # an object store's mv may leave the source behind
                if old and old != e["final"] and fs.exists(mf.join(root, rel(old))):
                    fs.rm(mf.join(root, rel(old)))


def _split_summary(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """A split's manifest entry: totals plus each shard's final name, size, checksum, counts and index record."""
    shards_out = []
    for e in entries:
        s = {k: e[k] for k in ("bytes", "sha256", "samples", "tokens", "supervised_tokens", "audio_seconds", "index")}
        s["name"] = e["final"]
        shards_out.append(s)
    tot = {k: sum(s[k] for s in shards_out) for k in ("samples", "tokens", "supervised_tokens", "audio_seconds",
                                                     "bytes")}
    return {**tot, "shards": shards_out}


def _build_manifest(config: ShardConfig, layout: Layout, fingerprint: str, capture_config: dict[str, Any],
                    extra: dict[str, Any] | None, splits: dict[str, Any],
                    skipped: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    fm = shard_metadata(config.field_meta(layout), fingerprint)
    codec = TAPS_CODECS[layout.taps_codec]
    own = {codec.layout_field: getattr(config, codec.layout_field)} if codec.layout_field else {}
    return {
        "schema_version": SCHEMA_VERSION,
        "format": config.format,
        "complete": True,
        "code_version": mf.code_version(),
        "fingerprint": fingerprint,
        "layout": layout.to_dict(),
        "taps": {"hf": list(layout.tap_ids), "vllm": layout.vllm_tap_ids, "convention": mf.TAP_CONVENTION},
        "top_k": {"k": layout.top_k, "rows": mf.TOPK_ROWS},
        "dtypes": fm["dtypes"],
        "codec": {"container": FORMATS[config.format].writer.container(config.zstd_level),
                  "zstd_level": config.zstd_level, "bf16_layout": config.bf16_layout,
                  "taps_codec": layout.taps_codec, "lossy": not codec.lossless, **own},
        "field_meta": fm,
        "integrity": INTEGRITY,
        "shard_config": config.to_dict(),
        "capture_config": capture_config,
        "extra": extra or {},
        "splits": splits,
        "skipped": skipped,
    }


def finalize_dataset(out_dir: str, *, layout: Layout, fingerprint: str, capture_config: dict[str, Any],
                     extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Merge all ranks' partial indexes, give shards final names, write README.md, then manifest.json."""
    fs, root = fsspec.core.url_to_fs(str(out_dir))
    parts = _load_parts(fs, root)
    _check_parts(parts, root, layout, fingerprint)
    config = ShardConfig.from_dict(parts[0][1]["shard_config"])
    man_path = mf.join(root, mf.MANIFEST)
    if fs.exists(man_path):
        fs.rm(man_path)  # the directory is not a dataset while shards move

    by_split: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for path, part in sorted(parts, key=lambda p: (p[1]["split"], p[1]["rank"])):
        by_split.setdefault(part["split"], []).append((path, part))
    _check_not_empty(by_split, root)
    splits: dict[str, Any] = {}
    skipped: dict[str, list[dict[str, Any]]] = {}
    for split, sparts in by_split.items():  # journal first: every part records its shards' final names
        _plan_final_names(split, [e for _, part in sparts for e in part["shards"]], config.format)
        for path, part in sparts:
            write_json_atomic(fs, path, part, indent=None)  # 1,024 parts of a 30k-shard capture: compact
    for split, sparts in by_split.items():
        entries = [e for _, part in sparts for e in part["shards"]]
        _move_to_final(fs, root, entries)
        splits[split] = _split_summary(entries)
        skipped[split] = _split_skips(sparts)

    manifest = _build_manifest(config, layout, fingerprint, capture_config, extra, splits, skipped)
    card = mf.render_card(manifest).encode()
    manifest[mf.CARD_KEY] = file_record(card)  # verify and pull check the card too (rendered without this key)
    tdir = mf.join(root, mf.TARGET_DIR)
    if fs.exists(mf.join(tdir, BUNDLE_FILE)):  # readers and verify refuse any other bundle.json bytes
        manifest[mf.BUNDLE_KEY] = file_record(bundle_doc_bytes(fs, tdir))
    write_bytes_atomic(fs, mf.join(root, mf.CARD), card)
    write_json_atomic(fs, man_path, manifest, indent=None)  # O(shards), ~10 MB at 30k shards: compact
    return manifest
