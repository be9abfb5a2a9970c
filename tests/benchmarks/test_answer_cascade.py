"""benchmarks.answer_cascade: the ears' transcript reaches the LM as a request is written (case and punctuation off),
and its reply is scored against the written request's."""

from __future__ import annotations

import tapdraft.demo.real.answer as answer
import tapdraft.demo.real.listen as listen
from benchmarks.answer_cascade import cascade


def test_an_exact_transcript_gives_the_written_reply_and_a_misheard_one_does_not(monkeypatch):
    # fake ears hear the first request with a capital and a period (exact once normalised), the second misheard;
    # the fake LM's reply spells its request's characters, so case and punctuation would change it
    heard = {0: "Tell me about a brave pilot.", 1: "describe a bread book"}
    monkeypatch.setattr(listen, "transcribe", lambda model, proc, waves: [heard[w] for w in waves])
    monkeypatch.setattr(answer, "reply", lambda model, proc, request, wave, n: [ord(c) for c in request][:n] + [0] * 32)
    refs = ["tell me about a brave pilot", "describe a red book"]
    written = [[ord(c) for c in r] + [0] * 32 for r in refs]
    res = cascade((None, None), (None, None), written, [0, 1], first=32, max_new_tokens=64, refs=refs)
    assert res["transcripts"]["exact"] == 1 and res["transcripts"]["n"] == 2
    assert res["first_32"] == 0.5 and res["mean_prefix_tokens"] == (len(written[0]) + len("describe a ")) / 2
