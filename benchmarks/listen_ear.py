"""What the ear allows: Whisper tiny.en transcribing with its own decoder (``demo.real.ear``) the utterances an open
listener is scored on (``open_listen.held_out``: the held-out open sentences and the closed task's held-out set,
spoken once in the listener's work directory), scored as the listener is (``listen.score_transcripts``).

    python -m benchmarks.listen_ear --workdir open_listen --sentences 5000 --name listen_ear.json

The flags are the open listener's (the same work directory and sizes find the same waves; nothing is trained).
Writes benchmarks/results/NAME with both sets' WER, their first pairs, the seconds and the machine's load.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from benchmarks.common import write_result
from tapdraft.demo.real.__main__ import add_open_listen_args, open_listen_config


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_open_listen_args(ap)
    ap.add_argument("--threads", type=int, default=1, help="the decoder's threads")
    ap.add_argument("--name", default="listen_ear.json")
    a = ap.parse_args(argv)
    from importlib.metadata import version

    from tapdraft.demo.real.ear import Ear
    from tapdraft.demo.real.listen import score_transcripts
    from tapdraft.demo.real.open_listen import held_out

    load_before, t0 = os.getloadavg(), time.time()
    cfg = open_listen_config(a)
    ear = Ear(a.root, threads=a.threads)
    sets = held_out(Path(a.workdir).resolve(), cfg)
    report = {"transcriber": f"Whisper tiny.en, its own decoder, greedy (ctranslate2 {version('ctranslate2')})",
              "sentences": {"n_train": cfg.n_train, "n_test": cfg.n_test, "seed": cfg.seed},
              **{name: score_transcripts(refs, ear.transcribe(waves)) for name, (refs, waves, _) in sets.items()},
              "seconds": round(time.time() - t0)}
    write_result(a.name, {**report, "machine_extra": {"threads": a.threads, "load_avg_before": load_before,
                                                      "load_avg_after": os.getloadavg()}})
    print({name: round(report[name]["wer"], 4) for name in sets})


if __name__ == "__main__":
    main()
