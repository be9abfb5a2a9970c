"""The command line's face: commands in pipeline order, help for every command, and each user mistake
as ONE ``error:`` line with exit code 2 (``--debug`` adds the traceback)."""

import errno
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tapdraft.cli import app, main
from tapdraft.shards.reader import open_dataset
from tapdraft.shards.shard_file import ShardConfig
from tests.capture.util import conv_record, write_manifest, write_wav
from tests.shards.synthetic import tiny_layout, write_dataset

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("regenerate", "capture", "verify", "inspect", "push", "pull", "derive", "train", "eval", "speculate", "export",
            "demo")


def test_every_command_has_help_in_pipeline_order():
    runner = CliRunner()
    top = runner.invoke(app, ["--help"])
    assert top.exit_code == 0
    rows = [line[2:].split()[0] for line in top.output.splitlines() if line.startswith("│ ") and line[2:3].strip()]
    listed = [r for r in rows if r in COMMANDS]
    assert tuple(listed) == COMMANDS, listed
    flat = " ".join(top.output.split())
    assert "(requests ->) regenerate -> capture -> verify / inspect -> train -> eval" in flat
    assert "derive writes a lighter dataset; push / pull share one through an object store" in flat
    for name in COMMANDS:
        res = runner.invoke(app, [name, "--help"])
        assert res.exit_code == 0 and "Usage" in res.output, name


def test_choices_in_help_come_from_their_registries(monkeypatch):
    """capture --help lists every storage format, taps codec and engine its registry holds, a new entry included."""
    import dataclasses

    from tapdraft.capture.engines import ENGINES
    from tapdraft.shards.formats import FORMATS
    from tapdraft.shards.taps import TAPS_CODECS

    monkeypatch.setitem(FORMATS, "parquet", dataclasses.replace(FORMATS["arrow"], name="parquet", help="columns"))
    from tapdraft import cli
    flat = " ".join(cli.format_help().split())
    assert all(f"{name} (" in flat for name in FORMATS) and "parquet (columns)" in flat
    assert all(f"{name} (" in cli.codec_help() for name in TAPS_CODECS)
    assert all(f"{name} (" in cli.engine_help("capture") for name in ENGINES)


def test_help_names_the_program_however_it_was_started(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])  # argv[0] is pytest's here, as it is cli.py under `python cli.py`
    assert e.value.code == 0 and "Usage: tapdraft train" in capsys.readouterr().out


def test_own_warnings_are_one_line_library_ones_keep_their_format():
    import warnings

    from tapdraft import cli
    import tapdraft.train.drafters.dflash.config as ours
    warnings.formatwarning = cli._format_warning
    try:
        assert cli._format_warning(UserWarning("mask id 1"), UserWarning, ours.__file__, 7) == "warning: mask id 1\n"
        lib = cli._format_warning(UserWarning("x"), UserWarning, torch.__file__, 7)
        assert lib.startswith(torch.__file__) and "UserWarning" in lib
        cli._RUN["debug"] = True
        assert "UserWarning" in cli._format_warning(UserWarning("x"), UserWarning, ours.__file__, 7)
    finally:
        cli._RUN["debug"] = False
        warnings.formatwarning = cli._PYTHON_FORMAT


def test_user_error_is_one_clear_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "cli.py", "train", "--data", str(tmp_path / "missing"), "--out", str(tmp_path / "run")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and f"dataset {tmp_path / 'missing'} does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()  # nothing half-written


# ------------------------------------------------------------------ every user mistake: one line, exit 2
@pytest.fixture()
def inputs(tmp_path) -> Path:
    write_wav(tmp_path / "a.wav", [1, 2, 3])
    return write_manifest(tmp_path / "train.jsonl", [conv_record(f"u{i}", "a.wav") for i in range(4)])


@pytest.fixture(autouse=True)
def _threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def run(args: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    return e.value.code, capsys.readouterr().err


def assert_one_line(code: int, err: str, *, contains: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and contains in lines[0], (code, err)


def capture_args(salm_dir, data, out, *extra):
    return ["capture", "--target", salm_dir, "--data", data, "--out", out, "--top-k", "4", "--threads", "1", *extra]


def test_bad_input_is_one_line(salm_dir, tmp_path, capsys):
    man = write_manifest(tmp_path / "bad.jsonl", [conv_record("u0", "missing.wav")])
    code, err = run(capture_args(salm_dir, man, tmp_path / "ds"), capsys)
    assert_one_line(code, err, contains="bad input 'u0'")
    code, err = run(["--debug", *capture_args(salm_dir, man, tmp_path / "ds")], capsys)
    assert code == 2 and "Traceback" in err and err.strip().splitlines()[-1].startswith("error: bad input 'u0'")


def test_full_disk_is_one_line_and_leaves_no_temp_files(salm_dir, inputs, tmp_path, capsys, monkeypatch):
    from tapdraft.shards import shard_file

    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device", "data/x.arrow.tmp")

    monkeypatch.setattr(shard_file._HashingSink, "write", full)
    out = tmp_path / "ds"
    code, err = run(capture_args(salm_dir, inputs, out), capsys)
    assert_one_line(code, err, contains="no space left on the device writing data/x.arrow.tmp; free space")
    assert [p for p in out.rglob("*") if p.name.endswith(".tmp")] == []


def test_uncompressed_raw_shards_from_the_command_line(salm_dir, inputs, tmp_path, capsys):
    code, err = run(capture_args(salm_dir, inputs, tmp_path / "w", "--format", "wds", "--zstd-level", "0"), capsys)
    assert_one_line(code, err, contains="zstd_level 0 (uncompressed) is for Arrow shards")
    out = tmp_path / "ds"
    code, err = run(capture_args(salm_dir, inputs, out, "--zstd-level", "0", "--bf16-layout", "raw"), capsys)
    assert code == 0, err
    ds = open_dataset(str(out))
    assert ds.manifest["codec"]["container"] == "arrow-ipc-stream" and ds.field_meta.bf16_layout == "raw"
    assert len(list(ds.stream("train", seed=0))) == 4
    with pytest.raises(SystemExit):
        main(["inspect", str(out)])
    assert "bf16 raw, arrow-ipc-stream (uncompressed)" in capsys.readouterr().out
    code, err = run(["verify", out], capsys)
    assert code == 0, err


def test_out_into_a_foreign_directory_is_one_line(salm_dir, inputs, tmp_path, capsys):
    out = tmp_path / "project"
    out.mkdir()
    (out / "README.md").write_text("mine")
    code, err = run(capture_args(salm_dir, inputs, out), capsys)
    assert_one_line(code, err, contains="not a tapdraft dataset")
    assert (out / "README.md").read_text() == "mine"


@pytest.mark.parametrize("fmt", ["arrow", "wds"])
def test_inspect_sample_out_of_range_is_one_line(tmp_path, capsys, fmt):
    root = tmp_path / "ds"
    write_dataset(str(root), tiny_layout(), ShardConfig(format=fmt, shard_bytes=2500), [5, 6, 7])
    code, err = run(["inspect", root, "--sample", 99999], capsys)
    assert_one_line(code, err, contains="sample 99999 is out of range")
    with pytest.raises(SystemExit) as e:
        main(["inspect", str(root), "--sample", "2"])
    assert e.value.code == 0 and "train[2]" in capsys.readouterr().out


def test_missing_and_foreign_paths_are_one_line(tmp_path, capsys):
    code, err = run(["inspect", tmp_path / "nope"], capsys)
    assert_one_line(code, err, contains="does not exist")
    (tmp_path / "half").mkdir()
    code, err = run(["inspect", tmp_path / "half"], capsys)
    assert_one_line(code, err, contains="manifest.json not found")
    code, err = run(["export", "--draft", tmp_path, "--out", tmp_path / "exp"], capsys)
    assert_one_line(code, err, contains="has no checkpoint")
    code, err = run(["capture", "--target", tmp_path / "none", "--data", tmp_path / "x.jsonl", "--out",
                     tmp_path / "ds", "--threads", "1"], capsys)
    assert_one_line(code, err, contains="does not exist")


def test_a_bug_still_shows_its_traceback(monkeypatch, capsys, tmp_path):
    import tapdraft.shards.reader as reader

    def boom(*a, **k):
        raise RuntimeError("an internal bug")

    monkeypatch.setattr(reader, "open_dataset", boom)
    with pytest.raises(RuntimeError, match="an internal bug"):
        main(["inspect", str(tmp_path)])


def test_classify_maps_errors_to_one_line_and_a_code():
    from tapdraft.common.errors import EXIT_INTERRUPTED, EXIT_USER, Interrupted, classify

    assert classify(ValueError("cannot finalize ds:\n  a: bad\n  b: worse")) == \
        (EXIT_USER, "cannot finalize ds: a: bad; b: worse")
    assert classify(Interrupted("stopped; kept 3"))[0] == EXIT_INTERRUPTED
    read_only = classify(OSError(errno.EROFS, "Read-only file system", "/x"))[1]
    assert read_only.startswith("the filesystem is read-only writing /x")
    assert classify(RuntimeError("bug")) is None and classify(OSError(errno.EIO, "I/O error")) is None


def test_readme_path_default_taps_train_the_dflash_recipe_without_a_tap_warning(tmp_path, capsys):
    """README: `capture` with its defaults, then `train --recipe dflash`: the recipe's tap rule is stored."""
    import warnings

    from tapdraft.demo.bpe import BPESize, build_bpe_lm, build_bpe_tokenizer, corpus_text
    from tapdraft.shards.taps import capture_tap_ids, default_tap_ids
    from tapdraft.train.config import RECIPES_DIR, load_run_config

    size = BPESize(vocab_size=512, hidden=32, layers=6, heads=2, kv_heads=1, intermediate=64)
    tok = build_bpe_tokenizer(corpus_text()[:200], size.vocab_size)
    target = tmp_path / "target"
    build_bpe_lm(tok, size).save_pretrained(target)
    tok.save_pretrained(target)
    data = write_manifest(tmp_path / "train.jsonl", [{"id": f"c{i}", "conversations": [
        {"from": "User", "value": f"say {w}"}, {"from": "Assistant", "value": f"the {w} is here"}]}
        for i, w in enumerate(["class", "module", "function", "method"])])
    code, err = run(["capture", "--target", target, "--data", data, "--out", tmp_path / "ds", "--threads", "1"], capsys)
    assert code == 0, err
    ds = open_dataset(str(tmp_path / "ds"))
    assert default_tap_ids(6, 1)[0] not in default_tap_ids(6, 5)  # a target where the old defaults warned
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cfg = load_run_config("dflash").drafter.resolve(ds.bundle(), ds.layout)
    assert not [w for w in seen if "tap" in str(w.message)], [str(w.message) for w in seen]
    assert list(cfg.target_layer_ids) == default_tap_ids(6, 1)
    # and for every target depth, every DFlash-family recipe's rule is inside the capture defaults
    for path in RECIPES_DIR.glob("*.yaml"):
        if path.stem.startswith("_"):
            continue
        run_cfg = load_run_config(path.stem)
        if not hasattr(run_cfg.drafter, "target_layer_ids") or run_cfg.family not in ("dflash", "dflash2"):
            continue
        for L in range(1, 81):
            rule = set(default_tap_ids(L, run_cfg.drafter.num_layers))
            if path.stem.endswith("_demo"):  # the demo captures with --draft-layers 2, its recipes' depth
                assert rule <= set(capture_tap_ids(L, 2)), (path.stem, L)
            else:
                assert rule <= set(capture_tap_ids(L, 5)), (path.stem, L)


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("command", ["capture", "derive", "push", "pull"])
def test_sigterm_exits_130_saying_what_was_kept(command, sig, salm_dir, inputs, tmp_path, capsys, monkeypatch,
                                                terminal_signals):
    """SIGTERM stops every command as Ctrl-C (SIGINT) does (train's behaviour): exit 130 and one line saying what was
    kept, never a bare 143 or a traceback. The signal lands inside the command's work (in-process:
    signal.raise_signal)."""
    import signal

    from tapdraft.capture import pipeline
    from tapdraft.shards import derive, transfer

    def term(real):
        def hit(*a, **kw):
            signal.raise_signal(getattr(signal, sig))
            return real(*a, **kw)
        return hit

    ds = tmp_path / "ds"
    write_dataset(str(ds), tiny_layout(), ShardConfig(shard_bytes=2500), [5, 6, 7])
    where, name, args, kept = {
        "capture": (pipeline, "run_batch", capture_args(salm_dir, inputs, tmp_path / "cap"), "inputs done and kept"),
        "derive": (derive, "cut_sample", ["derive", ds, "--out", tmp_path / "d"], "finished shards in"),
        "push": (transfer, "_upload", ["push", ds, tmp_path / "store"], "what was sent to"),
        "pull": (transfer, "_download", ["pull", ds, tmp_path / "copy"], "files downloaded into"),
    }[command]
    monkeypatch.setattr(where, name, term(getattr(where, name)))
    before = signal.getsignal(getattr(signal, sig))
    code, err = run(args, capsys)
    lines = [ln for ln in err.strip().splitlines() if ln.startswith(("interrupted:", "error:"))]
    assert code == 130 and len(lines) == 1 and lines[0].startswith("interrupted: ") and kept in lines[0], err
    assert "rerun the same command" in lines[0] and signal.getsignal(getattr(signal, sig)) == before


def test_an_over_long_capture_out_is_one_line(salm_dir, inputs, tmp_path, capsys):
    """ENAMETOOLONG was a traceback in capture (derive and pull: tests/common/test_errors.py)."""
    code, err = run(capture_args(salm_dir, inputs, tmp_path / ("c" * 300)), capsys)
    assert_one_line(code, err, contains="file name too long")


def test_capture_decides_its_writer_lanes_and_refuses_a_bad_count(salm_dir, inputs, tmp_path, capsys):
    """``--writers`` is auto by default: one lane on this CPU, recorded; a count that is not one is one line."""
    code, err = run(capture_args(salm_dir, inputs, tmp_path / "bad", "--writers", "four"), capsys)
    assert_one_line(code, err, contains="--writers must be auto or a whole number of lanes, got 'four'")
    assert not (tmp_path / "bad").exists()
    code, err = run(capture_args(salm_dir, inputs, tmp_path / "bad", "--writers", "0"), capsys)
    assert_one_line(code, err, contains="writers must be in [1, 64]")
    assert not (tmp_path / "bad").exists()
    code, err = run(capture_args(salm_dir, inputs, tmp_path / "ds", "--device", "cpu"), capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "ds" / "capture_config.json").read_text())["writers"] == 1
