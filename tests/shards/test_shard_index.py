"""O(shards) metadata: record batches live in each shard's index file, read lazily; schema 1 reads migrated."""

import json
import shutil

import pytest

from tapdraft.common.errors import CorruptShardError
from tapdraft.shards.reader import open_dataset
from tapdraft.shards.shard_index import INDEX_DIR, IndexCache, index_name, migrate_inline_index
from tapdraft.shards.verify import verify_dataset
from tapdraft.shards.finalize import finalize_dataset
from tapdraft.shards.shard_file import ShardConfig
from tapdraft.shards.writer import DatasetWriter
from tests.shards.synthetic import random_sample, tiny_bundle, tiny_layout, write_dataset
from tests.shards.test_roundtrip import assert_same

LENGTHS = [6, 3, 9, 4, 8, 5, 7, 2, 6]


@pytest.fixture(scope="module", params=["arrow", "wds"])
def made(tmp_path_factory, request):
    root = tmp_path_factory.mktemp(request.param) / "ds"
    man = write_dataset(str(root), tiny_layout(), ShardConfig(format=request.param, shard_bytes=2500, batch_bytes=700),
                        LENGTHS)
    return root, man


def _all(root):
    return list(open_dataset(str(root)).stream("train", seed=0, shuffle=False))


def test_manifest_lists_shards_not_record_batches(made):
    root, man = made
    text = (root / "manifest.json").read_text()
    assert '"batches"' not in text and '"tail"' not in text
    for sh in man["splits"]["train"]["shards"]:
        assert set(sh) == {"name", "bytes", "sha256", "samples", "tokens", "supervised_tokens", "audio_seconds",
                           "index"}
        doc = json.loads((root / index_name(sh["name"])).read_text())
        assert doc["bytes"] == sh["bytes"] and doc["samples"] == sh["samples"]
        assert (root / index_name(sh["name"])).stat().st_size == sh["index"][0]
        if man["format"] == "arrow":
            assert sum(b[2] for b in doc["batches"]) == sh["samples"] and len(doc["batches"]) >= 1
    names = sorted(p.name for p in (root / INDEX_DIR).iterdir())
    assert names == sorted(index_name(s["name"]).split("/")[1] for s in man["splits"]["train"]["shards"])


def test_opening_reads_no_index_and_reading_reads_only_the_shards_it_touches(made, monkeypatch):
    root, man = made
    import tapdraft.shards.reader as reader
    loaded = []
    real = reader.load_index
    def counting(fs, r, sh, *fmt):
        loaded.append(sh["name"])
        return real(fs, r, sh, *fmt)

    monkeypatch.setattr(reader, "load_index", counting)
    ds = open_dataset(str(root))
    assert loaded == []
    shards = man["splits"]["train"]["shards"]
    ds.sample("train", shards[0]["samples"])  # first sample of the second shard
    assert loaded == [shards[1]["name"]]
    ds.sample("train", shards[0]["samples"])
    assert loaded == [shards[1]["name"]]  # cached


def test_index_cache_keeps_the_last_few():
    calls = []
    cache = IndexCache(lambda sh: calls.append(sh["name"]) or sh["name"], size=2)
    for name in "abacdb":
        cache.get({"name": name})
    assert calls == ["a", "b", "c", "d", "b"]


def test_a_damaged_or_missing_index_is_refused_naming_it(made, tmp_path):
    root, man = made
    sh = man["splits"]["train"]["shards"][0]
    work = tmp_path / "w"
    shutil.copytree(root, work)
    path = work / index_name(sh["name"])
    path.write_bytes(path.read_bytes().replace(b'"samples":', b'"samples": '))  # one byte longer
    with pytest.raises(CorruptShardError, match=str(path)):
        _all(work)
    doc = json.loads((root / index_name(sh["name"])).read_text())
    path.write_text(json.dumps(doc, sort_keys=True, separators=(",", ":"))[:-1] + " ")  # same size, other bytes
    with pytest.raises(CorruptShardError, match="checksum"):
        _all(work)
    assert any(str(path) in p for p in verify_dataset(str(work), progress=False).problems)
    path.unlink()
    with pytest.raises(FileNotFoundError, match=str(path)):
        _all(work)


def _as_schema_1_2(root):
    """Rewrite a finished dataset's manifest as schema 1.2 wrote it: record batches inline, no index files."""
    man = json.loads((root / "manifest.json").read_text())
    for sh in man["splits"]["train"]["shards"]:
        doc = json.loads((root / index_name(sh["name"])).read_text())
        sh.update({k: doc[k] for k in ("head", "batches", "tail") if k in doc})
        sh.pop("index")
    man["schema_version"] = man["field_meta"]["schema_version"] = "1.2"
    shutil.rmtree(root / INDEX_DIR)
    (root / "manifest.json").write_text(json.dumps(man))
    return man


def test_schema_1_2_datasets_read_through_the_inline_index_migration(made, tmp_path):
    root, man = made
    old = tmp_path / "old"
    shutil.copytree(root, old)
    legacy = _as_schema_1_2(old)
    sh = legacy["splits"]["train"]["shards"][0]
    migrated = migrate_inline_index(sh)
    assert "batches" not in migrated and migrated["inline_index"]["head"] == sh["head"]
    assert migrate_inline_index(migrated) == migrated  # idempotent
    want, got = _all(root), _all(old)
    assert len(got) == len(LENGTHS)
    for a, b in zip(got, want):
        assert_same(a, b)
    rep = verify_dataset(str(old), progress=False)
    assert rep.ok, rep.problems


def test_a_capture_begun_before_index_files_is_refused_not_misread(tmp_path):
    """Part version 1 (record batches inline in the rank's index, before schema 2.0): finalize and a resuming writer
    refuse it, saying what to do, and leave the directory as it was."""
    layout = tiny_layout()
    fp = tiny_bundle(str(tmp_path / "target"), layout)
    with DatasetWriter(str(tmp_path), ShardConfig(shard_bytes=2500, batch_bytes=700), layout) as w:
        for i, T in enumerate(LENGTHS):
            w.write(random_sample(layout, T, i, audio_frames=T // 4), i)
    part_path = tmp_path / "_parts" / "train-rank00000.json"
    part = json.loads(part_path.read_text())
    for e in part["shards"]:
        doc = json.loads((tmp_path / index_name(e["name"])).read_text())
        e.update({k: doc[k] for k in ("head", "batches", "tail")})
        del e["index"]
        (tmp_path / index_name(e["name"])).unlink()
    part["version"], part["schema_version"] = 1, "1.2"
    part_path.write_text(json.dumps(part))
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(ValueError, match="partial index of version 1.*release that began it"):
        finalize_dataset(str(tmp_path), layout=layout, fingerprint=fp, capture_config={})
    with pytest.raises(ValueError, match="partial index of version 1"):
        DatasetWriter(str(tmp_path), ShardConfig(shard_bytes=2500, batch_bytes=700), layout)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before and not (tmp_path / "manifest.json").exists()
