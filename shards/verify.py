"""Check a dataset end to end and report EVERY problem, not just the first.

Checks: manifest present, valid, complete, known schema major, required keys; target bundle
fingerprint, its bundle.json against the manifest's record of it (where it has one) and its config against the
schema (``shards.target_config``); the card (README.md) against the manifest's record of it, where it has one;
per shard: present, size, sha256, its index file (size and hash against the manifest, ranges inside the shard),
readable to the end, schema metadata (version, fingerprint, dtypes), row counts and record-batch byte ranges, every
block and row checksum (shards.integrity), every sample re-validated against the layout (dtype, shape, finite
values) and the manifest's token/supervised/audio counts; sample ids unique within a split (a duplicate means an
input listed twice or shards merged twice); split totals; no empty split; every file of the dataset a
member (``shards.members``: listed by the manifest or the bundle, or a fixed name) and a regular file:
a stray (a leftover temp file, a foreign file) or a link anywhere in it is a problem. ``ok`` only when
all hold.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import fsspec
import pyarrow as pa

from tapdraft.shards import manifest as mf
from tapdraft.shards.bundle import open_bundle
from tapdraft.shards.codec import FieldMeta
from tapdraft.common.errors import CorruptShardError
from tapdraft.shards.formats import get_format
from tapdraft.shards.limits import check_manifest_shape, parse_json
from tapdraft.shards.members import strays
from tapdraft.common.progress import Progress
from tapdraft.shards.remote import RemoteConfig, open_url
from tapdraft.shards.schema import Layout, check_schema_version, validate_sample

REQUIRED_KEYS = ("schema_version", "format", "complete", "fingerprint", "layout", "field_meta", "splits", "taps",
                 "top_k", "dtypes", "codec", "capture_config", "code_version")
COUNT_KEYS = ("samples", "tokens", "supervised_tokens", "audio_seconds")


@dataclass
class VerifyReport:
    path: str
    problems: list[str] = field(default_factory=list)
    shards_checked: int = 0
    samples_checked: int = 0
    bytes_checked: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_dataset(url: str, *, deep: bool = True, progress: bool = True, remote: RemoteConfig | None = None,
                   manifest: bytes | None = None) -> VerifyReport:
    """Verify ``url`` (path or fsspec URL). ``deep``: also decode and re-validate every sample. A remote shard is
    read whole through the local cache (``shards.remote``: each object version is downloaded once).
    ``manifest``: check the directory against these manifest.json bytes instead of its own (a copy checked
    before its manifest is written)."""
    fs, root = open_url(str(url), remote)
    rep = VerifyReport(str(url))
    man_path = mf.join(root, mf.MANIFEST)
    if manifest is None and not fs.exists(man_path):
        rep.problems.append(f"{man_path}: missing; the directory is not a finished dataset (resume the capture, "
                            "then finalize)")
        return rep
    try:
        m = check_manifest_shape(parse_json(fs.cat_file(man_path) if manifest is None else manifest, man_path),
                                 man_path)
    except CorruptShardError as e:
        rep.problems.append(str(e))
        return rep
    missing = [k for k in REQUIRED_KEYS if k not in m]
    if missing:
        rep.problems.append(f"{man_path}: lacks keys {missing}; re-run finalize with this tapdraft")
    if m.get("complete") is not True:
        rep.problems.append(f"{man_path}: complete is not true; the capture has not finished (resume it, finalize)")
    try:
        check_schema_version(m.get("schema_version"), man_path)
    except ValueError as e:
        rep.problems.append(str(e))
        return rep
    if missing:
        return rep
    m = mf.migrate_manifest(m)
    try:
        mf.check_integrity(m, man_path)
        mf.check_shard_entries(m, man_path)
    except ValueError as e:
        rep.problems.append(str(e))
        return rep
    fp = m["fingerprint"]
    try:
        layout = Layout.from_dict(m["layout"])
        meta = FieldMeta.from_dict(m["field_meta"])
    except (KeyError, TypeError, ValueError) as e:
        rep.problems.append(f"{man_path}: layout is invalid ({e}); re-run finalize")
        return rep
    try:
        reader = get_format(m["format"], man_path).reader
    except ValueError as e:
        rep.problems.append(str(e))
        return rep
    _check_bundle(fs, root, fp, rep, m.get(mf.BUNDLE_KEY))
    rep.problems += card_problems(fs, root, m)

    shards = [(s, sh) for s, d in m["splits"].items() for sh in d["shards"]]
    rep.problems += strays(fs, root, m)
    total = sum(int(sh.get("bytes", 0)) for _, sh in shards)
    seen: dict[str, dict[str, str]] = {s: {} for s in m["splits"]}  # split -> sample id -> first shard holding it
    with Progress(f"verify {url}", total, enabled=progress, transient=True, fmt_count=mf.fmt_bytes) as bar:
        for split, sh in shards:
            _check_shard(fs, root, m, meta, layout, split, sh, rep, deep, bar.advance, seen[split], reader)
    if not m["splits"]:
        rep.problems.append(f"{man_path}: lists no split; the dataset holds nothing (re-capture it)")
    for split, d in m["splits"].items():
        if not d.get("samples"):
            skipped = m.get("skipped", {}).get(split, [])
            why = f"; first skip reason: {skipped[0]['sample_id']!r}: {skipped[0]['reason']}" if skipped else ""
            rep.problems.append(f"{man_path}: split {split} has no samples ({len(skipped)} skipped){why}; "
                                "re-capture it with inputs the target can use")
    rep.problems += mf.split_total_problems(m, man_path)
    return rep


CARD_HEAD_BYTES = 1 << 16
"""How much of README.md is read for its front matter (finalize's is ~60 bytes a split)."""


def card_problems(fs: fsspec.AbstractFileSystem, root: str, m: dict) -> list[str]:
    """Problems (one line each, naming README.md) of the card: README.md against the manifest's record of it (``manifest.CARD_KEY``; older manifests have none), and its front
    matter, whatever the record, against what finalize writes for this manifest (``manifest.card_front_matter``):
    ``datasets.load_dataset(DIR)`` reads the files its ``data_files`` name, so a card pointing them elsewhere (outside
    the dataset) would make it load foreign files. A card without front matter (written before it existed) has none
    to check. ``push`` refuses a card with any (it was sent as is)."""
    path = mf.join(root, mf.CARD)
    out: list[str] = []
    if fs.exists(path):
        head = fs.cat_file(path, start=0, end=CARD_HEAD_BYTES)
        want_fm = mf.card_front_matter(m).encode()
        if head.startswith(b"---") and not head.startswith(want_fm):
            out.append(f"{path}: its front matter (the data_files datasets.load_dataset reads) is not what "
                       "finalize writes for this manifest (each split's data/<split>-*.<ext> shards): it was edited, "
                       "and could make a loader read files outside the dataset; restore the card from the original "
                       "dataset (re-copy README.md)")
    want = m.get(mf.CARD_KEY)
    if want is None:
        return out
    if not fs.exists(path):
        return out + [f"{path}: missing, the manifest records the dataset card; re-copy README.md"]
    if fs.size(path) != want.get("bytes"):
        got = None
    else:
        got = hashlib.sha256(fs.cat_file(path)).hexdigest()
    if got != want.get("sha256"):
        out.append(f"{path}: not the card the manifest records (edited or damaged since finalize); restore it from the "
                   "original dataset (re-copy README.md)")
    return out


def _check_bundle(fs: fsspec.AbstractFileSystem, root: str, fp: str, rep: VerifyReport, expect: dict | None) -> None:
    """The bundle whole: bundle.json's bytes against the manifest's record (``expect``; None for manifests written
    before it), its fingerprinted fields, its config's values, every file it lists re-hashed."""
    tdir = mf.join(root, mf.TARGET_DIR)
    if not fs.exists(tdir):
        rep.problems.append(f"{tdir}: missing target bundle; re-copy target/ or re-run capture")
        return
    try:
        b = open_bundle(fs, tdir, verify=True, expect=expect)  # verify re-hashes every file; readers check sizes
    except (OSError, ValueError, KeyError) as e:
        rep.problems.append(f"{tdir}: {e}")
        return
    if b.fingerprint != fp:
        rep.problems.append(f"{tdir}: fingerprint {b.fingerprint[:12]} differs from the manifest's {fp[:12]}; the "
                            "bundle belongs to another target")


def unreadable_problem(path: str, samples: int, e: BaseException) -> str:
    """verify's line for a shard that stopped reading after ``samples`` samples: the reader's message without the
    shard's name it starts with, and the advice to re-copy it only when that message does not already give it (a
    missing column said "re-copy it (or re-capture it)" and then "re-copy or re-capture it")."""
    why = str(e).removeprefix(f"{path}: ")
    if "re-copy" in why or "re-capture" in why:
        return f"{path}: unreadable after {samples} samples: {why}"
    return f"{path}: unreadable after {samples} samples ({why}); re-copy or re-capture it"


def _check_shard(fs, root, m, meta, layout, split, sh, rep, deep, advance, seen: dict[str, str], reader) -> None:
    path = mf.join(root, sh["name"])
    if not fs.exists(path):
        rep.problems.append(f"{path}: missing; re-copy it or re-capture its samples")
        advance(sh.get("bytes", 0))
        return
    rep.shards_checked += 1
    size = fs.size(path)
    if size != sh["bytes"]:
        kind = "truncated" if size < sh["bytes"] else "longer than recorded"
        rep.problems.append(f"{path}: {kind}: {size} bytes on disk, manifest says {sh['bytes']}; re-copy the shard "
                            "or re-capture it")
    sha = hashlib.sha256()
    with fs.open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            sha.update(chunk)
            advance(len(chunk))
    rep.bytes_checked += size
    if size == sh["bytes"] and sha.hexdigest() != sh["sha256"]:
        rep.problems.append(f"{path}: sha256 {sha.hexdigest()[:12]} differs from the manifest's {sh['sha256'][:12]} "
                            "(corrupted); re-copy the shard or re-capture it")
    if not deep:
        return
    counts = {k: 0 for k in COUNT_KEYS}
    counts["audio_seconds"] = 0.0
    try:
        for sample in reader.verify_shard(fs, root, path, m, meta, sh, rep.problems.append):
            rep.samples_checked += 1
            try:
                validate_sample(sample, layout)
            except ValueError as e:
                rep.problems.append(f"{path}: {e}")
            sid = str(sample["sample_id"])
            if sid in seen:
                rep.problems.append(f"{path}: sample_id {sid!r} of split {split} is also in {seen[sid]}; an input was "
                                    "listed twice: deduplicate the inputs and re-capture")
            else:
                seen[sid] = path
            counts["samples"] += 1
            counts["tokens"] += int(sample["input_ids"].shape[0])
            counts["supervised_tokens"] += int(sample["loss_mask"].sum())
            counts["audio_seconds"] += float(sample["audio_seconds"])
    except (ValueError, KeyError, OSError, pa.ArrowException, EOFError) as e:
        rep.problems.append(unreadable_problem(path, counts["samples"], e))
        return
    for k in COUNT_KEYS:
        if abs(counts[k] - sh[k]) > 1e-6 * max(1.0, abs(sh[k])):
            rep.problems.append(f"{path}: holds {k}={counts[k]}, manifest says {sh[k]}; re-run finalize or re-capture")
