"""How far the speech LLM's language model keeps its own reply when a written request changes only in form: the
answerer's held-out requests (``demo.real.answer``'s test split) as written and in variants that mean the same
(capitalised, a final period, "please" before them, "can you" before them), each answered greedily one at a time as
the answerer's evaluation answers; per variant, the share whose first ``--first`` reply tokens equal the reply to the
request as written, the whole reply's share, and the mean agreeing prefix.

    python -m benchmarks.answer_variants [--first 32] [--max-new-tokens 64] [--name answer_variants.json]

A spoken request reaches the LM as ~75 audio frames in place of ~8 written tokens: it cannot be closer to the written
request than a variant in the same words is. So these shares bound what a bar on spoken replies equal to written
ones can ask of this LM: where the LM itself keeps its reply under a capital letter in few cases, no alignment of the
audio can make a spoken request keep it in most.
"""

from __future__ import annotations

import argparse
import os
from types import SimpleNamespace

from benchmarks.common import write_result

VARIANTS = {
    "capitalised": lambda r: r[0].upper() + r[1:],
    "final period": lambda r: r + ".",
    "please": lambda r: "please " + r,
    "can you": lambda r: "can you " + r,
}
"""Forms of a request that mean what it means."""


def variant_agreement(answer, requests: list[str], first: int) -> dict[str, dict]:
    """``answer(request) -> reply ids`` over every request and each of its ``VARIANTS``; the variants' replies scored
    against the written request's (``demo.real.answer.score_replies``, without its audio-swap count)."""
    from tapdraft.demo.real.answer import score_replies

    written = [answer(r) for r in requests]
    out = {}
    for name, form in VARIANTS.items():
        s = score_replies(written, [answer(form(r)) for r in requests], first=first)
        out[name] = {k: v for k, v in s.items() if k != "follows_audio"}
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--first", type=int, default=32, help="reply tokens compared (the answerer's bar: 32)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="reply tokens generated (the answerer's: 64)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--name", default="answer_variants.json", help="result file in benchmarks/results/")
    a = ap.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tapdraft.demo.real.answer import AnswerConfig, reply, requests
    from tapdraft.demo.real.build import build_real_targets

    if a.threads:
        torch.set_num_threads(a.threads)
    lm_dir = build_real_targets().smollm2  # the speech LLM's language model, as built for it
    tok = AutoTokenizer.from_pretrained(lm_dir)
    model = AutoModelForCausalLM.from_pretrained(lm_dir, dtype=torch.float32).eval()
    proc = SimpleNamespace(tokenizer=tok)
    held = requests(AnswerConfig())["test"]
    load = os.getloadavg()
    res = variant_agreement(lambda r: reply(model, proc, r, None, a.max_new_tokens), held, a.first)
    for name, s in res.items():
        print(f"{name:>12}: first {a.first} equal {100 * s[f'first_{a.first}']:.0f}%, whole {100 * s['whole']:.0f}%, "
              f"mean agreeing prefix {s['mean_prefix_tokens']:.1f} tokens ({s['n']} requests)")
    doc = {"benchmark": "answer_variants", "model": lm_dir.name, "requests": len(held), "first": a.first,
           "max_new_tokens": a.max_new_tokens, "variants": res, "machine_extra": {"load_avg_before": load}}
    write_result(a.name, doc)
    return doc


if __name__ == "__main__":
    main()
