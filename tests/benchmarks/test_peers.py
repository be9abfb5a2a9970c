"""ModelOpt's own offline loader reads what benchmarks/peers.py's converter writes, value for value.

Builds the ModelOpt venv on first use (engines/venv.sh modelopt: minutes, once), converts two samples of the
benchmark's own dataset (64 tokens each), and asks engines/modelopt_runner.py for what ModelOpt's
``OfflineSupervisedDataset(answer_only_loss=True)`` returns; every tensor must equal the tapdraft dataset's
(read through ``shards.reader``), and one ModelOpt DFlash step on them must train supervised rows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.peers import ModelOptSide, build_dataset, modelopt_job, peer_python, to_modelopt
from shards.reader import open_dataset
from shards.taps import default_tap_ids

pytestmark = [pytest.mark.engine, pytest.mark.slow]


class _Run:  # the few recipe fields modelopt_job reads
    class drafter:
        block_size, gamma, num_layers = 16, 7.0, 1

    class train:
        lr, beta1, beta2, weight_decay = 6e-4, 0.9, 0.95, 0.01


def test_modelopt_reads_the_converted_samples_as_the_dataset_holds_them(tmp_path: Path) -> None:
    data = build_dataset(tmp_path / "dataset", samples=2, tokens=64, seed=3)
    conv = to_modelopt(data, tmp_path / "modelopt")
    assert len(conv["files"]) == 2 and conv["target_layer_ids"] == [4]
    job = modelopt_job(conv, _Run, anchors=2, tokens=64, mask_token_id=conv["vocab_size"] - 1)
    peer = ModelOptSide(peer_python(), job, tmp_path / "run")
    try:
        assert peer.ready["target_layer_ids"] == conv["target_layer_ids"]  # ModelOpt's own layer rule
        got = peer.ask("load")["samples"]
        step = peer.step()
    finally:
        peer.close()
    ds = open_dataset(str(data))
    col = {t: j for j, t in enumerate(ds.layout.tap_ids)}
    (aux,) = default_tap_ids(ds.layout.num_layers, 1)
    for i, g in enumerate(got):
        s = ds.sample("train", i)
        taps = s["taps"].float()
        assert torch.equal(torch.tensor(g["input_ids"]), s["input_ids"].long())
        assert torch.equal(torch.tensor(g["loss_mask"]), s["loss_mask"].long())
        assert torch.equal(torch.tensor(g["aux_hidden_states"]), taps[:, col[aux]])
        assert torch.equal(torch.tensor(g["base_model_hidden_states"]), taps[:, col[ds.layout.num_layers - 1]])
    assert step["rows"] > 0 and 9.0 < step["loss"] < 13.0  # about ln(49,152) = 10.8 at random init
