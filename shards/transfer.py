"""push / pull: copy a finished dataset to or from an object store (any fsspec URL), manifest last.

    push("ds/", "s3://bucket/ds")     # upload what is missing or different, verify it, then manifest.json
    pull("s3://bucket/ds", "ds/")     # download what is missing, resume partial files, verify, then manifest

A dataset is its members (``shards.members``: the card, the shards and index files the manifest lists,
bundle.json and the files it lists; never the capture's working state, a stray file, or anything through
a link, which push refuses before sending a byte) plus manifest.json, the commit point: a reader refuses
a directory without it, so a copy interrupted at any instant is never mistaken for a dataset, and
rerunning the command finishes it. Both are idempotent (a finished copy is "up to date" after one listing) and refuse a
destination that holds another dataset or foreign files.

Verified: on S3 every object is uploaded by this module, whole (one PUT) below ``PART_BYTES`` and as
a multipart upload of ``PART_BYTES`` parts above, so its ETag is known before the upload (MD5, or the
MD5 of the parts' MD5s with ``-N``) and the store's ETag is compared after it; a pull compares the
same while downloading. A pull then runs ``tapdraft verify --quick``'s checks (each shard's sha256,
the bundle's hashes) on the copy before writing its manifest; a file that fails is deleted, so a
rerun fetches it again. Stores without ETags are checked by size (and the pull's verify).

One writer per destination: ``push`` holds the destination's writer lock (``_parts/rank00000.lock``, the name
capture, derive and pull lock a local directory by) from its first look at the destination to its manifest: a local
destination by ``mf.writer_lock``'s kernel lock, an object store by the same record kept in the store
(``common.lock.store_lock``: a conditional create on S3, a best-effort marker with a heartbeat elsewhere), confirmed
still held just before the manifest is written. A second push (or pull, derive, capture) to the same place is
refused at once naming the first; two pushes left one's manifest over the other's shards, each deleting the other's
files as leftovers. ``pull`` holds its destination's lock the same way, and both check the destination again once
they hold it (a writer that finished meanwhile is seen).

Resumable: a multipart upload's finished parts stay on the server; a rerun finds the upload
(``list_multipart_uploads``), keeps the parts whose MD5 matches and sends the rest. A download
continues its ``<file>.part`` from the last byte. A file already complete at the destination (same
size and ETag) is skipped, and an object already uploaded under another name (a capture's rank
shard before finalize renamed it) is copied on the server instead of sent again.
"""

from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import fsspec

from tapdraft.shards import manifest as mf
from tapdraft.common.atomic import replace
from tapdraft.common.errors import CorruptShardError
from tapdraft.common.lock import store_lock
from tapdraft.shards.limits import parse_json, regular_file
from tapdraft.shards.members import dataset_members
from tapdraft.common.progress import Progress
from tapdraft.shards.remote import RemoteConfig, is_local, retry
from tapdraft.shards.shard_index import INDEX_DIR

PART_BYTES = 64 << 20
"""Multipart part size (S3 allows 5 MiB..5 GiB and 10,000 parts: objects up to 625 GiB at this size)."""


def expected_etag(path: str, size: int, part_bytes: int = PART_BYTES) -> tuple[str, list[str], str]:
    """(the ETag S3 gives this file when uploaded as this module does, the parts' MD5s, the whole file's MD5:
    the ETag of a server-side copy on stores that digest a copy afresh), all hex."""
    whole, parts = hashlib.md5(), []
    with open(path, "rb") as f:
        while part := f.read(part_bytes):
            whole.update(part)
            parts.append(hashlib.md5(part).hexdigest())
    if size <= part_bytes:
        return whole.hexdigest(), [whole.hexdigest()], whole.hexdigest()
    return (hashlib.md5(b"".join(bytes.fromhex(p) for p in parts)).hexdigest() + f"-{len(parts)}", parts,
            whole.hexdigest())


def _etag(fs: Any, info: dict[str, Any]) -> str | None:
    """An object's ETag where it is an MD5 as above (S3 and its clones); None elsewhere (opaque tags)."""
    e = info.get("ETag") if hasattr(fs, "call_s3") else None
    return str(e).strip('"') if e else None


def _listing(fs: Any, root: str) -> dict[str, dict[str, Any]]:
    """relative path -> info of every file under ``root`` (one recursive listing) but the writers' ``_parts/``."""
    if not fs.exists(root):
        return {}
    found = fs.find(root, detail=True)
    base = fs._strip_protocol(root).rstrip("/")
    rels = {name[len(base):].lstrip("/"): info for name, info in found.items() if info.get("type") != "directory"}
    return {rel: info for rel, info in rels.items() if rel.split("/")[0] != mf.PARTS_DIR}


@contextmanager
def destination_lock(fs: Any, root: str, url: str, what: str) -> Iterator[Callable[[], None]]:
    """The writer lock of the destination ``root`` (module docstring); yields ``confirm``, called just before the
    commit (LockedError unless the lock is still held: only a store's lock can be lost). A local destination's
    ``_parts/`` is removed after, when empty."""
    if is_local(fs):
        with mf.writer_lock(root, 0, what):
            yield lambda: None
        try:
            Path(root, mf.PARTS_DIR).rmdir()
        except OSError:
            pass
    else:
        with store_lock(fs, mf.join(root, mf.lock_name(0)), f"{what} (rank 0)", guards=url) as confirm:
            yield confirm


def _open(url: str, config: RemoteConfig) -> tuple[Any, str, Callable[..., Any]]:
    """(inner filesystem, root, retry wrapper): transfers go to the store itself, not through the read cache."""
    fs, root = fsspec.core.url_to_fs(str(url), **dict(config.storage_options))
    fs.invalidate_cache()
    return fs, root, lambda fn, what: retry(fn, config, what)


def _read_manifest_bytes(root: Path) -> tuple[bytes, dict[str, Any]]:
    path = root / mf.MANIFEST
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: {root} is not a finished tapdraft dataset (finish or resume its "
                                "capture first)")
    regular_file(root, mf.MANIFEST)
    raw = path.read_bytes()
    return raw, mf.check_manifest(parse_json(raw, str(path)), str(path))


# ---- push ---------------------------------------------------------------------------------------

def push(src: str, url: str, *, config: RemoteConfig | None = None, progress: bool = True,
         part_bytes: int = PART_BYTES) -> dict[str, Any]:
    """Upload the finished local dataset ``src`` to ``url``; returns counts."""
    config = config or RemoteConfig()
    src_root = Path(src)
    raw, doc = _read_manifest_bytes(src_root)
    files = dataset_members(fsspec.filesystem("file"), str(src_root), doc)  # links refused before anything is sent
    from tapdraft.shards.verify import card_problems

    bad_card = card_problems(fsspec.filesystem("file"), str(src_root), doc)  # an edited card was sent as is
    if bad_card:
        raise CorruptShardError(bad_card[0])
    fs, root, R = _open(url, config)
    _check_destination(fs, R, url, root, raw, _listing(fs, root))  # before the lock: none is left in a foreign place
    with destination_lock(fs, root, url, "a push") as confirm:
        fs.invalidate_cache()
        return _push_locked(fs, R, url, root, src_root, raw, files, _listing(fs, root), confirm, part_bytes, progress)


def _check_destination(fs: Any, R: Callable[..., Any], url: str, root: str, raw: bytes,
                       remote: dict[str, Any]) -> None:
    """Refuse a destination that holds another dataset or files of something else."""
    man_url = mf.join(root, mf.MANIFEST)
    if mf.MANIFEST in remote:
        there = R(fs.cat_file, "read")(man_url)
        if there != raw:
            doc_there = parse_json(there, man_url)
            theirs = doc_there.get("fingerprint", "?") if isinstance(doc_there, dict) else "?"
            raise ValueError(f"{url} already holds another dataset (fingerprint {str(theirs)[:12]}, a different "
                             "manifest); push to a new URL, or delete that one first")
    elif remote and not ({r.split("/")[0] for r in remote} & {mf.DATA_DIR, mf.TARGET_DIR, mf.CARD}):
        raise ValueError(f"{url} holds {len(remote)} files that are not a tapdraft dataset; push to a new or empty "
                         "URL (nothing was changed)")


def _push_locked(fs: Any, R: Callable[..., Any], url: str, root: str, src_root: Path, raw: bytes,
                 files: dict[str, int], remote: dict[str, Any], confirm: Callable[[], None], part_bytes: int,
                 progress: bool) -> dict[str, Any]:
    """``push``'s copy to ``root``, whose writer lock the caller holds (``remote``: its listing, taken under it)."""
    _check_destination(fs, R, url, root, raw, remote)  # again: a push that finished meanwhile is seen
    man_url = mf.join(root, mf.MANIFEST)
    stats = {"files": len(files), "uploaded": 0, "copied": 0, "skipped": 0, "bytes_sent": 0}
    if mf.MANIFEST in remote and all(int(remote.get(rel, {}).get("size", -1)) == n for rel, n in files.items()):
        return {**stats, "skipped": len(files), "up_to_date": True}  # committed, every file there: one listing
    by_etag = {(_etag(fs, i), int(i.get("size", -1))): rel for rel, i in remote.items() if _etag(fs, i)}
    total = sum(files.values())
    with Progress(f"push {url}", total, enabled=progress, fmt_count=mf.fmt_bytes) as bar:
        for rel in sorted(files):
            lpath, size, rpath = str(src_root / rel), files[rel], mf.join(root, rel)
            want, parts, whole = expected_etag(lpath, size, part_bytes)
            have, accept = remote.get(rel), {want, whole}
            if have is not None and int(have.get("size", -1)) == size and _etag(fs, have) in (want, None):
                stats["skipped"] += 1
            elif (want, size) in by_etag and hasattr(fs, "copy"):  # the same bytes under another name
                R(fs.copy, "copy")(mf.join(root, by_etag[(want, size)]), rpath)
                stats["copied"] += 1
            else:
                sent = _upload(fs, R, lpath, rpath, size, parts, part_bytes, bar.advance)
                stats["uploaded"] += 1
                stats["bytes_sent"] += sent
                bar.advance(size - sent)  # resumed parts
                _check_uploaded(fs, R, rpath, size, accept)
                continue
            bar.advance(size)
            _check_uploaded(fs, R, rpath, size, accept)
        leftovers = [rel for rel in sorted(set(remote) - set(files) - {mf.MANIFEST})  # of an interrupted push or
                     if rel.split("/")[0] in (mf.DATA_DIR, INDEX_DIR, mf.TARGET_DIR)]  # capture, or an older push
        if leftovers:
            confirm()  # still this push's destination: never another writer's files deleted as leftovers
        for rel in leftovers:
            R(fs.rm_file, "delete")(mf.join(root, rel))
        if mf.MANIFEST not in remote:
            confirm()  # still this push's destination: never one push's manifest over another's shards
            R(fs.pipe_file, "write")(man_url, raw)  # last: the commit point
            _check_uploaded(fs, R, man_url, len(raw), {hashlib.md5(raw).hexdigest()})
    stats["up_to_date"] = stats["uploaded"] == stats["copied"] == 0 and mf.MANIFEST in remote
    return stats


def _check_uploaded(fs: Any, R: Callable[..., Any], rpath: str, size: int, accept: set[str]) -> None:
    """The stored object has the local file's size and (on S3) one of the ETags its bytes give."""
    fs.invalidate_cache(rpath)
    info = R(fs.info, "info")(rpath)
    got = _etag(fs, info)
    if int(info.get("size", -1)) != size or (got is not None and got not in accept):
        raise CorruptShardError(f"{rpath}: the store holds {info.get('size')} bytes with ETag {got}, the local file "
                                f"{size} bytes with ETag {sorted(accept)[0]}: the upload did not arrive intact; rerun "
                                "the push")


def _upload(fs: Any, R: Callable[..., Any], lpath: str, rpath: str, size: int, parts: list[str], part_bytes: int,
            advance: Callable[[int], None]) -> int:
    """Upload one file; returns the bytes sent (less than ``size`` when a multipart upload resumed)."""
    if len(parts) == 1 or not hasattr(fs, "call_s3"):
        if is_local(fs):  # a local destination (a mounted share): its folders are made as an object store's are
            fs.makedirs(fs._parent(rpath), exist_ok=True)
        R(fs.put_file, "upload")(lpath, rpath)
        advance(size)
        return size
    bucket, key, _ = fs.split_path(rpath)
    call = R(fs.call_s3, "upload")
    upload_id, done = None, {}
    for up in call("list_multipart_uploads", Bucket=bucket, Prefix=key).get("Uploads", []) or []:
        if up["Key"] != key:
            continue
        listed = call("list_parts", Bucket=bucket, Key=key, UploadId=up["UploadId"]).get("Parts", []) or []
        kept = {p["PartNumber"]: p["ETag"].strip('"') for p in listed
                if p["PartNumber"] <= len(parts) and p["ETag"].strip('"') == parts[p["PartNumber"] - 1]}
        if upload_id is None:
            upload_id, done = up["UploadId"], kept
        else:
            call("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=up["UploadId"])
    if upload_id is None:
        upload_id = call("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
    todo = [n for n in range(1, len(parts) + 1) if n not in done]

    def send(n: int) -> tuple[int, str]:
        with open(lpath, "rb") as f:
            f.seek((n - 1) * part_bytes)
            body = f.read(part_bytes)
        etag = call("upload_part", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=n, Body=body)["ETag"]
        if etag.strip('"') != parts[n - 1]:
            raise CorruptShardError(f"{rpath}: part {n} arrived with ETag {etag}, sent with MD5 {parts[n - 1]}; "
                                    "rerun the push")
        advance(len(body))
        return n, etag.strip('"')

    with ThreadPoolExecutor(4) as pool:
        done.update(dict(pool.map(send, todo)))
    call("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id,
         MultipartUpload={"Parts": [{"PartNumber": n, "ETag": f'"{done[n]}"'} for n in sorted(done)]})
    return sum(min(part_bytes, size - (n - 1) * part_bytes) for n in todo)


# ---- pull ---------------------------------------------------------------------------------------

def pull(url: str, dest: str, *, config: RemoteConfig | None = None, progress: bool = True,
         part_bytes: int = PART_BYTES) -> dict[str, Any]:
    """Download the finished dataset at ``url`` into the local directory ``dest``; returns counts. ``dest`` is new,
    empty, a copy under way or the same dataset: a directory of anything else is refused before a byte is written."""
    config = config or RemoteConfig()
    fs, root, R = _open(url, config)
    if is_local(fs) and Path(fs._strip_protocol(root)).resolve() == Path(dest).resolve():
        raise ValueError(f"pull {url} into itself: give another directory")
    man_url = mf.join(root, mf.MANIFEST)
    try:
        raw = R(fs.cat_file, "read")(man_url)
    except FileNotFoundError:
        raise FileNotFoundError(f"{man_url} not found: {url} is not a finished tapdraft dataset (a push writes "
                                "manifest.json last; let it finish, or rerun it)") from None
    doc = mf.check_manifest(parse_json(raw, man_url), man_url)
    remote = _listing(fs, root)
    files = dataset_members(fs, root, doc, sizes={rel: int(i.get("size", 0)) for rel, i in remote.items()})
    out = Path(dest)
    done = _pulled(out, raw, files)
    if done is not None:
        return done
    if not (out / mf.MANIFEST).is_file() and mf.foreign_directory(str(out)):
        raise ValueError(f"{dest} is a non-empty directory that is not a tapdraft dataset; pull into a new or empty "
                         "directory (nothing in it was changed)")
    local = fsspec.filesystem("file")
    with destination_lock(local, str(out.absolute()), dest, "a pull"):  # its _parts/ marks a copy under way
        done = _pulled(out, raw, files)  # again under the lock: a pull that finished meanwhile is seen
        return done if done is not None else _pull_locked(fs, R, url, root, raw, files, remote, out, part_bytes,
                                                          progress)


def _pulled(out: Path, raw: bytes, files: dict[str, int]) -> dict[str, Any] | None:
    """A pull's counts when ``out`` already holds this whole dataset; None when it is to be copied; ValueError
    when it holds another dataset."""
    if not (out / mf.MANIFEST).is_file():
        return None
    if (out / mf.MANIFEST).read_bytes() != raw:
        raise ValueError(f"{out} already holds another dataset (a different manifest.json); pull into a new "
                         "directory")
    if all((out / rel).is_file() and (out / rel).stat().st_size == n for rel, n in files.items()):
        return {"files": len(files), "downloaded": 0, "skipped": len(files), "bytes_received": 0, "up_to_date": True}
    return None


def _pull_locked(fs: Any, R: Callable[..., Any], url: str, root: str, raw: bytes, files: dict[str, int],
                 remote: dict[str, Any], out: Path, part_bytes: int, progress: bool) -> dict[str, Any]:
    """``pull``'s copy into ``out``, whose writer lock the caller holds."""
    from tapdraft.shards.verify import verify_dataset

    dest = str(out)
    (out / mf.MANIFEST).unlink(missing_ok=True)  # damaged since: not a dataset until the copy is whole again
    stats = {"files": len(files), "downloaded": 0, "skipped": 0, "bytes_received": 0}
    with Progress(f"pull {url}", sum(files.values()), enabled=progress, fmt_count=mf.fmt_bytes) as bar:
        for rel in sorted(files):
            target, size = out / rel, files[rel]
            if target.is_file() and target.stat().st_size == size:
                stats["skipped"] += 1
                bar.advance(size)
                continue
            got = _download(fs, R, mf.join(root, rel), target, size, _etag(fs, remote[rel]), part_bytes, bar.advance)
            stats["downloaded"] += 1
            stats["bytes_received"] += got
        rep = verify_dataset(str(out), deep=False, progress=False, manifest=raw)
        if rep.problems:
            base, kept = Path(os.path.abspath(out)), []
            for p in rep.problems:  # each names its file first: delete a member that failed, so a rerun fetches it
                bad = Path(os.path.abspath(p.split(": ", 1)[0]))  # again; a file that is no member is never touched
                rel = bad.relative_to(base).as_posix() if bad.is_relative_to(base) else None
                if rel in files and bad.is_file() and not bad.is_symlink():
                    bad.unlink()
                elif bad != base / mf.MANIFEST and (bad.exists() or bad.is_symlink()):
                    kept.append(str(bad))
            then = (f"{len(kept)} file(s) in {dest} are not part of the dataset and were left as they are (first: "
                    f"{kept[0]}): move them out of it, then rerun the pull" if kept else
                    "the bad files were deleted: rerun the pull to fetch them again")
            raise CorruptShardError(f"the copy of {url} in {dest} failed verification ({len(rep.problems)} "
                                    f"problem(s); first: {rep.problems[0]}); {then}")
        tmp = out / (mf.MANIFEST + ".tmp")
        tmp.write_bytes(raw)
        replace(tmp, out / mf.MANIFEST)  # last: the commit point (synced before and after)
    stats["up_to_date"] = False
    return stats


def _download(fs: Any, R: Callable[..., Any], rpath: str, target: Path, size: int, etag: str | None,
              part_bytes: int, advance: Callable[[int], None], chunk: int = 16 << 20) -> int:
    """``rpath`` -> ``target`` through ``target.part``, continuing a partial one; returns the bytes received."""
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(target.name + ".part")
    have = part.stat().st_size if part.exists() else 0
    if have > size:
        part.unlink()
        have = 0
    advance(have)
    got = 0
    get = R(fs.cat_file, "read")
    with open(part, "ab") as f:
        while have + got < size:
            data = get(rpath, start=have + got, end=min(size, have + got + chunk))
            if not data:
                raise CorruptShardError(f"{rpath}: the store returned nothing at byte {have + got} of {size}")
            f.write(data)
            got += len(data)
            advance(len(data))
    if etag is not None and ("-" not in etag or etag.endswith(f"-{-(-size // part_bytes)}")):  # else: another tool's
        multi, _, whole = expected_etag(str(part), size, part_bytes)  # parts (verify still checks the copy)
        want = multi if "-" in etag else whole
        if want != etag:
            part.unlink()
            raise CorruptShardError(f"{rpath}: the downloaded copy has ETag {want}, the store says {etag}: damaged in "
                                    "transit (the partial file was deleted); rerun the pull")
    replace(part, target)  # synced before and after: a power cut cannot leave a short shard under its name
    return got


# ---- capture into a store: stage locally, upload finished shards in the background -------------------

def is_remote_url(url: str) -> bool:
    return not is_local(fsspec.core.url_to_fs(str(url))[0])


def staging_dir(url: str, config: RemoteConfig | None = None) -> str:
    """The default local staging directory of a capture into ``url`` (beside the read cache)."""
    config = config or RemoteConfig()
    key = hashlib.sha256(str(url).rstrip("/").encode()).hexdigest()[:16]
    return str(Path(config.cache_dir).parent / "staging" / key)


class StagedUpload:
    """While a capture writes its shards into the local ``stage``, upload each finished shard of ``rank`` to
    ``url`` in a background thread (one listing of ``stage/data`` every ``every_s``); ``finish()`` then
    pushes the finalized dataset (``push``: renamed shards are copied on the store, not sent again; the
    manifest last). A failed background upload is only retried later: ``finish`` sends whatever is missing.

        with StagedUpload(stage, url, rank) as up:
            capture into stage ...
        up.finish()          # rank 0, after finalize
    """

    EVERY_S = 2.0
    """Seconds between two looks for finished shards (a shard takes minutes to fill at real sizes)."""

    def __init__(self, stage: str, url: str, rank: int = 0, *, config: RemoteConfig | None = None,
                 part_bytes: int = PART_BYTES) -> None:
        self.stage, self.url, self.rank = Path(stage), str(url), rank
        self.config, self.every_s, self.part_bytes = config or RemoteConfig(), self.EVERY_S, part_bytes
        self.sent: dict[str, int] = {}
        self.errors, self.last_error = 0, ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tapdraft-upload", daemon=True)

    def __enter__(self) -> "StagedUpload":
        self.stage.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        fs, root, R = _open(self.url, self.config)
        while True:
            stopping = self._stop.wait(self.every_s)
            self.upload_ready(fs, root, R)
            if stopping:
                return

    def upload_ready(self, fs: Any, root: str, R: Callable[..., Any]) -> None:
        """Upload this rank's finished shards not yet sent (the writer renames a shard from its temp name only
        once it is complete)."""
        data = self.stage / mf.DATA_DIR
        for p in sorted(data.iterdir()) if data.is_dir() else []:
            rel = f"{mf.DATA_DIR}/{p.name}"
            if not mf.is_rank_shard(rel, self.rank) or rel in self.sent:
                continue
            try:
                size = p.stat().st_size
                want, parts, whole = expected_etag(str(p), size, self.part_bytes)
                _upload(fs, R, str(p), mf.join(root, rel), size, parts, self.part_bytes, lambda n: None)
                _check_uploaded(fs, R, mf.join(root, rel), size, {want, whole})
                self.sent[rel] = size
            except Exception as e:  # noqa: BLE001 (the store is down, or finalize renamed it: finish() catches up)
                self.errors += 1
                self.last_error = f"{type(e).__name__}: {e}"

    def finish(self, *, progress: bool = True) -> dict[str, Any]:
        return push(str(self.stage), self.url, config=self.config, progress=progress, part_bytes=self.part_bytes)
