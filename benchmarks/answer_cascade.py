"""What the speech LLM's ears allow: on the answerer's held-out spoken requests, the reply of a cascade built from the
same parts (the model transcribes the request, its other task; the transcript, case and punctuation off as the
requests are written, goes to the same frozen LM as a written request) against the written request's reply, beside
the spoken reply itself. Two ears are tried: the answerer's own transcription and the listener it started from (the
better transcriber). A cascade with the same ears is what behaviour-aligned speech LLMs are held against (BLSP,
arXiv:2309.00916).

    python -m benchmarks.answer_cascade [--first 32] [--max-new-tokens 64] [--threads 2] [--name answer_cascade.json]

A cascade whose transcript is exact gives the written reply by construction, so its share over the first tokens is
about its share of exact transcripts: what hearing of this quality buys when every word the ears get right reaches
the LM as the written word. The spoken reply has no transcript to get exactly right (the audio frames go to the LM),
so the cascade is a reference for a bar on spoken replies equal to written ones, not a bound. The direct figures
repeat ``benchmarks.answer``'s for the same model and audio.
"""

from __future__ import annotations

import argparse
import itertools
import os
import time

from benchmarks.common import write_result


def cascade(ears, answerer, written: list[list[int]], waves: list, first: int, max_new_tokens: int,
            refs: list[str]) -> dict:
    """``ears`` = (model, processor) transcribes each wave; ``answerer``'s LM answers each transcript written; the
    transcripts scored against ``refs`` and the replies against ``written``."""
    from tapdraft.demo.real.answer import reply, score_replies
    from tapdraft.demo.real.listen import normalise, score_transcripts, transcribe

    heard = transcribe(*ears, waves)
    replies = [reply(*answerer, normalise(h), None, max_new_tokens) for h in heard]
    return {"transcripts": score_transcripts(refs, heard), **score_replies(written, replies, first)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--first", type=int, default=32, help="reply tokens the first-tokens share judges")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens per reply ('whole' compares up to here)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--name", default="answer_cascade.json")
    a = ap.parse_args(argv)
    import torch
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

    from tapdraft.demo.real.answer import AnswerConfig, build_answerer, reply, requests, score_replies, speak_all
    from tapdraft.demo.real.listen import VOICES, ListenConfig, build_listener

    if a.threads:
        torch.set_num_threads(a.threads)
    load_before, t0 = os.getloadavg(), time.time()
    cfg = AnswerConfig()  # the default answerer: its LM frozen, so its written replies are the LM's

    def load(d):
        return (Qwen2AudioForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval(),
                AutoProcessor.from_pretrained(d))

    answerer_dir, _ = build_answerer(None, cfg)
    listener_dir, _ = build_listener(None, ListenConfig(steps=cfg.listen_steps))
    answerer, listener = load(answerer_dir), load(listener_dir)
    asked = requests(cfg)
    waves = speak_all(asked, itertools.cycle(VOICES))  # the audio the answerer's own evaluation heard
    out = {}
    for split in ("test", "oov"):
        written = [reply(*answerer, t, None, a.max_new_tokens) for t in asked[split]]
        spoken = [reply(*answerer, None, w, a.max_new_tokens) for w in waves[split]]
        out[split] = {"spoken": score_replies(written, spoken, a.first),
                      **{f"cascade_{name}_ears": cascade(ears, answerer, written, waves[split], a.first,
                                                         a.max_new_tokens, asked[split])
                         for name, ears in (("answerer", answerer), ("listener", listener))}}
        print(split, {k: (v.get("transcripts", {}).get("exact"), v[f"first_{a.first}"]) for k, v in out[split].items()},
              flush=True)
    write_result(a.name, {"benchmark": "answer_cascade", "answerer": answerer_dir.name, "listener": listener_dir.name,
                          "first": a.first, "max_new_tokens": a.max_new_tokens, "held_out": out["test"],
                          "out_of_vocabulary": out["oov"], "seconds": round(time.time() - t0),
                          "machine_extra": {"threads": torch.get_num_threads(), "load_avg_before": load_before}})


if __name__ == "__main__":
    main()
