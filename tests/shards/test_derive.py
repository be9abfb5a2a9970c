"""`tapdraft derive`: a lighter dataset from a finished one, checked sample by sample against the source."""

import hashlib
import json

import datasets
import pytest
import torch
from typer.testing import CliRunner

from tapdraft.cli import app, main
from tapdraft.shards.formats.arrow import decode_row
from tapdraft.shards.codec import fp8_decode, fp8_encode
from tapdraft.shards.derive import DeriveConfig, derive_dataset, derived_note
from tapdraft.shards.reader import open_dataset
from tapdraft.shards.verify import verify_dataset
from tapdraft.shards.shard_file import ShardConfig
from tests.shards.synthetic import tiny_layout, write_dataset
from tests.shards.test_roundtrip import assert_same

LENGTHS = [6, 3, 9, 4, 8, 5, 7]


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    root = tmp_path_factory.mktemp("src") / "ds"
    write_dataset(str(root), tiny_layout(), ShardConfig(shard_bytes=2500, batch_bytes=700), LENGTHS)
    write_dataset(str(root), tiny_layout(), ShardConfig(shard_bytes=2500, batch_bytes=700), [4, 5], split="validation")
    return root


def _samples(root, split="train"):
    return list(open_dataset(str(root)).stream(split, seed=0, shuffle=False))


def test_derive_keeps_a_subset_exactly_and_records_its_lineage(src, tmp_path):
    out = tmp_path / "light"
    man = derive_dataset(DeriveConfig(src=str(src), out=str(out), taps=(3,), top_k=2, max_samples=5,
                                      splits=("train",), progress=False))
    assert list(man["splits"]) == ["train"] and man["layout"]["tap_ids"] == [3] and man["layout"]["top_k"] == 2
    lin = man["extra"]["derived_from"]
    src_man = json.loads((src / "manifest.json").read_text())
    assert lin["source_manifest_sha256"] == hashlib.sha256((src / "manifest.json").read_bytes()).hexdigest()
    assert lin["source"] == "ds" and lin["source_fingerprint"] == src_man["fingerprint"] == man["fingerprint"]
    assert lin["dropped"] == {"taps": [1], "splits": ["validation"], "samples": {"train": 2}, "top_k": [4, 2]}
    assert str(tmp_path) not in json.dumps(man) and str(src) not in json.dumps(man)  # no local paths
    got, want = _samples(out), _samples(src)[:5]
    assert len(got) == 5
    for g, w in zip(got, want):
        assert torch.equal(g["taps"], w["taps"][:, 1:])
        assert torch.equal(g["topk_ids"], w["topk_ids"][:, :2])
        assert torch.equal(g["topk_logprobs"], w["topk_logprobs"][:, :2])
        assert_same({k: v for k, v in g.items() if k not in ("taps", "topk_ids", "topk_logprobs")},
                    {k: v for k, v in w.items() if k not in ("taps", "topk_ids", "topk_logprobs")})
    rep = verify_dataset(str(out), progress=False)
    assert rep.ok and rep.samples_checked == 5, rep.problems
    assert open_dataset(str(out)).bundle().fingerprint == open_dataset(str(src)).bundle().fingerprint
    files = sorted(str(p) for p in (out / "data").glob("train-*.arrow"))
    row = datasets.load_dataset("arrow", data_files=files, split="train", cache_dir=str(tmp_path / "hf"))[0]
    assert torch.equal(decode_row(row, man["field_meta"])["taps"], got[0]["taps"])
    assert derive_dataset(DeriveConfig(src=str(src), out=str(out), taps=(3,), top_k=2, max_samples=5,
                                       splits=("train",), progress=False)) == man  # rerun: finished, unchanged
    with pytest.raises(ValueError, match="made otherwise"):
        derive_dataset(DeriveConfig(src=str(src), out=str(out), taps=(1,), progress=False))


def test_derive_to_fp8_and_dropping_the_teacher(src, tmp_path):
    out = tmp_path / "fp8"
    man = derive_dataset(DeriveConfig(src=str(src), out=str(out), codec="fp8", top_k=0, progress=False))
    assert man["codec"]["lossy"] and man["layout"]["top_k"] == 0
    assert man["extra"]["derived_from"]["dropped"]["precision"] == "taps bf16 -> fp8"
    for g, w in zip(_samples(out), _samples(src)):
        assert torch.equal(g["taps"], fp8_decode(*fp8_encode(w["taps"])))
        assert "topk_ids" not in g
    assert verify_dataset(str(out), progress=False).ok
    note = derived_note(man)
    assert "derived from ds" in note and "top-k 4 -> 0" in note and "fp8" in note
    assert man["extra"]["derived_from"]["source_manifest_sha256"][:12] in note
    assert derived_note(json.loads((src / "manifest.json").read_text())) is None


@pytest.mark.parametrize("kw, msg", [
    (dict(taps=(2,)), r"source stores taps \[1, 3\], not \[2\]"),
    (dict(top_k=9), "top-4; derive can keep fewer"),
    (dict(splits=("nope",)), r"--splits \['nope'\]"),
])
def test_derive_refuses_what_the_source_cannot_give(src, tmp_path, kw, msg):
    with pytest.raises(ValueError, match=msg):
        derive_dataset(DeriveConfig(src=str(src), out=str(tmp_path / "x"), progress=False, **kw))
    assert not (tmp_path / "x").exists()


def test_fp8_source_is_not_derived_back_to_bf16(tmp_path):
    root = tmp_path / "f"
    write_dataset(str(root), tiny_layout(taps_codec="fp8"), ShardConfig(), [4, 5])
    with pytest.raises(ValueError, match="cannot restore the precision"):
        derive_dataset(DeriveConfig(src=str(root), out=str(tmp_path / "x"), codec="bf16", progress=False))


def test_derive_command(src, tmp_path, capsys):
    r = CliRunner().invoke(app, ["derive", str(src), "--out", str(tmp_path / "c"), "--taps", "1", "--max-samples", "2"])
    assert r.exit_code == 0, r.output
    assert open_dataset(str(tmp_path / "c")).num_samples("train") == 2
    with pytest.raises(SystemExit) as e:
        main(["derive", str(src), "--out", str(tmp_path / "d"), "--taps", "x"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: --taps 'x'"), err


def test_derive_recompresses_with_writer_lanes_and_keeps_old_keys(src, tmp_path):
    """A capture written uncompressed (the GPU-rate setting) is recompressed afterwards, samples unchanged."""
    raw = tmp_path / "raw"
    man = derive_dataset(DeriveConfig(src=str(src), out=str(raw), zstd_level=0, bf16_layout="raw", writers=2,
                                      progress=False))
    assert {k: man["shard_config"][k] for k in ("zstd_level", "bf16_layout", "writers")} == \
        {"zstd_level": 0, "bf16_layout": "raw", "writers": 2}
    packed = tmp_path / "packed"
    derive_dataset(DeriveConfig(src=str(raw), out=str(packed), zstd_level=1, bf16_layout="planes", progress=False))
    for d in (raw, packed):
        assert verify_dataset(str(d), progress=False).ok
        for split in ("train", "validation"):
            got = {s["sample_id"]: s for s in _samples(d, split)}
            want = _samples(src, split)
            assert sorted(got) == sorted(s["sample_id"] for s in want)
            for w in want:
                assert_same(got[w["sample_id"]], w)
    assert open_dataset(str(packed)).manifest["shard_config"]["zstd_level"] == 1
    from tapdraft.shards.derive import _key_settings

    # a derive without the shard settings keeps the key it had before they existed (a finished one stays finished)
    assert set(_key_settings(DeriveConfig(src="a", out="b"))) == {"src", "out", "taps", "codec", "splits",
                                                                   "max_samples", "top_k", "progress"}


def test_derive_joins_datasets_of_one_target(src, tmp_path, capsys):
    """Broad data and one's own traffic in one training set: the added samples follow the source's exactly, cut to
    its layout; a conversation both hold (the shared validation split) is kept once, and the lineage names both."""
    other = tmp_path / "own"
    write_dataset(str(other), tiny_layout(), ShardConfig(shard_bytes=2500, batch_bytes=700), [5, 6, 3], seed=1)
    write_dataset(str(other), tiny_layout(), ShardConfig(shard_bytes=2500, batch_bytes=700), [4, 5], split="validation")
    out = tmp_path / "joined"
    man = derive_dataset(DeriveConfig(src=str(src), out=str(out), add=(str(other),), taps=(3,), progress=False))
    assert verify_dataset(str(out), progress=False).ok
    got, want = _samples(out), _samples(src) + _samples(other)
    assert [s["sample_id"] for s in got] == [s["sample_id"] for s in want] and len(got) == len(LENGTHS) + 3
    for g, w in zip(got, want):
        assert torch.equal(g["taps"], w["taps"][:, 1:])
        assert_same({k: v for k, v in g.items() if k != "taps"}, {k: v for k, v in w.items() if k != "taps"})
    assert [s["sample_id"] for s in _samples(out, "validation")] == [s["sample_id"] for s in _samples(src, "validation")]
    lin = man["extra"]["derived_from"]
    assert lin["duplicates"] == {"validation": 2} and lin["dropped"]["samples"] == {"train": 0, "validation": 2}
    assert [a["source"] for a in lin["added"]] == ["own"]
    assert lin["added"][0]["source_manifest_sha256"] == hashlib.sha256((other / "manifest.json").read_bytes()).hexdigest()
    assert derive_dataset(DeriveConfig(src=str(src), out=str(out), add=(str(other),), taps=(3,), progress=False)) == man
    r = CliRunner().invoke(app, ["derive", str(src), "--add", str(other), "--out", str(tmp_path / "cli"), "--taps", "3"])
    assert r.exit_code == 0, r.output
    derive_dataset(DeriveConfig(src=str(src), out=str(tmp_path / "shown"), add=(str(other),)))
    err = capsys.readouterr().err
    assert "derive validation: 4/4 (100%)" in err and "2 in two datasets, kept once" in err, err  # read, not lost
    assert json.loads((tmp_path / "cli" / "manifest.json").read_text())["extra"]["derived_from"]["added"] == lin["added"]


def _dataset(root, lengths, seed, bundle_seed=0, extra=None, layout=None):
    """A finished random dataset whose target bundle and rendering (``extra``) can differ from ``src``'s."""
    from tapdraft.shards.finalize import finalize_dataset
    from tapdraft.shards.writer import DatasetWriter
    from tests.shards.synthetic import random_sample, tiny_bundle

    layout = layout or tiny_layout()
    fp = tiny_bundle(str(root / "target"), layout, seed=bundle_seed)
    w = DatasetWriter(str(root), ShardConfig(), layout, split="train")
    for i, T in enumerate(lengths):
        w.write(random_sample(layout, T, seed * 100003 + i), i)
    w.close()
    finalize_dataset(str(root), layout=layout, fingerprint=fp, capture_config={"synthetic": True}, extra=extra)
    return root


@pytest.mark.parametrize("other, msg", [
    (dict(lengths=[9, 9], seed=0), "'s0' of split train is in two of the joined datasets with other tokens"),
    (dict(lengths=[4], seed=2, layout=tiny_layout(tap_ids=(3,))), "cut to the source's layout"),
    (dict(lengths=[4], seed=3, layout=tiny_layout(hidden_size=8)), "captured from another target"),
    (dict(lengths=[4], seed=6, layout=tiny_layout(has_final_hidden=True)), "its layout differs"),
    (dict(lengths=[4], seed=4, bundle_seed=1), "captured from another target"),
    (dict(lengths=[4], seed=5, extra={"placeholder": "x"}), "rendered otherwise"),
])
def test_derive_refuses_what_cannot_be_joined(src, tmp_path, other, msg):
    """Same ids over other tokens, taps the source has and the added lacks, another width, another target, another
    rendering: each refused in one line naming the added dataset's problem, nothing written."""
    added = _dataset(tmp_path / "added", **other)
    with pytest.raises(ValueError, match=msg) as e:
        derive_dataset(DeriveConfig(src=str(src), out=str(tmp_path / "x"), add=(str(added),), progress=False))
    assert "\n" not in str(e.value)
    assert not (tmp_path / "x").exists()
