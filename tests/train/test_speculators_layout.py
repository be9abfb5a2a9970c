"""``--layout speculators``: the fields vLLM's speculators reader turns into its DFlash config, and the refusals.
(Loaded by speculators' own classes and served by vLLM: tests/engines/test_vllm_speculators.py.)"""

import pytest
import torch

from tests.train.dflash_fixtures import tiny_bundle, tiny_layout
from tapdraft.train.drafters.dflash.config import DFlashConfig
from tapdraft.train.drafters.dflash.model import DFlashDrafter
from tapdraft.train.drafters.dflash.export import to_speculators


def _draft(tmp_path, taps):
    bundle = tiny_bundle(tmp_path)
    layout = tiny_layout(bundle, tap_ids=(1, 2, 3))
    torch.manual_seed(0)
    model = DFlashDrafter.build(DFlashConfig(num_layers=1, block_size=4, target_layer_ids=taps), bundle, layout)
    return model.trainable_state_dict(), model.export_config()


def test_fields_as_vllm_reads_them(tmp_path):
    state, cfg = _draft(tmp_path, (1, 2))
    weights, doc = to_speculators(state, cfg, verifier="org/target")
    assert weights.keys() == state.keys()
    assert doc["speculators_model_type"] == "dflash" and doc["architectures"] == ["DFlashDraftModel"]
    assert doc["aux_hidden_state_layer_ids"] == [2, 3]  # vLLM ids; vLLM maps them back to target_layer_ids i - 1
    assert doc["sliding_window_non_causal"] is True  # vLLM: dflash_config.causal = not this, for every layer
    assert doc["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert doc["speculators_config"]["verifier"]["name_or_path"] == "org/target"
    assert doc["transformer_layer_config"]["hidden_size"] == cfg["hidden_size"]


def test_refuses_what_the_format_cannot_hold(tmp_path):
    state, cfg = _draft(tmp_path, (1, 3))  # 3 is the tiny target's last layer
    with pytest.raises(ValueError, match="taps the target's last layer"):
        to_speculators(state, cfg, verifier="t")
    state, cfg = _draft(tmp_path / "b", (1, 2))
    with pytest.raises(ValueError, match="--verifier"):
        to_speculators(state, cfg, verifier=None)
    with pytest.raises(ValueError, match="DFlash and DFlash2"):
        to_speculators(state, {**cfg, "tapdraft": {"family": "mtp"}}, verifier="t")
    windowed = {**cfg, "dflash_config": {**cfg["dflash_config"], "use_swa": True, "swa_window_size": 8}}
    with pytest.raises(ValueError, match="sliding window"):
        to_speculators(state, windowed, verifier="t")
