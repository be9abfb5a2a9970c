"""What a regenerated conversation is: which turns are replaced, its resume key, its output record.

The resume key (:func:`prefix_key`) is a sha256 over what regenerating a conversation reads: its
sample id, its turns with the replaced assistant turns blanked, and its audio references (path,
offset, duration; a content hash for audio given as bytes or arrays). Row position never enters it,
so a rerun finds the conversations it already did wherever they sit in the file.

:func:`process_window` regenerates one window of conversations: round r takes the r-th replaced
turn of every live conversation, prepares its prompt (the template's generation prompt, audio
decoded), buckets by prompt + max_new_tokens, generates, and checks each reply (dropped replies and
bad inputs get an entry with their reason). ``regenerate`` writes its entries as part files; fused
capture keeps the generation's states instead.

An output record is the input record with its other fields kept and its turns rewritten as text
turns (placeholders inline, each listing its audios by a path relative to the output), which
``capture.inputs.read_jsonl`` reads back; ``regenerated_by`` names the target fingerprint. Each
regenerated turn carries ``token_ids``, the ids the target generated (its end-of-turn id left to the
template), and ``"truncated": true`` when it hit max_new_tokens: capture stores those ids, never a
re-tokenization of the text, which for a BPE tokenizer can differ (8% of one real run's replies did).
A reply is checked where capture will put it: rendered with its ids, its supervised span must be the
ids generated, end of turn included. When the template does not allow that (it rewrites the reply's
text, or ends the turn with another id than the target did) the reply is kept as text alone if its
text renders to the generated ids (the check before ids were carried), else dropped as ``unplaced``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from tapdraft.capture.generation import Generation, ReplyConfig, context_length
from tapdraft.capture.inputs import AudioRef, BadInput, Conversation
from tapdraft.capture.replies.generate import generate, row_seed
from tapdraft.capture.stages import bucket
from tapdraft.capture.targets.base import Prepared, Target
from tapdraft.common.atomic import staged
from tapdraft.common.errors import TapdraftError


# ------------------------------------------------------------------------------------------ keys and turns
def regenerated_turns(messages: list[dict[str, str]], last_only: bool) -> list[int]:
    """Indices of the assistant messages to replace."""
    idx = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    return idx[-1:] if last_only else idx


def _audio_key(ref: AudioRef) -> list[Any]:
    if ref.data is not None:
        return ["bytes", hashlib.sha256(ref.data).hexdigest()]
    if ref.array is not None:
        import numpy as np

        return ["array", hashlib.sha256(np.ascontiguousarray(ref.array).tobytes()).hexdigest(), ref.sample_rate]
    return ["path", ref.path, ref.offset, ref.duration]


def prefix_key(item: Conversation | BadInput, last_only: bool) -> str:
    """Content hash of what regenerating ``item`` reads (replaced turns blanked): the resume key."""
    if isinstance(item, BadInput):
        doc: Any = ["bad", item.sample_id, item.source, item.line, item.reason]
    else:
        turns = set(regenerated_turns(item.messages, last_only))
        msgs = [[m["role"], None if i in turns else m["content"]]
                + ([] if i in turns or "token_ids" not in m else [m["token_ids"], bool(m.get("truncated"))])
                for i, m in enumerate(item.messages)]
        doc = [item.sample_id, msgs, [_audio_key(a) for a in item.audios]]
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def output_record(conv: Conversation, messages: list[dict[str, str]], out_dir: Path, placeholder: str,
                  fingerprint: str, truncated: bool) -> dict[str, Any]:
    """The conversation as a JSONL record capture reads back: the input record's other fields kept,
    turns rewritten (text with placeholders, each listing its audios relative to the output)."""
    audios = list(conv.audios)
    turns = []
    for m in messages:
        n = m["content"].count(placeholder)
        turn: dict[str, Any] = {"from": m["role"], "type": "text", "value": m["content"]}
        turn.update({k: m[k] for k in ("token_ids", "truncated") if k in m})
        if n:
            turn["audio"] = [_audio_entry(a, out_dir) for a in audios[:n]]
            audios = audios[n:]
        turns.append(turn)
    rec = {k: v for k, v in (conv.record or {}).items() if k not in ("conversations", "messages", "sample_id")}
    rec.update(id=conv.sample_id, conversations=turns, regenerated_by=fingerprint)
    if truncated:
        rec["truncated"] = True
    return rec


def _audio_entry(ref: AudioRef, out_dir: Path) -> dict[str, Any]:
    if ref.path is None:  # bytes or an array: write it beside the output so the record can point at it
        import soundfile as sf

        d = out_dir / "audio"
        d.mkdir(parents=True, exist_ok=True)
        if ref.data is not None:
            name = hashlib.sha256(ref.data).hexdigest()[:20]
            ext = {b"RIFF": ".wav", b"fLaC": ".flac", b"OggS": ".ogg"}.get(ref.data[:4], ".audio")
            path = d / (name + ext)
            if not path.is_file():
                with staged(path) as tmp:
                    tmp.write_bytes(ref.data)
        else:
            import numpy as np

            arr = np.ascontiguousarray(ref.array, dtype=np.float32)
            path = d / (hashlib.sha256(arr.tobytes()).hexdigest()[:20] + ".wav")
            if not path.is_file():
                with staged(path) as tmp:
                    sf.write(str(tmp), arr, int(ref.sample_rate or 16000), subtype="FLOAT", format="WAV")
        rel = path.relative_to(out_dir).as_posix()
    else:
        rel = Path(ref.path).resolve().as_posix()
        try:
            rel = Path(rel).relative_to(out_dir.resolve()).as_posix()
        except ValueError:
            rel = os.path.relpath(rel, out_dir.resolve())
    e: dict[str, Any] = {"path": rel}
    if ref.offset:
        e["offset"] = ref.offset
    if ref.duration is not None:
        e["duration"] = ref.duration
    return e


class RegenerateError(TapdraftError, ValueError):
    """A bad input stopped the run (on_error='fail'); finished windows are kept for the rerun."""


# ------------------------------------------------------------------------------------------ one window
@dataclass
class RunStats:
    """This run's work (a resume counts only what it computed)."""

    conversations: int = 0
    replies: int = 0
    tokens: int = 0
    dropped: Counter = field(default_factory=Counter)
    seconds: float = 0.0
    turns_settled: int = 0
    """Regenerated turns done with: replied, or given up with their conversation (a drop, a bad input); the
    progress bar counts these, so it moves with every reply, not with every window."""


@dataclass
class _Live:
    li: int
    gi: int
    key: str
    conv: Conversation
    messages: list[dict[str, str]]
    turns: list[int]
    placeholder: str
    truncated: bool = False
    last: Generation | None = None
    """The last reply kept (its states, for fused capture, when the budget ends the conversation after it)."""


def _drop(key: str, gi: int, sample_id: str, reason: str, message: str) -> dict[str, Any]:
    return {"key": key, "gi": gi, "status": reason, "sample_id": sample_id, "message": message}


def _prompt(target: Target, lv: _Live, turn: int) -> Prepared:
    msgs = lv.messages[:turn]
    n_audio = sum(m["content"].count(lv.placeholder) for m in msgs)
    return target.prepare_prompt(replace(lv.conv, messages=msgs, audios=lv.conv.audios[:n_audio]), lv.li)


def _check(target: Target, replies: ReplyConfig, lv: _Live, turn: int, g: Generation) -> tuple[str, str] | None:
    """Why a reply is dropped, or None; on success the reply replaces the turn in ``lv.messages``."""
    if g.error:
        return "generation_error", "the target produced NaN/Inf logits"
    if not g.tokens:
        return "empty", "the target ended its turn at once"
    if g.truncated and not replies.keep_truncated:
        return "truncated", f"no end of turn within max_new_tokens={replies.generation.max_new_tokens}"
    text = target.tokenizer.decode(g.tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if lv.placeholder in text:
        return "placeholder", f"the reply contains the audio placeholder {lv.placeholder!r}, which reads back as audio"
    reply = {"role": "assistant", "content": text, "token_ids": list(g.tokens), **({"truncated": True}
                                                                                   if g.truncated else {})}
    try:
        placed = target.reply_ids(lv.messages[:turn] + [reply]) == g.ids
    except ValueError:
        placed = False
    if not placed:  # the template rewrites the reply: kept as text only when the text renders to the same ids
        reply = {"role": "assistant", "content": text}
        try:
            rendered = target.reply_ids(lv.messages[:turn] + [reply])
        except ValueError:
            rendered = []
        if (rendered[: len(g.tokens)] if g.truncated else rendered) != g.ids:
            return "unplaced", ("the chat template does not write the reply's ids where they were generated (it "
                                "rewrites the text or ends the turn with another id), and its text renders to "
                                "other ids")
    lv.messages[turn] = reply
    lv.truncated |= g.truncated
    lv.last = g
    return None


def _budget_entry(lv: _Live, r: int, out_dir: Path | None, fingerprint: str, states: bool) -> dict[str, Any]:
    """Round ``r`` of ``lv`` would pass the conversation's token budget: the conversation ends at its last kept
    reply (``cut_turns`` counts the turns it loses), or is dropped as ``over_budget`` when ``r`` is its first."""
    if r == 0:
        return _drop(lv.key, lv.gi, lv.conv.sample_id, "over_budget",
                     "its first turn's prompt + max_new_tokens passes --max-conversation-tokens")
    msgs = lv.messages[: lv.turns[r - 1] + 1]
    e: dict[str, Any] = {"key": lv.key, "gi": lv.gi, "status": "ok", "cut_turns": len(lv.turns) - r}
    if out_dir is not None:
        e["record"] = output_record(lv.conv, msgs, out_dir, lv.placeholder, fingerprint, lv.truncated)
    if states:
        e["generation"], e["conversation"] = lv.last, replace(lv.conv, messages=msgs)
    return e


BAD_INPUT_REASONS = ("bad_input", "no_user_turn", "too_long")
"""Drop reasons that are the input's fault (``on_error='fail'`` stops on them)."""
REPLY_DROP_REASONS = ("truncated", "empty", "unplaced", "placeholder", "generation_error", "over_budget")
"""Drop reasons that are the reply's (always counted, never an error)."""


def process_window(
    target: Target, replies: ReplyConfig, chunk: list[tuple[int, int, Any, str]], *, batch_tokens: int,
    max_batch_size: int, on_error: str, stats: RunStats, fingerprint: str = "", out_dir: Path | None = None,
    tap_ids: list[int] | None = None, report: Callable[[], None] = lambda: None,
) -> list[dict[str, Any]]:
    """Regenerate one window's conversations ((local index, global index, item, key)) -> one entry each:
    ``status`` 'ok' or the drop reason, plus the output ``record`` (when ``out_dir`` is given) and, with
    ``tap_ids``, the final reply's :class:`Generation` (its states, for fused capture) and ``conversation``."""
    entries: dict[int, dict[str, Any]] = {}
    live: list[_Live] = []
    ctx = context_length(target)
    max_new = replies.generation.max_new_tokens

    def bad(li: int, gi: int, key: str, sid: str, reason: str, msg: str, line=None, src="") -> None:
        if on_error == "fail":
            raise RegenerateError(f"bad input {sid!r} ({src}, line {line}): {msg}. Finished windows are kept; fix "
                                  "the input, or rerun the same command with --on-error skip to count and skip it.")
        entries[li] = _drop(key, gi, sid, reason, msg)

    for li, gi, item, key in chunk:
        if isinstance(item, BadInput):
            bad(li, gi, key, item.sample_id, "bad_input", item.reason, item.line, item.source)
            stats.turns_settled += 1
            continue
        turns = regenerated_turns(item.messages, replies.last_turn_only)
        if not all(any(m["role"] == "user" for m in item.messages[:t]) for t in turns):
            stats.turns_settled += max(1, len(turns))
            bad(li, gi, key, item.sample_id, "no_user_turn", "an assistant turn to regenerate has no user turn "
                "before it", item.line, item.source)
            continue
        live.append(_Live(li, gi, key, item, [dict(m) for m in item.messages], turns, target.input_placeholder))
    r = 0
    while live:
        prompts: dict[int, Prepared] = {}
        for lv in live:
            c = lv.conv
            try:
                p = _prompt(target, lv, lv.turns[r])
            except (ValueError, OSError) as e:
                stats.turns_settled += len(lv.turns) - r
                bad(lv.li, lv.gi, lv.key, c.sample_id, "bad_input", str(e), c.line, c.source)
                continue
            if ctx is not None and p.length + max_new > ctx:
                stats.turns_settled += len(lv.turns) - r
                bad(lv.li, lv.gi, lv.key, c.sample_id, "too_long", f"too long: prompt of {p.length} positions + "
                    f"max_new_tokens {max_new} > the target's context of {ctx}", c.line, c.source)
                continue
            if replies.over_budget(p.length):
                stats.turns_settled += len(lv.turns) - r
                entries[lv.li] = _budget_entry(lv, r, out_dir, fingerprint, tap_ids is not None)
                stats.dropped.update(["over_budget"] * (r == 0))
                continue
            prompts[lv.li] = p
        by_li = {lv.li: lv for lv in live}
        finals: dict[int, Generation] = {}
        for g in bucket({li: p.length + max_new for li, p in prompts.items()}, batch_tokens=batch_tokens,
                        max_batch_size=max_batch_size):
            seeds = [row_seed(replies.generation.seed, by_li[li].conv.sample_id, r) for li in g]
            gens = generate(target, [prompts[li] for li in g], replies.generation, seeds=seeds, tap_ids=tap_ids)
            for li, gen in zip(g, gens):
                lv = by_li[li]
                stats.tokens += len(gen.ids)
                stats.turns_settled += 1
                why = _check(target, replies, lv, lv.turns[r], gen)
                if why is not None:
                    entries[li] = _drop(lv.key, lv.gi, lv.conv.sample_id, *why)
                    stats.dropped[why[0]] += 1
                    stats.turns_settled += len(lv.turns) - r - 1
                else:
                    stats.replies += 1
                    finals[li] = gen
            report()
        nxt = []
        for lv in live:
            if lv.li in entries or lv.li not in finals:
                continue
            if r + 1 < len(lv.turns):
                nxt.append(lv)
                continue
            e: dict[str, Any] = {"key": lv.key, "gi": lv.gi, "status": "ok"}
            if out_dir is not None:
                e["record"] = output_record(lv.conv, lv.messages, out_dir, lv.placeholder, fingerprint, lv.truncated)
            if tap_ids is not None:
                e["generation"], e["conversation"] = finals[lv.li], replace(lv.conv, messages=lv.messages)
            entries[lv.li] = e
        live, r = nxt, r + 1
    for e in entries.values():
        if e["status"] in BAD_INPUT_REASONS:
            stats.dropped[e["status"]] += 1
    stats.conversations += len(chunk)
    return [entries[li] for li, *_ in chunk]
