"""Writer -> reader round trips: every field comes back bit-identical (bf16) or within fp8 error."""

import json
import shutil
from pathlib import Path

import pyarrow as pa
import torch
import pytest

from tapdraft.shards.formats.arrow import decode_batch
from tapdraft.shards.reader import open_dataset
from tests.shards.synthetic import random_sample, tiny_layout, write_dataset
from tapdraft.shards.shard_file import ShardConfig


def assert_same(a, b):
    assert set(a) == set(b)
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype, k
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == pytest.approx(b[k]) if isinstance(a[k], float) else a[k] == b[k], k


@pytest.mark.parametrize("zstd_level", [1, 0])
@pytest.mark.parametrize("bf16_layout", ["planes", "raw", "split"])
def test_arrow_roundtrip_random_access(tmp_path, bf16_layout, zstd_level):
    layout = tiny_layout(has_final_hidden=True, has_audio_embeds=True)
    lengths = [5, 9, 3, 12, 7, 1, 6, 40]  # the last one is larger than a record batch
    cfg = ShardConfig(bf16_layout=bf16_layout, zstd_level=zstd_level, shard_bytes=3000, batch_bytes=1500)
    man = write_dataset(str(tmp_path), layout, cfg, lengths)
    assert len(man["splits"]["train"]["shards"]) > 1
    assert man["codec"]["container"] == "arrow-ipc-stream" + ("+zstd" if zstd_level else "")
    ds = open_dataset(str(tmp_path))
    assert ds.num_samples("train") == len(lengths)
    assert ds.layout == layout
    assert ds.bundle().fingerprint == ds.fingerprint
    wants = [random_sample(layout, T, i, audio_frames=T // 4) for i, T in enumerate(lengths)]
    for i, want in enumerate(wants):
        assert_same(ds.sample("train", i), want)
    for got, want in zip(ds.stream("train", seed=0, shuffle=False), wants):  # streaming may view its batches
        assert_same(got, want)
    # counts in the manifest match the content
    assert man["splits"]["train"]["tokens"] == sum(lengths)
    assert man["splits"]["train"]["supervised_tokens"] == sum(int(w["loss_mask"].sum()) for w in wants)


def test_stream_yields_every_sample_once(tmp_path):
    layout = tiny_layout()
    lengths = [4 + i % 5 for i in range(23)]
    write_dataset(str(tmp_path), layout, ShardConfig(shard_bytes=4000, batch_bytes=700), lengths)
    ds = open_dataset(str(tmp_path))
    ids = [s["sample_id"] for s in ds.stream("train", seed=3, shuffle_buffer=5)]
    assert sorted(ids) == sorted(f"s{i}" for i in range(len(lengths)))
    assert ids != [f"s{i}" for i in range(len(lengths))]


def test_streamed_tensors_view_only_their_own_batch_and_random_access_copies(tmp_path):
    """Uncompressed raw shards: a one-sample batch handed over becomes tensors over the bytes read (no copy);
    a sample of a batch of several is copied (a view would keep its neighbours alive); ``sample`` copies
    out of its cached batch, so editing what it returned does not change the next read."""
    layout = tiny_layout()
    big = len(random_sample(layout, 30, 0)["taps"].view(torch.int16).numpy().tobytes())
    write_dataset(str(tmp_path), layout, ShardConfig(zstd_level=0, bf16_layout="raw", batch_bytes=big), [30, 3, 3])
    ds = open_dataset(str(tmp_path))
    shard = ds.manifest["splits"]["train"]["shards"][0]
    assert [b[2] for b in ds.shard_index(shard).batches] == [1, 2]

    def inside(t, batch):
        buf = batch.column("taps").buffers()[2]
        return buf.address <= t.data_ptr() < buf.address + buf.size

    for b, shared in ((0, True), (1, False)):
        batch = ds.reader.read_record_batch(shard, b)
        got = decode_batch(batch, ds.field_meta, share=True)
        assert [inside(g["taps"], batch) for g in got] == [shared] * batch.num_rows
        assert not any(inside(g["taps"], batch) for g in decode_batch(batch, ds.field_meta))
    want = random_sample(layout, 30, 0, audio_frames=30 // 4)
    assert_same(next(iter(ds.stream("train", seed=0, shuffle=False))), want)
    ds.sample("train", 0)["taps"].zero_()
    assert_same(ds.sample("train", 0), want)


LEGACY = Path(__file__).with_name("data")
"""fp8 datasets (Arrow and WebDataset) written by the code before the fp8 byte layout was recorded:
``write_dataset(dir, tiny_layout(taps_codec="fp8"), ShardConfig(format=fmt), [5, 9, 3, 12])``."""


@pytest.mark.parametrize("fmt", ["arrow", "wds"])
def test_fp8_datasets_without_a_recorded_layout_still_read(tmp_path, fmt):
    from tapdraft.shards.codec import fp8_decode, fp8_encode
    from tapdraft.shards.verify import verify_dataset

    old = tmp_path / "old"
    shutil.copytree(LEGACY / f"fp8_before_layouts_{fmt}", old)
    man = json.loads((old / "manifest.json").read_text())
    assert "fp8_layout" not in man["field_meta"] and "fp8_layout" not in man["shard_config"]
    layout = tiny_layout(taps_codec="fp8")
    got = list(open_dataset(str(old)).stream("train", seed=0, shuffle=False))
    assert len(got) == 4
    for i, (T, s) in enumerate(zip([5, 9, 3, 12], got)):
        want = random_sample(layout, T, i, audio_frames=T // 4)
        assert torch.equal(s["taps"], fp8_decode(*fp8_encode(want["taps"])))
        assert torch.equal(s["input_ids"], want["input_ids"])
    rep = verify_dataset(str(old), progress=False)
    assert not rep.problems and rep.samples_checked == 4
    # the same samples written now: packed fp8 bytes, recorded, decoding to the same tensors
    new = tmp_path / "new"
    man2 = write_dataset(str(new), layout, ShardConfig(format=fmt), [5, 9, 3, 12])
    assert man2["field_meta"]["fp8_layout"] == man2["codec"]["fp8_layout"] == "packed"
    for a, b in zip(open_dataset(str(new)).stream("train", seed=0, shuffle=False), got):
        assert_same(a, b)


def test_a_reader_that_predates_packed_fp8_stops_instead_of_misreading(tmp_path):
    from tapdraft.shards.formats.arrow import decode_row

    layout = tiny_layout(taps_codec="fp8")
    man = write_dataset(str(tmp_path), layout, ShardConfig(), [5, 9])
    batch = next(pa.ipc.open_stream(pa.memory_map(str(tmp_path / man["splits"]["train"]["shards"][0]["name"]))))
    row = batch.to_pylist()[0]
    assert "taps" not in row and {"taps_exponent", "taps_mantissa", "taps_scale"} <= set(row)
    assert decode_row(row, man["field_meta"])["taps"].dtype == torch.bfloat16
    old = {k: v for k, v in man["field_meta"].items() if k != "fp8_layout"}  # what an older reader understands
    with pytest.raises(KeyError, match="taps"):  # reading it as one byte a value looks for a 'taps' field
        decode_row(row, old)


def test_a_legacy_fp8_capture_resumes_only_with_its_own_layout(tmp_path):
    from tapdraft.shards.writer import DatasetWriter

    layout = tiny_layout(taps_codec="fp8")
    root = tmp_path / "part"
    w = DatasetWriter(str(root), ShardConfig(fp8_layout="bytes"), layout, fingerprint="0" * 64)
    w.write(random_sample(layout, 5, 0), 0)
    w.close()
    part = root / "_parts" / "train-rank00000.json"
    doc = json.loads(part.read_text())
    del doc["shard_config"]["fp8_layout"]  # as the code before the field wrote it
    part.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="fp8_layout"):
        DatasetWriter(str(root), ShardConfig(), layout, fingerprint="0" * 64)
    DatasetWriter(str(root), ShardConfig(fp8_layout="bytes"), layout, fingerprint="0" * 64).close()
    bf16 = tiny_layout()
    w = DatasetWriter(str(tmp_path / "b"), ShardConfig(), bf16, fingerprint="0" * 64)
    w.close()
    part = tmp_path / "b" / "_parts" / "train-rank00000.json"
    doc = json.loads(part.read_text())
    del doc["shard_config"]["fp8_layout"]
    part.write_text(json.dumps(doc))
    DatasetWriter(str(tmp_path / "b"), ShardConfig(), bf16, fingerprint="0" * 64).close()  # bf16 taps: no fp8 bytes
