"""Writer -> reader round trips: every field comes back bit-identical (bf16) or within fp8 error."""

import torch
import pytest

from shards.reader import open_dataset
from tests.shards.synthetic import random_sample, tiny_layout, write_dataset
from shards.writer import ShardConfig


def assert_same(a, b):
    assert set(a) == set(b)
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype, k
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == pytest.approx(b[k]) if isinstance(a[k], float) else a[k] == b[k], k


@pytest.mark.parametrize("bf16_layout", ["planes", "raw"])
def test_arrow_roundtrip_random_access(tmp_path, bf16_layout):
    layout = tiny_layout(has_final_hidden=True, has_audio_embeds=True)
    lengths = [5, 9, 3, 12, 7, 1, 6]
    cfg = ShardConfig(bf16_layout=bf16_layout, shard_bytes=3000, batch_bytes=1500)
    man = write_dataset(str(tmp_path), layout, cfg, lengths)
    assert len(man["splits"]["train"]["shards"]) > 1
    ds = open_dataset(str(tmp_path))
    assert ds.num_samples("train") == len(lengths)
    assert ds.layout == layout
    assert ds.bundle().fingerprint == ds.fingerprint
    for i, T in enumerate(lengths):
        want = random_sample(layout, T, i, audio_frames=T // 4)
        assert_same(ds.sample("train", i), want)
    # counts in the manifest match the content
    assert man["splits"]["train"]["tokens"] == sum(lengths)
    assert man["splits"]["train"]["supervised_tokens"] == sum(
        int(random_sample(layout, T, i, audio_frames=T // 4)["loss_mask"].sum()) for i, T in enumerate(lengths))


def test_stream_yields_every_sample_once(tmp_path):
    layout = tiny_layout()
    lengths = [4 + i % 5 for i in range(23)]
    write_dataset(str(tmp_path), layout, ShardConfig(shard_bytes=4000, batch_bytes=700), lengths)
    ds = open_dataset(str(tmp_path))
    ids = [s["sample_id"] for s in ds.stream("train", seed=3, shuffle_buffer=5)]
    assert sorted(ids) == sorted(f"s{i}" for i in range(len(lengths)))
    assert ids != [f"s{i}" for i in range(len(lengths))]
