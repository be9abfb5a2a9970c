"""``tapdraft regenerate``: replace assistant turns with the target's own replies, resumably.

A drafter learns the target's distribution best from the target's own replies. For each
conversation every assistant turn (or only the last) is replaced by what the target says given
everything before it (earlier turns already replaced), decoded by :mod:`capture.replies.generate`.

Stages, per rank (``rank_slice`` of the input, as capture does):

    windows of ``window`` conversations (``--window``, 32) -> skip those already done (keyed, below)
    in-process (``engine='transformers'``): capture.replies.process_window: round r = the r-th regenerated
        turn of every live conversation, prompt prepared (template's generation prompt, audio decoded),
        bucketed by prompt + max_new_tokens, generated, checked
    ``engine='vllm'``: capture.replies.stream over capture.vllm.regenerate: up to ``max_batch_size``
        conversations in flight in vLLM (continuous batching), each reply checked as it finishes and the
        conversation's next turn sent at once; windows overlap, each written when its last conversation settles
    part file: one JSON line per conversation (its record, or why it was dropped), written atomically

The progress bar counts replies (regenerated turns) as they finish, never whole windows. The window is the
resume unit, set by ``--window`` (default 32; it was a fixed 256, and a kill of a real run at 36-75 tokens/s
lost minutes); in-process it also bounds the padded batches, through vLLM it costs nothing (batching
crosses windows), so a small one there loses only seconds to a kill. Greedy replies through vLLM are the
in-process engine's token for token (tests/engines/test_vllm_regenerate.py), so the same output file, unless
``--prefix-caching`` reuses earlier turns' KV (``RegenerateConfig.prefix_caching``: faster on multi-turn data, equal
up to rounding);
its sidecar's settings name the engine. Sampling through vLLM is refused (its sampler is not tapdraft's
seeded one).

Resume is keyed by a content hash of what the regeneration reads (:func:`prefix_key`: sample id,
the turns with the replaced ones blanked, audio references), never by row position: a rerun after
kill -9 skips exactly the conversations whose part is on disk and recomputes the others with the
same windows, batches and seeds, so the merged file equals an uninterrupted run's. A window's part is
written whole or not at all, so nothing is duplicated or lost.

Each reply is written with the ids the target generated (``token_ids`` on its turn), which capture
stores as they are: no text round trip, which lost 8% of one real run's replies to a BPE tokenizer
that re-encodes decoded text differently (the old ``retokenized`` drop).

Dropped, counted by reason (``--on-limit keep`` keeps truncated replies, marked ``truncated``; the
default ``drop`` makes a target that never ends its turns show as drops): ``truncated``
(max_new_tokens without an end of turn), ``empty``, ``unplaced`` (the chat template does not write
the reply verbatim after its prompt, or ends the turn with another id than the target generated, so
the ids have no place in a capture, and the reply's text renders to other ids too; when the text does
render to the generated ids the reply is kept as text alone), ``placeholder`` (the reply holds the
audio placeholder, which would read back as an audio),
``over_budget`` (the first turn's prompt + max_new_tokens passes ``--max-conversation-tokens``; a later
turn that would pass it ends the conversation at the reply before it instead: kept, and counted as
``cut`` with the turns it lost),
``generation_error`` (NaN/Inf logits); bad input (``no_user_turn``, ``bad_input`` such as
audio that fails to decode, ``too_long`` for the context) is skipped and counted, or stops the run
with one line under ``on_error='fail'``. Rank 0 merges every rank's parts in input order, writes the
output shards (atomically), then the sidecar (:mod:`capture.provenance`; counts by reason and the
first 1000 dropped conversations with their reasons), then removes the parts.

One regeneration writes an output at a time: each rank holds ``common.lock.exclusive_lock`` on
``OUT.regenerate-rankNNNNN.lock`` (beside the output, like ``OUT.parts``, so removing the parts never
removes a held lock) for the whole run; a second one is refused at once, a killed one's lock is stale
and taken over.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from tapdraft.capture.config import VLLMConfig
from tapdraft.capture.engines import DEFAULT_ENGINE, ENGINES, get_engine
from tapdraft.capture.inputs import BadInput, read_inputs
from tapdraft.capture.provenance import sidecar_path, target_fingerprint
from tapdraft.capture.replies.requests import read_requests_provenance
from tapdraft.capture.replies.stream import stream_windows
from tapdraft.capture.replies.windows import ReplyConfig, RunStats, prefix_key, process_window, regenerated_turns
from tapdraft.capture.stages import barrier, dist_env, numbered, rank_slice, resolve_device, resolve_dtype, windows
from tapdraft.capture.targets.base import Target
from tapdraft.common.atomic import staged
from tapdraft.common.lock import exclusive_lock
from tapdraft.common.progress import Progress
from tapdraft.common.template import read_template_file, template_kwargs, template_sha

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class RegenerateConfig:
    """One regeneration: target, input, output, how replies are decoded and batched."""

    target: str
    """Target directory (any kind ``capture.targets.load.load_target`` loads)."""
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
    """Conversations per generation batch at most (engine 'vllm': conversations in flight at once)."""
    window: int = 32
    """Conversations per part file: the unit a resume recomputes (a kill loses the unfinished windows only)."""
    shard_size: int = 100_000
    """Conversations per output shard when ``out`` is a directory."""
    dtype: str = "auto"
    """Target compute dtype: 'auto' = bfloat16 on GPU, float32 on CPU."""
    device: str = "auto"
    """'auto' = cuda if available (cuda:LOCAL_RANK under torchrun), else cpu."""
    chat_template: str | None = None
    """Jinja file replacing the target tokenizer's chat template; None uses the tokenizer's own."""
    template_kwargs: tuple[tuple[str, Any], ...] = ()
    """Variables the chat template is rendered with (enable_thinking, a system prompt...); in the fingerprint."""
    llm_config: str | None = None
    """NeMo SALM checkpoints only: a local directory with the LLM's config.json and tokenizer (as for capture)."""
    on_error: str = "fail"
    """Bad input: 'fail' stops with one line (the run stays resumable); 'skip' counts it with its reason. Capture
    has the same default: a bad input stops a command unless ``--on-error skip`` is given."""
    allow_outside_paths: bool = False
    """Let a JSONL's audio paths leave its directory (as capture's ``allow_outside_paths``; not in the resume key)."""
    progress: bool = True
    """Show a progress bar with replies/s and tokens/s."""
    engine: str = DEFAULT_ENGINE
    """What decodes, a name in ``capture.engines.ENGINES``: 'transformers' (in-process, padded batches) or 'vllm'
    (capture's vLLM worker in generate mode, continuous batching; greedy only)."""
    vllm: VLLMConfig | None = None
    """With engine 'vllm': its parallel sizes and CPU KV cache (None = VLLMConfig's defaults)."""
    vllm_python: str | None = None
    """With engine 'vllm': the python of the environment vLLM is installed in (None = this interpreter)."""
    prefix_caching: bool = False
    """With engine 'vllm': vLLM's prefix caching, so a conversation's next turn reuses the KV of the turns before it
    instead of prefilling them again (multi-turn data is prefilled about once, not once per turn). A reused block's
    KV was computed in another step and batch than a fresh prefill computes it, so at a near-tie a reply may take
    the other token than the in-process engine's, and a rerun after a kill may not repeat a window token for token:
    the replies are the target's greedy ones up to rounding. Recorded in the settings a resume must match."""

    def __post_init__(self) -> None:
        if not isinstance(self.replies, ReplyConfig):
            raise ValueError("RegenerateConfig.replies must be a ReplyConfig")
        get_engine(self.engine, "RegenerateConfig.engine").check_regenerate(self)
        for name in ("batch_tokens", "max_batch_size", "window", "shard_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"RegenerateConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_samples is not None and self.max_samples < 1:
            raise ValueError(f"RegenerateConfig.max_samples must be >= 1, got {self.max_samples}")
        if self.on_error not in ("skip", "fail"):
            raise ValueError(f"RegenerateConfig.on_error must be 'skip' or 'fail', got {self.on_error!r}")
        object.__setattr__(self, "template_kwargs", tuple(template_kwargs(self.template_kwargs).items()))
        if self.dtype not in DTYPES:
            raise ValueError(f"RegenerateConfig.dtype must be one of {DTYPES}, got {self.dtype!r}")

    def identity(self) -> dict[str, Any]:
        """What decides the output: a resume must match it exactly."""
        return {"data": self.data, **self.replies.to_dict(), "chat_template": self.chat_template,
                "template_kwargs": dict(self.template_kwargs), "max_samples": self.max_samples,
                "batch_tokens": self.batch_tokens, "max_batch_size": self.max_batch_size, "window": self.window,
                "dtype": self.dtype, **({"engine": self.engine} if self.engine != DEFAULT_ENGINE else {}),
                **({"prefix_caching": True} if self.prefix_caching else {})}


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


def _inputs(cfg: RegenerateConfig, placeholder: str) -> Iterator[Any]:
    return read_inputs(cfg.data, placeholder=placeholder, allow_outside_paths=cfg.allow_outside_paths)


def _rank_items(cfg: RegenerateConfig, placeholder: str, rank: int, world: int) -> Iterator[tuple[int, tuple]]:
    """(local index, (global index, item, key)) of this rank's slice."""
    items = numbered(_inputs(cfg, placeholder), cfg.max_samples)
    keyed = _keyed(items, cfg.replies.last_turn_only)
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


def lock_path(out: str | Path, rank: int) -> Path:
    """Rank ``rank``'s lock file for output ``out``: beside it, removed on release (see ``common.lock``)."""
    return Path(str(out).rstrip("/") + f".regenerate-rank{rank:05d}.lock")


def regenerate(cfg: RegenerateConfig, *, target: Target | None = None) -> dict[str, Any]:
    """Run (or resume) a regeneration; returns the sidecar document plus this run's ``run_stats``.

    This rank holds its exclusive lock on ``cfg.out`` throughout (a second regeneration is refused)."""
    rank, world = dist_env()
    with exclusive_lock(lock_path(cfg.out, rank), f"a regeneration (rank {rank})", guards=cfg.out):
        return {**_regenerate_locked(cfg, target, rank, world), "output": str(Path(cfg.out).resolve())}


def _regenerate_locked(cfg: RegenerateConfig, target: Target | None, rank: int, world: int) -> dict[str, Any]:
    from tapdraft.capture.targets.load import load_target

    out, work = Path(cfg.out), work_dir(cfg.out)
    side = sidecar_path(out)
    if side.is_file():
        doc = json.loads(side.read_text())
        if doc.get("settings") != cfg.identity():
            raise ValueError(f"{cfg.out} already holds a regeneration with other settings; write to another --out")
        if rank == 0 and work.exists():
            shutil.rmtree(work)
        return {**doc, "run_stats": {"already_complete": True}}
    template = None if cfg.chat_template is None else read_template_file(cfg.chat_template)
    engine_kind = ENGINES[cfg.engine]
    engine_kind.preflight(cfg)  # before anything is loaded or written
    device = resolve_device(cfg.device)
    if target is None:
        target = load_target(cfg.target, dtype=resolve_dtype(cfg.dtype, device), device=str(device),
                             llm_config=cfg.llm_config, template=template, template_kwargs=dict(cfg.template_kwargs),
                             head_only=not engine_kind.loads_decoder)  # vLLM's runs elsewhere: tokenizer and head here
    elif template is not None or cfg.template_kwargs:
        target.use_template(template, dict(cfg.template_kwargs))
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
    placeholder = target.input_placeholder
    stats = RunStats()
    with engine_kind.reply_session(cfg, target, device) as engine, torch.inference_mode():
        t0 = time.perf_counter()  # after the engine's start: rates are decoding's
        _run_rank(target, engine, cfg, work, fp, out_dir, placeholder, rank, world, stats, t0)
        stats.seconds = time.perf_counter() - t0
    barrier(world)
    run_stats = {"conversations": stats.conversations, "replies": stats.replies, "tokens": stats.tokens,
                 "dropped": dict(stats.dropped), "seconds": round(stats.seconds, 3)}
    if engine is not None:
        run_stats["engine"] = {"name": cfg.engine, "version": engine.version, "startup_s": round(engine.startup_s, 3),
                               **engine.stats()}
    if rank != 0:
        return {"run_stats": run_stats, "rank": rank}
    doc = merge(cfg, work, out, placeholder, fp, target.template.text)
    return {**doc, "run_stats": run_stats}


def _turns(item: Any, last_only: bool) -> int:
    """Replies a conversation asks for: the progress bar's unit (a bad input counts one)."""
    return 1 if isinstance(item, BadInput) else max(1, len(regenerated_turns(item.messages, last_only)))


def _run_rank(target: Target, engine: Any, cfg: RegenerateConfig, work: Path, fp: str, out_dir: Path,
              placeholder: str, rank: int, world: int, stats: RunStats, t0: float) -> None:
    done = _done_keys(work)
    last_only = cfg.replies.last_turn_only
    total = n_done = 0
    for _, (_, item, key) in _rank_items(cfg, placeholder, rank, world):
        n = _turns(item, last_only)
        total += n
        n_done += n if key in done else 0
    with Progress("regenerate", total, enabled=cfg.progress) as bar:  # counts replies

        def report() -> None:
            dt = max(time.perf_counter() - t0, 1e-9)
            rates = f"{stats.replies / dt:.1f} replies/s  {stats.tokens / dt:,.0f} tok/s"
            bar.update(n_done + stats.turns_settled, rates)

        def write(w: int, entries: list[dict[str, Any]]) -> None:
            tag = hashlib.sha256("".join(e["key"] for e in entries).encode()).hexdigest()[:8]
            with staged(work / f"r{rank:05d}-w{w:07d}-{tag}.jsonl") as tmp:
                tmp.write_text("".join(json.dumps(e, sort_keys=True) + "\n" for e in entries))

        todo = ((w, [(li, gi, item, key) for li, (gi, item, key) in chunk if key not in done])
                for w, chunk in enumerate(windows(_rank_items(cfg, placeholder, rank, world), cfg.window)))
        if engine is not None:
            stream_windows(engine, target, cfg.replies, todo, max_in_flight=cfg.max_batch_size,
                           on_error=cfg.on_error, stats=stats, fingerprint=fp, out_dir=out_dir, write=write,
                           report=report)
        else:
            for w, chunk in todo:
                if chunk:
                    write(w, process_window(target, cfg.replies, chunk, batch_tokens=cfg.batch_tokens,
                                            max_batch_size=cfg.max_batch_size, on_error=cfg.on_error, stats=stats,
                                            fingerprint=fp, out_dir=out_dir, report=report))
                report()


def merge(cfg: RegenerateConfig, work: Path, out: Path, placeholder: str, fingerprint: str,
          template_text: str | None = None) -> dict[str, Any]:
    """Every rank's parts -> the output in input order (shards, then the sidecar last); removes the parts."""
    parts = _done_keys(work)
    records, counts, drops, seen, cut = [], Counter(), [], set(), Counter()
    for gi, item, key in _keyed(numbered(_inputs(cfg, placeholder), cfg.max_samples),
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
            if e.get("cut_turns"):
                cut["conversations"] += 1
                cut["turns"] += e["cut_turns"]
        else:
            counts[e["status"]] += 1
            drops.append({k: e[k] for k in ("sample_id", "status", "message")})
    total = len(seen) + counts["duplicate"]
    if not records and total:
        shutil.rmtree(work, ignore_errors=True)  # nothing to resume: a rerun should change a setting
        raise ValueError(f"regenerate wrote nothing: all {total} conversation(s) were dropped "
                         f"({_counted(counts)}). {drop_advice(counts, cfg, drops)} "
                         f"Nothing was written to {out.resolve()}.")
    if len(records) < total / 2:
        warnings.warn(f"regenerate kept only {len(records)} of {total} conversations (dropped {_counted(counts)}). "
                      f"{drop_advice(counts, cfg, drops)}", stacklevel=2)
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
    doc = {
        "complete": True,
        "target": cfg.target,
        "target_fingerprint": fingerprint,
        "settings": cfg.identity(),
        "generation": cfg.replies.generation.to_dict(),
        "chat_template": {"sha256": template_sha(template_text), "kwargs": dict(cfg.template_kwargs)},
        "replies_from_target": cfg.replies.from_target,
        "files": [p.name for p in files],
        "counts": {"conversations": total, "written": len(records), "dropped": dict(sorted(counts.items())),
                   **({"cut": dict(cut)} if cut else {})},
        "dropped": drops[:1000],
    }
    requests = read_requests_provenance(cfg.data)
    if requests is not None:  # the target wrote the requests too (tapdraft requests): say so downstream
        doc["requests"] = requests
    with staged(sidecar_path(out)) as tmp:
        tmp.write_text(json.dumps(doc, indent=2, sort_keys=True))
    shutil.rmtree(work, ignore_errors=True)
    return doc


def split_output(out: str | Path, parts: dict[str, tuple[list[str], Path]]) -> None:
    """One complete ``FILE.jsonl`` regeneration -> several, by conversation id: ``parts`` maps a name to its ids (in
    the order wanted) and its ``FILE.jsonl``. Each part gets its own sidecar (the settings and target of the run that
    wrote them, its own counts and drops), so that capture reads a part's provenance as it reads a whole output's;
    so many inputs regenerate with one engine start. A part's sidecar is written last: a killed split reruns."""
    out = Path(out)
    doc = json.loads(sidecar_path(out).read_text()) if sidecar_path(out).is_file() else {}
    if not doc.get("complete") or out.suffix != ".jsonl":
        raise ValueError(f"{out} is not a complete FILE.jsonl regeneration; run regenerate to it first")
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    dropped = {d["sample_id"]: d for d in doc["dropped"]}
    for name, (ids, _) in parts.items():  # every part checked before any is written
        missing = [i for i in ids if i not in records and i not in dropped]
        if missing:
            raise ValueError(f"{out} holds no conversation {missing[0]!r} of {name} ({len(missing)} missing): a "
                             "conversation repeated in another part is regenerated once; give each part its own")
    for name, (ids, dest) in parts.items():
        kept = [records[i] for i in ids if i in records]
        drops = [dropped[i] for i in ids if i in dropped]
        with staged(dest) as tmp:
            tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept))
        part = {**doc, "files": [dest.name], "split_from": out.name, "dropped": drops,
                "counts": {"conversations": len(ids), "written": len(kept),
                           "dropped": dict(sorted(Counter(d["status"] for d in drops).items()))}}
        with staged(sidecar_path(dest)) as tmp:
            tmp.write_text(json.dumps(part, indent=2, sort_keys=True))


def join_outputs(parts: list[str | Path], out: str | Path) -> dict[str, Any]:
    """Several complete ``FILE.jsonl`` regenerations -> one ``out`` (records in the parts' order), the inverse of
    :func:`split_output`: a pool regenerated in chunks (each its own resumable run) is used as one input, whose
    sidecar capture reads as a whole output's. The parts must come from the same target with the same reply
    settings (only their inputs differ); counts and drops are summed. The sidecar is written last."""
    docs = []
    for part in map(Path, parts):
        doc = json.loads(sidecar_path(part).read_text()) if sidecar_path(part).is_file() else {}
        if not doc.get("complete") or part.suffix != ".jsonl":
            raise ValueError(f"{part} is not a complete FILE.jsonl regeneration; run regenerate to it first")
        docs.append(doc)
    if not docs:
        raise ValueError("join_outputs needs at least one part")

    def same(d: dict[str, Any]) -> tuple:
        settings = {k: v for k, v in d["settings"].items() if k not in ("data", "max_samples")}
        return (d["target_fingerprint"], json.dumps(settings, sort_keys=True), d["generation"], d["chat_template"],
                d["replies_from_target"])

    for part, doc in zip(parts[1:], docs[1:]):
        if same(doc) != same(docs[0]):
            raise ValueError(f"{part} was regenerated with another target or other settings than {parts[0]}: "
                             "only parts of one regeneration setup join")
    out = Path(out)
    with staged(out) as tmp:
        with open(tmp, "w") as f:
            for part in map(Path, parts):
                f.write(part.read_text())
    counts: Counter = Counter()
    cut: Counter = Counter()
    for d in docs:
        counts.update(d["counts"]["dropped"])
        cut.update(d["counts"].get("cut", {}))
    doc = {**docs[0], "files": [out.name], "joined_from": [Path(p).name for p in parts],
           "settings": {**docs[0]["settings"], "data": [d["settings"]["data"] for d in docs]},
           "dropped": [x for d in docs for x in d["dropped"]][:1000],
           "counts": {"conversations": sum(d["counts"]["conversations"] for d in docs),
                      "written": sum(d["counts"]["written"] for d in docs), "dropped": dict(sorted(counts.items())),
                      **({"cut": dict(cut)} if cut else {})}}
    with staged(sidecar_path(out)) as tmp:
        tmp.write_text(json.dumps(doc, indent=2, sort_keys=True))
    return doc


def _counted(counts: Counter) -> str:
    return ", ".join(f"{k}: {v}" for k, v in counts.most_common())


_ADVICE = {
    "truncated": "The target did not end its replies within --max-new-tokens {max_new_tokens}: raise --max-new-tokens, "
                 "or check that the target ends its turns (its end-of-turn token and chat template; a base or "
                 "random-init model never does); --on-limit keep keeps such replies, marked truncated.",
    "empty": "The target replied with nothing: check the chat template's generation prompt (--chat-template).",
    "unplaced": "The chat template gives the generated ids no place (it rewrites the reply's text, or ends the turn "
                "with another id than the target generated): check --chat-template and the end-of-turn ids.",
    "placeholder": "The target wrote the audio placeholder into its replies: it is not trained for this prompt format.",
    "generation_error": "The target produced NaN/Inf logits: try --dtype float32.",
    "bad_input": "Fix the inputs (first: {first}).",
    "no_user_turn": "The conversations have no user turn before the assistant's: check the input's roles.",
    "too_long": "The prompts do not fit the target's context: shorten them or lower --max-new-tokens.",
    "over_budget": "The first turns do not fit --max-conversation-tokens {budget}: raise it or lower --max-new-tokens.",
    "duplicate": "The input repeats the same conversations.",
}


def drop_advice(counts: Counter, cfg: RegenerateConfig, drops: list[dict[str, Any]]) -> str:
    """What to do about the most common drop reason (one sentence or two)."""
    top = counts.most_common(1)[0][0]
    first = next((f"{d['sample_id']!r}: {d['message']}" for d in drops if d["status"] == top), "")
    return _ADVICE.get(top, "See the sidecar's list of dropped conversations.").format(
        max_new_tokens=cfg.replies.generation.max_new_tokens, first=first,
        budget=cfg.replies.max_conversation_tokens)


def summary(doc: dict[str, Any]) -> str:
    """One screen: written and dropped counts by reason, this run's rates."""
    c, rs = doc["counts"], doc.get("run_stats", {})
    out = Path(doc.get("output", ""))
    where = out.parent if out.suffix == ".jsonl" else out
    lines = [f"{c['written']} of {c['conversations']} conversations written to "
             f"{', '.join(str(where / f) for f in doc['files'])}; "
             f"dropped {c['dropped'] or 0}"
             + (f"; {c['cut']['conversations']} cut at --max-conversation-tokens ({c['cut']['turns']} turns not "
                "regenerated)" if c.get("cut") else "")]
    if rs.get("already_complete"):
        lines.append("already complete; nothing to do")
    elif rs.get("seconds"):
        s = rs["seconds"]
        lines.append(f"this run: {rs['replies']} replies, {rs['tokens']:,} tokens in {s:.1f}s = "
                     f"{rs['replies'] / s:.2f} replies/s, {rs['tokens'] / s:,.0f} tok/s"
                     + (f" (vLLM {rs['engine']['version']}, started in {rs['engine']['startup_s']:.0f}s)"
                        if "engine" in rs else ""))
        e = rs.get("engine", {})
        if e.get("prompt_tokens"):
            lines.append(f"prompts: {e['prompt_tokens']:,} tokens, {e['cached_tokens']:,} of them from vLLM's prefix "
                         "cache" + ("" if e["prefix_caching"] else " (off: --prefix-caching reuses a conversation's "
                                    "earlier turns)"))
    g = doc["generation"]
    lines.append(("greedy" if g["greedy"] else f"sampled (temperature {g['temperature']}, top_p {g['top_p']}, "
                  f"seed {g['seed']})") + f", max_new_tokens {g['max_new_tokens']}, target "
                 f"{doc['target_fingerprint'][:12]}; replies_from_target={doc['replies_from_target']}")
    return "\n".join(lines)
