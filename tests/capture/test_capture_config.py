"""CaptureConfig embeds ShardConfig; its JSON record stays flat, and older records migrate."""

import json

import pytest

from capture.config import CaptureConfig, check_resume, migrate_capture_record
from shards.shard_file import ShardConfig


def _cfg(**kw):
    return CaptureConfig(target="t", out="o", data=(("train", "x.jsonl"),), **kw)


def test_record_flattens_the_shard_config():
    d = _cfg(shard=ShardConfig(format="wds", shard_bytes=123)).to_dict()
    assert "shard" not in d
    assert (d["format"], d["shard_bytes"], d["zstd_level"], d["bf16_layout"]) == ("wds", 123, 1, "planes")
    with pytest.raises(ValueError, match="ShardConfig.format"):
        _cfg(shard=ShardConfig(format="zip"))
    with pytest.raises(ValueError, match="must be a ShardConfig"):
        _cfg(shard={"format": "wds"})


def test_a_record_from_before_the_embedding_still_resumes(tmp_path):
    now = _cfg(shard=ShardConfig(batch_bytes=4 << 20)).to_dict()  # the record-batch size older captures used
    old = {k: v for k, v in now.items() if k != "batch_bytes"}  # what older captures wrote
    assert migrate_capture_record(old) == now
    path = tmp_path / "capture_config.json"
    path.write_text(json.dumps(old))
    with pytest.warns(UserWarning, match="predates input hashing"):  # nor did they hash their inputs
        check_resume(path, now)
    path.write_text(json.dumps({**old, "batch_bytes": 1}))
    with pytest.raises(ValueError, match="batch_bytes"):
        check_resume(path, now)


def test_a_record_from_before_the_fp8_layout_resumes_with_what_it_wrote(tmp_path):
    path = tmp_path / "capture_config.json"
    for codec in ("bf16", "fp8"):
        now = _cfg(codec=codec).to_dict()
        old = {k: v for k, v in now.items() if k != "fp8_layout"}  # one byte per fp8 value, unrecorded
        path.write_text(json.dumps(old))
        assert migrate_capture_record(old)["fp8_layout"] == "bytes"
        if codec == "bf16":
            check_resume(path, now)  # bf16 taps: the fp8 layout writes nothing
        else:
            with pytest.raises(ValueError, match="fp8_layout"):
                check_resume(path, now)
            check_resume(path, _cfg(codec=codec, shard=ShardConfig(fp8_layout="bytes")).to_dict())
