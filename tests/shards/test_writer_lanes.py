"""Writer lanes (ShardConfig.writers > 1): the same samples as one lane, the same bytes every run, and a crash
resumed to the dataset an uninterrupted run writes."""

import dataclasses
import hashlib

import pytest

from tapdraft.shards import shard_file
from tapdraft.shards.reader import open_dataset
from tapdraft.shards.verify import verify_dataset
from tapdraft.shards.finalize import finalize_dataset
from tapdraft.shards.shard_file import ShardConfig
from tapdraft.shards.writer import DatasetWriter
from tests.shards.synthetic import random_sample, tiny_bundle, tiny_layout

CFG = ShardConfig(shard_bytes=2500, batch_bytes=800)
N = 23


def _capture(root, cfg, layout, *, crash_after=None, skips=(7, 15)):
    """Write inputs 0..N-1 (``skips`` recorded as skipped); with ``crash_after``, stop there without closing."""
    w = DatasetWriter(str(root), cfg, layout)
    for i in range(w.next_index, N):
        if crash_after is not None and i == crash_after:
            w.abort()  # what a kill leaves: finished shards and the rank's index, open shards dropped
            return
        if i in skips:
            w.skip(i, f"s{i}", "too long")
        else:
            w.write(random_sample(layout, 4 + i % 5, i), i)
    w.close()


def _finalize(root, layout, fp):
    man = finalize_dataset(str(root), layout=layout, fingerprint=fp, capture_config={})
    return man, {s["name"]: s["sha256"] for s in man["splits"]["train"]["shards"]}


def _files(root):
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and "target" not in p.parts}


@pytest.fixture
def target(tmp_path):
    layout = tiny_layout()
    return layout, tiny_bundle(str(tmp_path / "target"), layout)


def _samples(root):
    ds = open_dataset(str(root))
    return {s["sample_id"]: s for s in (ds.sample("train", i) for i in range(ds.num_samples("train")))}


def test_lanes_write_the_samples_one_writer_writes(tmp_path, target):
    layout, fp = target
    for name, writers in (("one", 1), ("three", 3)):
        tiny_bundle(str(tmp_path / name / "target"), layout)
        _capture(tmp_path / name, dataclasses.replace(CFG, writers=writers), layout)
        _finalize(tmp_path / name, layout, fp)
        assert verify_dataset(str(tmp_path / name), deep=True).ok
    one, three = _samples(tmp_path / "one"), _samples(tmp_path / "three")
    assert sorted(one) == sorted(three) and len(one) == N - 2
    for sid, s in one.items():
        for k, v in s.items():
            assert (v == three[sid][k]).all() if hasattr(v, "all") else v == three[sid][k], (sid, k)
    man = open_dataset(str(tmp_path / "three")).manifest
    assert man["shard_config"]["writers"] == 3
    assert [s["index"] for s in man["skipped"]["train"]] == [7, 15]


@pytest.mark.filterwarnings("ignore:input index")
@pytest.mark.parametrize("fmt", ["arrow", "wds"])
def test_lanes_write_the_same_bytes_every_run_and_a_crash_resumes_to_them(tmp_path, target, fmt):
    layout, fp = target
    cfg = dataclasses.replace(CFG, writers=3, format=fmt)
    runs = {}
    for name, crash in (("a", None), ("b", None), ("killed", 17)):
        root = tmp_path / name
        tiny_bundle(str(root / "target"), layout)
        _capture(root, cfg, layout, crash_after=crash)
        if crash is not None:
            assert 0 < DatasetWriter(str(root), cfg, layout).num_done < N  # something kept, something redone
            _capture(root, cfg, layout)
        _finalize(root, layout, fp)
        runs[name] = _files(root)
    assert runs["a"] == runs["b"] == runs["killed"]
    assert sum(name.startswith("data/") for name in runs["a"]) > 3  # several lanes' shards, renamed in seq order


def test_a_resume_with_another_writer_count_is_refused(tmp_path, target):
    layout, _ = target
    _capture(tmp_path, dataclasses.replace(CFG, writers=2), layout, crash_after=12)
    with pytest.raises(ValueError, match="writers"):
        DatasetWriter(str(tmp_path), dataclasses.replace(CFG, writers=3), layout)


def test_a_lane_that_fails_surfaces_its_error_and_leaves_no_temp_shard(tmp_path, target, monkeypatch):
    layout, _ = target
    real_add = shard_file._Shard.add

    def add(self, sample, index):
        if index == 9:
            raise OSError("No space left on device")
        real_add(self, sample, index)

    monkeypatch.setattr(shard_file._Shard, "add", add)
    w = DatasetWriter(str(tmp_path), dataclasses.replace(CFG, writers=2), layout)
    with pytest.raises(OSError, match="No space left"):
        for i in range(N):
            w.write(random_sample(layout, 5, i), i)
        w.close()
    w.abort()
    assert not list((tmp_path / "data").glob("*.tmp"))
    assert 0 < DatasetWriter(str(tmp_path), dataclasses.replace(CFG, writers=2), layout).next_index <= 9


def test_writers_out_of_range_is_refused():
    with pytest.raises(ValueError, match="writers must be in"):
        ShardConfig(writers=0)


def test_a_writer_is_not_handed_an_undecided_lane_count(tmp_path):
    """``writers=None`` is the capture's to decide (capture.config.pin_writers); a writer refuses it."""
    with pytest.raises(ValueError, match="writers is None"):
        DatasetWriter(str(tmp_path), ShardConfig(writers=None), tiny_layout())
