"""One projector update of the speech LLM's listener, with its frozen LM in fp32 and in a bf16 copy
(``listen.fit``'s ``frozen_dtype``; ``listen-open --frozen-lm``): the seconds an update takes each way, alternated
``--pairs`` times, and the loss each gives at the same parameters.

    python -m benchmarks.listen_step --pairs 5 --name listen_step.json

The utterances are espeak-ng sentences of the kind ``listen-open`` trains on, encoded once; each timed update starts
from the same projector (a fresh copy), so the two precisions do the same work. One torch thread by default.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch

from benchmarks.common import write_result

SENTENCES = ["can you explain how a neural network learns from its data",
             "write a short story about a dog who finds a red ball in the park",
             "what is the best way to learn a new language quickly",
             "please summarize the main points of this article for me",
             "how do i make a simple web page with a blue background",
             "tell me three facts about the history of the roman empire",
             "why is the sky blue during the day and dark at night",
             "give me a recipe for a quick dinner with chicken and rice"]


def update(model, examples, frames, dtype: torch.dtype) -> tuple[float, float]:
    """Seconds of one update from a copy of ``model`` and the loss it saw."""
    from tapdraft.demo.real.listen import fit

    m = copy.deepcopy(model)
    t0 = time.perf_counter()
    loss = fit(m, examples, frames, list(m.model.multi_modal_projector.parameters()), steps=1, batch=len(examples),
               lr=1e-3, seed=0, log=lambda *_: None, frozen_dtype=dtype)[0]
    return time.perf_counter() - t0, loss


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=None, help="cache root of the listener (built on first use)")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--name", default="listen_step.json")
    a = ap.parse_args(argv)
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

    from tapdraft.demo.real import listen

    torch.set_num_threads(a.threads)
    start, _ = listen.build_listener(a.root)
    model = Qwen2AudioForConditionalGeneration.from_pretrained(start, dtype=torch.float32).eval()
    proc = AutoProcessor.from_pretrained(start)
    waves = [listen.speak(s, *listen.VOICES[i % len(listen.VOICES)]) for i, s in enumerate(SENTENCES)]
    frames = listen.encode_audio(model, waves, proc.feature_extractor)
    examples = listen.transcription_examples(proc.tokenizer, SENTENCES)
    update(model, examples, frames, torch.bfloat16)  # warm both paths once
    update(model, examples, frames, torch.float32)
    runs: dict[str, list[tuple[float, float]]] = {"fp32": [], "bf16": []}
    loads = []
    for p in range(a.pairs):
        for name in (("fp32", "bf16") if p % 2 == 0 else ("bf16", "fp32")):
            runs[name].append(update(model, examples, frames, torch.float32 if name == "fp32" else torch.bfloat16))
        loads.append(os.getloadavg()[0])
    seconds = {k: statistics.median(s for s, _ in v) for k, v in runs.items()}
    loss = {k: v[0][1] for k, v in runs.items()}
    speedup = statistics.median(f[0] / b[0] for f, b in zip(runs["fp32"], runs["bf16"]))
    print(f"an update of {len(SENTENCES)} utterances: fp32 {seconds['fp32']:.2f} s, bf16 {seconds['bf16']:.2f} s "
          f"({speedup:.2f}x); loss {loss['fp32']:.4f} / {loss['bf16']:.4f}")
    write_result(a.name, {"benchmark": "listen_step", "model": start.name, "utterances": len(SENTENCES),
                          "frames": [int(f.shape[0]) for f in frames], "seconds": seconds, "bf16_speedup": speedup,
                          "runs": runs, "loss": loss, "loss_rel_diff": abs(loss["bf16"] - loss["fp32"]) / loss["fp32"],
                          "machine_extra": {"threads": a.threads, "load_avg_per_pair": loads}})


if __name__ == "__main__":
    main()
