"""Recovering from a mistake: a regeneration that keeps nothing fails loudly, inputs are checked before
anything is created, a changed input is accepted with an explicit --restart, and a device that is not
there is one line with nothing left behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tapdraft.cli import main
from tapdraft.shards.reader import open_dataset
from tests.capture.util import conv_record, write_manifest, write_wav


def run(args: list, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    return e.value.code, capsys.readouterr().err


def one_line(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith(("capture ", "regenerate: "))]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def capture_args(salm_dir, data, out, *extra):
    return ["capture", "--target", salm_dir, "--data", data, "--out", out, "--top-k", "4", "--threads", "1", *extra]


@pytest.fixture()
def good(tmp_path) -> Path:
    write_wav(tmp_path / "a.wav", [1, 2, 3])
    return write_manifest(tmp_path / "train.jsonl", [conv_record(f"u{i}", "a.wav") for i in range(3)])


def test_a_regeneration_that_keeps_nothing_exits_2_and_writes_nothing(salm_dir, good, tmp_path, capsys):
    out = tmp_path / "regen" / "train.jsonl"
    code, err = run(["regenerate", "--target", salm_dir, "--data", good, "--out", out, "--max-new-tokens", "4",
                     "--threads", "1"], capsys)  # a random-init target never ends its replies
    line = one_line(err)
    assert code == 2 and "all 3 conversation(s) were dropped (truncated: 3)" in line
    assert "raise --max-new-tokens" in line and "end-of-turn token" in line and str(out) in line
    assert sorted(p.name for p in out.parent.iterdir()) == []  # no output, no sidecar, no parts, no lock


def test_capture_of_an_empty_regenerate_output_names_its_counts(salm_dir, tmp_path, capsys):
    data = tmp_path / "regen.jsonl"
    data.write_text("")
    (tmp_path / "regen.regenerate.json").write_text(json.dumps({
        "complete": True, "counts": {"conversations": 48, "written": 0, "dropped": {"truncated": 48}}}))
    code, err = run(capture_args(salm_dir, data, tmp_path / "ds"), capsys)
    line = one_line(err)
    assert code == 2 and "holds no conversations" in line and "kept 0 of 48" in line and "truncated" in line
    assert "--max-new-tokens" in line and not (tmp_path / "ds").exists()


def test_a_typo_in_data_creates_nothing_and_the_corrected_path_captures(salm_dir, good, tmp_path, capsys):
    out = tmp_path / "ds"
    code, err = run(capture_args(salm_dir, tmp_path / "trian.jsonl", out), capsys)
    assert code == 2 and f"input {tmp_path / 'trian.jsonl'} does not exist" in one_line(err)
    assert not out.exists()
    code, err = run(capture_args(salm_dir, tmp_path / "none-target", out), capsys)  # same for the target
    assert code == 2 and not out.exists()
    code, err = run(capture_args(salm_dir, good, out), capsys)
    assert code == 0, err
    assert open_dataset(str(out)).num_samples("train") == 3


def test_a_fixed_input_is_captured_again_with_restart(salm_dir, good, tmp_path, capsys):
    bad = write_manifest(tmp_path / "bad.jsonl", [conv_record("u0", "a.wav"), conv_record("u1", "missing.wav")])
    out = tmp_path / "ds"
    code, err = run(capture_args(salm_dir, bad, out), capsys)
    assert code == 2 and "--restart" in one_line(err)
    bad.write_text(good.read_text())  # the user fixes the file
    code, err = run(capture_args(salm_dir, bad, out), capsys)
    line = one_line(err)
    assert code == 2 and f"input {bad} (split train) changed" in line and "rerun with --restart" in line
    code, err = run(capture_args(salm_dir, bad, out, "--restart"), capsys)
    assert code == 0, err
    ds = open_dataset(str(out))
    assert ds.num_samples("train") == 3 and ds.manifest["capture_config"]["inputs"]["train"]["sha256"]
    assert [s["sample_id"] for s in ds.stream("train", seed=0, shuffle=False)] == ["u0", "u1", "u2"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_device_cuda_without_cuda_is_one_line_and_leaves_nothing(salm_dir, good, tmp_path, capsys):
    out = tmp_path / "ds"
    code, err = run(capture_args(salm_dir, good, out, "--device", "cuda"), capsys)
    assert code == 2 and "no CUDA device" in one_line(err) and "--device cpu" in err
    assert not out.exists()
    code, err = run(capture_args(salm_dir, good, out, "--device", "gpu0"), capsys)
    assert code == 2 and "is not a device" in one_line(err) and not out.exists()


def _tree(root: Path) -> dict[str, bytes | None]:
    return {p.relative_to(root).as_posix(): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


def test_a_project_directory_is_never_written_into_restart_included(salm_dir, tmp_path, capsys):
    """A user's project (a README and inputs under data/) is not a dataset: capture, --restart and derive each
    refuse it in one line and leave every file as it was."""
    project = tmp_path / "project"
    write_wav(project / "data" / "a.wav", [1, 2, 3])
    data = write_manifest(project / "data" / "train.jsonl", [conv_record(f"u{i}", "a.wav") for i in range(3)])
    (project / "README.md").write_text("my project")
    before = _tree(project)
    for extra in ((), ("--restart",)):
        code, err = run(capture_args(salm_dir, data, project, *extra), capsys)
        assert code == 2 and "is a non-empty directory that is not a tapdraft dataset" in one_line(err)
        assert _tree(project) == before, extra
    ds = tmp_path / "ds"
    assert run(capture_args(salm_dir, data, ds), capsys)[0] == 0
    code, err = run(["derive", ds, "--out", project], capsys)
    assert code == 2 and "not a tapdraft dataset" in one_line(err) and _tree(project) == before


def test_restart_leaves_what_a_fresh_capture_leaves_and_keeps_what_it_did_not_write(salm_dir, good, tmp_path,
                                                                                   capsys):
    """--restart after a changed input removes only the earlier capture's own files (a user's file under data/
    stays) and the result, file for file, is what a fresh capture of the new input writes: verify passes."""
    out, fresh = tmp_path / "ds", tmp_path / "fresh"
    assert run(capture_args(salm_dir, good, out, "--shard-bytes", "6000"), capsys)[0] == 0
    (out / "data" / "notes.txt").write_text("mine")
    changed = write_manifest(tmp_path / "changed.jsonl", [conv_record(f"v{i}", "a.wav") for i in range(2)])
    good.write_text(changed.read_text())
    code, err = run(capture_args(salm_dir, good, out, "--shard-bytes", "6000", "--restart"), capsys)
    assert code == 0, err
    assert (out / "data" / "notes.txt").read_text() == "mine"
    (out / "data" / "notes.txt").unlink()
    assert run(capture_args(salm_dir, good, fresh, "--shard-bytes", "6000"), capsys)[0] == 0
    assert sorted(_tree(out)) == sorted(_tree(fresh))
    assert run(["verify", out], capsys)[0] == 0


def test_restart_with_the_same_input_leaves_what_the_first_capture_left(salm_dir, good, tmp_path, capsys):
    """--restart with unchanged input left a stray index beside the new shards (verify exited 1): the same files now,
    and verify passes."""
    out = tmp_path / "ds"
    assert run(capture_args(salm_dir, good, out, "--shard-bytes", "6000"), capsys)[0] == 0
    first = sorted(_tree(out))
    code, err = run(capture_args(salm_dir, good, out, "--shard-bytes", "6000", "--restart"), capsys)
    assert code == 0, err
    assert sorted(_tree(out)) == first
    assert run(["verify", out], capsys)[0] == 0


@pytest.mark.parametrize("name", ["a*b", "../../x"])
def test_a_bad_split_name_is_refused_before_anything_is_captured(salm_dir, good, tmp_path, capsys, name):
    out = tmp_path / "ds"
    code, err = run(capture_args(salm_dir, good, out, "--data", f"{name}={good}"), capsys)
    assert code == 2 and f"split name {name!r} must be letters, digits or underscores" in one_line(err)
    assert not out.exists()
