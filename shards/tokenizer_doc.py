"""A bundle's tokenizer files read as data: the ids and names a drafter asks of ``tokenizer.json`` and
``tokenizer_config.json``, parsed bounded and checked by shape.

Why: the bundle's tokenizer files come with a dataset someone else wrote. Their size is bounded before they are
read (``shards.limits.MAX_BUNDLE_FILE_BYTES``); their JSON was walked as if well formed, so a ``tokenizer.json``
nested 100k deep was a RecursionError and one whose ``model`` is a string or whose added token ids are not numbers
a TypeError / AttributeError traceback in ``train``. Here every part a drafter reads has its declared type, or a
``CorruptShardError`` names the file and the field in one line.

    tokenizer.json          model: object; model.vocab: {token: id} (WordPiece, BPE) or a list (Unigram);
                            added_tokens: [{id: integer, content: string}, ...]; at least one id in all
    tokenizer_config.json   an object (its ``*_token`` names are read where they are strings)
"""

from __future__ import annotations

import json
from typing import Any

from tapdraft.common.errors import CorruptShardError
from tapdraft.shards.limits import MAX_VOCAB, parse_json

TODO = "re-copy target/ from the original dataset (or re-capture it with this tapdraft)"


def _where(bundle: Any, name: str) -> str:
    root = getattr(bundle, "path", None)
    return f"{root}/tokenizer/{name}" if root is not None else f"the bundle's tokenizer/{name}"


def _refuse(where: str, field: str, value: Any, bound: str) -> CorruptShardError:
    try:
        shown = json.dumps(value)[:40]
    except (TypeError, ValueError):
        shown = type(value).__name__
    return CorruptShardError(f"{where}: {field} is {shown}, not {bound}; {TODO}")


def _is_id(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < MAX_VOCAB


def _doc(bundle: Any, name: str) -> dict[str, Any] | None:
    raw = getattr(bundle, "tokenizer_files", {}).get(name)
    if raw is None:
        return None
    where = _where(bundle, name)
    doc = parse_json(raw, where)
    if not isinstance(doc, dict):
        raise _refuse(where, "the document", doc, "an object")
    return doc


def tokenizer_vocab(bundle: Any) -> tuple[set[int], dict[str, int]] | None:
    """(every id tokenizer.json can produce, token name -> id) or None when the bundle has no tokenizer.json."""
    doc = _doc(bundle, "tokenizer.json")
    if doc is None:
        return None
    where = _where(bundle, "tokenizer.json")
    model = doc.get("model") or {}
    if not isinstance(model, dict):
        raise _refuse(where, "model", model, "an object")
    vocab = model.get("vocab") or {}
    if isinstance(vocab, dict):
        if not all(_is_id(i) for i in vocab.values()):
            bad = next(k for k, i in vocab.items() if not _is_id(i))
            raise _refuse(where, f"model.vocab[{json.dumps(bad)[:30]}]", vocab[bad], f"an id in [0, {MAX_VOCAB})")
        ids, by_name = set(vocab.values()), dict(vocab)
    elif isinstance(vocab, list):  # Unigram: [piece, score] pairs, ids by position
        ids, by_name = set(range(len(vocab))), {}
    else:
        raise _refuse(where, "model.vocab", vocab, "an object of token ids or a list")
    added = doc.get("added_tokens") or []
    if not isinstance(added, list):
        raise _refuse(where, "added_tokens", added, "a list")
    for i, t in enumerate(added):
        if not (isinstance(t, dict) and _is_id(t.get("id")) and isinstance(t.get("content"), str)):
            raise _refuse(where, f"added_tokens[{i}]", t, f"an object of an id in [0, {MAX_VOCAB}) and a content string")
        ids.add(t["id"])
        by_name[t["content"]] = t["id"]
    if not ids:  # `{}` passed every check above; a drafter then took max() of no ids
        raise CorruptShardError(f"{where}: model.vocab and added_tokens hold no token id, so it is not a tokenizer "
                                f"(an empty or stripped file); {TODO}")
    return ids, by_name


def tokenizer_config(bundle: Any) -> dict[str, Any]:
    """tokenizer_config.json as an object ({} when the bundle has none)."""
    return _doc(bundle, "tokenizer_config.json") or {}
