"""A drafter worth serving on a real model: vLLM on this CPU serving held-out requests alone and with a tapdraft
drafter, on a real target (demo.real.speedup holds the stages and ``TARGETS``; each stage is cached in
``--workdir``).

    python -m benchmarks.real_speedup --target text --workdir real_work      # SmolLM2, eagle3_small, 3 drafts
    python -m benchmarks.real_speedup --target general --workdir general/n2000 --pool general/pool \\
        --train 2000 --recipe dflash_small                                  # SmolLM2 on its replies to ShareGPT
    python -m benchmarks.real_speedup --target self --workdir self/n1100 --train 1100 --validation 64 \\
        --recipe dflash_small --stop-after train                            # ... to requests it wrote itself
    python -m benchmarks.real_speedup --target speech --workdir speech_work  # the listener on held-out speech
    python -m benchmarks.real_speedup --target assistant --workdir assistant_work \\
        --recipe dflash_small                                               # spoken requests answered at length
    python -m benchmarks.real_speedup --target text --workdir real_work --recipe eagle3 --run eagle3_k5 --k 5 \\
        --set max_steps=800 --name real_speedup_eagle3.json                 # another recipe on the same data
    python -m benchmarks.real_speedup --target text --workdir real_work --requests other \\
        --name real_speedup_smollm2_other.json                              # the same drafter, another kind of request

Writes benchmarks/results/NAME (default real_speedup_smollm2.json / _speech.json / _assistant.json). Needs the vLLM
engine venv (``engines/venv.sh vllm``, built on first use) and the real targets (``python -m tapdraft.demo.real build``).
"""

from __future__ import annotations

import argparse
import json
import sys

from benchmarks.common import RESULTS
from tapdraft.demo.real.speedup import LAYOUT_HELP, TARGETS, SpeedupConfig, format_serve, run_speedup

NAMES = {"text": ("SmolLM2-135M-Instruct", "real_speedup_smollm2.json"),
         "general": ("SmolLM2-135M-Instruct, trained on its own replies to ShareGPT", "real_speedup_general.json"),
         "self": ("SmolLM2-135M-Instruct, trained on its own replies to requests it wrote itself",
                  "real_speedup_self.json"),
         "speech": ("Whisper tiny.en + SmolLM2-135M-Instruct, taught to transcribe", "real_speedup_speech.json"),
         "assistant": ("Whisper tiny.en + SmolLM2-135M-Instruct, aligned to answer spoken requests",
                       "real_speedup_assistant.json")}


def main(argv: list[str] | None = None) -> None:
    d = SpeedupConfig()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", choices=sorted(NAMES), default="text")
    ap.add_argument("--workdir", default="real_work")
    ap.add_argument("--train", type=int, default=None, help="training conversations (default: " + ", ".join(
                        f"{t.train} {n}" for n, t in TARGETS.items()) + ")")
    ap.add_argument("--validation", type=int, default=d.validation)
    ap.add_argument("--held-out", type=int, default=d.held_out)
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="reply cap, generating and serving alike (default: " + ", ".join(
                        f"{t.max_tokens} {n}" for n, t in TARGETS.items()) + ")")
    ap.add_argument("--threads", type=int, default=d.threads, help="torch threads of capture and training")
    ap.add_argument("--engine-threads", type=int, default=d.engine_threads,
                    help="vLLM's threads (1: on a shared machine more threads wait on each other at OpenMP barriers)")
    ap.add_argument("--recipe", default=d.recipe)
    ap.add_argument("--method", default=d.method, help="vLLM's method when the export does not state one")
    ap.add_argument("--layout", default=None, help=LAYOUT_HELP)
    ap.add_argument("--run", default=None, help="run name (default: the recipe)")
    ap.add_argument("--set", action="append", default=[], help="training override KEY=VALUE (repeatable)")
    ap.add_argument("--k", default="3", help="drafts a round to serve with, comma-separated")
    ap.add_argument("--pairs", type=int, default=d.pairs)
    ap.add_argument("--prompts", type=int, default=d.prompts, help="requests served")
    ap.add_argument("--requests", choices=["held_out", "other"], default=d.requests,
                    help="held_out: the training prompts' kind on unseen topics or sentences; other: another kind "
                         "(text: everyday writing and explaining; speech: words the listener never heard; assistant: "
                         "those sentences to transcribe)")
    ap.add_argument("--pool", default=None, help="general: the ShareGPT pool's directory, shared by training sizes "
                    "(default WORKDIR/pool)")
    ap.add_argument("--listen-steps", type=int, default=d.listen_steps, help="the speech target's projector updates")
    ap.add_argument("--answer-steps", type=int, default=d.answer_steps, help="the assistant target's updates")
    ap.add_argument("--stop-after", choices=["prompts", "replies", "capture", "train"], default=None)
    ap.add_argument("--name", default=None)
    a = ap.parse_args(argv)
    cfg = SpeedupConfig(target=a.target, train=a.train, validation=a.validation, held_out=a.held_out,
                        max_tokens=a.max_tokens, threads=a.threads, engine_threads=a.engine_threads, recipe=a.recipe,
                        run=a.run, sets=tuple(a.set), k=tuple(int(x) for x in a.k.split(",")), pairs=a.pairs,
                        prompts=a.prompts, requests=a.requests, pool=a.pool, listen_steps=a.listen_steps, answer_steps=a.answer_steps,
                        method=a.method,
                        layout=a.layout)
    serve = run_speedup(a.workdir, cfg, a.stop_after, log=lambda m: print(m, flush=True))
    if serve is None:
        return
    print(format_serve(serve))
    target, name = NAMES[a.target]
    report = {"target": target, "recipe": cfg.recipe, "layout": cfg.layout, "set": list(cfg.sets), "k": list(cfg.k), "pairs": cfg.pairs,
              "prompts": cfg.prompts, "requests": cfg.requests, "train": cfg.train, "max_tokens": cfg.max_tokens, "threads": cfg.threads,
              "engine_threads": cfg.engine_threads,
              "command": "python -m benchmarks.real_speedup " + " ".join(argv if argv is not None else sys.argv[1:]),
              "serve": serve}
    if a.target in ("speech", "assistant"):
        report["listen_steps"] = cfg.listen_steps
    if a.target == "assistant":
        report["answer_steps"] = cfg.answer_steps
    out = RESULTS / (a.name or name)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
