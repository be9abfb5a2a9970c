"""``tapdraft requests``: requests written by the target itself, for a user who has no data (the Magpie method).

An instruction-tuned target given only its chat template's opening of a user turn (the system turn the template
adds, then the user's header) writes a plausible request and ends it with its end-of-turn token, as it ends a reply.
Sampled many times (seeded: a row's draws depend only on the seed and its index, never on its batch), deduplicated
and filtered, those requests are the input of ``tapdraft regenerate``, which then writes the target's replies:
a drafter's whole training set from the target alone.

    tapdraft requests --target MODEL_DIR --count 5000 --out requests.jsonl
    tapdraft regenerate --target MODEL_DIR --data requests.jsonl --out train.regen.jsonl

Dropped, counted by reason: ``truncated`` (no end of turn within ``--max-new-tokens``), ``empty``, ``short`` (fewer
than ``min_words`` words), ``special`` (the text holds a special token or the audio placeholder: the model wrote
template markup, not a request), ``duplicate`` (the same request, compared without case, punctuation or spacing).
Draws continue in batches until ``count`` requests are kept or ``max_draws`` were made (then it says how many it
kept). The sidecar ``NAME.requests.json`` (written last) records how they were made: the method, the target's
fingerprint, the template's opening as text, the sampling settings, the counts; ``regenerate`` copies it into its
own sidecar and capture into the dataset's record of its inputs, so a dataset says its requests were the target's.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tapdraft.capture.generation import GenerationConfig
from tapdraft.capture.provenance import target_fingerprint
from tapdraft.capture.replies.generate import generate, row_seed
from tapdraft.capture.targets.base import Prepared, Target
from tapdraft.common.atomic import staged
from tapdraft.common.progress import Progress

SENTINEL = "\u2063tapdraft-request\u2063"
"""A user turn's content no template rewrites: the text before it is the template's opening of a user turn."""
METHOD = "magpie: sampled from the target's chat template opening of a user turn, ended by its end-of-turn token"
PENDING = "(the target's reply)"
"""The assistant turn's text until ``tapdraft regenerate`` writes the target's reply (it refuses an empty turn)."""


@dataclass(frozen=True)
class RequestsConfig:
    """How many requests to have the target write, how they are sampled and what is kept."""

    target: str
    """Target directory (any kind ``capture.targets.load.load_target`` loads)."""
    out: str
    """``FILE.jsonl``: one conversation a line, the request and a pending reply."""
    count: int = 1000
    """Requests to keep."""
    generation: GenerationConfig = field(default_factory=lambda: GenerationConfig(
        max_new_tokens=128, temperature=1.0, top_p=0.95))
    """Sampling (greedy would write one request): temperature 1 and top-p 0.95 by default."""
    min_words: int = 3
    """A request of fewer words is dropped (``short``)."""
    batch_size: int = 64
    """Requests sampled at once."""
    max_draws: int | None = None
    """Draws at most (None: 4 x count)."""
    device: str = "auto"
    dtype: str = "auto"
    progress: bool = True

    def __post_init__(self) -> None:
        if self.count < 1 or self.batch_size < 1 or self.min_words < 0:
            raise ValueError("--count and --batch-size must be >= 1 and --min-words >= 0")
        if self.generation.greedy:
            raise ValueError("--temperature 0 would write the same request every time: sample (e.g. 1.0)")
        if not str(self.out).endswith(".jsonl"):
            raise ValueError(f"--out {self.out}: give a FILE.jsonl")
        if self.max_draws is not None and self.max_draws < self.count:
            raise ValueError(f"--max-draws ({self.max_draws}) must be >= --count ({self.count})")


def requests_sidecar(out: str | Path) -> Path:
    """``NAME.requests.json`` beside ``NAME.jsonl``."""
    out = Path(out)
    return out.with_name(out.name.removesuffix(".jsonl") + ".requests.json")


def read_requests_provenance(spec: str | Path) -> dict[str, Any] | None:
    """The requests sidecar of an input file, when the target wrote its requests."""
    path = requests_sidecar(spec)
    return json.loads(path.read_text()) if str(spec).endswith(".jsonl") and path.is_file() else None


def user_turn_opening(target: Target) -> list[int]:
    """The ids the chat template writes before a user's words (its default system turn included)."""
    text = target.template.render([{"role": "user", "content": SENTINEL}])
    if SENTINEL not in text:
        raise ValueError("the chat template does not write a user turn's content as given; requests cannot be "
                         "sampled from it")
    return target.template.encode(text[:text.index(SENTINEL)])


def _key(text: str) -> str:
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


def _why_dropped(text: str, truncated: bool, min_words: int, specials: list[str], seen: set[str]) -> str | None:
    if truncated:
        return "truncated"
    if not text.strip():
        return "empty"
    if len(text.split()) < min_words:
        return "short"
    if any(s and s in text for s in specials):
        return "special"
    if _key(text) in seen:
        return "duplicate"
    return None


@dataclass
class _Draws:
    kept: list[str] = field(default_factory=list)
    seen: set[str] = field(default_factory=set)
    dropped: Counter = field(default_factory=Counter)
    drawn: int = 0
    tokens: int = 0


def _sample(target: Target, cfg: RequestsConfig, opening: list[int], max_draws: int, bar: Progress) -> _Draws:
    """Draw batches until ``cfg.count`` requests are kept or ``max_draws`` were drawn."""
    specials = [*target.tokenizer.all_special_tokens, target.input_placeholder]
    d = _Draws()
    while len(d.kept) < cfg.count and d.drawn < max_draws:
        batch = [Prepared(index=i, sample_id=f"request-{i}", source="template",
                          token_ids=torch.tensor(opening, dtype=torch.long),
                          assistant_mask=torch.zeros(len(opening), dtype=torch.bool), length=len(opening))
                 for i in range(d.drawn, min(d.drawn + cfg.batch_size, max_draws))]
        seeds = [row_seed(cfg.generation.seed, p.sample_id, 0) for p in batch]
        for g in generate(target, batch, cfg.generation, seeds=seeds):
            if len(d.kept) == cfg.count:  # the batch's later draws are not looked at: counts never depend on it
                break
            d.drawn += 1
            d.tokens += len(g.ids)
            text = target.tokenizer.decode(g.tokens, skip_special_tokens=False).strip()
            why = _why_dropped(text, g.truncated, cfg.min_words, specials, d.seen)
            if why is not None:
                d.dropped[why] += 1
            else:
                d.kept.append(text)
                d.seen.add(_key(text))
        bar.update(len(d.kept), f"{d.drawn} drawn")
    return d


def write_requests(cfg: RequestsConfig, *, target: Target | None = None) -> dict[str, Any]:
    """Sample, filter and write the requests (atomically, the sidecar last); returns the sidecar document."""
    from tapdraft.capture.stages import resolve_device, resolve_dtype
    from tapdraft.capture.targets.load import load_target

    if target is None:
        device = resolve_device(cfg.device)
        target = load_target(cfg.target, dtype=resolve_dtype(cfg.dtype, device), device=str(device))
    opening = user_turn_opening(target)
    t0 = time.perf_counter()
    with Progress("requests", cfg.count, enabled=cfg.progress) as bar:
        d = _sample(target, cfg, opening, cfg.max_draws or 4 * cfg.count, bar)
    if not d.kept:
        raise ValueError(f"the target wrote no usable request in {d.drawn} draws (dropped {dict(d.dropped)}): is it "
                         "an instruction-tuned model whose template opens a user turn?")
    records = [{"id": f"request-{i:06d}", "conversations": [{"from": "User", "value": text},
                                                            {"from": "Assistant", "value": PENDING}]}
               for i, text in enumerate(d.kept)]
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with staged(out) as tmp:
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    doc = {"method": METHOD, "target": cfg.target, "target_fingerprint": target_fingerprint(target),
           "opening": target.tokenizer.decode(opening, skip_special_tokens=False),
           "generation": cfg.generation.to_dict(), "min_words": cfg.min_words,
           "counts": {"asked": cfg.count, "drawn": d.drawn, "kept": len(d.kept),
                      "dropped": dict(sorted(d.dropped.items()))},
           "tokens": d.tokens, "seconds": round(time.perf_counter() - t0, 3), "files": [out.name]}
    with staged(requests_sidecar(out)) as tmp:
        tmp.write_text(json.dumps(doc, indent=2, sort_keys=True))
    return doc


def summary(doc: dict[str, Any]) -> str:
    c = doc["counts"]
    short = "" if c["kept"] == c["asked"] else f" (asked for {c['asked']}: raise --max-draws or lower --min-words)"
    return (f"{c['kept']} requests written to {doc['files'][0]}{short}; {c['drawn']} drawn, dropped "
            f"{c['dropped'] or 0}; {doc['tokens']:,} tokens in {doc['seconds']:.1f}s\n"
            f"sampled at temperature {doc['generation']['temperature']}, top_p {doc['generation']['top_p']}, seed "
            f"{doc['generation']['seed']} from the template's opening {doc['opening']!r}")
