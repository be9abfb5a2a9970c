"""A drafter worth serving on a real model, end to end: the target's own replies, a capture, a trained drafter,
then vLLM on this machine serving held-out requests alone and with the drafter, timed in alternated pairs.

Three real targets (``python -m tapdraft.demo.real build``), in ``TARGETS``:

    text       SmolLM2-135M-Instruct; requests about the Python standard library (demo.real.prompts), held
               out by module
    general    SmolLM2-135M-Instruct on broad data (demo.real.broad): ShareGPT V3's conversations, every turn
               rewritten by the target under a token budget, from a pool regenerated in chunks that several
               training sizes share (``pool``); held out: first requests of ShareGPT conversations never trained on
    speech     the real-parts speech LLM taught to transcribe (demo.real.listen); spoken sentences of its task,
               the held-out ones never heard by the listener or the drafter
    assistant  the same speech LLM aligned to answer spoken requests (demo.real.answer); spoken requests, the
               held-out ones never heard by the answerer or the drafter

Stages, each cached in the work directory (rerun to continue where it stopped):

    prompts   data/SPLIT.prompts.jsonl (+ data/audio/*.wav): train, validation, held_out; with requests="other"
              also other: requests of another kind than the training ones (text: everyday writing and
              explaining, no Python; speech: sentences holding words the listener never heard; assistant: those
              sentences to transcribe, the model's other task)
    replies   data/SPLIT.jsonl: the target's greedy replies, ``tapdraft regenerate --engine vllm --on-limit keep``
              over every split at once (a reply cut at max_tokens is kept, marked truncated: SmolLM2 answers at
              length), threads / engine_threads engines side by side
    capture   dataset/: ``tapdraft capture`` of the three splits
    train     runs/RUN, exports/RUN: ``tapdraft train --recipe R``, then ``tapdraft export``
    serve     vLLM alone and with the export on the held-out (or other) requests, one request at a time (batch 1, the latency speculative decoding
              is for), ``pairs`` times alternated: tokens/s of each, their ratio, greedy outputs compared, and
              vLLM's accepted drafts held round by round against ``tapdraft speculate`` on the same requests

``tapdraft demo --real`` runs it on a speech target; ``python -m benchmarks.real_speedup`` on either, writing
its figures to benchmarks/results/.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from tapdraft.common.atomic import staged
from tapdraft.demo.real import commands

Log = Callable[[str], None]

SPLITS = ("train", "validation", "held_out")
REQUESTS = ("held_out", "other")
"""What the serve stage serves: held-out requests of the training prompts' kind, or requests of another kind."""
@dataclass(frozen=True)
class SpeedupConfig:
    target: str = "speech"
    """A name in ``TARGETS``: ``text`` (SmolLM2-135M-Instruct), ``speech`` (the listener: Whisper tiny.en +
    SmolLM2) or ``assistant`` (the same speech LLM answering spoken requests)."""
    train: int | None = None
    """Training conversations (None: the target's ``train``)."""
    validation: int = 64
    held_out: int = 64
    max_tokens: int | None = None
    """Reply cap, generating and serving alike (None: the target's ``max_tokens``)."""
    threads: int = 2
    """torch threads of capture and training."""
    engine_threads: int = 1
    """vLLM's threads (1: on a shared machine more threads wait on each other at OpenMP barriers)."""
    recipe: str = "eagle3_small"
    run: str | None = None
    """Run name (None: the recipe's)."""
    sets: tuple[str, ...] = ()
    """Training overrides KEY=VALUE."""
    k: tuple[int, ...] = (3,)
    """Drafts a round to serve with."""
    pairs: int = 3
    prompts: int = 16
    """Requests served."""
    requests: str = "held_out"
    """``held_out`` (the training prompts' kind, on topics or sentences never trained on) or ``other`` (another
    kind: a drafter that pays only on its own distribution is fragile)."""
    pool: str | None = None
    """The general target: where its ShareGPT pool's regenerated chunks live (None: the work directory's ``pool/``);
    share one across work directories of several training sizes (a data-scaling curve) and each chunk is made once."""
    listen_steps: int = 300  # demo.real.listen.ListenConfig's default
    """The listener's projector updates (its cached directory is keyed by them)."""
    answer_steps: int = 400  # demo.real.answer.AnswerConfig's default
    """The answerer's updates (its cached directory is keyed by them)."""
    method: str = "eagle3"
    """vLLM's method when the export does not state one."""
    layout: str | None = None
    """The export's layout (``tapdraft export --layout``; None: the family's default). An MTP head is served by vLLM
    in ``tapdraft-vllm``."""

    @property
    def engines(self) -> int:
        """vLLM engines side by side when regenerating: the threads in engines of ``engine_threads`` each (independent
        engines use the cores better than threads)."""
        return max(1, self.threads // self.engine_threads)

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise ValueError(f"target must be one of {sorted(TARGETS)}, got {self.target!r}")
        if self.requests not in REQUESTS:
            raise ValueError(f"requests must be one of {list(REQUESTS)}, got {self.requests!r}")
        t = TARGETS[self.target]
        object.__setattr__(self, "train", self.train or t.train)
        object.__setattr__(self, "max_tokens", self.max_tokens or t.max_tokens)
        object.__setattr__(self, "run", self.run or self.recipe)
        if min(self.train, self.validation, self.held_out, self.pairs, self.prompts, *self.k) < 1:
            raise ValueError("train, validation, held_out, pairs, prompts and every k must be >= 1")
        if self.prompts > self.held_out:
            raise ValueError(f"prompts ({self.prompts}) must be <= held_out ({self.held_out})")


def _smollm2(cfg: SpeedupConfig, log: Log) -> Path:
    from tapdraft.demo.real.build import build_real_targets

    return build_real_targets().smollm2


def _listener(cfg: SpeedupConfig, log: Log) -> Path:
    from tapdraft.demo.real.listen import ListenConfig, build_listener

    return build_listener(None, ListenConfig(steps=cfg.listen_steps), log)[0]


def _answerer(cfg: SpeedupConfig, log: Log) -> Path:
    from tapdraft.demo.real.answer import AnswerConfig, build_answerer

    return build_answerer(None, AnswerConfig(steps=cfg.answer_steps, listen_steps=cfg.listen_steps), log)[0]


def _text_splits(data: Path, cfg: SpeedupConfig, log: Log) -> dict[str, list[dict]]:
    from tapdraft.demo.real.prompts import prompt_splits

    return prompt_splits(cfg.train, cfg.validation, cfg.held_out)


def _text_other(data: Path, cfg: SpeedupConfig, log: Log) -> list[dict]:
    from tapdraft.demo.real.prompts import other_prompts

    return other_prompts(cfg.prompts)


def _spoken_splits(data: Path, cfg: SpeedupConfig, log: Log) -> dict[str, list[dict]]:
    from tapdraft.demo.real.listen import speech_splits

    return speech_splits(data, cfg.train, cfg.validation, cfg.held_out, progress=log)


def _spoken_other(data: Path, cfg: SpeedupConfig, log: Log) -> list[dict]:
    from tapdraft.demo.real.listen import speech_other

    return speech_other(data, cfg.prompts, progress=log)


def _broad_splits(data: Path, cfg: SpeedupConfig, log: Log) -> dict[str, list[dict]]:
    from tapdraft.demo.real.broad import sharegpt_splits

    splits, counts = sharegpt_splits(cfg.validation, cfg.held_out)
    log(f"ShareGPT: {counts['records']} complete records (the file is cut off: {counts['cut_off']}), "
        f"{counts['kept']} kept, dropped {counts['dropped']}")
    return {"validation": splits["validation"], "held_out": splits["held_out"]}


def _broad_train(work: Path, cfg: SpeedupConfig, target: Path, venv: Path, log: Log) -> None:
    """data/train.jsonl: the pool's first ``train`` conversations, regenerated in shared chunks and joined; and
    data/validation.jsonl under the pool's conversation budget (multi-turn, as the pool is)."""
    from tapdraft.capture.provenance import sidecar_path
    from tapdraft.capture.replies.regenerate import join_outputs
    from tapdraft.demo.real.broad import regenerate_pool, regenerate_split, sharegpt_splits

    regenerate_split(work / "data" / "validation.jsonl", target=target, venv=venv, engines=cfg.engines,
                     max_new_tokens=cfg.max_tokens, log=log)
    out = work / "data" / "train.jsonl"
    if sidecar_path(out).exists():
        return
    pool = sharegpt_splits(cfg.validation)[0]["pool"]
    chunks = regenerate_pool(Path(cfg.pool) if cfg.pool else work / "pool", pool, cfg.train, target=target,
                             venv=venv, engines=cfg.engines, max_new_tokens=cfg.max_tokens, log=log)
    join_outputs(chunks, out)


def _self_train(work: Path, cfg: SpeedupConfig, target: Path, venv: Path, log: Log) -> None:
    """data/train.jsonl: ``train`` requests the target writes itself (``tapdraft requests``, the Magpie method) and its
    replies to them under the pool's settings; data/validation.jsonl as the general target's, so both are checked on
    the same ShareGPT conversations."""
    from tapdraft.capture.provenance import sidecar_path
    from tapdraft.capture.replies.requests import requests_sidecar
    from tapdraft.demo.real.broad import regenerate_args, regenerate_split

    regenerate_split(work / "data" / "validation.jsonl", target=target, venv=venv, engines=cfg.engines,
                     max_new_tokens=cfg.max_tokens, log=log)
    asked, out = work / "data" / "requests.jsonl", work / "data" / "train.jsonl"
    if sidecar_path(out).exists():
        return
    if not requests_sidecar(asked).exists():
        commands.run_cli("requests", "--target", str(target), "--out", str(asked), "--count", str(cfg.train),
                         "--threads", str(cfg.threads), log=log)
    commands.run_cli("regenerate", "--data", str(asked), "--out", str(out),
                     *regenerate_args(target, venv, cfg.engines, cfg.max_tokens), log=log)


def _request_splits(data: Path, cfg: SpeedupConfig, log: Log) -> dict[str, list[dict]]:
    from tapdraft.demo.real.answer import spoken_requests

    return spoken_requests(data, cfg.train, cfg.validation, cfg.held_out, progress=log)


@dataclass(frozen=True)
class RealTarget:
    """A real target of the chain: how its model directory is built, its requests, its defaults."""
    model: Callable[[SpeedupConfig, Log], Path]
    """The model directory (built and cached on first use)."""
    splits: Callable[[Path, SpeedupConfig, Log], dict[str, list[dict]]]
    """train / validation / held_out conversations (wavs written under the data folder)."""
    other: Callable[[Path, SpeedupConfig, Log], list[dict]]
    """``prompts`` requests of another kind."""
    train: int
    """Default training conversations."""
    max_tokens: int
    """Default reply cap."""
    train_replies: Callable[[Path, SpeedupConfig, Path, Path, Log], None] | None = None
    """Writes ``data/train.jsonl`` (replies and sidecar) itself, when its training conversations are not a split of
    ``splits`` regenerated with the others: the general target's come from a pool regenerated in shared chunks."""


TARGETS = {
    "text": RealTarget(_smollm2, _text_splits, _text_other, train=1800, max_tokens=192),
    "general": RealTarget(_smollm2, _broad_splits, _text_other, train=2000, max_tokens=192, train_replies=_broad_train),
    "self": RealTarget(_smollm2, _broad_splits, _text_other, train=2000, max_tokens=192, train_replies=_self_train),
    "speech": RealTarget(_listener, _spoken_splits, _spoken_other, train=2400, max_tokens=32),
    "assistant": RealTarget(_answerer, _request_splits, _spoken_other, train=1200, max_tokens=128),
}


DEMO_SIZES = {
    "full": SpeedupConfig(target="assistant", train=800, validation=32, held_out=32, prompts=16,
                          sets=("max_steps=400",)),
    "quick": SpeedupConfig(target="general", train=100, validation=16, held_out=16, prompts=8, pairs=1, max_tokens=96,
                           sets=("max_steps=150",)),
}
"""``tapdraft demo --real`` (full) and ``--real --quick``: the full size is the speech LLM that answers (the sizes
``benchmarks.real_speedup --target assistant`` measured); the quick size is a general drafter for its language model
alone (SmolLM2: no listener to train) from 100 ShareGPT conversations the target regenerates, checked on first requests
of conversations it never saw, 150 drafter steps and one pair (a figure to see, not to quote: the data-scaling curve
in docs/speedup.md says what more data buys). The full size's took 100 minutes with the answerer of the time (a
quarter of its pairs transcription): model 3,139 s (listener and answerer trained), prompts 19 s, replies 750 s,
capture 660 s, training 641 s, serving 794 s; 1.89x over whole requests (twelfth stop). On today's answerer (half, its
WER 9.2%; built alone in 39 minutes) it ran in 47 minutes with the model cached: replies 688 s, capture 727 s,
training 647 s, serving 731 s; 2.02x over whole requests, 2.33x over the decode (docs/LOG.md 2026-12-04, thirteenth
stop)."""


def target_dir(cfg: SpeedupConfig, log: Log = print) -> Path:
    """The model directory (built and cached on first use)."""
    return TARGETS[cfg.target].model(cfg, log)


def stage_prompts(work: Path, cfg: SpeedupConfig, log: Log = print) -> None:
    data = work / "data"
    target = TARGETS[cfg.target]
    if cfg.requests == "other" and not (data / "other.prompts.jsonl").exists():
        data.mkdir(parents=True, exist_ok=True)
        commands.write_jsonl(data / "other.prompts.jsonl", target.other(data, cfg, log))
    if (data / "held_out.prompts.jsonl").exists():
        return
    data.mkdir(parents=True, exist_ok=True)
    splits = target.splits(data, cfg, log)
    for split in SPLITS:  # held_out last: its file marks the stage done
        if split in splits:  # a target whose training replies come otherwise (train_replies) has no train prompts
            commands.write_jsonl(data / f"{split}.prompts.jsonl", splits[split])


def stage_replies(work: Path, cfg: SpeedupConfig, target: Path, venv: Path, log: Log = print) -> None:
    """Every split's replies in one ``tapdraft regenerate`` call (vLLM starts once, not once a split): the missing
    splits' prompts joined into ``replies-SPLITS.prompts.jsonl``, the output split back by id with a sidecar each."""
    from tapdraft.capture.provenance import sidecar_path
    from tapdraft.capture.replies.regenerate import split_output

    data = work / "data"
    own = TARGETS[cfg.target].train_replies
    if own is not None:
        own(work, cfg, target, venv, log)
    wanted = ("other",) * (cfg.requests == "other") + SPLITS
    missing = [s for s in wanted if not sidecar_path(data / f"{s}.jsonl").exists()]
    if not missing:
        return
    prompts = {s: [json.loads(line) for line in (data / f"{s}.prompts.jsonl").read_text().splitlines()]
               for s in missing}
    name = "replies-" + "-".join(missing)  # the splits it holds: "other" added later regenerates alone
    joined, replies = data / f"{name}.prompts.jsonl", data / f"{name}.jsonl"
    if not sidecar_path(replies).exists():
        commands.write_jsonl(joined, [r for rs in prompts.values() for r in rs])
        commands.run_cli("regenerate", "--target", str(target), "--data", str(joined), "--out", str(replies),
             "--max-new-tokens", str(cfg.max_tokens), "--on-limit", "keep", "--engine", "vllm",
             "--vllm-python", str(venv / "bin" / "python"), "--max-batch-size", "32",
             "--threads", str(cfg.engine_threads), "--data-parallel-size", str(cfg.engines), log=log)
    split_output(replies, {s: ([r["id"] for r in prompts[s]], data / f"{s}.jsonl") for s in missing})


def stage_capture(work: Path, cfg: SpeedupConfig, target: Path, log: Log = print) -> Path:
    ds, data = work / "dataset", work / "data"
    if not (ds / "manifest.json").exists():
        commands.run_cli("capture", "--target", str(target), "--data", str(data / "train.jsonl"),
             "--data", f"validation={data / 'validation.jsonl'}", "--data", f"held_out={data / 'held_out.jsonl'}",
             "--out", str(ds), "--threads", str(cfg.threads), log=log)
    return ds


def stage_train(work: Path, cfg: SpeedupConfig, dataset: Path, log: Log = print) -> tuple[Path, Path]:
    run, export = work / "runs" / cfg.run, work / "exports" / cfg.run
    if not (export / "config.json").exists():
        sets = [x for s in cfg.sets for x in ("--set", s)]
        commands.run_cli("train", "--data", str(dataset), "--recipe", cfg.recipe, "--out", str(run), "--threads",
             str(cfg.threads), *sets, log=log)
    return run, stage_export(work, cfg, dataset, log)


LAYOUT_HELP = "the export's layout (default: the family's; an MTP head is served in tapdraft-vllm)"
"""``--layout``'s help in every benchmark that exports a run (``stage_export``)."""


def stage_export(work: Path, cfg: SpeedupConfig, dataset: Path | None = None, log: Log = print) -> Path:
    """exports/RUN: ``tapdraft export`` of runs/RUN in ``cfg.layout``, carrying the frozen head rows a draft
    vocabulary needs from ``dataset`` (default: the work directory's own). A run trained by another benchmark
    (``benchmarks.data_scaling``) is exported here on first use."""
    run, export = work / "runs" / cfg.run, work / "exports" / cfg.run
    if not (export / "config.json").exists():
        if not (run / "config.json").is_file():
            raise FileNotFoundError(f"{work} has neither exports/{cfg.run} nor runs/{cfg.run}: train the run first "
                                    f"(python -m benchmarks.real_speedup --workdir {work} --recipe ... --stop-after train)")
        layout = ("--layout", cfg.layout) if cfg.layout else ()
        commands.run_cli("export", "--draft", str(run), "--out", str(export), "--data", str(dataset or work / "dataset"),
                         *layout, log=log)
    return export


def speculate_served(conversations: Path, target: Path, run: Path, dataset: Path, n: int,
                     max_tokens: int, drafts: int | None = None) -> dict[str, Any]:
    """``tapdraft speculate`` (in-process decoding) of the same served conversations: per-round counts to hold
    vLLM's against, and the offline replay on those conversations. At the command's own thread default, not
    torch's (every core), which beside an engine or another scoring runs several times slower."""
    from tapdraft.capture.stages import torch_threads
    from tapdraft.common.host import default_threads
    from tapdraft.speculate.run import SpeculateConfig, run_speculate

    cfg = SpeculateConfig(target=str(target), draft=str(run), data=str(dataset), conversations=str(conversations),
                          max_samples=n, max_new_tokens=max_tokens, drafts=drafts, check_greedy=False, device="cpu",
                          cost_steps=0)
    with torch_threads(default_threads()):
        return run_speculate(cfg, progress=False)


def served_method(tapdraft_cfg: dict[str, Any], default: str) -> str:
    """vLLM's speculative method for an export: what its config states (``tapdraft.serve_with.vllm.method``), else
    ``default``."""
    return tapdraft_cfg.get("serve_with", {}).get("vllm", {}).get("method") or tapdraft_cfg.get("method", default)


def serve_pairs(work: Path, cfg: SpeedupConfig, target: Path, venv: Path, export: Path, requests: list[dict],
                log: Log = print, max_model_len: int = 1024) -> dict[str, list[dict[str, Any]]]:
    """vLLM alone and with the export (``k=K`` for each of ``cfg.k``) on ``requests``, one at a time, ``cfg.pairs``
    times alternated: per run its wall time, tokens, load, and per request the outputs, drafts and engine timings."""
    from tapdraft.engines.serving import serve_vllm

    job = {"target": str(target), "requests": requests, "max_tokens": cfg.max_tokens, "max_model_len": max_model_len,
           "warmup": 1, "repeats": 1}
    method = served_method(json.loads((export / "config.json").read_text()).get("tapdraft", {}), cfg.method)
    runs: dict[str, list[dict]] = {"alone": [], **{f"k={k}": [] for k in cfg.k}}
    for p in range(cfg.pairs):
        for name in (list(runs) if p % 2 == 0 else list(runs)[::-1]):
            spec = None if name == "alone" else {"method": method, "model": str(export),
                                                 "num_speculative_tokens": int(name[2:])}
            res = serve_vllm(venv, {**job, "speculative": spec}, work / "vllm" / "serve", timeout=3600,
                             threads=cfg.engine_threads)
            tokens = sum(len(o["token_ids"]) for o in res["outputs"])
            runs[name].append({"seconds": res["seconds"][0], "tokens": tokens, "load_avg": os.getloadavg()[0],
                               "outputs": [o["token_ids"] for o in res["outputs"]],
                               "prompt_ids": [o["prompt_token_ids"] for o in res["outputs"]],
                               "spec": [o["spec"] for o in res["outputs"]],
                               "timing": [o.get("timing") for o in res["outputs"]],
                               "decode": decode_rate(res["outputs"])})
            log(f"pair {p + 1}/{cfg.pairs} {name}: {tokens / res['seconds'][0]:.1f} tokens/s "
                f"(load {os.getloadavg()[0]:.1f})")
    return runs


def _subset(run: dict[str, Any], idx: list[int]) -> dict[str, Any]:
    """One run restricted to the requests ``idx``, timed by the engine per request (scheduled to last token)."""
    timing = [run["timing"][i] for i in idx]
    outs = [{"token_ids": run["outputs"][i], "timing": t} for i, t in zip(idx, timing)]
    seconds = sum(t["last_token_ts"] - t["scheduled_ts"] for t in timing) if all(timing) else None
    return {**run, "outputs": [run["outputs"][i] for i in idx], "spec": [run["spec"][i] for i in idx],
            "tokens": sum(len(run["outputs"][i]) for i in idx), "seconds": seconds, "decode": decode_rate(outs)}


def pair_figures(runs: dict[str, list[dict[str, Any]]], idx: list[int] | None = None) -> dict[str, Any]:
    """Speeds and ratios of ``serve_pairs``' runs, over every request (timed by the wall clock of each run) or over
    the requests ``idx`` (a kind of request: timed by the engine, request by request): per ``k=K`` the pairs'
    speedups and their median, over whole requests and over the decode alone, greedy identity and vLLM's tau."""
    if idx is not None:
        runs = {name: [_subset(r, idx) for r in rs] for name, rs in runs.items()}
    alone = runs["alone"]
    greedy = alone[0]["outputs"]
    report: dict[str, Any] = {"alone_tokens_per_s": [r["tokens"] / r["seconds"] for r in alone]}
    if all(r["decode"] is not None for rs in runs.values() for r in rs):
        report["alone_decode_tokens_per_s"] = [r["decode"] for r in alone]
    for name, rs in runs.items():
        if name == "alone":
            continue
        ratios = [(a["seconds"] / r["seconds"]) * (r["tokens"] / a["tokens"]) for a, r in zip(alone, rs)]
        accepted = sum(sum(s["per_step_accepted"]) for s in rs[0]["spec"])
        rounds = sum(len(s["per_step_accepted"]) for s in rs[0]["spec"])
        report[name] = {"tokens_per_s": [r["tokens"] / r["seconds"] for r in rs], "speedup_pairs": ratios,
                        "speedup_median": statistics.median(ratios),
                        "greedy_identical": all(r["outputs"] == greedy for r in rs),
                        "vllm_tau": 1 + accepted / max(rounds, 1), "rounds": rounds, "accepted": accepted,
                        "load_avg": [r["load_avg"] for r in rs]}
        if "alone_decode_tokens_per_s" in report:
            pairs = [r["decode"] / a["decode"] for a, r in zip(alone, rs)]
            report[name].update(decode_tokens_per_s=[r["decode"] for r in rs], decode_speedup_pairs=pairs,
                                decode_speedup_median=statistics.median(pairs))
    return report


def speculate_check(conversations: Path, target: Path, run: Path, dataset: Path, sample_ids: list[str],
                    greedy: list[list[int]], served: dict[str, Any], max_tokens: int,
                    drafts: int | None = None) -> dict[str, Any]:
    """``tapdraft speculate`` on the served requests against vLLM's rounds (``served``: the first run at ``drafts``
    a round, None: the number the export was trained for): whether they are equal, speculate's tau and the offline
    replay on the same conversations (None where they are not in ``dataset``, or at fewer drafts than trained)."""
    from tapdraft.engines.serving import check_served

    ours = speculate_served(conversations, target, run, dataset, len(sample_ids), max_tokens, drafts)
    vllm = {"vllm": "", "outputs": [{"token_ids": t, "spec": s} for t, s in zip(served["outputs"], served["spec"])]}
    try:
        check_served({"outputs": [{"token_ids": t} for t in greedy]}, vllm, ours, sample_ids)
        equal = True
    except (AssertionError, KeyError):  # reported, not hidden: the table says whether they agree
        equal = False
    same = ours.get("offline_same", False)
    return {"rounds_equal_to_speculate": equal,
            "speculate": {"tau": ours["tau"], "offline_tau_replayed": ours.get("offline_tau_replayed") if same else None,
                          "offline_over": ours.get("offline_over") if same else None}}


def stage_serve(work: Path, cfg: SpeedupConfig, target: Path, venv: Path, dataset: Path, run: Path, export: Path,
                log: Log = print) -> dict[str, Any]:
    from tapdraft.engines.serving import vllm_requests

    audio = work / "vllm" / ("audio" if cfg.requests == "held_out" else f"audio-{cfg.requests}")
    requests, sample_ids, prompt_ids = vllm_requests(target, work / "data" / f"{cfg.requests}.jsonl", cfg.prompts,
                                                     audio)
    runs = serve_pairs(work, cfg, target, venv, export, requests, log)
    greedy = runs["alone"][0]["outputs"]
    report: dict[str, Any] = {"requests": cfg.requests, **pair_figures(runs),
                              "prompt_ids_equal_to_capture": runs["alone"][0]["prompt_ids"] == prompt_ids}
    transcripts = served_transcripts(target, work / "data" / f"{cfg.requests}.prompts.jsonl", sample_ids, greedy)
    if transcripts is not None:
        report["transcripts"] = transcripts
    tapdraft_cfg = json.loads((export / "config.json").read_text()).get("tapdraft", {})
    k_trained = tapdraft_cfg.get("serve_with", {}).get("vllm", {}).get("num_speculative_tokens")
    if f"k={k_trained}" in runs:  # vLLM's rounds against tapdraft's at the drafts it was trained for
        # requests of another kind are not in the dataset: speculate then has no replay over them (None, not a figure
        # from other conversations)
        check = speculate_check(work / "data" / f"{cfg.requests}.jsonl", target, run, dataset, sample_ids, greedy,
                                runs[f"k={k_trained}"][0], cfg.max_tokens)
        report.update(check)
        report["speculate"]["k"] = k_trained
    return report


def decode_rate(outputs: list[dict[str, Any]]) -> float | None:
    """Tokens per second over the decode alone: every token after a request's first over the engine's time from its
    first token to its last (the audio encoder and the prefill excluded); None when the engine gave no timestamps."""
    if any(o.get("timing") is None for o in outputs):
        return None
    tokens = sum(max(len(o["token_ids"]) - 1, 0) for o in outputs)
    seconds = sum(o["timing"]["last_token_ts"] - o["timing"]["first_token_ts"] for o in outputs)
    return tokens / seconds if seconds > 0 else None


def served_transcripts(target: Path, prompts: Path, sample_ids: list[str], outputs: list[list[int]]
                       ) -> dict[str, Any] | None:
    """The served greedy replies scored as transcripts of the spoken sentences (speech requests carry the sentence
    as ``reference``): WER and exact matches; None for requests without one (text)."""
    refs = {r["id"]: r.get("reference") for r in map(json.loads, prompts.read_text().splitlines())}
    if not all(refs.get(i) for i in sample_ids):
        return None
    from transformers import AutoTokenizer

    from tapdraft.demo.real.listen import score_transcripts

    tok = AutoTokenizer.from_pretrained(str(target))
    hyps = [tok.decode(ids, skip_special_tokens=True).strip() for ids in outputs]
    return score_transcripts([refs[i] for i in sample_ids], hyps)


def format_serve(report: dict[str, Any]) -> str:
    """The serve stage in a few lines: both speeds, the ratio, and whether vLLM agreed with tapdraft."""
    alone = statistics.median(report["alone_tokens_per_s"])
    lines = [f"vLLM, the target alone: {alone:.1f} tokens/s (median of {len(report['alone_tokens_per_s'])})"]
    if report.get("requests") == "other":
        lines.insert(0, "served: requests of another kind than the training prompts")
    for name, r in report.items():
        if name.startswith("k="):
            lines.append(f"vLLM with the drafter ({name[2:]} drafts a round): {statistics.median(r['tokens_per_s']):.1f} "
                         f"tokens/s: {r['speedup_median']:.2f}x (pairs {', '.join(f'{x:.2f}' for x in r['speedup_pairs'])}), "
                         f"acceptance length {r['vllm_tau']:.2f}, greedy output "
                         f"{'identical' if r['greedy_identical'] else 'DIFFERENT'}")
            if "decode_speedup_median" in r:
                lines.append(f"  over the decode alone (first token to last): {r['decode_speedup_median']:.2f}x "
                             f"(pairs {', '.join(f'{x:.2f}' for x in r['decode_speedup_pairs'])}; the target alone "
                             f"{statistics.median(report['alone_decode_tokens_per_s']):.1f} tokens/s)")
    if "transcripts" in report:
        t = report["transcripts"]
        lines.append(f"the replies as transcripts of the spoken sentences: WER {100 * t['wer']:.1f}%, "
                     f"{t['exact']}/{t['n']} exact")
    if "speculate" in report:
        s = report["speculate"]
        replay = ("no offline replay: the requests are not in the dataset" if s.get("offline_tau_replayed") is None
                  else f"offline replay {s['offline_tau_replayed']:.3f}")
        lines.append(f"tapdraft speculate on the same requests: tau {s['tau']:.3f} ({replay}); vLLM's rounds equal "
                     f"to it: {report['rounds_equal_to_speculate']}")
    if "seconds" in report:
        lines.append(f"this command: {report['seconds'] / 60:.1f} minutes (stages cached in the work directory "
                     "were not rerun)")
    return "\n".join(lines)


def claim_workdir(work: Path, target: str) -> None:
    """A work directory holds one target's chain (its stages are cached by name, not by target): the first run records
    its target in ``chain.json`` and a run for another target is refused before it reads or writes anything."""
    record = work / "chain.json"
    if record.is_file():
        had = json.loads(record.read_text())["target"]
        if had != target:
            raise ValueError(f"{work} holds the {had} target's chain; give the {target} target another --workdir")
        return
    with staged(record) as tmp:
        tmp.write_text(json.dumps({"target": target}) + "\n")


def run_speedup(work: str | Path, cfg: SpeedupConfig, stop_after: str | None = None,
                log: Log = print) -> dict[str, Any] | None:
    """Every stage up to ``stop_after`` (None: through serving); the serve report, or None when stopped early."""
    from tapdraft.engines.serving import engine_venv

    work = Path(work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    claim_workdir(work, cfg.target)
    t0 = last = time.time()

    def done(stage: str) -> bool:
        nonlocal last
        now = time.time()
        log(f"[{stage}] {now - last:.0f} s ({now - t0:.0f} s in all)")
        last = now
        return stop_after == stage

    target = target_dir(cfg, log)
    done("model")
    stage_prompts(work, cfg, log)
    if done("prompts"):
        return None
    venv = engine_venv("vllm")
    stage_replies(work, cfg, target, venv, log)
    if done("replies"):
        return None
    dataset = stage_capture(work, cfg, target, log)
    if done("capture"):
        return None
    run, export = stage_train(work, cfg, dataset, log)
    if done("train"):
        return None
    report = stage_serve(work, cfg, target, venv, dataset, run, export, log)
    done("serve")
    return {**report, "seconds": round(time.time() - t0)}
