"""What code outside shards/ asks about a dataset directory: finished or not, its target, its bundle."""

import pytest
import torch

from tapdraft.shards.bundle import load_bundle
from tapdraft.shards.manifest import complete_manifest, dataset_fingerprint, write_or_check_bundle
from tests.shards.synthetic import tiny_layout, write_dataset
from tapdraft.shards.shard_file import ShardConfig


def _parts(H: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    config = {"model_type": "x", "hidden_size": H, "num_hidden_layers": 2, "vocab_size": 8, "num_attention_heads": 2,
              "num_key_value_heads": 1, "head_dim": H // 2, "intermediate_size": 2 * H, "rope_theta": 1e4,
              "rms_norm_eps": 1e-6, "logits_scaling": 1.0, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    return dict(config=config, audio={}, chat_template=None, embed_tokens=torch.randn(8, H, generator=g),
                norm_weight=torch.ones(H), lm_head=torch.randn(8, H, generator=g), tokenizer_dir=None)


def test_bundle_written_once_then_checked(tmp_path):
    out = tmp_path / "ds"
    assert dataset_fingerprint(str(out)) is None
    fp = write_or_check_bundle(str(out), **_parts(4, 0))
    assert dataset_fingerprint(str(out)) == fp == load_bundle(out / "target").fingerprint
    before = sorted(p.name for p in out.rglob("*"))
    assert write_or_check_bundle(str(out), **_parts(4, 0)) == fp  # same target: nothing rewritten
    assert sorted(p.name for p in out.rglob("*")) == before
    with pytest.raises(ValueError, match="another target"):
        write_or_check_bundle(str(out), **_parts(4, 1))
    assert sorted(p.name for p in out.rglob("*")) == before  # no temp copy left behind


def test_complete_manifest_only_for_a_finished_dataset(tmp_path):
    out = tmp_path / "ds"
    assert complete_manifest(str(out)) is None
    m = write_dataset(str(out), tiny_layout(), ShardConfig(), [5, 6])
    got = complete_manifest(str(out))
    assert got is not None and got["fingerprint"] == m["fingerprint"] and got["complete"] is True
    man = out / "manifest.json"
    man.write_text(man.read_text().replace('"complete": true', '"complete": false'))
    assert complete_manifest(str(out)) is None
