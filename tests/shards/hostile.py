"""Hostile datasets: a good dataset, copied and then edited as someone who wants the reader's secrets would.

    src = good_dataset(tmp / "good")                 # a finished dataset whose bundle carries a tokenizer file
    case = build("tokenizer_link", src, tmp / "work")  # a copy with one defect; case.root, case.listed
    SECRET                                           # the bytes every outside file holds: none may come back
    leaked(tree)                                     # what of a copy came from outside a dataset
    build_numbers("samples_2_35", src, tmp / "w2")   # a manifest claiming the impossible (NUMBER_CASES)
    inflate_arrow_buffer(root, 2**40)                # an Arrow buffer declaring 1 TiB, every checksum consistent
    rewrite_columns(root, drop="topk_ids")           # a shard without a declared column (or add=: one extra)
    add_tar_member(wds_dataset(tmp / "w"), "notes")  # a tar sample with a member its schema does not declare

Each case is one class of the dataset boundary (``shards.members``): a link to a file outside (unlisted, or in
place of a listed file with the very bytes the bundle records, so that hashes alone pass), a link in place of a
folder, a special file, a stray regular file. ``listed`` says whether the defect is in a file readers open
(they must refuse it) or beside them (they must ignore it; verify reports it; nothing copies it).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tapdraft.shards.writer import ShardConfig
from tests.shards.synthetic import tiny_layout, write_dataset

SECRET = b"AWS_SECRET_ACCESS_KEY=hostile-fixture-not-a-real-key\n"
TOKENIZER = b'{"model": "hostile-fixture"}'


@dataclass(frozen=True)
class Hostile:
    root: Path
    """The edited copy (a dataset directory)."""
    listed: bool
    """The defect is in a file readers open (refused), not beside them (ignored)."""
    culprit: str
    """The path, relative to ``root``, that verify must name."""


def good_dataset(root: Path, tokenizer: bytes = TOKENIZER) -> Path:
    """A small finished dataset (arrow, 3 shards) whose bundle lists ``tokenizer/tokenizer.json`` (``tokenizer``)."""
    tok = root.parent / (root.name + "-tokenizer")
    tok.mkdir(parents=True)
    (tok / "tokenizer.json").write_bytes(tokenizer)
    write_dataset(str(root), tiny_layout(), ShardConfig(shard_bytes=2500, batch_bytes=800), [5, 8, 3, 6],
                  tokenizer_dir=str(tok))
    return root


def _outside(work: Path, name: str, data: bytes) -> Path:
    """A file beside the dataset, outside it."""
    p = work.parent / f"outside-{name}"
    p.write_bytes(data)
    return p


def _first_shard(root: Path) -> str:
    return json.loads((root / "manifest.json").read_text())["splits"]["train"]["shards"][0]["name"]


def _relink(root: Path, rel: str, work: Path) -> str:
    """``rel`` replaced by a link to an identical copy outside (what a Hub cache snapshot looks like)."""
    target = _outside(work, rel.replace("/", "_"), (root / rel).read_bytes())
    (root / rel).unlink()
    (root / rel).symlink_to(target)
    return rel


def _secret_link(root: Path, rel: str, work: Path) -> str:
    (root / rel).symlink_to(_outside(work, "secret", SECRET))
    return rel


def _environ_link(root: Path, rel: str, work: Path) -> str:
    (root / rel).symlink_to("/proc/self/environ")
    return rel


def _tokenizer_dir_link(root: Path, work: Path) -> str:
    d = work.parent / "outside-tokenizer"
    shutil.copytree(root / "target" / "tokenizer", d)
    (d / "vocab.json").write_bytes(SECRET)
    shutil.rmtree(root / "target" / "tokenizer")
    (root / "target" / "tokenizer").symlink_to(d, target_is_directory=True)
    return "target/tokenizer"


def _fifo(root: Path, rel: str) -> str:
    os.mkfifo(root / rel)
    return rel


def _stray(root: Path, rel: str) -> str:
    (root / rel).write_bytes(SECRET)
    return rel


CASES: dict[str, tuple[bool, Callable[[Path, Path], str]]] = {
    # unlisted: readers ignore it, verify reports it, nothing copies it
    "tokenizer_link": (False, lambda r, w: _secret_link(r, "target/tokenizer/vocab.json", w)),
    "environ_link": (False, lambda r, w: _environ_link(r, "target/tokenizer/added_tokens.json", w)),
    "root_link": (False, lambda r, w: _secret_link(r, "credentials.json", w)),
    "data_link": (False, lambda r, w: _secret_link(r, "data/extra.arrow", w)),
    "fifo": (False, lambda r, w: _fifo(r, "data/train-pipe.arrow")),
    "stray_file": (False, lambda r, w: _stray(r, "target/tokenizer/merges.txt")),
    # listed: the very bytes the manifest or bundle records, reached through a link: readers refuse it
    "listed_tokenizer_link": (True, lambda r, w: _relink(r, "target/tokenizer/tokenizer.json", w)),
    "tokenizer_dir_link": (True, lambda r, w: _tokenizer_dir_link(r, w)),
    "shard_link": (True, lambda r, w: _relink(r, _first_shard(r), w)),
    "index_link": (True, lambda r, w: _relink(r, "index/" + _first_shard(r).split("/")[-1] + ".json", w)),
    "weights_link": (True, lambda r, w: _relink(r, "target/weights.safetensors", w)),
    "manifest_link": (True, lambda r, w: _relink(r, "manifest.json", w)),
}


def _edit_manifest(root: Path, edit: Callable[[dict], object]) -> str:
    m = json.loads((root / "manifest.json").read_text())
    out = edit(m)
    (root / "manifest.json").write_text(json.dumps(m if out is None else out))
    return "manifest.json"


def _edit_raw(root: Path, edit: Callable[[str], str]) -> str:
    (root / "manifest.json").write_text(edit((root / "manifest.json").read_text()))
    return "manifest.json"


def _claim_samples(m: dict, n: int) -> None:
    m["splits"]["train"]["shards"][0]["samples"] = n
    m["splits"]["train"]["samples"] += n


def _shard0(m: dict, **claims: object) -> None:
    m["splits"]["train"]["shards"][0].update(claims)


NUMBER_CASES: dict[str, Callable[[Path], str]] = {
    "manifest_is_a_list": lambda r: _edit_manifest(r, lambda m: []),
    "split_is_a_list": lambda r: _edit_manifest(r, lambda m: m["splits"].update(train=[])),
    "shard_is_a_number": lambda r: _edit_manifest(r, lambda m: m["splits"]["train"]["shards"].__setitem__(0, 5)),
    "bytes_is_a_string": lambda r: _edit_manifest(r, lambda m: m["splits"]["train"]["shards"][0].update(bytes="9")),
    "bundle_record_is_a_string": lambda r: _edit_manifest(r, lambda m: m.update(bundle="0" * 64)),
    "samples_2_35": lambda r: _edit_manifest(r, lambda m: _claim_samples(m, 2**35)),
    "tokens_10_30": lambda r: _edit_manifest(r, lambda m: _shard0(m, tokens=10**30)),
    "tokens_negative": lambda r: _edit_manifest(r, lambda m: _shard0(m, tokens=-5)),
    "supervised_past_tokens": lambda r: _edit_manifest(r, lambda m: _shard0(m, supervised_tokens=10**6)),
    "audio_seconds_infinite": lambda r: _edit_manifest(r, lambda m: _shard0(m, audio_seconds=float("inf"))),
    "split_claims_more_samples": lambda r: _edit_manifest(r, lambda m: m["splits"]["train"].update(samples=9)),
    "no_layout": lambda r: _edit_manifest(r, lambda m: m.pop("layout") and None),
    "no_field_meta": lambda r: _edit_manifest(r, lambda m: m.pop("field_meta") and None),
    "integrity_empty": lambda r: _edit_manifest(r, lambda m: m.update(integrity={})),
    "hidden_size_a_string": lambda r: _edit_manifest(r, lambda m: m["layout"].update(hidden_size="16")),
    "nested_100k_deep": lambda r: _edit_raw(r, lambda raw: "[" * 100_000 + "]" * 100_000),
    "truncated": lambda r: _edit_raw(r, lambda raw: raw[:100]),
}
"""A manifest claiming what its bytes cannot hold, or not shaped like one: refused in one line naming it."""


def build_numbers(name: str, good: Path, work: Path) -> Hostile:
    """A copy of ``good`` at ``work`` whose manifest is the case ``name`` (one of NUMBER_CASES)."""
    shutil.copytree(good, work)
    return Hostile(work, True, NUMBER_CASES[name](work))


def build(name: str, good: Path, work: Path) -> Hostile:
    """A copy of ``good`` at ``work`` with the defect ``name`` (one of CASES)."""
    listed, edit = CASES[name]
    shutil.copytree(good, work, symlinks=True)
    return Hostile(work, listed, edit(work, work))


def leaked(tree: Path) -> list[str]:
    """What under ``tree`` came from outside a dataset: links and special files (not followed), and files whose
    bytes hold SECRET or this process's environment."""
    environ = Path("/proc/self/environ")
    env = environ.read_bytes()[:64] if environ.exists() else b""
    found = []
    for dirpath, dirnames, files in os.walk(tree):
        for f in dirnames + files:
            p = Path(dirpath) / f
            if p.is_symlink() or not (p.is_dir() or p.is_file()):
                found.append(f"{p} (not a regular file)")
            elif p.is_file() and (SECRET in (data := p.read_bytes()) or (env and env in data)):
                found.append(str(p))
    return found


def inflate_arrow_buffer(root: Path, declared: int) -> str:
    """The first shard's first zstd-compressed Arrow buffer made to declare ``declared`` uncompressed bytes, with
    every checksum the dataset records (batch hash, index hash, shard size and sha256) recomputed to match, as a
    crafter would: only a bound on the declared number can refuse it. Returns the shard's relative name."""
    import hashlib
    import struct

    from tapdraft.shards.integrity import digest

    man = json.loads((root / "manifest.json").read_text())
    sh = man["splits"]["train"]["shards"][0]
    shard, index = root / sh["name"], root / "index" / (sh["name"].split("/")[-1] + ".json")
    data = bytearray(shard.read_bytes())
    doc = json.loads(index.read_text())
    start, end = doc["batches"][0][:2]
    at = data.index(b"\x28\xb5\x2f\xfd", start)  # a zstd frame; the 8 bytes before it declare its decompressed size
    assert at < end
    data[at - 8:at] = struct.pack("<q", declared)
    doc["batches"][0][3] = digest(bytes(data[start:end]))
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    index.write_bytes(raw)
    shard.write_bytes(bytes(data))
    sh.update(index=[len(raw), digest(raw)], sha256=hashlib.sha256(bytes(data)).hexdigest())
    (root / "manifest.json").write_text(json.dumps(man))
    return sh["name"]


def replace_index(root: Path, raw: bytes) -> str:
    """The first shard's index file replaced by ``raw``, its manifest record (size, hash) made to match."""
    from tapdraft.shards.integrity import digest

    man = json.loads((root / "manifest.json").read_text())
    sh = man["splits"]["train"]["shards"][0]
    rel = "index/" + sh["name"].split("/")[-1] + ".json"
    (root / rel).write_bytes(raw)
    sh["index"] = [len(raw), digest(raw)]
    (root / "manifest.json").write_text(json.dumps(man))
    return rel


def rewrite_columns(root: Path, drop: str | None = None, add: str | None = None) -> str:
    """The first shard rewritten with the column ``drop`` removed or a binary column ``add`` appended, its schema
    metadata kept and every record the dataset keeps of it (batch ranges and hashes, head, tail, index record, shard
    size and sha256, split bytes) recomputed to match, as a crafter would: only a check of the columns against the
    declared schema can refuse it. Returns the shard's relative name."""
    import hashlib

    import pyarrow as pa

    from tapdraft.shards.integrity import digest

    man = json.loads((root / "manifest.json").read_text())
    sh = man["splits"]["train"]["shards"][0]
    shard, index = root / sh["name"], root / "index" / (sh["name"].split("/")[-1] + ".json")
    batches = list(pa.ipc.open_stream(shard.read_bytes()))
    schema = batches[0].schema
    if drop is not None:
        schema = schema.remove(schema.get_field_index(drop))
    if add is not None:
        schema = schema.append(pa.field(add, pa.binary(), nullable=False))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as w:  # uncompressed: a crafter needs no codec
        for b in batches:
            cols = [b.column(n) if n != add else pa.array([SECRET] * b.num_rows, pa.binary()) for n in schema.names]
            w.write_batch(pa.RecordBatch.from_arrays(cols, schema=schema))
    data = sink.getvalue().to_pybytes()
    head = len(schema.serialize())
    ends = [head] + [head + sum(len(pa.RecordBatch.from_arrays(
        [b.column(n) if n != add else pa.array([SECRET] * b.num_rows, pa.binary()) for n in schema.names],
        schema=schema).serialize()) for b in batches[:i + 1]) for i in range(len(batches))]
    eos = len(data) - 8
    assert ends[-1] == eos, (ends, len(data))
    doc = json.loads(index.read_text())
    starts = [0] + ends[1:-1]  # the first batch's range holds the schema message
    doc["batches"] = [[starts[i], ends[i + 1], b.num_rows, digest(data[starts[i]:ends[i + 1]])]
                      for i, b in enumerate(batches)]
    doc.update(head=[head, digest(data[:head])], tail=[eos, len(data), digest(data[eos:])], bytes=len(data))
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    index.write_bytes(raw)
    shard.write_bytes(data)
    man["splits"]["train"]["bytes"] += len(data) - sh["bytes"]
    sh.update(index=[len(raw), digest(raw)], sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    (root / "manifest.json").write_text(json.dumps(man))
    return sh["name"]


def wds_dataset(root: Path, tokenizer: bytes | None = None) -> Path:
    """A small finished WebDataset dataset (3 tar shards); with ``tokenizer``, its bundle lists that tokenizer.json."""
    tok = None
    if tokenizer is not None:
        tok = root.parent / (root.name + "-tokenizer")
        tok.mkdir(parents=True)
        (tok / "tokenizer.json").write_bytes(tokenizer)
    write_dataset(str(root), tiny_layout(), ShardConfig(format="wds", shard_bytes=6000), [5, 8, 3, 6],
                  tokenizer_dir=None if tok is None else str(tok))
    return root


def _commit_tar(root: Path, man: dict, sh: dict, data: bytes) -> None:
    """The tar shard ``sh`` rewritten as ``data``, its size, sha256 and index record (and the split's bytes) made to
    match, as a crafter would."""
    import hashlib

    from tapdraft.shards.integrity import digest

    shard, index = root / sh["name"], root / "index" / (sh["name"].split("/")[-1] + ".json")
    shard.write_bytes(data)
    doc = json.loads(index.read_text())
    doc["bytes"] = len(data)
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    index.write_bytes(raw)
    man["splits"]["train"]["bytes"] += len(data) - sh["bytes"]
    sh.update(index=[len(raw), digest(raw)], sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    (root / "manifest.json").write_text(json.dumps(man))


def add_tar_member(root: Path, ext: str = "notes", data: bytes = SECRET) -> str:
    """The first tar shard with a regular member ``<key>.<ext>`` (``data``) added to its first sample, after that
    sample's own members: a file the schema does not declare, which no checksum covers and which webdataset and
    datasets would hand a user as the sample's. Its size, sha256 and index record are made to match (the head, the
    first meta.json, is unchanged). Returns the member's name."""
    import io
    import tarfile

    man = json.loads((root / "manifest.json").read_text())
    sh = man["splits"]["train"]["shards"][0]
    tar = (root / sh["name"]).read_bytes()
    with tarfile.open(fileobj=io.BytesIO(tar)) as tf:
        members = tf.getmembers()
    key = members[0].name.partition(".")[0]
    after = [m for m in members if m.name.partition(".")[0] != key]
    at = after[0].offset if after else members[-1].offset_data + -(-members[-1].size // 512) * 512
    info = tarfile.TarInfo(f"{key}.{ext}")
    info.size, info.mode = len(data), 0o644
    member = info.tobuf(tarfile.USTAR_FORMAT) + data + b"\0" * (-len(data) % 512)
    _commit_tar(root, man, sh, tar[:at] + member + tar[at:])
    return info.name


def add_tar_links(root: Path) -> str:
    """The first tar shard with a symlink member (to a file outside) and a hard link member appended before its end
    blocks, its size, sha256 and index record (and the split's bytes) made to match: readers skip such members, so
    only a look at every member's type can see them. Returns the shard's relative name."""
    import io
    import tarfile

    man = json.loads((root / "manifest.json").read_text())
    sh = man["splits"]["train"]["shards"][0]
    data = (root / sh["name"]).read_bytes()
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        last = tf.getmembers()[-1]
        end = last.offset_data + -(-last.size // 512) * 512
    key = last.name.partition(".")[0]
    links = b""
    for name, kind, to in ((f"{key}.secret", tarfile.SYMTYPE, "/etc/passwd"), (f"{key}.copy", tarfile.LNKTYPE,
                                                                                last.name)):
        info = tarfile.TarInfo(name)
        info.type, info.linkname = kind, to
        links += info.tobuf(tarfile.USTAR_FORMAT)
    _commit_tar(root, man, sh, data[:end] + links + b"\0" * 1024)
    return sh["name"]
