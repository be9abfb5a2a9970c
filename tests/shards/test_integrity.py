"""Integrity on read: byte flips anywhere in a shard are caught by the reader, naming the shard;
the stock-library decoders check rows/members; datasets written before checksums still read."""

import glob
import hashlib
import io
import json
import random
import shutil
import tarfile

import datasets
import pyarrow as pa
import pytest
import webdataset

from tapdraft.shards.formats.arrow import META_KEY, decode_row
from tapdraft.common.errors import CorruptShardError
from tapdraft.shards.integrity import ROW_COLUMN
from tapdraft.shards.reader import open_dataset
from tapdraft.shards.formats.wds import TarShardWriter, decode_wds_sample
from tapdraft.shards.shard_file import ShardConfig
from tests.shards.synthetic import random_sample, tiny_layout, write_dataset
from tests.shards.test_roundtrip import assert_same

LENGTHS = [6, 3, 9, 4, 8, 5, 7]
FLIPS = 20


@pytest.fixture(scope="module", params=[("arrow", 1), ("wds", 1), ("arrow", 0)],
                ids=["arrow", "wds", "arrow-uncompressed"])
def clean(tmp_path_factory, request):
    fmt, level = request.param
    root = tmp_path_factory.mktemp(fmt) / "ds"
    man = write_dataset(str(root), tiny_layout(), ShardConfig(format=fmt, zstd_level=level, shard_bytes=2500,
                                                              batch_bytes=900), LENGTHS)
    assert len(man["splits"]["train"]["shards"]) >= 2
    return root, man


def _read_all(root):
    ds = open_dataset(str(root))
    return list(ds.stream("train", seed=0, shuffle=False))


def test_random_single_byte_flips_are_all_caught(clean, tmp_path):
    root, man = clean
    want = _read_all(root)
    shards = man["splits"]["train"]["shards"]
    rng = random.Random(1234)
    caught = []
    for trial in range(FLIPS):
        work = tmp_path / f"t{trial}"
        shutil.copytree(root, work)
        sh = rng.choice(shards)
        path = work / sh["name"]
        data = bytearray(path.read_bytes())
        pos = rng.randrange(len(data))
        data[pos] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
        try:
            got = _read_all(work)
        except ValueError as e:  # CorruptShardError, or FileNotFoundError-free refusals
            caught.append(sh["name"] in str(e))
            continue
        for a, b in zip(got, want):  # a flip that was not caught must at least change nothing
            assert_same(a, b)
        caught.append(False)
    assert caught == [True] * FLIPS, f"{sum(caught)}/{FLIPS} flips caught"


def test_a_foreign_shard_is_refused_before_any_of_its_samples(clean, tmp_path):
    """Opening reads no shard (O(shards)); the first read of a shard checks its head against its index, so a
    shard of another dataset with the same size is refused, naming it, before one of its samples comes out."""
    root, man = clean
    other = tmp_path / "other"
    write_dataset(str(other), tiny_layout(), ShardConfig.from_dict(man["shard_config"]), LENGTHS, seed=5)
    work = tmp_path / "work"
    shutil.copytree(root, work)
    shards = man["splits"]["train"]["shards"]
    name = shards[1]["name"]
    shutil.copy(other / name, work / name)
    if (other / name).stat().st_size != shards[1]["bytes"]:
        with pytest.raises(ValueError, match=name):
            open_dataset(str(work))
        return
    got = []
    with pytest.raises(ValueError, match=name):
        for s in open_dataset(str(work)).stream("train", seed=0, shuffle=False):
            got.append(s)
    assert len(got) <= shards[0]["samples"]
    with pytest.raises(ValueError, match=name):
        open_dataset(str(work)).sample("train", shards[0]["samples"])


def test_tar_writer_emits_the_bytes_tarfile_writes(tmp_path):
    layout = tiny_layout()
    from tapdraft.shards.codec import FieldMeta, encode_fields

    meta = FieldMeta(layout, "planes")
    ours = io.BytesIO()
    w = TarShardWriter(ours, ShardConfig(format="wds", zstd_level=1), meta, "f" * 64)
    for i in range(3):
        s = random_sample(layout, 5 + i, i)
        w.add(i, s, encode_fields(s, meta))  # member keys r00000-<i>
    w.close()
    ref = io.BytesIO()
    with tarfile.open(fileobj=ref, mode="w|", format=tarfile.USTAR_FORMAT) as tar:
        for m in tarfile.open(fileobj=io.BytesIO(ours.getvalue()), mode="r:"):
            data = tarfile.open(fileobj=io.BytesIO(ours.getvalue())).extractfile(m.name).read()
            info = tarfile.TarInfo(m.name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))
    assert ours.getvalue() == ref.getvalue()


def test_stock_decoders_check_what_they_decode(tmp_path):
    root = tmp_path / "a"
    man = write_dataset(str(root), tiny_layout(), ShardConfig(shard_bytes=2500, batch_bytes=900), LENGTHS)
    files = [str(root / s["name"]) for s in man["splits"]["train"]["shards"]]
    row = datasets.load_dataset("arrow", data_files=files, split="train", cache_dir=str(tmp_path / "hf"))[2]
    decode_row(row, man["field_meta"])
    bad = bytearray(row["taps"])
    bad[len(bad) // 3] ^= 0x10
    with pytest.raises(CorruptShardError, match="does not match its stored checksum"):
        decode_row({**row, "taps": bytes(bad)}, man["field_meta"])
    with pytest.raises(CorruptShardError, match="no 'checksum' column"):
        decode_row({k: v for k, v in row.items() if k != ROW_COLUMN}, man["field_meta"])

    root = tmp_path / "w"
    write_dataset(str(root), tiny_layout(), ShardConfig(format="wds", shard_bytes=3000), LENGTHS)
    urls = sorted(glob.glob(str(root / "data" / "*.tar")))
    raw = next(iter(webdataset.WebDataset(urls, shardshuffle=False)))
    decode_wds_sample(raw)
    blob = bytearray(raw["taps.zst"])
    blob[-3] ^= 0x01
    with pytest.raises(CorruptShardError, match=rf"{urls[0]}.*taps\.zst"):
        decode_wds_sample({**raw, "taps.zst": bytes(blob)})
    doc = json.loads(raw["meta.json"])
    with pytest.raises(CorruptShardError, match="meta.json does not match"):
        decode_wds_sample({**raw, "meta.json": json.dumps({**doc, "audio_seconds": 9.5}).encode()})


# ---- datasets written before checksums (schema 1.0) -------------------------------------------------
def _downgrade_arrow(path, sh):
    """Rewrite one shard as schema 1.0 wrote it: no checksum column, 3-element batch ranges."""
    batches = list(pa.ipc.open_stream(path.read_bytes()))
    meta = json.loads(batches[0].schema.metadata[META_KEY])
    meta["schema_version"] = "1.0"
    schema = batches[0].schema.remove(batches[0].schema.get_field_index(ROW_COLUMN))
    schema = schema.with_metadata({META_KEY: json.dumps(meta, sort_keys=True)})
    out = io.BytesIO()
    opts = pa.ipc.IpcWriteOptions(compression=pa.Codec("zstd", compression_level=1))
    w = pa.ipc.new_stream(out, schema, options=opts)
    ranges = []
    for b in batches:
        start = out.tell()
        w.write_batch(pa.RecordBatch.from_arrays([b.column(n) for n in schema.names], schema=schema))
        ranges.append([start, out.tell(), b.num_rows])
    w.close()
    path.write_bytes(out.getvalue())
    sh["batches"] = ranges


def _downgrade_wds(path, sh):
    out = io.BytesIO()
    src = tarfile.open(fileobj=io.BytesIO(path.read_bytes()))
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.USTAR_FORMAT) as tar:
        for m in src.getmembers():
            data = src.extractfile(m).read()
            if m.name.endswith(".meta.json"):
                doc = json.loads(data)
                later = ("checksum", "checksums", "content_checksums", "lineage")
                data = json.dumps({k: v for k, v in doc.items() if k not in later},
                                  sort_keys=True).encode()
            info = tarfile.TarInfo(m.name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))
    path.write_bytes(out.getvalue())


@pytest.mark.parametrize("fmt", ["arrow", "wds"])
def test_schema_1_0_datasets_still_read_with_a_warning(tmp_path, fmt):
    root = tmp_path / "ds"
    man = write_dataset(str(root), tiny_layout(), ShardConfig(format=fmt, shard_bytes=2500, batch_bytes=900),
                        LENGTHS)
    want = _read_all(root)
    for sh in man["splits"]["train"]["shards"]:
        path = root / sh["name"]
        (_downgrade_arrow if fmt == "arrow" else _downgrade_wds)(path, sh)
        data = path.read_bytes()
        sh["bytes"], sh["sha256"] = len(data), hashlib.sha256(data).hexdigest()
        sh.pop("index")  # schema 1.x listed record batches in the manifest and had no index files
    shutil.rmtree(root / "index")
    man["splits"]["train"]["bytes"] = sum(s["bytes"] for s in man["splits"]["train"]["shards"])
    man["schema_version"] = man["field_meta"]["schema_version"] = "1.0"
    del man["integrity"]
    (root / "manifest.json").write_text(json.dumps(man))
    with pytest.warns(UserWarning, match="written before checksums.*bytes are not"):
        got = _read_all(root)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert_same(a, b)
    if fmt == "arrow":
        files = [str(root / s["name"]) for s in man["splits"]["train"]["shards"]]
        row = datasets.load_dataset("arrow", data_files=files, split="train", cache_dir=str(tmp_path / "hf"))[0]
        assert_same(decode_row(row, man["field_meta"]), want[0])
    else:
        urls = sorted(glob.glob(str(root / "data" / "*.tar")))
        raw = next(iter(webdataset.WebDataset(urls, shardshuffle=False)))
        assert_same({k: v for k, v in decode_wds_sample(raw).items()}, want[0])
