"""``capture --engine vllm`` loads only the target's head (``capture.targets.head_only``) and proves it against vLLM's own
next-token log-probs (``capture.vllm.engine.prove_head``): a head that is right passes within fp32 rounding, one
that scales the logits otherwise is refused before any sample is written."""

from __future__ import annotations

import dataclasses

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def test_the_head_only_target_is_proven_by_vllm_and_a_wrong_head_is_refused(vllm_venv, bpe_target):
    from tapdraft.capture.config import VLLMConfig
    from tapdraft.capture.head import UnsupportedHead
    from tapdraft.capture.targets.head_only import resident_bytes
    from tapdraft.capture.targets.load import load_target
    from tapdraft.capture.vllm.engine import VLLMEngine, layer_ids, prove_head
    from tapdraft.shards.schema import Layout

    target = load_target(bpe_target.target, head_only=True)
    assert target.decoder_elsewhere
    h = target.head
    assert resident_bytes(target.lm) == sum(t.numel() * t.element_size() for t in {id(t): t for t in (
        h.embed_tokens, h.norm_weight, h.lm_head) if t is not None}.values())
    L = target.num_layers
    layout = Layout(hidden_size=target.hidden_size, num_layers=L, tap_ids=(0, L - 1), top_k=8,
                    audio_token_id=target.audio_token_id)
    with VLLMEngine(VLLMConfig(), python=str(vllm_venv / "bin" / "python"), target_dir=str(bpe_target.target),
                    layer_ids=layer_ids(layout.tap_ids, L), dtype="float32", max_model_len=256) as engine:
        err = prove_head(engine, target, layout)
        print(f"head proof: vLLM's next-token log-probs within {err:.2e} of tapdraft's head on vLLM's states")
        assert err < 1e-4
        target._head = dataclasses.replace(h, spec=dataclasses.replace(h.spec, logits_scaling=2.0))
        with pytest.raises(UnsupportedHead, match="vLLM's next-token log-probs differ"):
            prove_head(engine, target, layout)
