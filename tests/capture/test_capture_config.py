"""CaptureConfig embeds ShardConfig; its JSON record stays flat, and older records migrate."""

import json

import pytest

from tapdraft.capture.config import CaptureConfig, check_resume, migrate_capture_record
from tapdraft.shards.shard_file import ShardConfig


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


def test_a_vllm_capture_pins_its_thread_count_and_resumes_with_it(tmp_path):
    from tapdraft.capture.config import VLLMConfig, pin_threads

    record = tmp_path / "capture_config.json"
    fresh = pin_threads(_cfg(engine="vllm"), record, 2)
    assert fresh.vllm.threads == 2  # a new capture: this process's count, recorded
    record.write_text(json.dumps({**fresh.to_dict(), "inputs": {}}))
    with pytest.warns(UserWarning, match="with the 2 CPU threads it began with"):
        resumed = pin_threads(_cfg(engine="vllm"), record, 1)  # resumed where torch has another count
    assert resumed.vllm.threads == 2
    check_resume(record, resumed.to_dict())
    with pytest.raises(ValueError, match="vllm="):  # a count given that is not the recorded one: another dataset
        check_resume(record, pin_threads(_cfg(engine="vllm", vllm=VLLMConfig(threads=1)), record, 2).to_dict())
    assert pin_threads(_cfg(), record, 3).vllm is None  # the in-process engine: untouched
    with pytest.raises(ValueError, match="VLLMConfig.threads"):
        VLLMConfig(threads=0)

    legacy = {**fresh.to_dict(), "inputs": {}}  # recorded before the field: resumes with the current count, as it ran
    legacy["vllm"] = {k: v for k, v in legacy["vllm"].items() if k != "threads"}
    record.write_text(json.dumps(legacy))
    old = pin_threads(_cfg(engine="vllm"), record, 1)
    assert old.vllm.threads is None
    check_resume(record, old.to_dict())


def test_an_in_process_capture_pins_its_thread_count_and_resumes_with_it(tmp_path):
    from tapdraft.capture.config import pin_threads

    record = tmp_path / "capture_config.json"
    fresh = pin_threads(_cfg(), record, 2)
    assert fresh.threads == 2 and fresh.vllm is None  # a new capture: this process's count, recorded
    record.write_text(json.dumps({**fresh.to_dict(), "inputs": {}}))
    with pytest.warns(UserWarning, match="with the 2 CPU threads it began with"):
        resumed = pin_threads(_cfg(), record, 1)
    assert resumed.threads == 2
    check_resume(record, resumed.to_dict())
    with pytest.raises(ValueError, match="threads"):  # a count given that is not the recorded one: another dataset
        check_resume(record, pin_threads(_cfg(threads=1), record, 2).to_dict())
    with pytest.raises(ValueError, match="^--threads must be >= 1"):
        _cfg(threads=0)

    legacy = {k: v for k, v in fresh.to_dict().items() if k != "threads"}  # recorded before the field
    record.write_text(json.dumps({**legacy, "inputs": {}}))
    old = pin_threads(_cfg(), record, 1)
    assert old.threads is None  # the current count, as it ran
    check_resume(record, old.to_dict())


def test_auto_writers_follow_the_device_and_a_resume_keeps_the_recorded_count(tmp_path, monkeypatch):
    from tapdraft.capture.config import AUTO_WRITERS, auto_writers, pin_writers, rank_cores

    assert auto_writers("cpu", 64) == 1  # the forward needs the cores; one lane keeps up with it
    assert auto_writers("cuda", 16) == AUTO_WRITERS == 4  # a GPU waits on one lane (docs/performance.md)
    assert (auto_writers("cuda", 4), auto_writers("cuda", 1)) == (2, 1)  # half the cores a rank has, at least one
    record = tmp_path / "capture_config.json"
    auto = _cfg(shard=ShardConfig(writers=None))
    fresh = pin_writers(auto, record, "cuda", 16)
    assert fresh.shard.writers == 4 and fresh.to_dict()["writers"] == 4  # a new capture: decided, and recorded so
    assert pin_writers(_cfg(shard=ShardConfig(writers=3)), record, "cuda", 16).shard.writers == 3  # given: kept
    record.write_text(json.dumps({**fresh.to_dict(), "inputs": {}}))
    resumed = pin_writers(auto, record, "cpu", 2)  # resumed on a machine that would decide otherwise
    assert resumed.shard.writers == 4
    check_resume(record, resumed.to_dict())
    with pytest.raises(ValueError, match="writers=1"):  # a count given that is not the recorded one: refused
        check_resume(record, pin_writers(_cfg(shard=ShardConfig(writers=1)), record, "cpu", 2).to_dict())
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    assert rank_cores() == 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # eight ranks on a node share its cores
    assert rank_cores() == 2 and auto_writers("cuda", rank_cores()) == 1


@pytest.mark.parametrize("option,value", [("--draft-layers", "0"), ("--top-k", "-1"), ("--max-length", "0")])
def test_a_bad_option_is_named_as_the_user_typed_it(tmp_path, capsys, option, value):
    """Issue 57: the refusal named the internal field (``CaptureConfig.draft_layers must be >= 1``), not the option."""
    from tapdraft.cli import main

    data = tmp_path / "in.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(SystemExit) as e:
        main(["capture", "--target", str(tmp_path), "--data", str(data), "--out", str(tmp_path / "ds"), option, value])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith(f"error: {option} must be"), err
    assert "CaptureConfig" not in err[0] and not (tmp_path / "ds").exists()
