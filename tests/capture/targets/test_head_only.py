"""Head-only loading (``capture --engine vllm``): the decoder stays on the meta device, the bundle's pieces are
the very tensors a whole load gives, so the dataset's fingerprint and teacher rows cannot tell."""

import warnings

import pytest
import torch

from tapdraft.capture.provenance import target_fingerprint
from tapdraft.capture.targets.head_only import resident_bytes
from tapdraft.capture.targets.load import load_target
from tests.capture.lm_families import FAMILIES, save_family

BUFFERED = {"gemma", "gemma2", "gemma3_text"}
"""Families whose embedding holds a buffer (``embed_scale``) that only the whole model makes: loaded whole."""


@pytest.mark.parametrize("family", FAMILIES)
def test_head_only_load_gives_the_whole_loads_head(tmp_path, family):
    d = save_family(family, tmp_path / family)
    whole = load_target(d)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        head = load_target(d, head_only=True)
    assert head.decoder_elsewhere is (family not in BUFFERED)
    assert any("loading the whole model" in str(w.message) for w in caught) is (family in BUFFERED)
    assert head.head.spec == whole.head.spec
    a, b = whole.bundle_parts(), head.bundle_parts()
    for k in ("embed_tokens", "norm_weight", "lm_head", "norm_bias", "lm_head_bias"):
        assert (a.get(k) is None) == (b.get(k) is None), k
        if a.get(k) is not None:
            assert torch.equal(a[k], b[k]), k
    assert target_fingerprint(head) == target_fingerprint(whole)
    if head.decoder_elsewhere:
        h = head.head
        parts = {id(t): t for t in (h.embed_tokens, h.norm_weight, h.lm_head, h.norm_bias, h.lm_head_bias)
                 if t is not None}
        assert resident_bytes(head.lm) == sum(t.numel() * t.element_size() for t in parts.values())
        assert resident_bytes(head.lm) < resident_bytes(whole.lm)
        rows = torch.randn(5, head.hidden_size)
        assert torch.equal(head.head.logits(rows), whole.head.logits(rows))


def test_a_sharded_checkpoint_reads_the_head_from_its_index(tmp_path):
    from transformers import AutoModelForCausalLM

    d = save_family("qwen3", tmp_path / "one")
    lm = AutoModelForCausalLM.from_pretrained(d)
    lm.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    for f in d.glob("*.json"):
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "chat_template.jinja"):
            (tmp_path / "sharded" / f.name).write_bytes(f.read_bytes())
    for f in d.glob("*.jinja"):
        (tmp_path / "sharded" / f.name).write_bytes(f.read_bytes())
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    head, whole = load_target(tmp_path / "sharded", head_only=True), load_target(d)
    assert head.decoder_elsewhere
    assert target_fingerprint(head) == target_fingerprint(whole)
