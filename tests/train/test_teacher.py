"""The exact last hidden state (exact teacher, MTP's h^0) is never read from a lossy fp8 tap."""

import dataclasses

import pytest

from tests.train.dflash_fixtures import tiny_bundle, tiny_layout
from tapdraft.train.drafters.common.teacher import exact_last_tap, last_hidden_source
from tapdraft.train.drafters.dflash.config import DFlashConfig
from tapdraft.train.drafters.dflash.model import DFlashDrafter
from tapdraft.train.drafters.mtp.config import MTPConfig
from tapdraft.train.drafters.mtp.model import MTPDrafter


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return tiny_bundle(tmp_path_factory.mktemp("teacher"))


def test_fp8_last_layer_tap_is_not_exact(bundle):
    bf16 = tiny_layout(bundle, tap_ids=(1, 3))
    fp8 = dataclasses.replace(bf16, taps_codec="fp8")
    assert last_hidden_source(bf16) == "tap" and exact_last_tap(bf16) == 1
    assert last_hidden_source(fp8) is None and exact_last_tap(fp8) is None
    with pytest.raises(ValueError, match="lossy 'fp8' taps codec"):
        DFlashDrafter.build(DFlashConfig(num_layers=1, block_size=4, kd="exact", target_layer_ids=(1,)), bundle, fp8)
    with pytest.raises(ValueError, match="lossy 'fp8' taps codec"):
        MTPDrafter.build(MTPConfig(), bundle, fp8)
    # final_hidden is stored in bf16 whatever the taps codec: it is the exact source, and the only one read
    fp8_fh = dataclasses.replace(fp8, has_final_hidden=True)
    assert last_hidden_source(fp8_fh) == "final_hidden"
    model = MTPDrafter.build(MTPConfig(loss_type="lk"), bundle, fp8_fh)
    assert model.teacher_kind == "exact" and model.last_tap is None
    d = DFlashDrafter.build(DFlashConfig(num_layers=1, block_size=4, kd="exact", target_layer_ids=(1,)), bundle, fp8_fh)
    assert d.last_tap is None


def test_without_any_last_layer_the_message_says_what_to_do(bundle):
    layout = tiny_layout(bundle, tap_ids=(1, 2))
    with pytest.raises(ValueError, match="capture again with final_hidden"):
        MTPDrafter.build(MTPConfig(), bundle, layout)
