"""Datasets sent by others: paths stay inside the dataset, declared sizes are bounded before allocation."""

import json
import re
import shutil
import struct

import fsspec
import pytest

from tapdraft.shards.bundle import load_bundle
from tapdraft.common.errors import CorruptShardError
from tapdraft.shards.limits import MAX_SHARD_BYTES, decompress_bounded, safe_relpath
from tapdraft.shards.reader import open_dataset
from tapdraft.shards.shard_index import index_name, write_index
from tapdraft.shards.verify import verify_dataset
from tapdraft.shards.formats.wds import decode_wds_sample
from tapdraft.shards.shard_file import ShardConfig
from tests.shards.synthetic import tiny_layout, write_dataset

LENGTHS = [5, 7, 4, 6]


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    root = tmp_path_factory.mktemp("safe") / "ds"
    write_dataset(str(root), tiny_layout(), ShardConfig(shard_bytes=2500, batch_bytes=700), LENGTHS)
    return root


def _edited(good, tmp_path, edit):
    work = tmp_path / "ds"
    shutil.copytree(good, work)
    man = json.loads((work / "manifest.json").read_text())
    edit(man)
    (work / "manifest.json").write_text(json.dumps(man))
    return work


@pytest.mark.parametrize("name", ["../outside.arrow", "data/../../outside.arrow", "data/x/../../../outside.arrow", "/etc/passwd", "data//x.arrow",
                                  "s3://bucket/x.arrow", "data\\..\\x.arrow", "target/weights.safetensors", "~/x"])
def test_a_shard_path_outside_the_dataset_is_refused(good, tmp_path, name):
    (tmp_path / "outside.arrow").write_bytes(b"x" * 10)
    work = _edited(good, tmp_path, lambda m: m["splits"]["train"]["shards"][0].update(name=name))
    with pytest.raises(ValueError, match="not a relative path inside data/"):
        open_dataset(str(work))
    assert any("not a relative path" in p for p in verify_dataset(str(work), progress=False).problems)


def test_safe_relpath_accepts_plain_names():
    assert safe_relpath("data/train-00000-of-00001.arrow", "m", "data") == "data/train-00000-of-00001.arrow"
    assert safe_relpath("tokenizer/tokenizer.json", "b") == "tokenizer/tokenizer.json"
    with pytest.raises(ValueError):
        safe_relpath("data", "m", "data")


def test_a_bundle_file_outside_the_bundle_is_refused(good, tmp_path):
    work = tmp_path / "ds"
    shutil.copytree(good, work)
    (tmp_path / "secret").write_bytes(b"s")
    doc_path = work / "target" / "bundle.json"
    doc = json.loads(doc_path.read_text())
    doc["files"]["../../secret"] = {"sha256": "0" * 64, "bytes": 1}
    doc_path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="'../../secret'.*refusing to read outside"):
        load_bundle(work / "target")


def test_a_shard_claiming_a_terabyte_is_refused_before_reading(good, tmp_path):
    work = _edited(good, tmp_path, lambda m: m["splits"]["train"]["shards"][0].update(bytes=1 << 40))
    with pytest.raises(CorruptShardError, match=f"claims {1 << 40} bytes, outside 0..{MAX_SHARD_BYTES}"):
        open_dataset(str(work))
    assert any("claims" in p for p in verify_dataset(str(work), progress=False).problems)


def test_an_index_claiming_a_huge_size_or_ranges_past_its_shard_is_refused(good, tmp_path):
    work = _edited(good, tmp_path, lambda m: m["splits"]["train"]["shards"][0].update(index=[1 << 40, "0" * 16]))
    ds = open_dataset(str(work))
    with pytest.raises(CorruptShardError, match="claims .* bytes, outside"):
        ds.sample("train", 0)

    shutil.rmtree(work)
    work = _edited(good, tmp_path, lambda m: None)
    man = json.loads((work / "manifest.json").read_text())
    sh = man["splits"]["train"]["shards"][0]
    doc = json.loads((work / index_name(sh["name"])).read_text())
    doc["batches"][0][1] = 1 << 40  # a record batch reaching far past the shard: never allocated
    sh["index"] = write_index(fsspec.filesystem("file"), str(work / index_name(sh["name"])), doc)
    (work / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(CorruptShardError, match="record batch 0 range .* inside"):
        open_dataset(str(work)).sample("train", 0)


def _frame_declaring(size: int, payload: bytes) -> bytes:
    """A zstd frame whose header declares ``size`` decompressed bytes and holds one raw block of ``payload``."""
    header = struct.pack("<IB", 0xFD2FB528, 0xE0) + struct.pack("<Q", size)  # single segment, 8-byte content size
    block = struct.pack("<I", (len(payload) << 3) | 1)[:3]  # last block, raw
    return header + block + payload


def test_a_zstd_frame_declaring_a_huge_size_is_an_error_not_an_allocation():
    with pytest.raises(CorruptShardError, match=f"declares {1 << 40} bytes"):
        decompress_bounded(_frame_declaring(1 << 40, b"abc"), "x")
    assert decompress_bounded(_frame_declaring(3, b"abc"), "x") == b"abc"


def test_a_wds_member_declaring_a_huge_size_is_refused(tmp_path):
    import glob

    import webdataset

    from tapdraft.shards.integrity import digest, seal_doc

    root = tmp_path / "w"
    write_dataset(str(root), tiny_layout(), ShardConfig(format="wds", shard_bytes=3000), LENGTHS)
    raw = next(iter(webdataset.WebDataset(sorted(glob.glob(str(root / "data" / "*.tar"))), shardshuffle=False)))
    bomb = _frame_declaring(1 << 42, b"\0" * 16)
    doc = json.loads(raw["meta.json"])
    body = {k: v for k, v in doc.items() if k != "checksum"}
    body["checksums"]["taps.zst"] = digest(bomb)  # a crafted shard carries matching checksums
    crafted = {**raw, "taps.zst": bomb, "meta.json": json.dumps(seal_doc(body)).encode()}
    with pytest.raises(CorruptShardError, match="taps.zst declares"):
        decode_wds_sample(crafted)


def test_a_schema_2_shard_without_an_index_record_is_refused(good, tmp_path):
    work = _edited(good, tmp_path, lambda m: m["splits"]["train"]["shards"][0].pop("index"))
    with pytest.raises(CorruptShardError, match="has no index record"):
        open_dataset(str(work)).sample("train", 0)


@pytest.mark.parametrize("fmt, refusal", [
    ("parquet", "storage format .* is not one of \\['arrow', 'wds'\\]"),
    (None, "format is null, not a string"),  # the manifest's shape check speaks first
    (["wds"], "format is \\[\"wds\"\\], not a string"),
])
def test_a_manifest_of_an_unknown_storage_format_is_refused_not_read_as_another(good, tmp_path, fmt, refusal):
    work = _edited(good, tmp_path, lambda m: m.update(format=fmt))
    with pytest.raises(ValueError, match=refusal):
        open_dataset(str(work))
    problems = verify_dataset(str(work), progress=False).problems
    assert len(problems) == 1 and re.search(refusal, problems[0]), problems
