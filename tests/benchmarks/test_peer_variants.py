"""benchmarks.peer_variants: the loss-dtype variant keeps an unscaled head's bf16 logits only inside its block, and
leaves a scaled or capped head's upcast alone."""

from __future__ import annotations

import torch

import tapdraft.shards.head as head_math
from benchmarks.peer_variants import logits_dtype_loss, pass_seconds
from tapdraft.shards.head import HeadSpec


def test_the_logits_keep_their_dtype_only_inside_the_block():
    z = torch.randn(4, 8).to(torch.bfloat16)
    plain = HeadSpec()
    assert head_math.scale_logits(z, plain).dtype == torch.float32
    with logits_dtype_loss():
        assert head_math.scale_logits(z, plain).dtype == torch.bfloat16
        assert head_math.scale_logits(z, HeadSpec(logits_scaling=2.0)).dtype == torch.float32
    assert head_math.scale_logits(z, plain).dtype == torch.float32


def test_the_passes_are_timed_in_both_dtypes():
    t = pass_seconds(8, 64, reps=1)
    assert set(t) == {"log_softmax_bf16", "log_softmax_fp32", "exp_bf16", "exp_fp32", "cast_bf16_to_fp32",
                      "cast_fp32_to_bf16"} and all(v > 0 for v in t.values())
