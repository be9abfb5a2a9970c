"""The peers' own offline loaders read what benchmarks/peers.py's converters write, value for value, and each
benchmark row's two sides train the same thing.

ModelOpt: builds its venv on first use (engines/venv.sh modelopt: minutes, once), converts two samples of the
benchmark's own dataset (its 49,152-token shape, 64 tokens a sample), and asks engines/modelopt_runner.py for what
ModelOpt's ``OfflineSupervisedDataset(answer_only_loss=True)`` returns; every tensor must equal the tapdraft
dataset's (read through ``shards.reader``): DFlash's one tap, EAGLE-3's three (tapdraft's rule, not ModelOpt's
default). For every row, one step on each side: equal trainable parameters, equal loss rows, and first losses that
agree once ModelOpt's soft cross-entropy is taken as tapdraft's KL + H(teacher) (``peers.teacher_entropy``).
speculators (the vLLM engine venv, engines/venv.sh vllm): the same through its ``ArrowDataset`` and
engines/speculators_runner.py, its DFlash rows with ``ce`` and ``kl_div``.
About 2 minutes of CPU after the venvs exist.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.peers import (ROW_SPECS, ROWS, ModelOptSide, TapdraftSide, build_dataset, modelopt_job, peer_python,
                              speculators_job, teacher_entropy, to_modelopt, to_speculators)
from shards.reader import open_dataset
from shards.taps import default_tap_ids, eagle3_tap_ids

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


def _same_samples(got: list[dict], data: Path, aux: list[int], names: tuple[str, str] = (
        "aux_hidden_states", "base_model_hidden_states")) -> None:
    """The peer loader's samples equal the dataset's: ids, mask, the ``aux`` taps concatenated and the last layer
    (``names``: the peer's keys for those two)."""
    ds = open_dataset(str(data))
    col = {t: j for j, t in enumerate(ds.layout.tap_ids)}
    for i, g in enumerate(got):
        s = ds.sample("train", i)
        taps = s["taps"].float()
        assert torch.equal(torch.tensor(g["input_ids"]), s["input_ids"].long())
        assert torch.equal(torch.tensor(g["loss_mask"]), s["loss_mask"].long())
        assert torch.equal(torch.tensor(g[names[0]]), torch.cat([taps[:, col[t]] for t in aux], dim=-1))
        assert torch.equal(torch.tensor(g[names[1]]), taps[:, col[ds.layout.num_layers - 1]])


@pytest.mark.parametrize("name", ROWS)
def test_both_sides_of_a_row_train_the_same_rows_from_the_same_loss(tmp_path: Path, name: str) -> None:
    torch.set_num_threads(1)
    row = ROW_SPECS[name]
    data = build_dataset(tmp_path / "dataset", samples=2, tokens=64, seed=3, family=row.family)
    conv = to_modelopt(data, tmp_path / "modelopt", family=row.family)
    if row.family == "eagle3":
        assert conv["target_layer_ids"] == eagle3_tap_ids(8) == [1, 3, 5]
    mask = conv["vocab_size"] - 1
    tap = TapdraftSide(data, row, anchors=2, samples=2, tokens=64, mask_token_id=mask, head_dtype="float32")
    peer = ModelOptSide(peer_python(), modelopt_job(conv, tap.run, anchors=2, tokens=64, mask_token_id=mask, row=row),
                        tmp_path / "run")
    try:
        assert peer.ready["target_layer_ids"] == conv["target_layer_ids"]
        assert peer.ready["trainable_params"] == tap.trainable
        got = peer.ask("load")["samples"]
        theirs = peer.step()
    finally:
        peer.close()
    ours = tap.step()
    _same_samples(got, data, conv["target_layer_ids"])
    if row.family == "eagle3":  # every supervised row at each of the 3 steps (the second half of 2 x 64 tokens)
        assert ours["rows"] == theirs["rows"] == 3 * 2 * 32
    else:  # anchors are sampled independently: the same count of trained slots, not the same slots
        assert ours["rows"] == theirs["rows"] > 0
    if row.loss == "ce":  # both about ln(49,152) = 10.8 at random init
        assert 9.0 < ours["loss"] < 13.0 and abs(ours["loss"] - theirs["loss"]) < 0.25
        return
    d = tap.run.drafter
    weight = sum(d.step_decay**j for j in range(d.num_steps)) if row.family == "eagle3" else 1.0
    h = teacher_entropy(data)
    assert 9.0 < h < 11.0
    assert 0.0 < ours["loss"] < 1.0  # tapdraft's KL(p || q): near 0 at random init
    # ModelOpt's -sum p log q = KL + H(p), per step weight (EAGLE-3: 1 + 0.8 + 0.64)
    assert abs(ours["loss"] + h * weight - theirs["loss"]) < 0.25


@pytest.mark.parametrize("name", ["dflash-ce-speculators", "dflash-kd-speculators"])
def test_speculators_reads_the_converted_samples_and_trains_the_same_rows(tmp_path: Path, name: str) -> None:
    """speculators' ``ArrowDataset`` (in the vLLM venv) returns the dataset's tensors; one step each side: equal
    trainable parameters, the same blocks, the same loss once its per-row normalisation is taken as tapdraft's
    per-weight one (its ``kl_div`` is tapdraft's KL with no offset; its ``ce`` targets the teacher's argmax, not the
    dataset's token: both about ln V at random init)."""
    torch.set_num_threads(1)
    row = ROW_SPECS[name]
    data = build_dataset(tmp_path / "dataset", samples=2, tokens=64, seed=3)
    conv = to_speculators(data, tmp_path / "speculators")
    assert conv["target_layer_ids"] == [4] and conv["aux_layer_ids"] == [5] and conv["tokens"] == 128
    mask = conv["vocab_size"] - 1
    tap = TapdraftSide(data, row, anchors=2, samples=2, tokens=64, mask_token_id=mask, head_dtype="float32")
    peer = ModelOptSide(peer_python("vllm"), speculators_job(conv, tap.run, anchors=2, samples=2, mask_token_id=mask,
                                                             row=row), tmp_path / "run", peer="speculators")
    try:
        assert peer.ready["target_layer_ids"] == [5] and peer.ready["attn"] == "sdpa"
        assert peer.ready["trainable_params"] == tap.trainable == 3_873_152
        got = peer.ask("load")["samples"]
        theirs = [peer.step() for _ in range(2)]
    finally:
        peer.close()
    ours = tap.step()
    _same_samples(got, data, [4], ("hidden_states", "verifier_last_hidden_states"))
    # 2 blocks a sequence on both sides; tapdraft's all fit (full_blocks_only), speculators draws over the packed
    # row and masks the slots of a block that runs into the next sample's unsupervised half: never more rows
    assert ours["rows"] == 2 * 2 * 15
    assert all(t["anchors"] == 4 and 0 < t["rows"] <= ours["rows"] for t in theirs)
    assert max(t["rows"] for t in theirs) == ours["rows"]  # its second draw (seed 0) has every block whole
    first = theirs[0]["loss"] * theirs[0]["rows"] / theirs[0]["weight"]  # sum(w l) / sum(w), tapdraft's rule
    if row.loss == "ce":
        assert 9.0 < ours["loss"] < 13.0 and abs(ours["loss"] - first) < 0.25
    else:
        assert 0.0 < ours["loss"] < 1.0 and abs(ours["loss"] - first) < 0.05


def test_both_dspark_sides_train_the_same_rows_from_the_same_three_term_loss(tmp_path: Path) -> None:
    """The dspark row: the same Markov and confidence heads (equal parameters), the same next-token slots and the
    same 0.1 CE + 0.9 L1 + 0.1 BCE over the exact teacher on both sides, whose L1 is the same quantity (no offset)."""
    torch.set_num_threads(1)
    row = ROW_SPECS["dspark"]
    data = build_dataset(tmp_path / "dataset", samples=2, tokens=64, seed=3, family=row.family)
    conv = to_modelopt(data, tmp_path / "modelopt", family=row.family)
    assert conv["target_layer_ids"] == [4]  # DFlash's one-layer rule: DSpark is its backbone
    mask = conv["vocab_size"] - 1
    tap = TapdraftSide(data, row, anchors=2, samples=2, tokens=64, mask_token_id=mask, head_dtype="float32")
    job = modelopt_job(conv, tap.run, anchors=2, tokens=64, mask_token_id=mask, row=row)
    assert (job["markov_rank"], job["ce_weight"], job["tv_weight"], job["confidence_weight"]) == (256, 0.1, 0.9, 0.1)
    peer = ModelOptSide(peer_python(), job, tmp_path / "run")
    try:
        assert peer.ready["target_layer_ids"] == conv["target_layer_ids"]
        # DFlash's 3,873,152 + markov_w1 and markov_w2 (2 x 49,152 x 256) + the confidence head (576 + 256 + 1)
        assert peer.ready["trainable_params"] == tap.trainable == 3_873_152 + 2 * 49_152 * 256 + 833
        got = peer.ask("load")["samples"]
        theirs = peer.step()
    finally:
        peer.close()
    ours = tap.step()
    _same_samples(got, data, conv["target_layer_ids"])
    # 2 blocks a sample, every slot of a block (slot 0 too) supervised (anchors in the second half, 32..48); the one at
    # the last eligible anchor, 48, loses its last slot (label 64, past the end) on both sides. Anchors are sampled
    # independently, so each side has 64 rows less one per sample that drew anchor 48.
    assert 62 <= ours["rows"] <= 64 and 62 <= theirs["rows"] <= 64
    # 0.1 x CE (about ln(49,152) = 10.8) + 0.9 x sum|p - q| (at most 2) + 0.1 x BCE (about ln 2) at random init
    assert 1.0 < ours["loss"] < 3.0 and abs(ours["loss"] - theirs["loss"]) < 0.25
