"""Messages a newcomer reads: an interrupt is not an error, outputs are named by their full path."""

from __future__ import annotations

import pytest

from tapdraft.cli import main
from tests.capture.util import conv_record, write_manifest, write_wav


def test_an_interrupt_is_labelled_interrupted_not_error(monkeypatch, tmp_path, capsys):
    import tapdraft.shards.reader as reader
    from tapdraft.common.errors import Interrupted

    def stopped(*a, **k):
        raise Interrupted("training stopped by SIGINT after step 3 of 10; checkpoint saved")

    monkeypatch.setattr(reader, "open_dataset", stopped)
    with pytest.raises(SystemExit) as e:
        main(["inspect", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 130 and err == ["interrupted: training stopped by SIGINT after step 3 of 10; checkpoint "
                                           "saved"]


def test_regenerate_names_its_output_by_its_full_path(salm_dir, tmp_path, capsys, monkeypatch):
    write_wav(tmp_path / "a.wav", [1, 2])
    write_manifest(tmp_path / "train.jsonl", [conv_record("u0", "a.wav"), conv_record("u1", "a.wav")])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["regenerate", "--target", str(salm_dir), "--data", "train.jsonl", "--out", "regen/train.jsonl",
              "--max-new-tokens", "3", "--on-limit", "keep", "--threads", "1"])
    out = capsys.readouterr().out
    assert e.value.code in (0, None) and f"2 of 2 conversations written to {tmp_path / 'regen' / 'train.jsonl'};" in out
    assert sorted(p.name for p in (tmp_path / "regen").iterdir()) == ["train.jsonl", "train.regenerate.json"]


COMMANDS = ("regenerate", "capture", "verify", "inspect", "train", "eval", "speculate", "export", "demo")


def _help(args: list[str], capsys, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "120")
    with pytest.raises(SystemExit) as e:
        main([*args, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def test_help_tags_values_plainly_and_flags_not_at_all(capsys, monkeypatch):
    top = _help([], capsys, monkeypatch)
    assert "Pipeline: (requests ->) regenerate -> capture -> verify / inspect -> train -> eval -> speculate / export." \
        in top  # one line, not broken in two
    for name in COMMANDS:
        text = _help([name], capsys, monkeypatch)
        assert "<bool>" not in text and "<list[" not in text and "<str>" not in text, name
    train = _help(["train"], capsys, monkeypatch)
    assert "--list-recipes" in train and "--show-recipe" in train and "eval_every" in train
    assert "--set                 TEXT" in train and "--json                         Print" in train
    spec = _help(["speculate"], capsys, monkeypatch)
    assert "auto | cpu | cuda | cuda:N, for the target" in spec and "[default: auto]" in spec


def test_train_lists_and_shows_recipes(capsys):
    import yaml

    from tapdraft.train.config import load_run_config

    with pytest.raises(SystemExit) as e:
        main(["train", "--list-recipes"])
    rows = {ln.split()[0]: ln.split()[1] for ln in capsys.readouterr().out.splitlines()}
    assert e.value.code in (0, None) and rows["dflash"] == "dflash" and rows["mtp_lk"] == "mtp"
    assert not any(n.startswith("_") for n in rows)  # shared blocks are not recipes
    with pytest.raises(SystemExit):
        main(["train", "--show-recipe", "dflash_b8"])
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown == load_run_config("dflash_b8").to_dict() and shown["drafter"]["block_size"] == 8
    with pytest.raises(SystemExit) as e:
        main(["train", "--out", "x"])  # training still needs its dataset
    assert e.value.code == 2 and "--data is required" in capsys.readouterr().err


def test_the_public_entry_point_opens_a_dataset(tmp_path):
    import tapdraft
    from tapdraft.shards.shard_file import ShardConfig
    from tests.shards.synthetic import tiny_layout, write_dataset

    root = tmp_path / "ds"
    write_dataset(str(root), tiny_layout(), ShardConfig(format="arrow", shard_bytes=2500), [5, 6, 7])
    ds = tapdraft.open_dataset(str(root))
    assert isinstance(ds, tapdraft.Dataset) and ds.num_samples("train") == 3
    assert "import tapdraft\nds = tapdraft.open_dataset(" in (root / "README.md").read_text()
