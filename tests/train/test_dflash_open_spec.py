"""A native DFlash export carries the Open Spec Config block (version 0.0.0) and states its block size per engine.

The schema, written out literally from ``open-spec-config/open-spec-config`` at commit
b237d1ddeb517e76a1eaa6a9fd7fc634a433a0d9, ``src/open-spec-config/schema/dflash.schema.json``: every property
it declares with its JSON type (the schema sets no ``required`` and allows extra fields); the export's own Qwen3
fields must have those types too, since the block describes the whole ``config.json``.
"""

import json

import pytest

from dflash_fixtures import tiny_bundle, tiny_layout
from tapdraft.train.drafters.dflash.config import DFlashConfig
from tapdraft.train.drafters.dflash.model import DFlashDrafter
from tapdraft.train.drafters.dflash2.config import DFlash2Config
from tapdraft.train.drafters.dflash2.model import DFlash2Drafter
from tapdraft.train.export import export_drafter

INT, NUM, STR, BOOL, ARR, OBJ, NULL = int, (int, float), str, bool, list, dict, type(None)
TOP = {"open_spec_config_version": STR, "architectures": ARR, "auto_map": OBJ, "speculative_config": OBJ,
       "attention_bias": BOOL, "attention_dropout": NUM, "bos_token_id": (INT, NULL), "eos_token_id": (INT, ARR, NULL),
       "head_dim": INT, "hidden_act": STR, "hidden_size": INT, "initializer_range": NUM, "intermediate_size": INT,
       "layer_types": ARR, "max_position_embeddings": INT, "max_window_layers": INT, "model_type": STR,
       "num_attention_heads": INT, "num_hidden_layers": INT, "num_key_value_heads": INT, "pad_token_id": (INT, NULL),
       "rms_norm_eps": NUM, "rope_parameters": OBJ, "sliding_window": (INT, NULL), "tie_word_embeddings": BOOL,
       "transformers_version": STR, "use_cache": BOOL, "use_sliding_window": BOOL, "vocab_size": INT}
SPECULATIVE = {"method": STR, "speculative_tokens": INT, "verifier": STR, "target_layer_ids": ARR,
               "target_layer_start_idx": INT, "draft_vocab_size": INT, "dflash_config": OBJ,
               "speculative_library": STR, "speculative_library_version": STR}
DFLASH = {"sample_from_anchor": BOOL, "sliding_window_non_causal": BOOL, "mask_token_id": INT}


def _typed(doc, schema, where):
    for key, kind in schema.items():
        if key in doc:
            value = doc[key]
            assert isinstance(value, kind) and not (kind in (INT, NUM) and isinstance(value, bool)), (where, key)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    bundle = tiny_bundle(tmp_path_factory.mktemp("bundle"))
    return bundle, tiny_layout(bundle)


def test_dflash_export_carries_the_open_spec_config_block(setup, tmp_path):
    bundle, layout = setup
    model = DFlashDrafter.build(DFlashConfig(num_layers=1, block_size=4), bundle, layout)
    export_drafter(model, tmp_path, {})
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["open_spec_config_version"] == "0.0.0"
    _typed(cfg, TOP, "top")
    spec = cfg["speculative_config"]
    assert set(spec) <= set(SPECULATIVE) and set(spec["dflash_config"]) == set(DFLASH)
    _typed(spec, SPECULATIVE, "speculative_config")
    _typed(spec["dflash_config"], DFLASH, "dflash_config")
    assert spec["method"] == "dflash" and spec["speculative_tokens"] == 3 == cfg["block_size"] - 1
    assert spec["target_layer_ids"] == cfg["target_layer_ids"] and spec["target_layer_start_idx"] == 0
    assert spec["dflash_config"] == {"sample_from_anchor": False, "sliding_window_non_causal": True,
                                     "mask_token_id": cfg["dflash_config"]["mask_token_id"]}
    assert spec["speculative_library"] == "tapdraft" and spec["speculative_library_version"]
    assert "draft_vocab_size" not in spec
    rope = cfg["rope_parameters"]
    assert isinstance(rope["rope_theta"], NUM) and rope["rope_type"] == "default"


def test_every_engine_an_export_names_gets_its_block_size(setup, tmp_path):
    """vLLM's DFlash block is num_speculative_tokens + 1, SGLang's its draft-token count: both the trained block."""
    bundle, layout = setup
    model = DFlashDrafter.build(DFlashConfig(num_layers=1, block_size=4), bundle, layout)
    export_drafter(model, tmp_path, {})
    t = json.loads((tmp_path / "config.json").read_text())["tapdraft"]
    assert t["block_size"] == {"vllm": 4, "sglang": 4}
    assert t["serve_with"]["vllm"]["num_speculative_tokens"] + 1 == t["block_size"]["vllm"]
    assert t["serve_with"]["sglang"]["speculative_num_draft_tokens"] == t["block_size"]["sglang"]


def test_the_block_describes_dflash_only(setup, tmp_path):
    """Schema 0.0.0 knows DFlash's fields only: a DFlash2 export (its convolutions and selector) does not claim it."""
    bundle, layout = setup
    model = DFlash2Drafter.build(DFlash2Config(num_layers=1, block_size=4), bundle, layout)
    export_drafter(model, tmp_path, {})
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert "open_spec_config_version" not in cfg and "speculative_config" not in cfg
    assert cfg["tapdraft"]["block_size"] == {"vllm": 4} and set(cfg["tapdraft"]["serve_with"]) == {"vllm"}
