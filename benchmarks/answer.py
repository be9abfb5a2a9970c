"""The speech LLM that answers, measured like a speech LLM: on held-out spoken requests, how often its reply equals
the reply its LM gives the same request written (the first 32 tokens, and the whole reply to 64), the mean agreeing
prefix, whether a reply follows its audio; transcription WER on held-out sentences (its other task); with an LM update,
how far the LM's own written replies moved. The model is ``demo.real.answer``'s (built, or reused from its cache);
the figures are its own evaluation of the saved directory, reloaded.

    python -m benchmarks.answer --name answer_projector.json                     # the projector alone
    python -m benchmarks.answer --distill --lm-rank 8 --name answer_rank8.json   # a low-rank LM update, merged

Writes benchmarks/results/NAME with the configuration, the figures, the training time and the machine's load.
"""

from __future__ import annotations

import argparse
import os

from benchmarks.common import write_result
from tapdraft.demo.real.__main__ import add_answer_args, answer_config


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_answer_args(ap)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--name", default="answer.json")
    a = ap.parse_args(argv)
    import torch

    from tapdraft.demo.real.answer import build_answerer

    if a.threads:
        torch.set_num_threads(a.threads)
    load_before = os.getloadavg()
    d, info = build_answerer(a.root, answer_config(a))
    write_result(a.name, {"model": d.name, **info, "machine_extra": {"threads": torch.get_num_threads(),
                                                                    "load_avg_before": load_before}})


if __name__ == "__main__":
    main()
