"""The target config schema (shards.target_config): every rule refuses its planted violation in one line naming the
field, the value and the bound, and real targets' configs pass; a bundle is checked when written and when loaded."""

import json

import pytest
import torch

import tapdraft.shards.bundle as bundle_mod
from tapdraft.shards.bundle import load_bundle, write_bundle
from tapdraft.shards.target_config import check_export_config, check_fields, check_target_config

QWEN3 = {"model_type": "qwen3", "hidden_size": 1024, "num_hidden_layers": 4, "vocab_size": 151936,
         "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072,
         "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "logits_scaling": 1.0, "bos_token_id": None,
         "eos_token_id": 151645, "pad_token_id": 151643, "max_position_embeddings": 40960,
         "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
         "layer_types": ["full_attention"] * 4}
"""Qwen3-0.6B's values (16 heads of 128 over a 1024-wide stream: head_dim given, so no divisibility asked)."""

PASSING = [
    {},
    {"eos_token_id": [1, 2], "pad_token_id": -1, "model_type": "granite_speech"},
    {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
                         "rope_theta": 1e6, "truncate": False}},
    {"rope_parameters": {"rope_type": "longrope", "long_factor": [1.0, 1.5], "short_factor": [1.0, 1.0]}},
    {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},  # Gemma 3
    {"rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True}},  # Qwen3.5
    {"layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"]},
    {"head_dim": None, "hidden_size": 2048},  # 2048 / 16 heads
    {"num_attention_heads": None, "rope_parameters": None, "layer_types": None, "max_position_embeddings": None},
]

FAILING = [  # (replaced keys, field named, words of the bound)
    ({"num_attention_heads": 0}, "num_attention_heads", "an integer in [1, 4096]"),
    ({"hidden_size": "1024"}, "hidden_size", "an integer in [1, 131072]"),
    ({"hidden_size": 1024.0}, "hidden_size", "an integer"),
    ({"hidden_size": True}, "hidden_size", "an integer"),
    ({"hidden_size": None}, "hidden_size", "an integer"),
    ({"vocab_size": -5}, "vocab_size", "an integer in [1, 16777216]"),
    ({"num_hidden_layers": 1 << 20}, "num_hidden_layers", "an integer in [1, 4096]"),
    ({"max_position_embeddings": 0}, "max_position_embeddings", "an integer in [1, 1073741824]"),
    ({"max_position_embeddings": "7"}, "max_position_embeddings", "an integer"),
    ({"layer_types": "<script>alert(1)</script>"}, "layer_types", "a list of known layer kinds"),
    ({"layer_types": ["full_attention"] * 3 + ["<script>"]}, "layer_types", "a list of known layer kinds"),
    ({"layer_types": ["full_attention"] * 3}, "layer_types", "one entry per layer (num_hidden_layers = 4"),
    ({"num_key_value_heads": 3}, "num_key_value_heads", "a divisor of num_attention_heads (16)"),
    ({"head_dim": None, "hidden_size": 1000}, "hidden_size", "a multiple of num_attention_heads (16)"),
    ({"head_dim": 0}, "head_dim", "an integer in [1, 8192]"),
    ({"intermediate_size": 2_000_000}, "intermediate_size", "an integer in [1, 1048576]"),
    ({"intermediate_size": 16 * 1024 + 1}, "intermediate_size", "at most 16 x hidden_size (1024)"),  # issue 57
    ({"rope_theta": float("nan")}, "rope_theta", "a finite number > 0"),
    ({"rope_theta": -1.0}, "rope_theta", "a finite number > 0"),
    ({"rms_norm_eps": 2.0}, "rms_norm_eps", "a finite number in (0, 1)"),
    ({"logits_scaling": 0}, "logits_scaling", "a finite number > 0"),
    ({"eos_token_id": "</s>"}, "eos_token_id", "a non-empty list of them"),
    ({"eos_token_id": []}, "eos_token_id", "a non-empty list of them"),
    ({"model_type": "<script>"}, "model_type", "a name of letters"),
    ({"rope_parameters": "yarn"}, "rope_parameters", "a RoPE object"),
    ({"rope_parameters": {"rope_type": "<script>"}}, "rope_parameters", "rope_type one of default/"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": "4"}}, "rope_parameters", "a RoPE object"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 0}}, "rope_parameters", "rope_theta > 0"),
    ({"rope_parameters": {"<script>": {"rope_type": "default"}}}, "rope_parameters", "a RoPE object"),
]


@pytest.mark.parametrize("change", PASSING)
def test_real_targets_values_pass(change):
    check_target_config({**QWEN3, **change}, "bundle.json", "fix it")


@pytest.mark.parametrize("change,field,bound", FAILING, ids=[f"{f}={v!r}"[:40] for v, f, _ in FAILING])
def test_each_rule_refuses_its_violation_in_one_line(change, field, bound):
    with pytest.raises(ValueError) as e:
        check_target_config({**QWEN3, **change}, "x/target/bundle.json", "re-capture it")
    msg = str(e.value)
    assert msg.startswith(f"x/target/bundle.json: {field} = ") and bound in msg and msg.endswith("; re-capture it")
    assert "\n" not in msg
    if field in change:
        assert json.dumps(change[field])[:20] in msg  # the value, as it was written


def test_a_required_field_missing_is_named():
    with pytest.raises(ValueError, match=r"^b: vocab_size = null is not an integer in \[1, 16777216\]; do"):
        check_target_config({k: v for k, v in QWEN3.items() if k != "vocab_size"}, "b", "do")
    with pytest.raises(ValueError, match="config = "):
        check_target_config(["not", "an", "object"], "b", "do")


def test_an_export_is_checked_wherever_a_layout_nests_the_targets_values():
    """A speculators layout nests the layer config, the tapdraft section repeats the target's layer kinds under
    another name, and rope_scaling is the older name of rope_parameters: each is read by the same rule."""
    good = {"hidden_size": 32, "num_attention_heads": 4, "head_dim": 8, "rope_scaling": None,
            "transformer_layer_config": {"layer_types": ["full_attention"], "num_hidden_layers": 1,
                                         "max_position_embeddings": 4096},
            "tapdraft": {"target_layer_types": ["sliding_attention", "full_attention"], "family": "dflash"},
            "mtp_config": {"num_heads": None, "head_dim": None}, "architectures": ["X"]}
    check_export_config(good, "ck", "retrain")
    planted = [
        (("transformer_layer_config", "layer_types"), ["<script>"], "transformer_layer_config.layer_types"),
        (("transformer_layer_config", "max_position_embeddings"), -7, "transformer_layer_config.max_position"),
        (("tapdraft", "target_layer_types"), "<script>", "tapdraft.target_layer_types = "),
        (("rope_scaling",), {"rope_type": "<script>"}, "rope_scaling = "),
        (("num_attention_heads",), 0, "num_attention_heads = 0 is not an integer in [1, 4096]"),
    ]
    for path, value, named in planted:
        cfg = json.loads(json.dumps(good))
        node = cfg
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        with pytest.raises(ValueError) as e:
            check_export_config(cfg, "ck", "retrain")
        assert str(e.value).startswith("ck: ") and named in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_draft_layer_shape_is_checked_by_the_same_rules():
    with pytest.raises(ValueError, match=r"^layer: num_key_value_heads = 3 is not a divisor of num_attention_heads"):
        check_fields({"num_attention_heads": 4, "num_key_value_heads": 3}, "layer", "fix")


def _parts(config):
    g = torch.Generator().manual_seed(0)
    return dict(config=config, audio={}, chat_template=None, embed_tokens=torch.randn(8, 16, generator=g),
                norm_weight=torch.ones(16), lm_head=torch.randn(8, 16, generator=g), tokenizer_dir=None)


TINY = {"model_type": "x", "hidden_size": 16, "num_hidden_layers": 2, "vocab_size": 8, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 8, "intermediate_size": 32, "rope_theta": 1e4, "rms_norm_eps": 1e-6,
        "logits_scaling": 1.0, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def test_a_bundle_is_checked_when_written_and_when_loaded(tmp_path, monkeypatch):
    """write_bundle records no value a target cannot have; a bundle an older tapdraft wrote with one (its
    fingerprint consistent, so only the schema can tell) is refused when loaded, naming bundle.json."""
    with pytest.raises(ValueError, match=r"num_attention_heads = 0 is not an integer in \[1, 4096\]"):
        write_bundle(tmp_path / "a", **_parts({**TINY, "num_attention_heads": 0}))
    assert not (tmp_path / "a").exists()
    with pytest.raises(ValueError, match=r"layer_types = \"<script>\" is not null or a list of known layer kinds"):
        write_bundle(tmp_path / "a", **_parts({**TINY, "layer_types": "<script>"}))
    monkeypatch.setattr(bundle_mod, "check_target_config", lambda *a, **k: None)  # an older writer
    write_bundle(tmp_path / "old", **_parts({**TINY, "hidden_size": "16"}))
    assert load_bundle(tmp_path / "old").config["hidden_size"] == "16"
    monkeypatch.undo()
    with pytest.raises(ValueError) as e:
        load_bundle(tmp_path / "old")
    assert str(e.value).startswith(f"{tmp_path / 'old' / 'bundle.json'}: hidden_size = \"16\" is not an integer")
    assert "re-capture the dataset" in str(e.value)
