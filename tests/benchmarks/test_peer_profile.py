"""benchmarks.peer_profile counts a matmul as the frozen head's by its vocabulary-wide shape, and only such."""

from __future__ import annotations

import torch

from benchmarks.peer_profile import profile_side


class _Side:
    """A step of two matmuls: one against a [V, H] head (the head's), one [H, H] (the draft's)."""

    def __init__(self, vocab: int, hidden: int = 64, rows: int = 256) -> None:
        self.x, self.w, self.d = torch.randn(rows, hidden), torch.randn(vocab, hidden), torch.randn(hidden, hidden)

    def step(self) -> None:
        (self.x @ self.w.T).sum()
        for _ in range(4):
            self.x @ self.d


def test_the_head_share_counts_only_vocabulary_wide_matmuls():
    prof = profile_side(_Side(vocab=8192), steps=2, vocab=8192)
    assert 0.0 < prof["head_matmul_share"] < 1.0
    assert prof["head_matmul_s_per_step"] <= prof["s_per_step"]
    assert any(o["op"] == "aten::mm" for o in prof["top_ops"])
    # the same step seen with another vocabulary's width: no matmul is the head's
    assert profile_side(_Side(vocab=8192), steps=2, vocab=4096)["head_matmul_share"] == 0.0
