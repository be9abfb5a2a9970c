"""The peers' own offline loaders read what benchmarks/peers.py's converters write, value for value, and each
benchmark row's two sides train the same thing on equal terms.

Without a peer venv (seconds): a row whose sides compute at different precisions is refused unless asked for a
labelled mixed row; tapdraft draws fresh anchors every step from one generator per row; the held-out loss is on
samples the row never trains on and trains nothing; the synthetic target predicts its own text, so a CE on the
dataset token and one on the teacher's argmax are one loss; the spread is the pairs' min and max.

ModelOpt: builds its venv on first use (engines/venv.sh modelopt: minutes, once), converts two samples of the
benchmark's own dataset (its 49,152-token shape, 64 tokens a sample), and asks engines/peers/modelopt_runner.py for what
ModelOpt's ``OfflineSupervisedDataset(answer_only_loss=True)`` returns; every tensor must equal the tapdraft
dataset's (read through ``shards.reader``): DFlash's one tap, EAGLE-3's three (tapdraft's rule, not ModelOpt's
default). For every row, one step on each side: equal trainable parameters, equal loss rows, and first losses that
agree once ModelOpt's soft cross-entropy is taken as tapdraft's KL + H(teacher) (``peers.teacher_entropy``).
speculators (the vLLM engine venv, engines/venv.sh vllm): the same through its ``ArrowDataset`` and
engines/peers/speculators_runner.py, its DFlash rows with ``ce`` and ``kl_div``, its EAGLE-3 and DSpark rows.
About 2 minutes of CPU after the venvs exist.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

import tapdraft.train.drafters.dflash.loss as dflash_loss
from benchmarks.peers import (DTYPE_PARTS, ROW_SPECS, ROWS, ModelOptSide, TapdraftSide, argmax_agreement,
                              build_dataset, catch_up, check_dtypes, modelopt_job, peer_python, run_row, speculators_job, spread,
                              teacher_entropy, to_modelopt, to_speculators, write_base)
from tapdraft.shards.reader import open_dataset
from tapdraft.shards.taps import default_tap_ids, eagle3_tap_ids

MASK = 49_151  # the synthetic vocabulary's last id, which its samples never use


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 self-predicting samples of 64 tokens at the benchmark's shape: 2 to train, 1 held out."""
    return build_dataset(tmp_path_factory.mktemp("peers") / "dataset", samples=3, tokens=64, seed=3)


def test_a_row_whose_sides_differ_in_precision_is_refused_unless_mixed() -> None:
    bf16 = dict.fromkeys(DTYPE_PARTS, "bfloat16")
    assert check_dtypes("r", bf16, dict(bf16), mixed=False) is False
    for part in DTYPE_PARTS:  # one part at fp32 on the peer: refused, in one line naming the part
        theirs = {**bf16, part: "float32"}
        with pytest.raises(ValueError, match=f"{part} bfloat16 vs float32") as e:
            check_dtypes("r", bf16, theirs, mixed=False)
        assert "\n" not in str(e.value) and "--mixed" in str(e.value)
        assert check_dtypes("r", bf16, theirs, mixed=True) is True  # labelled mixed instead
    with pytest.raises(ValueError, match="draft bfloat16 vs None"):  # a side that did not report a part
        check_dtypes("r", bf16, {"head": "bfloat16", "embedding": "bfloat16"}, mixed=False)


def test_a_mixed_row_is_labelled_mixed() -> None:
    from benchmarks.peers import _label

    row = {"row": "dflash-ce", "family": "dflash", "anchors_per_seq": 32}
    assert not _label({**row, "mixed": False}).startswith("MIXED")
    assert _label({**row, "mixed": True}).startswith("MIXED precision: DFlash CE")


def test_a_mixed_precision_request_is_refused_before_anything_is_built(tmp_path: Path) -> None:
    args = argparse.Namespace(precision="bfloat16", peer_precision="float32", mixed=False, samples=2, heldout=1,
                              tokens=64, anchors=2, warmup=1, pairs=1)
    with pytest.raises(ValueError, match="mixed row; pass --mixed"):
        run_row("dflash-ce", args, tmp_path, Path("/nonexistent/python"))
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("precision", ["bfloat16", "float32"])
@pytest.mark.parametrize("family", ["dflash", "eagle3", "dspark"])
def test_tapdraft_side_computes_every_part_at_the_asked_precision(tmp_path_factory: pytest.TempPathFactory,
                                                                  small: Path, family: str, precision: str) -> None:
    torch.set_num_threads(1)
    name = {"dflash": "dflash-ce", "eagle3": "eagle3", "dspark": "dspark"}[family]
    data = small if family != "eagle3" else build_dataset(tmp_path_factory.mktemp("e3") / "d", samples=2, tokens=64,
                                                          seed=3, family="eagle3")
    tap = TapdraftSide(data, ROW_SPECS[name], anchors=2, samples=2, tokens=64, mask_token_id=MASK,
                       precision=precision)
    assert tap.step()["dtypes"] == dict.fromkeys(DTYPE_PARTS, precision)
    assert tap.draft_params() == "float32"  # fp32 trainable weights either way (bf16: under autocast)


def test_write_base_writes_the_checkpoint_in_the_asked_dtype(small: Path, tmp_path: Path) -> None:
    ds = open_dataset(str(small))
    from safetensors.torch import load_file

    for dtype in ("bfloat16", "float32"):
        cfg = write_base(ds.bundle(), ds.layout.num_layers, tmp_path / dtype, dtype=dtype)
        assert cfg["dtype"] == json.loads((tmp_path / dtype / "config.json").read_text())["dtype"] == dtype
        w = load_file(str(tmp_path / dtype / "model.safetensors"))
        assert {str(t.dtype) for t in w.values()} == {f"torch.{dtype}"}
        assert torch.equal(w["lm_head.weight"].float(), ds.bundle().lm_head.float())  # the values exactly


def _spy_anchors(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    real = dflash_loss.sample_anchors

    def spy(*a, **kw):
        out = real(*a, **kw)
        seen.append(out[0].clone())
        return out

    monkeypatch.setattr(dflash_loss, "sample_anchors", spy)
    return seen


def test_tapdraft_draws_fresh_anchors_every_step_from_one_seed_per_row(small: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)
    seen = _spy_anchors(monkeypatch)

    def side() -> TapdraftSide:
        return TapdraftSide(small, ROW_SPECS["dflash-ce"], anchors=2, samples=2, tokens=64, mask_token_id=MASK,
                            precision="float32")

    a = side()
    for _ in range(3):
        a.step()
    first = list(seen)
    assert len(first) == 3
    assert not torch.equal(first[0], first[1]) and not torch.equal(first[1], first[2])  # new rows each step
    seen.clear()
    b = side()  # the same row again: the same sequence (seeded once per row, not per step)
    for _ in range(3):
        b.step()
    assert all(torch.equal(x, y) for x, y in zip(first, seen))
    seen.clear()
    for _ in range(2):  # the planted violation, reseeding every step, is what the spy catches
        b.generator.manual_seed(0)
        b.step()
    assert torch.equal(seen[0], seen[1])


def test_heldout_loss_is_on_samples_not_trained_on_and_trains_nothing(small: Path) -> None:
    torch.set_num_threads(1)
    tap = TapdraftSide(small, ROW_SPECS["dflash-ce"], anchors=2, samples=2, tokens=64, mask_token_id=MASK,
                       precision="float32", heldout=1)
    assert tap.batch["sample_id"] == ["s0", "s1"] and tap.heldout["sample_id"] == ["s2"]
    before = [p.detach().clone() for p in tap.model.parameters()]
    one, two = tap.heldout_loss(), tap.heldout_loss()
    assert one == two and one["rows"] > 0  # seeded anchors, no step taken
    assert all(torch.equal(p, q) for p, q in zip(before, tap.model.parameters()))
    for _ in range(3):
        tap.step()
    assert tap.heldout_loss()["loss"] != one["loss"]  # it measures the trained model
    # the peers' jobs hold out the same samples: ModelOpt's files and speculators' rows after the training ones
    conv = {"files": ["a.pt", "b.pt", "c.pt"], "dtype": "bfloat16", "base": "B", "architecture": {}}
    job = modelopt_job(conv, tap.run, anchors=2, tokens=64, mask_token_id=MASK, samples=2)
    assert job["files"] == ["a.pt", "b.pt"] and job["heldout_files"] == ["c.pt"]
    conv = {"verifier": "V", "data": "D", "lengths": [64, 64, 64], "dtype": "bfloat16", "aux_layer_ids": [5]}
    job = speculators_job(conv, tap.run, anchors=2, samples=2, mask_token_id=MASK)
    assert (job["train_samples"], job["max_len"], job["heldout_len"]) == (2, 128, 64)
    with pytest.raises(ValueError, match="needs 3 \\+ 1 held out"):
        TapdraftSide(small, ROW_SPECS["dflash-ce"], anchors=2, samples=3, tokens=64, mask_token_id=MASK, heldout=1)


def test_the_dataset_token_is_the_teachers_argmax_so_both_ce_rows_train_one_label(small: Path, tmp_path: Path) -> None:
    assert argmax_agreement(small, "bfloat16") == argmax_agreement(small, "float32") == 1.0
    plain = build_dataset(tmp_path / "plain", samples=2, tokens=64, seed=3, self_predicting=False)
    assert argmax_agreement(plain) < 0.01  # random text: the two CE losses would be two losses
    args = argparse.Namespace(precision="float32", peer_precision=None, mixed=False, samples=1, heldout=1,
                              tokens=64, anchors=2, warmup=1, pairs=1)
    work = tmp_path / "work"
    work.mkdir()
    (work / "dataset-dflash-1+1x64").symlink_to(plain)  # the row refuses it before starting its peer
    with pytest.raises(ValueError, match="two CE losses would train different labels"):
        run_row("dflash-ce-speculators", args, work, Path("/nonexistent/python"))


def test_a_per_row_loss_is_rescaled_to_the_weight_sum_and_a_weighted_one_left_alone() -> None:
    from benchmarks.peers import per_weight

    assert per_weight({"loss": 2.0, "rows": 10, "weight": 4.0})["weighted_loss"] == 5.0
    assert per_weight({"loss": 2.0, "rows": 10}) == {"loss": 2.0, "rows": 10}


def test_spread_is_the_median_min_and_max_of_the_pairs() -> None:
    assert spread([1.5, 1.1, 2.0, 1.3, 1.4]) == {"median": 1.4, "min": 1.1, "max": 2.0, "pairs": 5}
    with pytest.raises(ValueError):
        spread([])


def test_the_faster_side_trains_on_until_it_has_spent_the_slower_sides_seconds() -> None:
    """Held-out loss after equal wall time: the side whose timed steps took less (here the peer's 2 s a step against
    5 s) steps on until its seconds reach the other's; a side whose steps take no time stops at the cap."""
    taken = {"tapdraft": 0, "peer": 0}

    def stepper(name: str, s: float):
        def step() -> dict[str, float]:
            taken[name] += 1
            return {"s": s}
        return step

    spent = {"tapdraft": 10.0, "peer": 4.0}
    assert catch_up(spent, {"tapdraft": stepper("tapdraft", 5.0), "peer": stepper("peer", 2.0)}, cap=20) == ("peer", 3)
    assert taken == {"tapdraft": 0, "peer": 3} and spent == {"tapdraft": 10.0, "peer": 10.0}
    spent = {"tapdraft": 1.0, "peer": 9.0}
    assert catch_up(spent, {"tapdraft": stepper("tapdraft", 0.0), "peer": stepper("peer", 1.0)}, cap=4) == \
        ("tapdraft", 4)


class _Run:  # the few recipe fields modelopt_job reads
    class drafter:
        block_size, gamma, num_layers = 16, 7.0, 1

    class train:
        lr, beta1, beta2, weight_decay = 6e-4, 0.9, 0.95, 0.01


@pytest.mark.engine
@pytest.mark.slow
def test_modelopt_reads_the_converted_samples_as_the_dataset_holds_them(small: Path, tmp_path: Path) -> None:
    """At its default precision on a bf16 checkpoint: every part computes in bf16, as tapdraft's side at bfloat16
    (the trainable draft's weights too: ModelOpt keeps no fp32 master copy), and it reports a held-out loss."""
    data = small
    conv = to_modelopt(data, tmp_path / "modelopt")
    assert len(conv["files"]) == 3 and conv["target_layer_ids"] == [4] and conv["dtype"] == "bfloat16"
    job = modelopt_job(conv, _Run, anchors=2, tokens=64, mask_token_id=conv["vocab_size"] - 1, samples=2)
    peer = ModelOptSide(peer_python(), job, tmp_path / "run")
    try:
        assert peer.ready["target_layer_ids"] == conv["target_layer_ids"]  # ModelOpt's own layer rule
        assert peer.ready["dtype"] == peer.ready["head_dtype"] == "torch.bfloat16"
        got = peer.ask("load")["samples"]
        step = peer.step()
        held = peer.ask("heldout")
    finally:
        peer.close()
    assert len(got) == 2
    assert not check_dtypes("dflash-ce", dict.fromkeys(DTYPE_PARTS, "bfloat16"), step["dtypes"], mixed=False)
    assert held["rows"] > 0 and 9.0 < held["loss"] < 13.0
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
        "aux_hidden_states", "base_model_hidden_states"), mask_shift: int = 0) -> None:
    """The peer loader's samples equal the dataset's: ids, mask (``mask_shift`` positions earlier), the ``aux`` taps
    concatenated and the last layer (``names``: the peer's keys for those two)."""
    ds = open_dataset(str(data))
    col = {t: j for j, t in enumerate(ds.layout.tap_ids)}
    for i, g in enumerate(got):
        s = ds.sample("train", i)
        taps = s["taps"].float()
        assert torch.equal(torch.tensor(g["input_ids"]), s["input_ids"].long())
        mask = s["loss_mask"].long()
        assert torch.equal(torch.tensor(g["loss_mask"]), torch.cat([mask[mask_shift:], mask.new_zeros(mask_shift)]))
        assert torch.equal(torch.tensor(g[names[0]]), torch.cat([taps[:, col[t]] for t in aux], dim=-1))
        assert torch.equal(torch.tensor(g[names[1]]), taps[:, col[ds.layout.num_layers - 1]])


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.parametrize("name", ROWS)
def test_both_sides_of_a_row_train_the_same_rows_from_the_same_loss(tmp_path: Path, name: str) -> None:
    torch.set_num_threads(1)
    row = ROW_SPECS[name]
    # ModelOpt's CE is on the dataset token, as tapdraft's, on any data: the random text these first-loss bounds
    # were set on (first losses differ by the two inits and independent anchor draws: 0.2 here, 0.55 on the
    # self-predicting samples at this seed, and within 0.2 from the second step on either)
    data = build_dataset(tmp_path / "dataset", samples=2, tokens=64, seed=3, family=row.family, self_predicting=False)
    conv = to_modelopt(data, tmp_path / "modelopt", family=row.family, dtype="float32")  # the fp32 control
    if row.family == "eagle3":
        assert conv["target_layer_ids"] == eagle3_tap_ids(8) == [1, 3, 5]
    mask = conv["vocab_size"] - 1
    tap = TapdraftSide(data, row, anchors=2, samples=2, tokens=64, mask_token_id=mask, precision="float32")
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
    assert not check_dtypes(name, ours["dtypes"], theirs["dtypes"], mixed=False)  # fp32 on both
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


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.parametrize(("name", "precision"), [("dflash-ce-speculators", "bfloat16"),
                                               ("dflash-kd-speculators", "float32")])
def test_speculators_reads_the_converted_samples_and_trains_the_same_rows(small: Path, tmp_path: Path, name: str,
                                                                          precision: str) -> None:
    """speculators' ``ArrowDataset`` (in the vLLM venv) returns the dataset's tensors; one step each side: equal
    trainable parameters, equal compute dtypes (bf16: its Trainer's autocast against tapdraft's bf16 head and
    autocast), the same blocks, the same loss once its per-row normalisation is taken as tapdraft's per-weight one
    (its ``kl_div`` is tapdraft's KL with no offset; its ``ce`` targets the teacher's argmax, which on this
    self-predicting data is the dataset's token tapdraft's CE targets: one loss), and a held-out loss."""
    torch.set_num_threads(1)
    row = ROW_SPECS[name]
    data = small
    conv = to_speculators(data, tmp_path / "speculators", dtype=precision)
    assert conv["target_layer_ids"] == [4] and conv["aux_layer_ids"] == [5] and conv["tokens"] == 192
    mask = conv["vocab_size"] - 1
    tap = TapdraftSide(data, row, anchors=2, samples=2, tokens=64, mask_token_id=mask, precision=precision)
    peer = ModelOptSide(peer_python("vllm"), speculators_job(conv, tap.run, anchors=2, samples=2, mask_token_id=mask,
                                                             row=row), tmp_path / "run", peer="speculators")
    try:
        assert peer.ready["target_layer_ids"] == [5] and peer.ready["attn"] == "sdpa"
        assert peer.ready["trainable_params"] == tap.trainable == 3_873_152
        assert peer.ready["tokens"] == 128  # the 2 training samples packed; the third held out
        got = peer.ask("load")["samples"]
        theirs = [peer.step() for _ in range(2)]
        held = peer.ask("heldout")
    finally:
        peer.close()
    ours = tap.step()
    assert not check_dtypes(name, ours["dtypes"], theirs[0]["dtypes"], mixed=False)
    assert ours["dtypes"]["head"] == precision
    assert held["rows"] > 0 and held["weight"] > 0
    assert len(got) == 2
    _same_samples(got, data, [4], ("hidden_states", "verifier_last_hidden_states"))
    # 2 blocks a sequence on both sides; tapdraft's all fit (full_blocks_only), speculators draws over the packed
    # row and masks the slots of a block that runs into the next sample's unsupervised half: never more rows
    assert ours["rows"] == 2 * 2 * 15
    assert all(t["anchors"] == 4 and 0 < t["rows"] <= ours["rows"] for t in theirs)
    assert max(t["rows"] for t in theirs) == ours["rows"]  # its second draw (seed 0) has every block whole
    first = theirs[0]["loss"] * theirs[0]["rows"] / theirs[0]["weight"]  # sum(w l) / sum(w), tapdraft's rule
    if row.loss == "ce":  # the labels are one (test above); the first values differ by the two inits and anchor
        # draws over 4 blocks (10.73 / 11.10 at this seed): about ln V each, far from the 2x a wrong normalisation gives
        assert 9.0 < ours["loss"] < 13.0 and abs(ours["loss"] - first) < 0.5
    else:
        assert 0.0 < ours["loss"] < 1.0 and abs(ours["loss"] - first) < 0.05


@pytest.mark.engine
@pytest.mark.slow
def test_both_dspark_sides_train_the_same_rows_from_the_same_three_term_loss(tmp_path: Path) -> None:
    """The dspark row: the same Markov and confidence heads (equal parameters), the same next-token slots and the
    same 0.1 CE + 0.9 L1 + 0.1 BCE over the exact teacher on both sides, whose L1 is the same quantity (no offset)."""
    torch.set_num_threads(1)
    row = ROW_SPECS["dspark"]
    data = build_dataset(tmp_path / "dataset", samples=2, tokens=64, seed=3, family=row.family)
    conv = to_modelopt(data, tmp_path / "modelopt", family=row.family, dtype="float32")
    assert conv["target_layer_ids"] == [4]  # DFlash's one-layer rule: DSpark is its backbone
    mask = conv["vocab_size"] - 1
    tap = TapdraftSide(data, row, anchors=2, samples=2, tokens=64, mask_token_id=mask, precision="float32")
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


def _one_step_each(tap: TapdraftSide, job: dict, work: Path, name: str) -> tuple[dict, list, dict, dict, dict]:
    """speculators' runner on ``job``: its ready document, its loader's samples, one step and a held-out loss; then
    one tapdraft step, and the two steps' compute dtypes checked equal."""
    peer = ModelOptSide(peer_python("vllm"), job, work, peer="speculators")
    try:
        got = peer.ask("load")["samples"]
        theirs = peer.step()
        held = peer.ask("heldout")
    finally:
        peer.close()
    ours = tap.step()
    assert not check_dtypes(name, ours["dtypes"], theirs["dtypes"], mixed=False)
    return peer.ready, got, theirs, held, ours


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bfloat16", "float32"])
def test_speculators_eagle3_trains_the_same_draft_on_the_same_rows(tmp_path: Path, precision: str) -> None:
    """Its EAGLE-3 draft with tapdraft's architecture: equal trainable parameters (5,089,536: fc, the first layer and
    the final norm; lm_head frozen on both), EAGLE-3's three taps by tapdraft's rule read back from its loader, the
    same rows at each of the 3 steps, equal compute dtypes, and first losses that agree (its ``kl_div`` is the KL,
    each step over its own rows times 0.8^j, as tapdraft's: no offset; the inits differ)."""
    torch.set_num_threads(1)
    name = "eagle3-speculators"
    row = ROW_SPECS[name]
    data = build_dataset(tmp_path / "dataset", samples=3, tokens=64, seed=3, family="eagle3")
    conv = to_speculators(data, tmp_path / "speculators", family="eagle3", dtype=precision)
    assert conv["target_layer_ids"] == eagle3_tap_ids(8) == [1, 3, 5] and conv["aux_layer_ids"] == [2, 4, 6]
    mask = conv["vocab_size"] - 1
    tap = TapdraftSide(data, row, anchors=2, samples=2, tokens=64, mask_token_id=mask, precision=precision, heldout=1)
    job = speculators_job(conv, tap.run, anchors=2, samples=2, mask_token_id=mask, row=row)
    assert (job["draft"], job["loss"], job["ttt_steps"], job["step_decay"]) == ("eagle3", "kl_div", 3, 0.8)
    ready, got, theirs, held, ours = _one_step_each(tap, job, tmp_path / "run", name)
    assert ready["target_layer_ids"] == [2, 4, 6] and ready["attn"] == "sdpa"
    assert ready["trainable_params"] == tap.trainable == 5_089_536
    assert ours["dtypes"]["head"] == precision
    # the mask one position earlier, so that its shifted rows are tapdraft's (to_speculators)
    _same_samples(got, data, [1, 3, 5], ("hidden_states", "verifier_last_hidden_states"), mask_shift=1)
    assert ours["rows"] == theirs["rows"] == 3 * 2 * 32  # every supervised row (the second half) at every step
    assert "weight" not in theirs and held["rows"] == 3 * 32 and 0.0 < held["loss"] < 1.0
    assert 0.0 < ours["loss"] < 1.0 and abs(ours["loss"] - theirs["loss"]) < 0.25


@pytest.mark.engine
@pytest.mark.slow
def test_speculators_dspark_trains_the_same_draft_from_the_same_three_term_loss(tmp_path: Path) -> None:
    """Its DSpark draft: DFlash's backbone, the vanilla rank-256 Markov head and the confidence head (29,039,809
    trainable on both), slot 0 predicted on both, its ``{"ce": 0.1, "tv": 1.8}`` (its tv is TV, tapdraft's L1 2 TV)
    plus 0.1 x the confidence BCE: tapdraft's 0.1 CE + 0.9 L1 + 0.1 BCE once its per-row normalisation is taken as
    tapdraft's per-weight one. First losses within the two inits' and anchor draws' spread (1.634 / 1.656 here)."""
    torch.set_num_threads(1)
    name = "dspark-speculators"
    row = ROW_SPECS[name]
    data = build_dataset(tmp_path / "dataset", samples=3, tokens=64, seed=3, family="dspark")
    conv = to_speculators(data, tmp_path / "speculators", family="dspark", dtype="bfloat16")
    mask = conv["vocab_size"] - 1
    tap = TapdraftSide(data, row, anchors=2, samples=2, tokens=64, mask_token_id=mask, heldout=1)
    job = speculators_job(conv, tap.run, anchors=2, samples=2, mask_token_id=mask, row=row)
    assert json.loads(job["loss"]) == {"ce": 0.1, "tv": 1.8} and job["confidence_weight"] == 0.1
    ready, _, theirs, held, ours = _one_step_each(tap, job, tmp_path / "run", name)
    assert ready["trainable_params"] == tap.trainable == 29_039_809
    # 2 blocks a sequence, 16 slots each from the anchor on; its blocks may run into the next sample's prompt
    assert ours["rows"] == 2 * 2 * 16 and theirs["anchors"] == 4 and 0 < theirs["rows"] <= ours["rows"]
    first = theirs["loss"] * theirs["rows"] / theirs["weight"]
    assert 1.0 < ours["loss"] < 2.5 and abs(ours["loss"] - first) < 0.1
    assert held["rows"] > 0 and 1.0 < held["loss"] * held["rows"] / held["weight"] < 2.5
