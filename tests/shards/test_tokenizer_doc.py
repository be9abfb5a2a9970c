"""A bundle's tokenizer files are data (shards.tokenizer_doc): a mistyped or deeply nested tokenizer.json is one line
naming the file and the field, in the reader and in ``train`` (issue 57: RecursionError / TypeError tracebacks)."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from tapdraft.cli import main
from tapdraft.common.errors import CorruptShardError
from tapdraft.shards.tokenizer_doc import tokenizer_config, tokenizer_vocab
from tests.shards.hostile import good_dataset

BAD = [  # (tokenizer.json, the field named)
    (b"[" * 100_000 + b"]" * 100_000, "nests deeper"),
    (b'{"model": "hostile-fixture"}', "model is"),
    (b'{"model": {"vocab": {"a": "7"}}}', 'model.vocab["a"] is "7"'),
    (b'{"model": {"vocab": 5}}', "model.vocab is 5"),
    (b'{"added_tokens": [{"id": "x", "content": "<s>"}]}', "added_tokens[0] is"),
    (b'{"added_tokens": {"id": 1}}', "added_tokens is"),
    (b'["a list"]', "the document is"),
    (b"{}", "model.vocab and added_tokens hold no token id"),  # issue 57: `max() arg is an empty sequence` in train
    (b'{"model": {"vocab": []}, "added_tokens": []}', "hold no token id"),
]


def _bundle(tok: bytes, config: bytes | None = None) -> SimpleNamespace:
    files = {"tokenizer.json": tok} | ({"tokenizer_config.json": config} if config is not None else {})
    return SimpleNamespace(path=Path("/ds/target"), tokenizer_files=files)


def test_a_well_formed_tokenizer_gives_its_ids_and_names():
    b = _bundle(b'{"model": {"vocab": {"a": 0, "b": 1}}, "added_tokens": [{"id": 5, "content": "<pad>"}]}', b"{}")
    assert tokenizer_vocab(b) == ({0, 1, 5}, {"a": 0, "b": 1, "<pad>": 5}) and tokenizer_config(b) == {}
    assert tokenizer_vocab(_bundle(b'{"model": {"vocab": [["a", 0.0], ["b", -1.0]]}}'))[0] == {0, 1}
    assert tokenizer_vocab(SimpleNamespace(path=None, tokenizer_files={})) is None


@pytest.mark.parametrize("raw,field", BAD, ids=[f for _, f in BAD])
def test_a_mistyped_or_nested_tokenizer_json_is_one_line_naming_it(raw, field):
    with pytest.raises(CorruptShardError) as e:
        tokenizer_vocab(_bundle(raw))
    msg = str(e.value)
    assert msg.startswith("/ds/target/tokenizer/tokenizer.json") and field in msg and "\n" not in msg, msg
    with pytest.raises(CorruptShardError, match=r"tokenizer_config.json: the document is \[\]"):
        tokenizer_config(_bundle(b"{}", b"[]"))


def test_train_on_a_mistyped_tokenizer_json_is_one_line(tmp_path, capsys):
    """The hostile fixture's tokenizer.json has a string model: train was an AttributeError traceback."""
    root = good_dataset(tmp_path / "ds")
    with pytest.raises(SystemExit) as e:
        main(["train", "--data", str(root), "--recipe", "dflash", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert str(root / "target" / "tokenizer" / "tokenizer.json") in err[0] and "model is" in err[0], err


def test_train_on_an_empty_tokenizer_json_is_one_line(tmp_path, capsys):
    """Issue 57: a bundle whose tokenizer.json is `{}` made train print `error: max() arg is an empty sequence`."""
    root = good_dataset(tmp_path / "ds", tokenizer=b"{}")
    with pytest.raises(SystemExit) as e:
        main(["train", "--data", str(root), "--recipe", "dflash", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert str(root / "target" / "tokenizer" / "tokenizer.json") in err[0] and "no token id" in err[0], err
