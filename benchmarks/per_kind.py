"""The served speedup per kind of request, as the papers report acceptance: a drafter users deploy meets every kind.

    python -m benchmarks.per_kind --target general --workdir general/n2000 --run dflash_small \\
        --prompts ../shared/eval --per-kind 8 --name per_kind_general_dflash.json

A drafter trained by ``benchmarks.real_speedup`` (its work directory: ``runs/RUN``, ``exports/RUN``) is served on
each kind of request, by vLLM on this CPU, alone and with the drafter, one request at a time, kind by kind: per kind
``--pairs`` alternated runs (alone first, then the drafter first, ...; one engine start a run, its context sized to
the kind's longest request, so a kind of short questions is not served in an engine sized for articles; each
request timed by the engine, from its scheduling to its last token, and over the decode alone). A kind's runs
follow each other within minutes, so the machine's drift over a whole benchmark does not fall between them. The
kinds:

    mt_bench, alpaca, gsm8k, qa, sum   the question sets EAGLE reports on (MT-bench, Alpaca, GSM8K, Natural Questions,
                                       CNN/DailyMail), read from ``--prompts`` (never copied into the project: EAGLE's
                                       repository publishes them as ``eagle/data/*/question.jsonl``). MT-bench is two
                                       turns: its second request is served after the target's own first reply, and
                                       each turn counts as a request.
    stdlib                             questions about Python modules no training prompt of the text target mentions
    other                              stories, tips, emails, explanations for a child (demo.real.prompts)

Stages, cached in WORKDIR/kinds/ (a rerun continues): the requests, the target's greedy replies (``tapdraft
regenerate --engine vllm``, one call, split back by kind), a capture of them (one split a kind, so that the offline
replay covers exactly the served conversations), then the serving. Per kind: the speedup over whole requests and
over the decode (median of the pairs), vLLM's tau, ``tapdraft speculate``'s tau and the offline replay on the same
conversations, whether vLLM's accepted drafts equal speculate's round by round, greedy identity, and the round cost
R = tau / decode speedup. The headline is the median kind and the worst kind, never the best. ``--k 2,3`` serves
every listed number of drafts a round in each pair: the first gives the main rows, held against ``tapdraft speculate
--drafts`` as many (MTP, EAGLE-3 and DFlash draft fewer than trained as vLLM does; the other families only their
trained number), the others vLLM's figures under ``other_k``: where acceptance is low, fewer drafts cost less.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, environment
from tapdraft.common.atomic import staged
from tapdraft.demo.real.commands import run_cli, write_jsonl
from tapdraft.demo.real.speedup import (LAYOUT_HELP, SpeedupConfig, pair_figures, serve_pairs, speculate_check,
                                      stage_export, target_dir)

EVAL_SETS = {"mt_bench": "mt_bench.jsonl", "alpaca": "alpaca.jsonl", "gsm8k": "gsm8k.jsonl", "qa": "qa.jsonl",
             "sum": "sum.jsonl"}
"""The per-kind question sets (EAGLE's ``question.jsonl`` files, under these names in ``--prompts``)."""
KINDS = (*EVAL_SETS, "stdlib", "other")
ENGINE_LENGTH_STEP = 256
"""A kind's serving context is its longest prompt plus the reply cap, rounded up to this."""


def engine_length(prompt_ids: list[list[int]], max_tokens: int) -> int:
    """vLLM's ``max_model_len`` for requests of these prompts: the longest with a whole reply, rounded up."""
    need = max(map(len, prompt_ids)) + max_tokens
    return -(-need // ENGINE_LENGTH_STEP) * ENGINE_LENGTH_STEP


def spread(items: list[Any], n: int) -> list[Any]:
    """``n`` items evenly spread over ``items`` (MT-bench's categories come in runs of ten)."""
    if n >= len(items):
        return list(items)
    return [items[round(i * len(items) / n)] for i in range(n)]


def eval_conversations(prompts: Path, kind: str, n: int) -> list[dict[str, Any]]:
    """A question set's first-turn requests (MT-bench: ``ceil(n / 2)`` questions with both turns, each turn a request
    once :func:`turn_records` splits them), replies pending."""
    from tapdraft.demo.real.prompts import PENDING

    path = prompts / EVAL_SETS[kind]
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: --prompts names a folder with {', '.join(EVAL_SETS.values())} "
                                "(EAGLE's eagle/data/*/question.jsonl)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = spread(rows, -(-n // 2) if kind == "mt_bench" else n)
    out = []
    for r in rows:
        turns = r["turns"] if kind == "mt_bench" else r["turns"][:1]
        conv = [t for text in turns for t in ({"from": "User", "value": text}, {"from": "Assistant", "value": PENDING})]
        out.append({"id": f"{kind}-{r['question_id']}", "conversations": conv})
    return out


def kind_conversations(prompts: Path, n: int) -> dict[str, list[dict[str, Any]]]:
    """Every kind's requests: the question sets from ``prompts``, the held-out library questions and the other ones."""
    from tapdraft.demo.real.prompts import other_prompts, prompt_splits

    kinds = {k: eval_conversations(prompts, k, n) for k in EVAL_SETS}
    kinds["stdlib"] = [{**c, "id": f"stdlib-{c['id']}"} for c in prompt_splits(1, 1, n)["held_out"]]
    kinds["other"] = other_prompts(n)
    return kinds


def turn_records(record: dict[str, Any]) -> list[dict[str, Any]]:
    """A regenerated multi-turn conversation -> one record per reply, each up to that reply (the earlier replies the
    target's own, token for token): ``ID-1``, ``ID-2``..."""
    turns = record["conversations"]
    ends = [i for i, t in enumerate(turns) if t["from"] == "assistant"]
    return [{**record, "id": f"{record['id']}-{j + 1}", "conversations": turns[:e + 1]} for j, e in enumerate(ends)]


def stage_replies(work: Path, kinds: dict[str, list[dict]], target: Path, venv: Path, cfg: SpeedupConfig,
                  log=print) -> None:
    """WORK/KIND.jsonl (+ sidecar) for every kind: one regeneration, split back; MT-bench split into its turns."""
    from tapdraft.capture.provenance import sidecar_path
    from tapdraft.capture.replies.regenerate import split_output

    if all(sidecar_path(work / f"{k}.jsonl").exists() for k in kinds):
        return
    joined, replies = work / "requests.jsonl", work / "replies.jsonl"
    if not sidecar_path(replies).exists():
        write_jsonl(joined, [r for rs in kinds.values() for r in rs])
        run_cli("regenerate", "--target", str(target), "--data", str(joined), "--out", str(replies),
             "--max-new-tokens", str(cfg.max_tokens), "--on-limit", "keep", "--engine", "vllm",
             "--vllm-python", str(venv / "bin" / "python"), "--max-batch-size", "32",
             "--threads", str(cfg.engine_threads), "--data-parallel-size", str(cfg.engines), log=log)
    split_output(replies, {k: ([r["id"] for r in rs], work / f"{k}.jsonl") for k, rs in kinds.items()})
    for k in kinds:  # a request per turn: each record up to one reply, the earlier ones the target's own
        path = work / f"{k}.jsonl"
        records = [t for r in map(json.loads, path.read_text().splitlines()) for t in turn_records(r)]
        with staged(path) as tmp:
            tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def stage_capture(work: Path, kinds: list[str], target: Path, cfg: SpeedupConfig, log=print) -> Path:
    ds = work / "dataset"
    if not (ds / "manifest.json").exists():
        data = [x for k in kinds for x in ("--data", f"{k}={work / f'{k}.jsonl'}")]
        run_cli("capture", "--target", str(target), *data, "--out", str(ds), "--threads", str(cfg.threads), log=log)
    return ds


def serving_key(export: Path, cfg: SpeedupConfig, per_kind: int) -> str:
    """The name a kind's served runs are kept under (``kinds/served/KEY/KIND.json``, so a stopped benchmark serves
    only the kinds it had not): the run, and a hash of what the runs depend on (the export's files, the drafts a
    round, the pairs, the reply cap, the requests a kind, the engine's threads)."""
    files = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in export.iterdir() if f.is_file())
    what = {"export": files, "k": list(cfg.k), "pairs": cfg.pairs, "max_tokens": cfg.max_tokens,
            "per_kind": per_kind, "engine_threads": cfg.engine_threads}
    return f"{cfg.run}-{hashlib.sha256(json.dumps(what).encode()).hexdigest()[:12]}"


def kind_rows(served: dict[str, dict[str, list[dict]]], k: str) -> dict[str, dict[str, Any]]:
    """Per kind, ``pair_figures`` of its own runs (``serve_pairs``' over its requests) at ``k`` drafts a round, and
    the round cost it implies."""
    rows = {}
    for kind, runs in served.items():
        idx = list(range(len(runs["alone"][0]["outputs"])))
        fig = pair_figures(runs, idx)
        row = {"requests": len(idx), "alone_tokens_per_s": statistics.median(fig["alone_tokens_per_s"]),
               **{key: fig[k][key] for key in ("speedup_median", "speedup_pairs", "greedy_identical", "vllm_tau",
                                               "rounds", "accepted")}}
        if "decode_speedup_median" in fig[k]:
            row.update(decode_speedup_median=fig[k]["decode_speedup_median"],
                       decode_speedup_pairs=fig[k]["decode_speedup_pairs"],
                       round_cost=fig[k]["vllm_tau"] / fig[k]["decode_speedup_median"])
        rows[kind] = row
    return rows


def headline(rows: dict[str, dict[str, Any]], key: str) -> dict[str, Any]:
    """The median kind's and the worst kind's figure of ``key`` (never the best)."""
    values = {kind: r[key] for kind, r in rows.items() if r.get(key) is not None}
    worst = min(values, key=values.get)
    return {"median": statistics.median(values.values()), "worst": values[worst], "worst_kind": worst}


def format_rows(rows: dict[str, dict[str, Any]]) -> str:
    head = (f"{'kind':<10} {'reqs':>4} {'whole':>6} {'decode':>6} {'tau vLLM':>8} {'speculate':>9} {'replay':>7} "
            f"{'R':>5}  equal greedy")
    lines = [head]
    for kind, r in rows.items():
        s = r.get("speculate", {})
        replay = s.get("offline_tau_replayed")
        lines.append(f"{kind:<10} {r['requests']:>4} {r['speedup_median']:>5.2f}x {r.get('decode_speedup_median', 0):>5.2f}x"
                     f" {r['vllm_tau']:>8.3f} {s.get('tau', float('nan')):>9.3f} "
                     f"{replay if replay is None else round(replay, 3)!s:>7} {r.get('round_cost', 0):>5.2f}  "
                     f"{str(r.get('rounds_equal_to_speculate')):<5} {r['greedy_identical']}")
    for key, what in (("speedup_median", "whole requests"), ("decode_speedup_median", "the decode")):
        if all(key in r for r in rows.values()):
            h = headline(rows, key)
            lines.append(f"over {what}: median kind {h['median']:.2f}x, worst kind {h['worst']:.2f}x ({h['worst_kind']})")
    return "\n".join(lines)


def run_per_kind(work: Path, cfg: SpeedupConfig, prompts: Path, per_kind: int, log=print,
                 stop_after: str | None = None) -> dict[str, Any] | None:
    """The stages (module docstring); with ``stop_after`` ("capture") none after it, and no report: the kinds'
    requests, replies and capture are then ready for ``benchmarks.data_scaling``, which needs no serving."""
    from tapdraft.engines.serving import engine_venv, vllm_requests

    if stop_after != "capture":  # a drafter that cannot be served is refused before an hour of replies and capture
        run, export = work / "runs" / cfg.run, stage_export(work, cfg, log=log)
        held_drafts(export, cfg.k[0])
    target = target_dir(cfg, log)
    kinds_dir = work / "kinds"
    kinds_dir.mkdir(parents=True, exist_ok=True)
    venv = engine_venv("vllm")
    kinds = kind_conversations(prompts, per_kind)
    stage_replies(kinds_dir, kinds, target, venv, cfg, log)
    dataset = stage_capture(kinds_dir, list(kinds), target, cfg, log)
    if stop_after == "capture":  # the kinds' data needs no drafter: data_scaling trains its runs after it
        return None
    served, ids, lengths = {}, {}, {}
    kept = kinds_dir / "served" / serving_key(export, cfg, per_kind)
    for kind in kinds:
        reqs, ids[kind], prompt_ids = vllm_requests(target, kinds_dir / f"{kind}.jsonl", per_kind, kinds_dir / "audio")
        lengths[kind] = engine_length(prompt_ids, cfg.max_tokens)
        if (kept / f"{kind}.json").is_file():
            served[kind] = json.loads((kept / f"{kind}.json").read_text())
            log(f"{kind}: served before, kept in {kept}")
            continue
        served[kind] = serve_pairs(kinds_dir, cfg, target, venv, export, reqs, lambda m, kind=kind: log(f"{kind}: {m}"),
                                   max_model_len=lengths[kind])
        with staged(kept / f"{kind}.json") as tmp:
            tmp.write_text(json.dumps(served[kind]))
    k = f"k={cfg.k[0]}"
    rows = kind_rows(served, k)
    for kind in kinds:
        rows[kind]["max_model_len"] = lengths[kind]
    for kind, runs in served.items():
        greedy = runs["alone"][0]["outputs"]
        rows[kind].update(speculate_check(kinds_dir / f"{kind}.jsonl", target, run, dataset, ids[kind], greedy,
                                          runs[k][0], cfg.max_tokens, drafts=cfg.k[0]))
        log(f"{kind}: speculate tau {rows[kind]['speculate']['tau']:.3f}, rounds equal to vLLM's: "
            f"{rows[kind]['rounds_equal_to_speculate']}")
    others = {name: k_report(kind_rows(served, name)) for name in next(iter(served.values()))
              if name not in ("alone", k)}
    return {"k": cfg.k[0], **k_report(rows), **({"other_k": others} if others else {})}


def held_drafts(export: Path, k: int) -> None:
    """Refuse, before serving, a first ``--k`` that ``tapdraft speculate`` cannot draft for this export (more than
    it was trained for, or fewer where its family cannot)."""
    from tapdraft.train.drafters.base import get_family

    tapdraft_cfg = json.loads((export / "config.json").read_text()).get("tapdraft", {})
    trained = tapdraft_cfg.get("serve_with", {}).get("vllm", {}).get("num_speculative_tokens")
    if trained is not None and "family" in tapdraft_cfg:
        get_family(tapdraft_cfg["family"])[1].check_drafts(k, trained)


def k_report(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The kinds' rows at one number of drafts a round with their headlines (median and worst kind)."""
    return {"kinds": rows, "whole_requests": headline(rows, "speedup_median"),
            **({"decode": headline(rows, "decode_speedup_median")}
               if all("decode_speedup_median" in r for r in rows.values()) else {})}


def training_data(work: Path) -> dict[str, Any] | None:
    """What the drafter was trained on: the work directory's dataset, its training split's conversations and tokens."""
    manifest = work / "dataset" / "manifest.json"
    if not manifest.is_file():
        return None
    split = json.loads(manifest.read_text())["splits"].get("train", {})
    return {k: split.get(k) for k in ("samples", "tokens", "supervised_tokens")}


def main(argv: list[str] | None = None) -> None:
    d = SpeedupConfig()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", choices=["text", "general", "self"], default="general")
    ap.add_argument("--workdir", required=True, help="a benchmarks.real_speedup work directory with runs/RUN")
    ap.add_argument("--run", required=True, help="the run (and export) name in the work directory")
    ap.add_argument("--prompts", required=True, type=Path,
                    help="the folder of the question sets (mt_bench.jsonl, alpaca.jsonl, gsm8k.jsonl, qa.jsonl, sum.jsonl)")
    ap.add_argument("--per-kind", type=int, default=8, help="requests served per kind")
    ap.add_argument("--max-tokens", type=int, default=None, help="reply cap (default: the target's)")
    ap.add_argument("--k", default="3", help="drafts a round to serve with, comma-separated: the first is held "
                                             "against tapdraft speculate drafting as many, the others vLLM's figures")
    ap.add_argument("--layout", default=None, help=LAYOUT_HELP + ", for a run not yet exported")
    ap.add_argument("--pairs", type=int, default=d.pairs)
    ap.add_argument("--threads", type=int, default=d.threads)
    ap.add_argument("--engine-threads", type=int, default=d.engine_threads)
    ap.add_argument("--stop-after", choices=["capture"], default=None,
                    help="capture: make the kinds' requests, replies and capture, serve nothing (what "
                         "benchmarks.data_scaling reads)")
    ap.add_argument("--name", default=None)
    a = ap.parse_args(argv)
    cfg = SpeedupConfig(target=a.target, run=a.run, max_tokens=a.max_tokens, k=tuple(int(x) for x in a.k.split(",")),
                        pairs=a.pairs, threads=a.threads, engine_threads=a.engine_threads, layout=a.layout)
    work = Path(a.workdir).resolve()
    try:
        report = run_per_kind(work, cfg, a.prompts.resolve(), a.per_kind, log=lambda m: print(m, flush=True),
                              stop_after=a.stop_after)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    if report is None:
        print(f"the kinds' requests, replies and capture are in {work / 'kinds'}; nothing served")
        return
    print(format_rows(report["kinds"]))
    for name, other in report.get("other_k", {}).items():  # vLLM's figures only: speculate drafts the trained k
        print(f"served at {name}:\n{format_rows(other['kinds'])}")
    out = RESULTS / (a.name or f"per_kind_{a.target}_{a.run}.json")
    doc = {"target": a.target, "run": a.run, "per_kind": a.per_kind, "pairs": a.pairs, "max_tokens": cfg.max_tokens,
           "command": "python -m benchmarks.per_kind " + " ".join(argv if argv is not None else sys.argv[1:]),
           "training_data": training_data(work), **environment(threads=a.threads, engine_threads=a.engine_threads),
           **report}
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
