"""Regenerate through a continuous-batching engine: each conversation advances as soon as its reply finishes.

:func:`capture.replies.windows.process_window` runs a window round by round (every first reply, then every
second...) in padded batches, which an in-process decoder needs. An engine that schedules requests itself
(``capture.vllm.regenerate.VLLMReplies``: ``submit`` prompts, ``next`` reply as it finishes) is better fed one
conversation at a time: up to ``max_in_flight`` conversations are live, and when a reply finishes it is
checked (the same ``_check`` as the windowed path), the conversation's next turn is prompted with it at once
(a later turn needs the earlier replies), or the conversation is settled and the next one from the input
admitted. Windows overlap: window w + 1's conversations start while window w's longest replies still decode,
and each window's entries (in input order) are handed to ``write`` the moment its last conversation settles.
So the resume unit stays the window (``regenerate --window``: a kill loses the unfinished windows' work only),
and greedy replies, which do not depend on what else is in the batch, are the windowed path's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol

from tapdraft.capture.generation import Generation, ReplyConfig, context_length
from tapdraft.capture.inputs import BadInput
from tapdraft.capture.replies.windows import (BAD_INPUT_REASONS, RegenerateError, RunStats, _budget_entry, _check, _drop,
                                     _Live, _prompt, output_record, regenerated_turns)
from tapdraft.capture.targets.base import Prepared, Target


class ReplyEngine(Protocol):
    in_flight: int

    def submit(self, prompts: list[tuple[int, Prepared]]) -> None:
        """Decode (tag, prompt) pairs; a tag is its conversation's local index, the same on each of its turns."""
        ...

    def next(self) -> tuple[int, Generation]: ...

    def stats(self) -> dict[str, Any]:
        """What the run's prompts cost the engine (recorded in ``run_stats["engine"]``)."""
        ...


@dataclass
class _Window:
    w: int
    n: int
    lis: list[int] = field(default_factory=list)
    entries: dict[int, dict[str, Any]] = field(default_factory=dict)


def stream_windows(engine: ReplyEngine, target: Target, replies: ReplyConfig,
                   windows: Iterable[tuple[int, list[tuple[int, int, Any, str]]]], *, max_in_flight: int,
                   on_error: str, stats: RunStats, fingerprint: str, out_dir: Path,
                   write: Callable[[int, list[dict[str, Any]]], None],
                   report: Callable[[], None] = lambda: None) -> None:
    """Regenerate the conversations of ``windows`` ((w, [(local index, global index, item, key)])), handing each
    window's entries to ``write(w, entries)`` once all its conversations are settled (module docstring)."""
    ctx = context_length(target)
    max_new = replies.generation.max_new_tokens
    open_: dict[int, _Window] = {}
    owner: dict[int, _Window] = {}
    live: dict[int, tuple[_Live, int]] = {}  # local index -> (conversation, its round)
    source = ((_Window(w, len(chunk)), li, gi, item, key) for w, chunk in windows if chunk
              for li, gi, item, key in chunk)
    pending: list[tuple[int, Prepared]] = []

    def settle(li: int, entry: dict[str, Any]) -> None:
        win = owner.pop(li)
        win.entries[li] = entry
        live.pop(li, None)
        if len(win.entries) == win.n:
            del open_[win.w]
            for e in win.entries.values():
                if e["status"] in BAD_INPUT_REASONS:
                    stats.dropped[e["status"]] += 1
            stats.conversations += win.n
            write(win.w, [win.entries[i] for i in win.lis])

    def bad(lv_li: int, gi: int, key: str, sid: str, reason: str, msg: str, line=None, src="") -> None:
        if on_error == "fail":
            raise RegenerateError(f"bad input {sid!r} ({src}, line {line}): {msg}. Finished windows are kept; fix "
                                  "the input, or rerun the same command with --on-error skip to count and skip it.")
        stats.turns_settled += 1
        settle(lv_li, _drop(key, gi, sid, reason, msg))

    def prompt(lv: _Live, r: int) -> None:
        """Queue round ``r`` of ``lv`` or settle it as bad input."""
        c = lv.conv
        try:
            p = _prompt(target, lv, lv.turns[r])
        except (ValueError, OSError) as e:
            stats.turns_settled += len(lv.turns) - r - 1
            return bad(lv.li, lv.gi, lv.key, c.sample_id, "bad_input", str(e), c.line, c.source)
        if ctx is not None and p.length + max_new > ctx:
            stats.turns_settled += len(lv.turns) - r - 1
            return bad(lv.li, lv.gi, lv.key, c.sample_id, "too_long", f"too long: prompt of {p.length} positions + "
                       f"max_new_tokens {max_new} > the target's context of {ctx}", c.line, c.source)
        if replies.over_budget(p.length):
            stats.turns_settled += len(lv.turns) - r
            stats.dropped.update(["over_budget"] * (r == 0))
            return settle(lv.li, _budget_entry(lv, r, out_dir, fingerprint, False))
        live[lv.li] = (lv, r)
        pending.append((lv.li, p))

    def admit() -> bool:
        """Start the next conversation of the input; False when there is none."""
        nxt = next(source, None)
        if nxt is None:
            return False
        win, li, gi, item, key = nxt
        win = open_.setdefault(win.w, win)
        owner[li] = win
        win.lis.append(li)
        if isinstance(item, BadInput):
            bad(li, gi, key, item.sample_id, "bad_input", item.reason, item.line, item.source)
            return True
        turns = regenerated_turns(item.messages, replies.last_turn_only)
        if not all(any(m["role"] == "user" for m in item.messages[:t]) for t in turns):
            stats.turns_settled += max(1, len(turns)) - 1
            bad(li, gi, key, item.sample_id, "no_user_turn", "an assistant turn to regenerate has no user turn "
                "before it", item.line, item.source)
            return True
        prompt(_Live(li, gi, key, item, [dict(m) for m in item.messages], turns, target.input_placeholder), 0)
        return True

    more = True
    while True:
        while more and len(live) < max_in_flight:
            more = admit()
        if pending:
            engine.submit(pending)
            pending = []
        if not live:
            break
        li, gen = engine.next()
        lv, r = live[li]
        stats.tokens += len(gen.ids)
        stats.turns_settled += 1
        why = _check(target, replies, lv, lv.turns[r], gen)
        if why is not None:
            stats.dropped[why[0]] += 1
            stats.turns_settled += len(lv.turns) - r - 1
            settle(li, _drop(lv.key, lv.gi, lv.conv.sample_id, *why))
        else:
            stats.replies += 1
            if r + 1 < len(lv.turns):
                prompt(lv, r + 1)
            else:
                settle(li, {"key": lv.key, "gi": lv.gi, "status": "ok",
                            "record": output_record(lv.conv, lv.messages, out_dir, lv.placeholder, fingerprint,
                                                    lv.truncated)})
        report()
    assert not open_, f"windows {sorted(open_)} were not settled"
