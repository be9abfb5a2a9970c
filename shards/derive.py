"""``tapdraft derive``: a lighter dataset made from a finished one, without the target model.

    derive_dataset(DeriveConfig(src="ds", out="ds-light", taps=(9, 17), codec="fp8", top_k=8,
                                splits=("train",), max_samples=10_000))

``zstd_level`` / ``bf16_layout`` rewrite the shards' compression (a capture written uncompressed at GPU
speed, recompressed on CPU nodes afterwards) and ``writers`` spreads that work over threads.

The source is read in file order (``stream(shuffle=False)``) and each sample is cut down: taps to
the chosen subset, teacher top-k to its first K (capture stores them in descending order and the
log-probs are under the full softmax, so the first K of them are exactly a top-K capture's), taps
re-encoded with the fp8 codec when asked; then written by the ordinary ``DatasetWriter`` and
``finalize_dataset``, so ``verify``, ``train`` and the stock libraries treat the result as any
dataset. The target bundle is copied as it is (same fingerprint: a drafter trained on either runs
on the same target): bundle.json and the files it lists, never through a link (``shards.members``).
A derive killed mid-way resumes from the same command (the writer's index, keyed by the source's
manifest and these settings), a finished one returns its manifest.

``add`` joins more datasets of the same target after the source, split by split (broad data the
target regenerated, then a user's own traffic: one training set). Each is cut to the source's
layout; one captured from another target or rendered by another chat template is refused. A
sample id seen before is kept once when its tokens and loss mask are the same (the same
conversation captured twice: a validation split both captures share) and refused otherwise.

Lineage: the manifest's ``extra.derived_from`` records the source (its directory name, the sha256
of its manifest, its target fingerprint, schema and code version), what was dropped (taps,
top-k, splits, samples, precision) and each added dataset (the same, with its capture's inputs).
``derived_note`` turns it into the clause that a refusal adds, so a recipe needing something
dropped says so in its one error line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import fsspec

from tapdraft.shards import manifest as mf
from tapdraft.common.atomic import staged
from tapdraft.shards.bundle import copy_bundle
from tapdraft.shards.finalize import finalize_dataset
from tapdraft.common.progress import Progress
from tapdraft.shards.reader import open_dataset
from tapdraft.shards.schema import Layout
from tapdraft.shards.shard_file import ShardConfig
from tapdraft.shards.taps import TAPS_CODECS
from tapdraft.shards.writer import DatasetWriter

DERIVED_KEY = "derived_from"
"""``extra[DERIVED_KEY]``: the lineage of a derived dataset (absent on captured ones)."""


@dataclass(frozen=True)
class DeriveConfig:
    """What to keep of a finished dataset, and where to write it."""

    src: str
    """The source dataset (path or fsspec URL)."""
    out: str
    """The new dataset's local directory (resumed when rerun with the same settings)."""
    taps: tuple[int, ...] | None = None
    """HF tap ids to keep, a subset of the source's; None keeps them all."""
    codec: str | None = None
    """Taps codec of the new dataset: 'fp8' (lossy) or 'bf16'; None keeps the source's. fp8 -> bf16 is refused."""
    splits: tuple[str, ...] | None = None
    """Splits to keep; None keeps them all."""
    max_samples: int | None = None
    """At most this many samples per split, the first in file order; None keeps them all."""
    top_k: int | None = None
    """Teacher top-k to keep, at most the source's (0 drops the teacher rows); None keeps the source's."""
    zstd_level: int | None = None
    """zstd level of the new shards (0: uncompressed); None keeps the source's. What recompresses a capture written
    uncompressed to keep up with its GPU (docs/performance.md)."""
    bf16_layout: str | None = None
    """bf16 byte layout of the new shards ('planes' | 'raw'); None keeps the source's."""
    add: tuple[str, ...] = ()
    """More finished datasets of the same target whose samples follow the source's, split by split (module
    docstring)."""
    writers: int = 1
    """Writer lanes (threads) of the new dataset (ShardConfig.writers); where samples go, not what they are."""
    progress: bool = True
    """Show progress."""

    def __post_init__(self) -> None:
        if self.codec is not None and self.codec not in TAPS_CODECS:
            raise ValueError(f"--codec must be one of {tuple(TAPS_CODECS)}, got {self.codec!r}")
        if self.max_samples is not None and self.max_samples < 1:
            raise ValueError(f"--max-samples must be >= 1, got {self.max_samples}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"--top-k must be >= 0, got {self.top_k}")
        if self.taps is not None and not self.taps:
            raise ValueError("--taps needs at least one tap id")
        if self.splits is not None and not self.splits:
            raise ValueError("--splits needs at least one split")


def derived_layout(src: Layout, cfg: DeriveConfig) -> Layout:
    """The new dataset's layout; ValueError (one line, what to do) for what the source cannot give."""
    taps = tuple(sorted(set(cfg.taps))) if cfg.taps is not None else src.tap_ids
    missing = [t for t in taps if t not in src.tap_ids]
    if missing:
        raise ValueError(f"--taps {list(taps)}: the source stores taps {list(src.tap_ids)}, not {missing}; "
                         "derive keeps a subset of them")
    k = src.top_k if cfg.top_k is None else cfg.top_k
    if k > src.top_k:
        raise ValueError(f"--top-k {k}: the source stores top-{src.top_k}; derive can keep fewer, not more")
    codec = cfg.codec or src.taps_codec
    if TAPS_CODECS[codec].lossless and not TAPS_CODECS[src.taps_codec].lossless:
        raise ValueError(f"--codec {codec}: the source's taps are {src.taps_codec} (lossy); derive cannot restore the "
                         "precision")
    return dataclasses.replace(src, tap_ids=taps, top_k=k, taps_codec=codec)


def cut_sample(sample: dict[str, Any], src: Layout, new: Layout) -> dict[str, Any]:
    """One source sample as the new layout stores it (taps subset, first K teacher columns)."""
    out = dict(sample)
    if new.tap_ids != src.tap_ids:
        keep = [src.tap_ids.index(t) for t in new.tap_ids]
        out["taps"] = sample["taps"][:, keep].contiguous()
    if new.top_k == 0:
        for name in ("topk_rows", "topk_ids", "topk_logprobs"):
            out.pop(name, None)
    elif new.top_k < src.top_k:
        out["topk_ids"] = sample["topk_ids"][:, : new.top_k].contiguous()
        out["topk_logprobs"] = sample["topk_logprobs"][:, : new.top_k].contiguous()
    return out


def shard_config(src: ShardConfig, cfg: DeriveConfig) -> ShardConfig:
    """The new dataset's shard config: the source's, with the compression and lanes asked for."""
    over = {k: getattr(cfg, k) for k in ("zstd_level", "bf16_layout") if getattr(cfg, k) is not None}
    return dataclasses.replace(src, **over, writers=cfg.writers)


def _key_settings(cfg: DeriveConfig) -> dict[str, Any]:
    """The settings a resume must share: not where the output goes or how progress shows, nor the lanes; the
    shard settings and added datasets only when given (derives made before they existed keep their key)."""
    d = dataclasses.asdict(cfg) | {"progress": None, "out": None}
    del d["writers"]
    if not cfg.add:
        del d["add"]
    return {k: v for k, v in d.items() if v is not None or k not in ("zstd_level", "bf16_layout")}


def _manifest_sha(ds: Any) -> str:
    with ds.fs.open(mf.join(ds.root, mf.MANIFEST), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _rendering(man: dict[str, Any]) -> dict[str, Any]:
    """What fixes how a dataset's conversations became tokens (chat template, placeholder, target kind)."""
    return {k: v for k, v in (man.get("extra") or {}).items() if k not in ("derive_key", DERIVED_KEY)}


def check_added(src: Any, added: list[Any], names: tuple[str, ...], layout: Layout, cfg: DeriveConfig) -> None:
    """ValueError (one line, what to do) for an added dataset that cannot join the source's samples."""
    for ds, name in zip(added, names):
        if ds.fingerprint != src.fingerprint:
            raise ValueError(f"--add {name}: captured from another target (fingerprint {ds.fingerprint[:12]}) than "
                             f"{cfg.src} ({src.fingerprint[:12]}); only one target's datasets can be joined")
        if _rendering(ds.manifest) != _rendering(src.manifest):
            raise ValueError(f"--add {name}: its conversations were rendered otherwise than {cfg.src}'s (chat "
                             "template, placeholder or target kind); capture it again as the source was")
        same = dataclasses.replace(cfg, taps=layout.tap_ids, top_k=layout.top_k, codec=layout.taps_codec)
        try:
            theirs = derived_layout(ds.layout, same)
        except ValueError as e:
            raise ValueError(f"--add {name}: it cannot be cut to the source's layout ({e})") from None
        if theirs != layout:
            raise ValueError(f"--add {name}: its layout differs from {cfg.src}'s beyond taps and top-k "
                             f"({ds.layout} against {layout}); only one target's datasets can be joined")


class JoinConflict(ValueError):
    """Two joined datasets name different conversations by one sample id: found while writing, so the derive
    removes the directory it started."""


def _tokens_digest(sample: dict[str, Any]) -> bytes:
    h = hashlib.sha256()
    for name in ("input_ids", "loss_mask"):
        h.update(sample[name].contiguous().numpy().tobytes())
    return h.digest()[:16]


def joined_samples(sources: list[Any], split: str, duplicates: dict[str, int],
                   seen_again: Callable[[int], None] = lambda n: None) -> Iterator[tuple[Layout, dict[str, Any]]]:
    """The split's samples of every source in turn, each with its source's layout (cut only where written). With
    several sources, a sample id seen before in the split is passed over when its tokens are the same (counted in
    ``duplicates[split]``, told to ``seen_again`` with the count so far) and refused otherwise; one source is read as
    it is (``verify`` owns its ids)."""
    seen: dict[str, bytes] | None = {} if len(sources) > 1 else None  # sample id -> tokens digest
    for ds in sources:
        if split not in ds.splits:
            continue
        for sample in ds.stream(split, seed=0, shuffle=False):
            if seen is not None:
                sid, digest = str(sample["sample_id"]), _tokens_digest(sample)
                if sid in seen:
                    if seen[sid] != digest:
                        raise JoinConflict(f"sample {sid!r} of split {split} is in two of the joined datasets with "
                                           "other tokens; give one of them other sample ids (they name conversations)")
                    duplicates[split] = duplicates.get(split, 0) + 1
                    seen_again(duplicates[split])
                    continue
                seen[sid] = digest
            yield ds.layout, sample


def _source(url: str, man: dict[str, Any], man_sha: str) -> dict[str, Any]:
    name = url.rstrip("/").rsplit("/", 1)[-1]  # its name: a local path means nothing elsewhere
    return {"source": name, "source_manifest_sha256": man_sha,
            "source_fingerprint": man["fingerprint"], "source_schema_version": man["schema_version"],
            "source_code_version": man.get("code_version")}


def _lineage(src_url: str, man: dict[str, Any], man_sha: str, cfg: DeriveConfig, layout: Layout,
             splits: list[str], counts: dict[str, int], available: dict[str, int],
             added: list[tuple[dict[str, Any], str]], duplicates: dict[str, int]) -> dict[str, Any]:
    src = Layout.from_dict(man["layout"])
    dropped: dict[str, Any] = {
        "taps": [t for t in src.tap_ids if t not in layout.tap_ids],
        "splits": [s for s in man["splits"] if s not in splits],
        "samples": {s: available[s] - counts[s] for s in splits},
    }
    if layout.top_k < src.top_k:
        dropped["top_k"] = [src.top_k, layout.top_k]
    if layout.taps_codec != src.taps_codec:
        dropped["precision"] = f"taps {src.taps_codec} -> {layout.taps_codec}"
    joined = {"added": [{**_source(url, m, sha), "capture_inputs": m["capture_config"].get("inputs")}
                        for (m, sha), url in zip(added, cfg.add)],
              "duplicates": duplicates} if added else {}
    return {**_source(src_url, man, man_sha), "dropped": dropped, **joined,
            "settings": {"taps": None if cfg.taps is None else list(cfg.taps), "codec": cfg.codec,
                         "splits": None if cfg.splits is None else list(cfg.splits),
                         "max_samples": cfg.max_samples, "top_k": cfg.top_k, "zstd_level": cfg.zstd_level,
                         "bf16_layout": cfg.bf16_layout}}


def derived_note(manifest: dict[str, Any]) -> str | None:
    """The clause a refusal adds for a derived dataset (what was dropped, what to do); None for a captured one."""
    d = (manifest.get("extra") or {}).get(DERIVED_KEY)
    if not d:
        return None
    drop = d.get("dropped", {})
    what = [f"taps {drop['taps']}"] if drop.get("taps") else []
    if drop.get("top_k"):
        what.append(f"top-k {drop['top_k'][0]} -> {drop['top_k'][1]}")
    if drop.get("precision"):
        what.append(drop["precision"])
    lost = ", ".join(what) or "nothing the recipe reads"
    return (f"this dataset was derived from {d.get('source')} (manifest {str(d.get('source_manifest_sha256'))[:12]}) "
            f"dropping {lost}: derive again from the source keeping what the recipe needs, or train on the source")


def _copy_bundle(src_fs: fsspec.AbstractFileSystem, src_root: str, out: Path, fingerprint: str,
                 expect: dict[str, Any] | None) -> None:
    dest = out / mf.TARGET_DIR
    if dest.is_dir():
        if mf.dataset_fingerprint(str(out)) != fingerprint:
            raise ValueError(f"{out} holds the bundle of another target; derive into a new --out directory")
        return
    with staged(dest) as t:  # bundle.json and what it lists: nothing else of the source, no link followed
        copy_bundle(src_fs, mf.join(src_root, mf.TARGET_DIR), t, expect)


def _finished(out: Path, lineage: str) -> dict[str, Any] | None:
    """The manifest of ``out`` when this derive already finished it; None when none is finished there; ValueError
    when another dataset is."""
    done = mf.complete_manifest(str(out))
    if done is not None and (done.get("extra") or {}).get("derive_key") != lineage:
        raise ValueError(f"{out} is already a finished dataset made otherwise; derive into a new --out directory")
    return done


def derive_dataset(cfg: DeriveConfig) -> dict[str, Any]:
    """Write the derived dataset; returns its manifest (see the module docstring)."""
    ds = open_dataset(cfg.src)
    added = [open_dataset(a) for a in cfg.add]
    man, man_sha = ds.manifest, _manifest_sha(ds)
    splits = list(cfg.splits) if cfg.splits is not None else list(dict.fromkeys(s for d in (ds, *added)
                                                                                 for s in d.splits))
    unknown = [s for s in splits if not any(s in d.splits for d in (ds, *added))]
    if unknown:
        raise ValueError(f"--splits {unknown}: {cfg.src} has splits {ds.splits}")
    layout = derived_layout(ds.layout, cfg)
    check_added(ds, added, cfg.add, layout, cfg)
    added_shas = [_manifest_sha(a) for a in added]
    out = Path(cfg.out)
    for d in (ds, *added):
        if Path(str(d.root)).resolve() == out.resolve():
            raise ValueError(f"--out {cfg.out} is a source dataset; derive into a new directory")
    lineage = hashlib.sha256(json.dumps([man_sha, _key_settings(cfg), *added_shas], sort_keys=True).encode()
                             ).hexdigest()
    done = _finished(out, lineage)
    if done is not None:
        return done
    if mf.foreign_directory(str(out)):
        raise ValueError(f"{out} is a non-empty directory that is not a tapdraft dataset; choose a new --out")
    shard_cfg = shard_config(ShardConfig.from_dict(man["shard_config"]), cfg)
    fresh = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    counts: dict[str, int] = {}
    available = {s: sum(d.num_samples(s) for d in (ds, *added) if s in d.splits) for s in splits}
    duplicates: dict[str, int] = {}
    try:
        with mf.writer_lock(str(out), 0, "a derive"):  # first: its _parts/ marks the directory as a dataset
            done = _finished(out, lineage)  # again under the lock: a derive that finished meanwhile is seen
            if done is not None:
                return done
            _copy_bundle(ds.fs, ds.root, out, ds.fingerprint, man.get(mf.BUNDLE_KEY))  # never an edited bundle.json
            for split in splits:
                n = available[split] if cfg.max_samples is None else min(cfg.max_samples, available[split])
                w = DatasetWriter(str(out), shard_cfg, layout, split=split, fingerprint=ds.fingerprint,
                                  lineage=f"derive {lineage}")
                with Progress(f"derive {split}", n, done=w.num_done, enabled=cfg.progress) as bar:
                    def kept_once(d: int, bar: Progress = bar) -> None:  # the bar counts samples read
                        bar.advance(1, info=f"{d} in two datasets, kept once")

                    samples = joined_samples([ds, *added], split, duplicates, kept_once)
                    counts[split] = _write_split(w, samples, layout, n, bar)
            extra = {**(man.get("extra") or {}), "derive_key": lineage,
                     DERIVED_KEY: _lineage(cfg.src, man, man_sha, cfg, layout, splits, counts, available,
                                           [(a.manifest, sha) for a, sha in zip(added, added_shas)], duplicates)}
            return finalize_dataset(str(out), layout=layout, fingerprint=ds.fingerprint,
                                    capture_config=man["capture_config"], extra=extra)
    except JoinConflict:
        if fresh:  # it can never finish with these inputs: leave nothing half-written
            shutil.rmtree(out, ignore_errors=True)
        raise


def _write_split(w: DatasetWriter, samples: Iterator[tuple[Layout, dict[str, Any]]], layout: Layout, n: int,
                 bar: Progress) -> int:
    """The first ``n`` samples written through ``w`` (those a killed derive wrote are passed over, not cut again);
    returns how many."""
    i = 0
    try:
        for src_layout, sample in samples:
            if i >= n:
                break
            if not w.is_done(i):
                w.write(cut_sample(sample, src_layout, layout), i)
                bar.advance(1)
            i += 1
    except BaseException:
        w.abort()
        raise
    w.close()
    return i
