"""Stock-library compatibility: datasets and webdataset read the shards; values equal tapdraft's reader."""

import glob

import datasets
import pytest
import torch
import webdataset

from tapdraft.shards.formats.arrow import decode_row, read_shard_metadata
from tapdraft.shards.reader import open_dataset
from tests.shards.synthetic import random_sample, tiny_layout, write_dataset
from tapdraft.shards.formats.wds import decode_wds_sample
from tapdraft.shards.shard_file import ShardConfig
from tests.shards.test_roundtrip import assert_same

LENGTHS = [6, 3, 9, 4, 8]


@pytest.mark.parametrize("codec,zstd_level,bf16_layout", [("bf16", 1, "planes"), ("fp8", 1, "planes"),
                                                          ("bf16", 0, "planes"), ("bf16", 0, "split")])
def test_datasets_loads_arrow_shards(tmp_path, codec, zstd_level, bf16_layout):
    layout = tiny_layout(taps_codec=codec, has_final_hidden=True)
    man = write_dataset(str(tmp_path / "ds"), layout, ShardConfig(shard_bytes=2500, batch_bytes=900,
                                                                  zstd_level=zstd_level, bf16_layout=bf16_layout),
                        LENGTHS)
    files = [str(tmp_path / "ds" / s["name"]) for s in man["splits"]["train"]["shards"]]
    assert len(files) > 1
    ours = open_dataset(str(tmp_path / "ds"))
    want = [ours.sample("train", i) for i in range(len(LENGTHS))]
    loaded = datasets.load_dataset("arrow", data_files=files, split="train", cache_dir=str(tmp_path / "hf"))
    assert len(loaded) == len(LENGTHS)
    for i in range(len(LENGTHS)):
        assert_same(decode_row(loaded[i], man["field_meta"]), want[i])
    # memory-mapped, no copy: one shard at a time
    offset = 0
    for f in files:
        part = datasets.Dataset.from_file(f)
        meta = read_shard_metadata(f)
        assert meta["fingerprint"] == man["fingerprint"]
        for j in range(len(part)):
            assert_same(decode_row(part[j], meta), want[offset + j])
        offset += len(part)
    assert offset == len(LENGTHS)
    if codec == "fp8":
        assert want[0]["taps"].dtype == torch.bfloat16


@pytest.mark.parametrize("bf16_layout", ["planes", "split"])
def test_webdataset_iterates_tar_shards(tmp_path, bf16_layout):
    layout = tiny_layout(has_audio_embeds=True)
    man = write_dataset(str(tmp_path), layout, ShardConfig(format="wds", shard_bytes=3000, bf16_layout=bf16_layout),
                        LENGTHS)
    urls = sorted(glob.glob(str(tmp_path / "data" / "train-*.tar")))
    assert len(urls) == len(man["splits"]["train"]["shards"]) > 1
    got = list(webdataset.WebDataset(urls, shardshuffle=False).map(decode_wds_sample))
    ours = list(open_dataset(str(tmp_path)).stream("train", seed=0, shuffle=False))
    assert len(got) == len(ours) == len(LENGTHS)
    for a, b in zip(got, ours):
        assert a.pop("__key__").startswith("r00000-")  # webdataset re-adds its bookkeeping keys
        assert_same({k: v for k, v in a.items() if not k.startswith("__")}, b)


@pytest.mark.parametrize("zstd_level", [1, 0])
def test_fsspec_memory_url_roundtrip(zstd_level):
    layout = tiny_layout()
    url = f"memory://tapdraft-test/ds{zstd_level}"
    write_dataset(url, layout, ShardConfig(shard_bytes=2000, batch_bytes=500, zstd_level=zstd_level), LENGTHS)
    ds = open_dataset(url)
    assert ds.num_samples("train") == len(LENGTHS)
    assert sum(len(ds.shard_index(sh).batches) for sh in ds.manifest["splits"]["train"]["shards"]) > 2
    streamed = list(ds.stream("train", seed=1, shuffle=False))
    for i, T in enumerate(LENGTHS):
        want = random_sample(layout, T, i, audio_frames=T // 4)
        assert_same(ds.sample("train", i), want)
        assert_same(streamed[i], want)
    assert ds.bundle().fingerprint == ds.fingerprint


def test_file_url_roundtrip(tmp_path):
    layout = tiny_layout()
    write_dataset(str(tmp_path), layout, ShardConfig(), LENGTHS)
    ds = open_dataset(f"file://{tmp_path}")
    assert [ds.sample("train", i)["sample_id"] for i in range(len(LENGTHS))] == [f"s{i}" for i in range(len(LENGTHS))]
    assert ds.bundle().fingerprint == ds.fingerprint


@pytest.mark.parametrize("fmt", ["arrow", "wds"])
def test_dataset_card_snippets_run_from_any_directory(tmp_path, monkeypatch, fmt):
    import re

    root = tmp_path / "ds"
    write_dataset(str(root), tiny_layout(), ShardConfig(format=fmt, shard_bytes=2500), LENGTHS)
    card = (root / "README.md").read_text()
    card, share = card.split("## Share it")
    snippets = re.findall(r"```python\n(.*?)```", card, re.S)
    assert len(snippets) == 2 and all("path/to/this/directory" in s for s in snippets)
    upload = re.findall(r"```python\n(.*?)```", share, re.S)  # needs the Hub: compiled, not run
    assert len(upload) == 1 and "upload_large_folder" in upload[0] and compile(upload[0], "card", "exec")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    want = open_dataset(str(root)).stream("train", seed=0, shuffle=False)
    first = next(iter(want))
    for code in snippets:
        ns: dict = {}
        exec(code.replace("path/to/this/directory", str(root)).replace(": ...", ": break"), ns)
        got = ns.get("sample")
        if got is not None:
            assert_same({k: v for k, v in got.items() if not k.startswith("__")}, first)
    assert "sample" in ns


@pytest.mark.parametrize("fmt", ["arrow", "wds"])
def test_datasets_loads_the_directory_with_no_arguments(tmp_path, fmt):
    """The card's front matter names each split's shards: ``datasets.load_dataset(DIR)`` alone gives every split,
    and its rows decode to tapdraft's samples (Arrow rows with ``decode_row``, tar rows with ``decode_wds_sample``)."""
    root = tmp_path / "ds"
    cfg = ShardConfig(format=fmt, shard_bytes=2500, batch_bytes=900)
    write_dataset(str(root), tiny_layout(), cfg, LENGTHS)
    man = write_dataset(str(root), tiny_layout(), cfg, [5, 4], split="validation", seed=1)
    card = (root / "README.md").read_text()
    assert card.startswith("---\nconfigs:\n- config_name: default\n") and "upload_large_folder" in card
    loaded = datasets.load_dataset(str(root), cache_dir=str(tmp_path / "hf"))
    assert set(loaded) == {"train", "validation"}
    ours = open_dataset(str(root))
    for split in ("train", "validation"):
        assert len(loaded[split]) == ours.num_samples(split)
        for i, row in enumerate(loaded[split]):
            got = decode_row(row, man["field_meta"]) if fmt == "arrow" else decode_wds_sample(row, decompressed=True)
            assert_same(got, ours.sample(split, i))
