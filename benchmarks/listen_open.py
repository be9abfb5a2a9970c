"""The open listener, measured: ``demo.real.open_listen``'s chain in a work directory (every stage resumes there, so
a stopped run continues), then the saved model's own evaluation, reloaded: WER on held-out open sentences (spoken
from conversations the training never saw) and on the closed task's held-out set.

    python -m benchmarks.listen_open --workdir open_listen --sentences 5000 --steps 1200 --encoder-layers 2 \\
        --threads 1 --name listen_open_enc2.json

Writes benchmarks/results/NAME with the configuration, the figures, the training loss at its end, the seconds the
whole chain took in this invocation and the machine's load.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from benchmarks.common import write_result
from tapdraft.demo.real.__main__ import add_open_listen_args, open_listen_config


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_open_listen_args(ap)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--name", default="listen_open.json")
    a = ap.parse_args(argv)
    import torch

    from tapdraft.demo.real.listen import build_listener
    from tapdraft.demo.real.open_listen import train_open_listener

    if a.threads:
        torch.set_num_threads(a.threads)
    load_before = os.getloadavg()
    start, _ = build_listener(a.root)
    report = train_open_listener(Path(a.workdir).resolve(), open_listen_config(a), start)
    write_result(a.name, {**report, "machine_extra": {"threads": torch.get_num_threads(),
                                                      "load_avg_before": load_before,
                                                      "load_avg_after": os.getloadavg()}})


if __name__ == "__main__":
    main()
