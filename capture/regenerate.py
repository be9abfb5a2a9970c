"""``tapdraft regenerate``: replace assistant turns with the target's own replies, resumably.

A drafter learns the target's distribution best from the target's own replies. For each
conversation every assistant turn (or only the last) is replaced by what the target says given
everything before it (earlier turns already replaced), decoded by :mod:`capture.generate`.

Stages, per rank (``rank_slice`` of the input, as capture does):

    windows of ``window`` conversations -> skip those already done (keyed, below)
    round r = the r-th regenerated turn of every live conversation: prepare the prompt (template's
        generation prompt, audio decoded), bucket by prompt + max_new_tokens, generate, check
    part file: one JSON line per conversation (its record, or why it was dropped), written atomically

Resume is keyed by a content hash of what the regeneration reads (:func:`prefix_key`: sample id,
the turns with the replaced ones blanked, audio references), never by row position: a rerun after
kill -9 skips exactly the conversations whose part is on disk and recomputes the others with the
same windows, batches and seeds, so the merged file equals an uninterrupted run's. A window's part is
written whole or not at all, so nothing is duplicated or lost.

Dropped, counted by reason (``--keep-truncated`` keeps truncated replies, marked ``truncated``):
``truncated`` (max_new_tokens without an end of turn), ``empty``, ``retokenized`` (the reply's text
renders to other ids than were generated, so a capture of the text would not see the target's
tokens), ``placeholder`` (the reply holds the audio placeholder, which would read back as an audio),
``generation_error`` (NaN/Inf logits); bad input (``no_user_turn``, ``bad_input`` such as
audio that fails to decode, ``too_long`` for the context) is skipped and counted, or stops the run
with one line under ``on_error='fail'``. Rank 0 merges every rank's parts in input order, writes the
output shards (atomically), then the sidecar (:mod:`capture.provenance`), then removes the parts.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from capture.generate import Generation, context_length, generate, row_seed
from capture.inputs import BadInput, Conversation, read_inputs
from capture.stages import barrier, bucket, dist_env, numbered, rank_slice, resolve_device, resolve_dtype, windows
from capture.salm import DEFAULT_PLACEHOLDER
from capture.provenance import sidecar_path, target_fingerprint
from capture.replies import ReplyConfig, output_record, prefix_key, regenerated_turns
from capture.targets import Prepared, Target
from shards.atomic import staged

DTYPES = ("auto", "float32", "bfloat16", "float16")


class RegenerateError(ValueError):
    """A bad input stopped the run (on_error='fail'); finished windows are kept for the rerun."""


@dataclass(frozen=True)
class RegenerateConfig:
    """One regeneration: target, input, output, how replies are decoded and batched."""

    target: str
    """Target directory (any kind ``capture.load.load_target`` loads)."""
    data: str
    """Input conversations: a JSONL manifest, a directory of JSONL shards, an HF dataset dir or ``hf:NAME[:split]``."""
    out: str
    """``FILE.jsonl``, or a directory that receives JSONL shards."""
    replies: ReplyConfig = field(default_factory=ReplyConfig)
    """Which turns are rewritten and how they are decoded."""
    max_samples: int | None = None
    """Only the first N conversations of the input."""
    batch_tokens: int = 16384
    """Padded (prompt + max_new_tokens) tokens per generation batch."""
    max_batch_size: int = 64
    """Conversations per generation batch at most."""
    window: int = 256
    """Conversations per part file: the unit a resume recomputes."""
    shard_size: int = 100_000
    """Conversations per output shard when ``out`` is a directory."""
    dtype: str = "auto"
    """Target compute dtype: 'auto' = bfloat16 on GPU, float32 on CPU."""
    device: str = "auto"
    """'auto' = cuda if available (cuda:LOCAL_RANK under torchrun), else cpu."""
    on_error: str = "skip"
    """Bad input: 'skip' counts it with its reason; 'fail' stops with one line (the run stays resumable)."""
    progress: bool = True
    """Show a progress bar with replies/s and tokens/s."""

    def __post_init__(self) -> None:
        if not isinstance(self.replies, ReplyConfig):
            raise ValueError("RegenerateConfig.replies must be a ReplyConfig")
        for name in ("batch_tokens", "max_batch_size", "window", "shard_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"RegenerateConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_samples is not None and self.max_samples < 1:
            raise ValueError(f"RegenerateConfig.max_samples must be >= 1, got {self.max_samples}")
        if self.on_error not in ("skip", "fail"):
            raise ValueError(f"RegenerateConfig.on_error must be 'skip' or 'fail', got {self.on_error!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"RegenerateConfig.dtype must be one of {DTYPES}, got {self.dtype!r}")

    def identity(self) -> dict[str, Any]:
        """What decides the output: a resume must match it exactly."""
        return {"data": self.data, **self.replies.to_dict(), "max_samples": self.max_samples, "batch_tokens": self.batch_tokens,
                "max_batch_size": self.max_batch_size, "window": self.window, "dtype": self.dtype}


# ------------------------------------------------------------------------------------------ one window
@dataclass
class RunStats:
    """This run's work (a resume counts only what it computed)."""

    conversations: int = 0
    replies: int = 0
    tokens: int = 0
    dropped: Counter = field(default_factory=Counter)
    seconds: float = 0.0


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


def _drop(lv_or_key: Any, gi: int, sample_id: str, reason: str, message: str) -> dict[str, Any]:
    return {"key": lv_or_key, "gi": gi, "status": reason, "sample_id": sample_id, "message": message}


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
    text = target.tokenizer.decode(g.tokens, skip_special_tokens=False)
    if lv.placeholder in text:
        return "placeholder", f"the reply contains the audio placeholder {lv.placeholder!r}, which reads back as audio"
    msgs = lv.messages[:turn] + [{"role": "assistant", "content": text}]
    rendered = target.reply_ids(msgs)
    if (rendered[: len(g.tokens)] if g.truncated else rendered) != g.ids:
        return "retokenized", "the reply's text renders to other token ids than the target generated"
    lv.messages[turn] = {"role": "assistant", "content": text}
    lv.truncated |= g.truncated
    return None


BAD_INPUT_REASONS = ("bad_input", "no_user_turn", "too_long")
"""Drop reasons that are the input's fault (``on_error='fail'`` stops on them)."""
REPLY_DROP_REASONS = ("truncated", "empty", "retokenized", "placeholder", "generation_error")
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
            continue
        turns = regenerated_turns(item.messages, replies.last_turn_only)
        if not all(any(m["role"] == "user" for m in item.messages[:t]) for t in turns):
            bad(li, gi, key, item.sample_id, "no_user_turn", "an assistant turn to regenerate has no user turn "
                "before it", item.line, item.source)
            continue
        live.append(_Live(li, gi, key, item, [dict(m) for m in item.messages], turns,
                          target.placeholder or DEFAULT_PLACEHOLDER))
    r = 0
    while live:
        prompts: dict[int, Prepared] = {}
        for lv in live:
            c = lv.conv
            try:
                p = _prompt(target, lv, lv.turns[r])
            except (ValueError, OSError) as e:
                bad(lv.li, lv.gi, lv.key, c.sample_id, "bad_input", str(e), c.line, c.source)
                continue
            if ctx is not None and p.length + max_new > ctx:
                bad(lv.li, lv.gi, lv.key, c.sample_id, "too_long", f"too long: prompt of {p.length} positions + "
                    f"max_new_tokens {max_new} > the target's context of {ctx}", c.line, c.source)
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
                why = _check(target, replies, lv, lv.turns[r], gen)
                if why is not None:
                    entries[li] = _drop(lv.key, lv.gi, lv.conv.sample_id, *why)
                    stats.dropped[why[0]] += 1
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


# ------------------------------------------------------------------------------------------ run, resume, merge
SETTINGS_FILE = "settings.json"


def work_dir(out: str | Path) -> Path:
    """Where the part files of an unfinished run live (removed once the output is complete)."""
    return Path(str(out).rstrip("/") + ".parts")


def _done_keys(work: Path) -> dict[str, dict[str, Any]]:
    done: dict[str, dict[str, Any]] = {}
    for part in sorted(work.glob("r*.jsonl")):
        for line in part.read_text().splitlines():
            e = json.loads(line)
            done.setdefault(e["key"], e)
    return done


def _keyed(items: Iterator[tuple[int, Any]], last_only: bool) -> Iterator[tuple[int, Any, str]]:
    for gi, item in items:
        yield gi, item, prefix_key(item, last_only)


def _rank_items(cfg: RegenerateConfig, placeholder: str, rank: int, world: int) -> Iterator[tuple[int, tuple]]:
    """(local index, (global index, item, key)) of this rank's slice."""
    keyed = _keyed(numbered(read_inputs(cfg.data, placeholder=placeholder), cfg.max_samples), cfg.replies.last_turn_only)
    return rank_slice(((gi, (gi, item, key)) for gi, item, key in keyed), rank, world)


def _check_settings(work: Path, current: dict[str, Any]) -> None:
    path = work / SETTINGS_FILE
    if not path.is_file():
        return
    old = json.loads(path.read_text())
    for k in sorted(set(old) | set(current)):
        if old.get(k) != current.get(k):
            raise ValueError(f"{work} holds an unfinished regeneration with {k}={old.get(k)!r}, this run has "
                             f"{k}={current.get(k)!r}. Rerun with the original settings to resume, or delete {work}.")


def regenerate(cfg: RegenerateConfig, *, target: Target | None = None) -> dict[str, Any]:
    """Run (or resume) a regeneration; returns the sidecar document plus this run's ``run_stats``."""
    from capture.load import load_target

    rank, world = dist_env()
    out, work = Path(cfg.out), work_dir(cfg.out)
    side = sidecar_path(out)
    if side.is_file():
        doc = json.loads(side.read_text())
        if doc.get("settings") != cfg.identity():
            raise ValueError(f"{cfg.out} already holds a regeneration with other settings; write to another --out")
        if rank == 0 and work.exists():
            shutil.rmtree(work)
        return {**doc, "run_stats": {"already_complete": True}}
    if target is None:
        device = resolve_device(cfg)  # type: ignore[arg-type]
        target = load_target(cfg.target, dtype=resolve_dtype(cfg, device), device=str(device))  # type: ignore[arg-type]
    target.template_kwargs = dict(cfg.replies.template_kwargs)
    fp = target_fingerprint(target)
    settings = {**cfg.identity(), "target_fingerprint": fp}
    _check_settings(work, settings)
    if rank == 0:
        work.mkdir(parents=True, exist_ok=True)
        if not (work / SETTINGS_FILE).is_file():
            with staged(work / SETTINGS_FILE) as tmp:
                tmp.write_text(json.dumps(settings, indent=2, sort_keys=True))
    barrier(world)
    out_dir = out.parent if out.suffix == ".jsonl" else out
    out_dir.mkdir(parents=True, exist_ok=True)
    placeholder = target.placeholder or DEFAULT_PLACEHOLDER  # as capture reads text-only inputs
    stats = RunStats()
    t0 = time.perf_counter()
    with torch.inference_mode():
        _run_rank(target, cfg, work, fp, out_dir, placeholder, rank, world, stats, t0)
    stats.seconds = time.perf_counter() - t0
    barrier(world)
    run_stats = {"conversations": stats.conversations, "replies": stats.replies, "tokens": stats.tokens,
                 "dropped": dict(stats.dropped), "seconds": round(stats.seconds, 3)}
    if rank != 0:
        return {"run_stats": run_stats, "rank": rank}
    doc = merge(cfg, work, out, placeholder, fp)
    return {**doc, "run_stats": run_stats}


def _run_rank(target: Target, cfg: RegenerateConfig, work: Path, fp: str, out_dir: Path, placeholder: str,
              rank: int, world: int, stats: RunStats, t0: float) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    done = _done_keys(work)
    total = sum(1 for _ in _rank_items(cfg, placeholder, rank, world))
    n_done = 0
    with Progress(TextColumn("regenerate"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[rates]}"), disable=not cfg.progress) as bar:
        task = bar.add_task("regenerate", total=total, rates="")

        def report() -> None:
            dt = max(time.perf_counter() - t0, 1e-9)
            bar.update(task, completed=n_done + stats.conversations,
                       rates=f"{stats.replies / dt:.1f} replies/s  {stats.tokens / dt:,.0f} tok/s")

        for w, chunk in enumerate(windows(_rank_items(cfg, placeholder, rank, world), cfg.window)):
            todo = [(li, gi, item, key) for li, (gi, item, key) in chunk if key not in done]
            if not todo:
                n_done += len(chunk)
                report()
                continue
            n_done += len(chunk) - len(todo)
            entries = process_window(target, cfg.replies, todo, batch_tokens=cfg.batch_tokens,
                                     max_batch_size=cfg.max_batch_size, on_error=cfg.on_error, stats=stats,
                                     fingerprint=fp, out_dir=out_dir, report=report)
            tag = hashlib.sha256("".join(e["key"] for e in entries).encode()).hexdigest()[:8]
            with staged(work / f"r{rank:05d}-w{w:07d}-{tag}.jsonl") as tmp:
                tmp.write_text("".join(json.dumps(e, sort_keys=True) + "\n" for e in entries))
            report()


def merge(cfg: RegenerateConfig, work: Path, out: Path, placeholder: str, fingerprint: str) -> dict[str, Any]:
    """Every rank's parts -> the output in input order (shards, then the sidecar last); removes the parts."""
    parts = _done_keys(work)
    records, counts, drops, seen = [], Counter(), [], set()
    for gi, item, key in _keyed(numbered(read_inputs(cfg.data, placeholder=placeholder), cfg.max_samples),
                                cfg.replies.last_turn_only):
        if key in seen:
            counts["duplicate"] += 1
            continue
        seen.add(key)
        e = parts.get(key)
        if e is None:
            raise AssertionError(f"input {gi} (key {key[:12]}) has no result in {work}: a rank did not finish")
        if e["status"] == "ok":
            records.append(e["record"])
        else:
            counts[e["status"]] += 1
            drops.append({k: e[k] for k in ("sample_id", "status", "message")})
    if out.suffix == ".jsonl":
        files = [out]
        chunks = [records]
    else:
        n = max(1, -(-len(records) // cfg.shard_size))
        files = [out / f"regenerated-{i:05d}-of-{n:05d}.jsonl" for i in range(n)]
        chunks = [records[i * cfg.shard_size:(i + 1) * cfg.shard_size] for i in range(n)]
    for path, chunk in zip(files, chunks):
        with staged(path) as tmp:
            tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in chunk))
    total = len(seen) + counts["duplicate"]
    doc = {
        "complete": True,
        "target": cfg.target,
        "target_fingerprint": fingerprint,
        "settings": cfg.identity(),
        "generation": cfg.replies.generation.to_dict(),
        "template_kwargs": cfg.replies.template_kwargs,
        "replies_from_target": cfg.replies.from_target,
        "files": [p.name for p in files],
        "counts": {"conversations": total, "written": len(records), "dropped": dict(sorted(counts.items()))},
        "dropped": drops[:1000],
    }
    with staged(sidecar_path(out)) as tmp:
        tmp.write_text(json.dumps(doc, indent=2, sort_keys=True))
    shutil.rmtree(work, ignore_errors=True)
    return doc


def summary(doc: dict[str, Any]) -> str:
    """One screen: written and dropped counts by reason, this run's rates."""
    c, rs = doc["counts"], doc.get("run_stats", {})
    lines = [f"{c['written']} of {c['conversations']} conversations written to {', '.join(doc['files'])}; "
             f"dropped {c['dropped'] or 0}"]
    if rs.get("already_complete"):
        lines.append("already complete; nothing to do")
    elif rs.get("seconds"):
        s = rs["seconds"]
        lines.append(f"this run: {rs['replies']} replies, {rs['tokens']:,} tokens in {s:.1f}s = "
                     f"{rs['replies'] / s:.2f} replies/s, {rs['tokens'] / s:,.0f} tok/s")
    g = doc["generation"]
    lines.append(("greedy" if g["greedy"] else f"sampled (temperature {g['temperature']}, top_p {g['top_p']}, "
                  f"seed {g['seed']})") + f", max_new_tokens {g['max_new_tokens']}, target "
                 f"{doc['target_fingerprint'][:12]}; replies_from_target={doc['replies_from_target']}")
    return "\n".join(lines)
