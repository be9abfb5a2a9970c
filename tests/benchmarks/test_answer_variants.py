"""benchmarks.answer_variants scores each variant's replies against the written request's, request by request."""

from __future__ import annotations

from benchmarks.answer_variants import VARIANTS, variant_agreement


def test_a_variant_that_keeps_the_reply_scores_one_and_one_that_changes_it_scores_its_prefix():
    # a fake LM: its reply spells the request's words in lower case, then 30 fillers; "please" and "can you" add
    # words up front (the reply differs from the first token), a capital or a final period change nothing
    def answer(request: str) -> list[int]:
        words = request.lower().rstrip(".").split()
        return [hash(w) % 1000 for w in words] + [7] * 30

    res = variant_agreement(answer, ["tell me about a brave pilot", "describe a red book"], first=32)
    assert set(res) == set(VARIANTS)
    for same in ("capitalised", "final period"):
        assert res[same]["first_32"] == 1.0 and res[same]["whole"] == 1.0 and res[same]["mean_prefix_tokens"] > 32
    for other in ("please", "can you"):
        assert res[other]["first_32"] == 0.0 and res[other]["mean_prefix_tokens"] == 0.0
