"""A DFlash export is a model repository: ``AutoModel.from_pretrained(export, trust_remote_code=True)`` builds
the exact drafter (shipped modeling file), and an engine's logits (target lm_head only) equal tapdraft's, for
argmax and for sampling, on a target that scales its logits."""

import json

import pytest
import torch
from transformers import AutoModel, DynamicCache

from tests.train.dflash_fixtures import away_from_init, synthetic_samples, tiny_bundle, tiny_layout
from tapdraft.train.drafters.dflash.config import DFlashConfig
from tapdraft.train.drafters.dflash.model import DFlashDrafter
from tapdraft.train.export import export_drafter

B = 4


@pytest.fixture(scope="module", params=[None, 6], ids=["full", "window6"])
def exported(request, tmp_path_factory):
    """A two-layer draft exported with full attention, and with a sliding window of 6 (the shipped modeling file
    reads it from ``dflash_config``, as vLLM does)."""
    root = tmp_path_factory.mktemp("auto")
    bundle = tiny_bundle(root, scaling=1.7)
    layout = tiny_layout(bundle, tap_ids=(1, 2, 3))
    torch.manual_seed(0)
    cfg = DFlashConfig(num_layers=2, block_size=B, target_layer_ids=(1, 2), sliding_window=request.param)
    model = away_from_init(DFlashDrafter.build(cfg, bundle, layout), 0.2)
    export_drafter(model, root / "export", {})
    sample = synthetic_samples(bundle, layout, 1, min_len=30, max_len=30, seed=3)[0]
    return model, bundle, root / "export", sample


def _engine_inputs(model, bundle, sample, start, end):
    """What an engine feeds: the target's states at the draft's layers for context rows start..end-1, the block's
    target embeddings (anchor token at position end, then mask tokens) and their positions."""
    taps = sample["taps"].float()[start:end][:, list(model.tap_index)]  # [C, n, H]
    ids = torch.full((B,), model.config.mask_token_id)
    ids[0] = int(sample["input_ids"][end])
    return dict(target_hidden=taps.reshape(1, end - start, -1), noise_embedding=bundle.embed_tokens[ids][None].float(),
                position_ids=torch.cat([torch.arange(start, end), torch.arange(end, end + B)])[None])


def test_automodel_loads_the_exact_drafter(exported):
    model, bundle, export, sample = exported
    cfg = json.loads((export / "config.json").read_text())
    assert cfg["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"}
    assert (export / "modeling_dflash.py").is_file()
    for key in ("max_position_embeddings", "rope_parameters", "layer_types"):
        assert key in cfg
    W = model.config.sliding_window
    assert cfg["layer_types"] == ["full_attention"] * 2  # vLLM makes a sliding_attention layer causal
    assert ({"use_swa": True, "swa_window_size": W} if W else {}).items() <= cfg["dflash_config"].items()
    assert W or not {"use_swa", "swa_window_size"} & set(cfg["dflash_config"])
    auto, info = AutoModel.from_pretrained(export, trust_remote_code=True, output_loading_info=True)
    assert type(auto).__name__ == "DFlashDraftModel"
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    auto.eval()
    lm_head = bundle.lm_head.float()
    for P in (6, 17, 25):
        with torch.no_grad():
            h = auto(**_engine_inputs(model, bundle, sample, 0, P))[0, 1:]
            engine_logits = h @ lm_head.T  # engines: the target's lm_head, nothing else
            ids = sample["input_ids"][: P + 1].long()
            b, anchors = model._live_block(ids, sample["taps"].float()[:P])
            ours = model.logits(model.block_hidden(b["input_ids"], model.context(b["taps"]), anchors)[0, 0, 1:])
        torch.testing.assert_close(engine_logits, ours, rtol=1e-5, atol=1e-5)
        # sampling, not only argmax: the distributions a sampled decode draws from are tapdraft's q
        for T in (0.6, 1.0):
            _, q = model.propose(ids, sample["taps"].float()[:P], temperature=T, generator=torch.Generator())
            torch.testing.assert_close(torch.softmax(engine_logits / T, -1), q, rtol=1e-5, atol=1e-6)
        assert engine_logits.argmax(-1).tolist() == model.propose(ids, sample["taps"].float()[:P])[0].tolist()


def test_the_reference_loops_draft_cache_gives_the_same_blocks(exported):
    """The reference decoding loop keeps the draft's context K/V in a cache, cropped to the verified length,
    and feeds only the new context rows each round: blocks equal a fresh full-context call."""
    model, bundle, export, sample = exported
    auto = AutoModel.from_pretrained(export, trust_remote_code=True).eval()
    cache = DynamicCache()
    with torch.no_grad():
        start = 0
        for P in (5, 9, 16):
            h_cached = auto(**_engine_inputs(model, bundle, sample, start, P), past_key_values=cache, use_cache=True)
            cache.crop(P - cache.get_seq_length())  # transformers 5 crops by a negative count
            start = P
            h_fresh = auto(**_engine_inputs(model, bundle, sample, 0, P))
            torch.testing.assert_close(h_cached, h_fresh, rtol=1e-5, atol=1e-5)


def test_serving_facts_come_from_the_target(exported, tmp_path):
    """The bundle records the target's context length, RoPE and layer kinds (outside the fingerprint) and the
    export repeats them; a RoPE scaling the drafter does not implement is refused, not silently dropped."""
    import dataclasses

    from tapdraft.shards.bundle import load_bundle, write_bundle
    from tests.train.dflash_fixtures import tiny_layout

    model, bundle, export, _ = exported
    facts = {"max_position_embeddings": 4096, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
             "layer_types": ["full_attention"] * 4}
    parts = dict(audio=bundle.audio, chat_template=None, embed_tokens=bundle.embed_tokens,
                 norm_weight=bundle.norm_weight, lm_head=bundle.lm_head, tokenizer_dir=None, head=bundle.head)
    fp = write_bundle(tmp_path / "t", config={**bundle.config, **facts}, **parts)
    assert fp == bundle.fingerprint  # bundles written before these facts were recorded keep their fingerprint
    b2 = load_bundle(tmp_path / "t")
    assert {k: b2.config[k] for k in facts} == facts
    layout = tiny_layout(b2, tap_ids=(1, 2, 3))
    d = DFlashDrafter.build(DFlashConfig(num_layers=1, block_size=B, target_layer_ids=(1,)), b2, layout)
    cfg = d.export_config()
    assert cfg["max_position_embeddings"] == 4096 and cfg["tapdraft"]["target_layer_types"] == facts["layer_types"]
    yarn = dataclasses.replace(b2, config={**b2.config, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="yarn"):
        DFlashDrafter.build(DFlashConfig(num_layers=1, block_size=B, target_layer_ids=(1,)), yarn, layout)
