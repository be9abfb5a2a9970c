"""Writer: shard rolling, resume after a crash, multi-rank finalize, and clear errors on bad input."""

import json

import pytest
import torch

from tapdraft.shards.codec import encode_fields
from tapdraft.shards.reader import open_dataset
from tapdraft.shards.verify import verify_dataset
from tests.shards.synthetic import random_sample, tiny_bundle, tiny_layout
from tapdraft.shards.finalize import finalize_dataset
from tapdraft.shards.shard_file import ShardConfig
from tapdraft.shards.writer import DatasetWriter

CFG = ShardConfig(shard_bytes=2500, batch_bytes=800)


def _write(w, indices, layout, T=6):
    for i in indices:
        w.write(random_sample(layout, T, i), i)


def test_resume_discards_temp_shard_and_continues(tmp_path):
    layout = tiny_layout()
    fp = tiny_bundle(str(tmp_path / "target"), layout)
    w = DatasetWriter(str(tmp_path), CFG, layout)
    _write(w, range(19), layout)
    if w._lanes[0].shard is None:  # make sure some samples sit in an open temp shard
        _write(w, [19], layout)
    total = 20 if w._lanes[0].shard is not None else 19
    _write(w, range(total, 20), layout)
    finished = sum(e["samples"] for e in w._shards)
    assert 0 < finished < 20
    tmp_files = list((tmp_path / "data").glob("*.tmp"))
    assert len(tmp_files) == 1
    del w  # crash: never closed

    w2 = DatasetWriter(str(tmp_path), CFG, layout)
    assert not list((tmp_path / "data").glob("*.tmp"))
    assert w2.next_index == finished
    with pytest.warns(UserWarning, match="already in a finished shard"):
        assert w2.write(random_sample(layout, 6, 0), 0) is False
    _write(w2, range(w2.next_index, 20), layout)
    w2.skip(20, "bad-one", "too long")
    w2.close()
    man = finalize_dataset(str(tmp_path), layout=layout, fingerprint=fp, capture_config={})
    ds = open_dataset(str(tmp_path))
    assert ds.num_samples("train") == 20
    assert [ds.sample("train", i)["sample_id"] for i in range(20)] == [f"s{i}" for i in range(20)]
    assert man["skipped"]["train"] == [{"index": 20, "sample_id": "bad-one", "reason": "too long", "rank": 0}]
    assert DatasetWriter(str(tmp_path), CFG, layout).next_index == 21


def test_multi_rank_finalize_orders_by_rank_and_names_shards(tmp_path):
    layout = tiny_layout()
    fp = tiny_bundle(str(tmp_path / "target"), layout)
    for r in range(2):
        with DatasetWriter(str(tmp_path), CFG, layout, rank=r) as w:
            for i in range(7):
                w.write(random_sample(layout, 5, 100 * r + i), i)
    man = finalize_dataset(str(tmp_path), layout=layout, fingerprint=fp, capture_config={"x": 1})
    shards = man["splits"]["train"]["shards"]
    n = len(shards)
    assert [s["name"] for s in shards] == [f"data/train-{i:05d}-of-{n:05d}.arrow" for i in range(n)]
    ds = open_dataset(str(tmp_path))
    ids = [ds.sample("train", i)["sample_id"] for i in range(14)]
    assert ids == [f"s{i}" for i in range(7)] + [f"s{100 + i}" for i in range(7)]
    assert json.loads((tmp_path / "manifest.json").read_text())["complete"] is True
    assert "datasets.load_dataset" in (tmp_path / "README.md").read_text()
    # finalize twice is harmless
    man2 = finalize_dataset(str(tmp_path), layout=layout, fingerprint=fp, capture_config={"x": 1})
    assert man2["splits"] == man["splits"]


def test_finalize_refuses_unclosed_rank_and_mismatched_configs(tmp_path):
    layout = tiny_layout()
    fp = tiny_bundle(str(tmp_path / "target"), layout)
    with DatasetWriter(str(tmp_path), CFG, layout, rank=0) as w:
        _write(w, range(3), layout)
    w1 = DatasetWriter(str(tmp_path), ShardConfig(shard_bytes=100), layout, rank=1)
    _write(w1, range(3), layout)
    with pytest.raises(ValueError, match="rank 1 of split train was not closed"):
        finalize_dataset(str(tmp_path), layout=layout, fingerprint=fp, capture_config={})
    w1.close()
    with pytest.raises(ValueError, match="shard config"):
        finalize_dataset(str(tmp_path), layout=layout, fingerprint=fp, capture_config={})
    assert not (tmp_path / "manifest.json").exists()


def test_finalize_refuses_two_fingerprints(tmp_path):
    layout = tiny_layout()
    with DatasetWriter(str(tmp_path), CFG, layout, rank=0, fingerprint="a" * 64) as w:
        _write(w, range(2), layout)
    with DatasetWriter(str(tmp_path), CFG, layout, rank=1, fingerprint="b" * 64) as w:
        _write(w, range(2), layout)
    with pytest.raises(ValueError, match=r"rank00001\.json: shards carry target fingerprint bbbbbbbbbbbb"):
        finalize_dataset(str(tmp_path), layout=layout, fingerprint="a" * 64, capture_config={})


def test_resume_with_other_config_is_refused(tmp_path):
    layout = tiny_layout()
    with DatasetWriter(str(tmp_path), CFG, layout) as w:
        _write(w, range(2), layout)
    with pytest.raises(ValueError, match="Resume with the same settings"):
        DatasetWriter(str(tmp_path), ShardConfig(bf16_layout="raw"), layout)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("taps", lambda s: s["taps"].float(), "field 'taps' has dtype torch.float32, expected torch.bfloat16"),
        ("taps", lambda s: s["taps"][:, :1], r"field 'taps' has shape"),
        ("taps", lambda s: s["taps"].index_fill(0, torch.tensor([2]), float("nan")), "NaN or Inf"),
        ("topk_logprobs", lambda s: s["topk_logprobs"].index_fill(0, torch.tensor([0]), float("-inf")), "NaN or Inf"),
    ],
)
def test_bad_samples_name_sample_and_field(tmp_path, field, value, match):
    layout = tiny_layout()
    w = DatasetWriter(str(tmp_path), CFG, layout)
    s = random_sample(layout, 6, 0, sample_id="utt-42")
    s[field] = value(s)
    with pytest.raises(ValueError, match=match) as e:
        w.write(s, 0)
    assert "utt-42" in str(e.value) and "input index 0" in str(e.value)


def test_shards_roll_by_bytes(tmp_path):
    layout = tiny_layout(hidden_size=64)
    fp = tiny_bundle(str(tmp_path / "target"), layout)
    with DatasetWriter(str(tmp_path), ShardConfig(shard_bytes=20_000, batch_bytes=4000), layout) as w:
        _write(w, range(40), layout, T=16)
    man = finalize_dataset(str(tmp_path), layout=layout, fingerprint=fp, capture_config={})
    sizes = [s["bytes"] for s in man["splits"]["train"]["shards"]]
    assert len(sizes) >= 3
    assert all(b >= 20_000 for b in sizes[:-1]) and all(b < 20_000 + 8000 for b in sizes)
    for s in man["splits"]["train"]["shards"]:
        assert (tmp_path / s["name"]).stat().st_size == s["bytes"]


def test_a_split_whose_every_input_was_skipped_is_not_finalized(tmp_path):
    layout = tiny_layout()
    fp = tiny_bundle(str(tmp_path / "target"), layout)
    with DatasetWriter(str(tmp_path), CFG, layout, split="train") as w:
        _write(w, range(3), layout)
    with DatasetWriter(str(tmp_path), CFG, layout, split="validation") as w:
        for i in range(4):
            w.skip(i, f"v{i}", f"no supervised tokens: reason {i}")
    with pytest.raises(ValueError, match=r"split 'validation' has no samples: all 4 input\(s\) were skipped "
                                         r"\(first: 'v0': no supervised tokens: reason 0; 'v1': .*; 'v2': .*\)\. "
                                         r"Fix the inputs"):
        finalize_dataset(str(tmp_path), layout=layout, fingerprint=fp, capture_config={})
    assert not (tmp_path / "manifest.json").exists()


def test_a_record_batch_never_grows_past_batch_bytes_unless_one_sample_does(tmp_path):
    layout = tiny_layout(hidden_size=64)
    fp = tiny_bundle(str(tmp_path / "target"), layout)
    cfg = ShardConfig(batch_bytes=3000)
    lengths = [3, 4, 2, 30, 5, 3, 6, 2, 2, 40, 1]
    meta = cfg.field_meta(layout)
    sizes = [sum(len(v) for v in encode_fields(random_sample(layout, T, i), meta).values())
             for i, T in enumerate(lengths)]
    assert max(sizes) > cfg.batch_bytes > min(sizes) * 3
    with DatasetWriter(str(tmp_path), cfg, layout) as w:
        for i, T in enumerate(lengths):
            w.write(random_sample(layout, T, i), i)
    man = finalize_dataset(str(tmp_path), layout=layout, fingerprint=fp, capture_config={})
    ds = open_dataset(str(tmp_path))
    rows = [b[2] for s in man["splits"]["train"]["shards"] for b in ds.shard_index(s).batches]
    assert sum(rows) == len(lengths) and max(rows) > 1
    starts = [sum(rows[:j]) for j in range(len(rows))]
    for a, n in zip(starts, rows):
        batch = sizes[a : a + n]
        assert n == 1 or sum(batch) <= cfg.batch_bytes, (a, batch)
        if a + n < len(sizes):  # flushed only because the next sample would not fit
            assert sum(batch) + sizes[a + n] > cfg.batch_bytes


def test_uncompressed_shards_are_arrow_only():
    with pytest.raises(ValueError, match="zstd_level 0 .* Arrow"):
        ShardConfig(format="wds", zstd_level=0)
    with pytest.raises(ValueError, match=r"\[0, 22\]"):
        ShardConfig(zstd_level=-1)


@pytest.mark.parametrize("after", ["shard renamed", "index written"])
def test_a_kill_between_a_shards_rename_its_index_and_the_part_loses_nothing(tmp_path, monkeypatch, after):
    """The rank's part is the truth: a shard (and its index file) finished but not yet in the part is redone."""
    import tapdraft.shards.shard_file as shard_file
    from tapdraft.shards.shard_index import index_name

    class Kill(BaseException):
        pass

    layout = tiny_layout()
    fp = tiny_bundle(str(tmp_path / "target"), layout)
    real = shard_file.write_index

    def dying(fs, path, doc):
        if after == "index written":
            real(fs, path, doc)
        raise Kill(after)

    w = DatasetWriter(str(tmp_path), CFG, layout)
    monkeypatch.setattr(shard_file, "write_index", dying)
    with pytest.raises(Kill):
        _write(w, range(20), layout)
    monkeypatch.setattr(shard_file, "write_index", real)
    orphan = sorted((tmp_path / "data").iterdir())[-1].name
    assert (tmp_path / index_name(f"data/{orphan}")).exists() == (after == "index written")
    w2 = DatasetWriter(str(tmp_path), CFG, layout)
    assert not (tmp_path / "data" / orphan).exists() and not (tmp_path / index_name(f"data/{orphan}")).exists()
    _write(w2, range(w2.next_index, 20), layout)
    w2.close()
    finalize_dataset(str(tmp_path), layout=layout, fingerprint=fp, capture_config={})
    ds = open_dataset(str(tmp_path))
    assert [ds.sample("train", i)["sample_id"] for i in range(20)] == [f"s{i}" for i in range(20)]
    assert verify_dataset(str(tmp_path), progress=False).ok
