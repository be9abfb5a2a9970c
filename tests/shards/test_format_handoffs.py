"""What a storage format is handed fits the protocols shards/formats/base.py types it with: the shard file's hashing
sink (``Sink``), ``ShardConfig`` (``ShardSettings``) and an open dataset (``OpenShards``), so a member one side drops
or renames fails here rather than in a format at run time."""

from __future__ import annotations

from pathlib import Path

import pytest

from tapdraft.shards.formats.base import OpenShards, ShardSettings, Sink
from tapdraft.shards.reader import open_dataset
from tapdraft.shards.shard_file import ShardConfig, _HashingSink
from tests.shards.synthetic import tiny_layout, write_dataset


def test_the_shard_files_sink_and_settings_are_what_a_writer_is_handed(tmp_path: Path) -> None:
    with (tmp_path / "f").open("wb") as f:
        sink = _HashingSink(f)
        assert isinstance(sink, Sink)
    assert isinstance(ShardConfig(), ShardSettings)


@pytest.mark.parametrize("fmt", ["arrow", "wds"])
def test_an_open_dataset_is_what_a_reader_is_handed(tmp_path: Path, fmt: str) -> None:
    write_dataset(str(tmp_path / "ds"), tiny_layout(), ShardConfig(format=fmt), [8, 12])
    ds = open_dataset(str(tmp_path / "ds"))
    assert isinstance(ds, OpenShards)
    assert ds.num_samples("train") == 2 and ds.sample("train", 1)["input_ids"].numel() == 12


@pytest.mark.parametrize("proto", [Sink, ShardSettings, OpenShards])
def test_an_object_missing_a_member_does_not_fit(proto: type) -> None:
    assert not isinstance(object(), proto)
