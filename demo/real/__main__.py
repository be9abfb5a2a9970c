"""``python -m tapdraft.demo.real build [--root DIR]``: build (or reuse) the real targets and print where they are;
``python -m tapdraft.demo.real listen [--root DIR] [--steps N]``: build (or reuse) the speech LLM trained to transcribe;
``python -m tapdraft.demo.real answer [--root DIR] [--steps N]``: build (or reuse) the speech LLM that answers spoken
requests;
``python -m tapdraft.demo.real broad --workdir DIR --train N``: SmolLM2's own replies to N ShareGPT conversations (resumable);
``python -m tapdraft.demo.real listen-open --workdir DIR [--sentences N] [--steps N]``: the listener taught open speech
(resumable)."""

from __future__ import annotations

import argparse
import json

from tapdraft.demo.real.answer import AnswerConfig, build_answerer
from tapdraft.demo.real.build import build_real_targets
from tapdraft.demo.real.listen import ListenConfig, build_listener
from tapdraft.demo.real.open_listen import FROZEN_LM, OpenListenConfig


def add_answer_args(p: argparse.ArgumentParser) -> None:
    """The answerer's flags (``AnswerConfig``'s fields a user sets), shared with ``benchmarks.answer``."""
    p.add_argument("--root", default=None, help="cache root (default ~/.cache/tapdraft/models)")
    p.add_argument("--steps", type=int, default=AnswerConfig.steps, help="updates")
    p.add_argument("--n-train", type=int, default=AnswerConfig.n_train, help="training requests")
    p.add_argument("--batch", type=int, default=AnswerConfig.batch, help="requests per update")
    p.add_argument("--lr", type=float, default=AnswerConfig.lr, help="AdamW learning rate")
    p.add_argument("--keep-projector", action="store_true",
                   help="keep the listener's projector (what the audio says to the LM); needs --lm-rank")
    p.add_argument("--train-encoder", action="store_true", help="train the audio encoder too, at --encoder-lr")
    p.add_argument("--encoder-lr", type=float, default=AnswerConfig.encoder_lr, help="the encoder's learning rate")
    p.add_argument("--distill", action="store_true",
                   help="learn the frozen LM's distribution given the written request (KL from its top-k, computed "
                        "once), not only its greedy reply")
    p.add_argument("--transcribe-share", type=float, default=AnswerConfig.transcribe_share,
                   help="share of the training pairs that are transcription, the model's other task")
    p.add_argument("--lm-rank", type=int, default=AnswerConfig.lm_rank,
                   help="rank of a low-rank LM update merged before saving (0: the LM frozen)")


def answer_config(a: argparse.Namespace) -> AnswerConfig:
    return AnswerConfig(steps=a.steps, n_train=a.n_train, batch=a.batch, lr=a.lr,
                        train_projector=not a.keep_projector, train_encoder=a.train_encoder,
                        encoder_lr=a.encoder_lr, distill=a.distill, lm_rank=a.lm_rank,
                        transcribe_share=a.transcribe_share)


def add_open_listen_args(p: argparse.ArgumentParser) -> None:
    """The open listener's flags (``OpenListenConfig``'s fields a user sets), shared with ``benchmarks.listen_open``."""
    p.add_argument("--workdir", required=True, help="its work directory: every stage is kept there and resumes")
    p.add_argument("--root", default=None, help="cache root of the closed listener it starts from")
    p.add_argument("--sentences", type=int, default=OpenListenConfig.n_train, help="training sentences")
    p.add_argument("--test", type=int, default=OpenListenConfig.n_test, help="held-out open sentences")
    p.add_argument("--steps", type=int, default=OpenListenConfig.steps, help="projector updates")
    p.add_argument("--batch", type=int, default=OpenListenConfig.batch, help="utterances per update")
    p.add_argument("--lr", type=float, default=OpenListenConfig.lr, help="AdamW learning rate")
    p.add_argument("--encoder-layers", type=int, default=OpenListenConfig.encoder_layers,
                   help="the audio encoder's top layers trained with the projector (0: the projector alone)")
    p.add_argument("--encoder-lr", type=float, default=OpenListenConfig.encoder_lr,
                   help="their AdamW learning rate")
    p.add_argument("--frozen-lm", choices=FROZEN_LM, default=OpenListenConfig.frozen_lm,
                   help="the frozen LM's precision in training (auto: bf16 on a CPU with bf16 instructions)")
    p.add_argument("--lm-rank", type=int, default=OpenListenConfig.lm_rank,
                   help="a low-rank update of the LM trained with the projector, merged (0: the LM frozen)")


def open_listen_config(a: argparse.Namespace) -> OpenListenConfig:
    return OpenListenConfig(n_train=a.sentences, n_test=a.test, steps=a.steps, batch=a.batch, lr=a.lr,
                            encoder_layers=a.encoder_layers, encoder_lr=a.encoder_lr, frozen_lm=a.frozen_lm,
                            lm_rank=a.lm_rank)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tapdraft.demo.real", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="the SmolLM2 and speech LLM directories, cached and checked")
    b.add_argument("--root", default=None, help="cache root (default ~/.cache/tapdraft/models)")
    li = sub.add_parser("listen", help="the speech LLM with its projector trained on espeak-ng transcription")
    li.add_argument("--root", default=None, help="cache root (default ~/.cache/tapdraft/models)")
    li.add_argument("--steps", type=int, default=ListenConfig.steps, help="projector updates")
    li.add_argument("--n-train", type=int, default=ListenConfig.n_train, help="training sentences")
    an = sub.add_parser("answer", help="the speech LLM aligned to answer a spoken request as its LM answers it written")
    add_answer_args(an)
    an.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    br = sub.add_parser("broad", help="SmolLM2's own replies to ShareGPT conversations, in resumable chunks")
    br.add_argument("--workdir", required=True)
    br.add_argument("--train", type=int, default=2000, help="pool conversations (a multiple of 500 is regenerated)")
    br.add_argument("--validation", type=int, default=64)
    br.add_argument("--engines", type=int, default=1, help="vLLM engines side by side, one thread each")
    lo = sub.add_parser("listen-open", help="the listener taught open speech: espeak-ng sentences of ShareGPT's "
                                            "requests (resumable work directory)")
    add_open_listen_args(lo)
    lo.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    a = p.parse_args(argv)
    if getattr(a, "threads", None):
        import torch

        torch.set_num_threads(a.threads)
    if a.cmd == "build":
        t = build_real_targets(a.root)
        print(json.dumps({"smollm2": str(t.smollm2), "speech": str(t.speech), "checks": t.checks}, indent=2))
    elif a.cmd == "broad":
        from pathlib import Path

        from tapdraft.demo.real.broad import regenerate_broad
        from tapdraft.engines.serving import engine_venv

        done = regenerate_broad(Path(a.workdir).resolve(), a.train, a.validation, venv=engine_venv("vllm"),
                                engines=a.engines)
        print(json.dumps(done, indent=2))
    elif a.cmd == "listen-open":
        from pathlib import Path

        from tapdraft.demo.real.open_listen import train_open_listener

        start, _ = build_listener(a.root)
        report = train_open_listener(Path(a.workdir).resolve(), open_listen_config(a), start)
        print(json.dumps({k: v for k, v in report.items() if k != "config"}, indent=2))
    elif a.cmd == "answer":
        d, info = build_answerer(a.root, answer_config(a))
        print(json.dumps({"dir": str(d), **{k: v for k, v in info.items() if k != "config"}}, indent=2))
    else:
        d, info = build_listener(a.root, ListenConfig(steps=a.steps, n_train=a.n_train))
        print(json.dumps({"dir": str(d), **{k: v for k, v in info.items() if k != "config"}}, indent=2))


if __name__ == "__main__":
    main()
