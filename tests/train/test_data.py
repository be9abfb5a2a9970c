"""Data path stages on plain lists, collate, and exact resume of the composed stream."""

import pytest
import torch

from dflash_fixtures import synthetic_samples, tiny_bundle, tiny_layout, write_synthetic_dataset
from tapdraft.train.data import BatchStream, batch_by_tokens, collate, has_targets, truncate


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds")
    bundle = tiny_bundle(root)
    layout = tiny_layout(bundle)
    return root, bundle, layout, synthetic_samples(bundle, layout, 24, min_len=10, max_len=30)


def _ids(batch):
    return batch["sample_id"]


def test_batch_by_tokens_budget_and_order():
    lens = [5, 7, 3, 9, 2, 2, 12]
    items = [({"input_ids": torch.zeros(n)}, i) for i, n in enumerate(lens)]
    out = list(batch_by_tokens(items, max_tokens=16, max_batch_size=3))
    flat = [int(s["input_ids"].shape[0]) for b, _ in out for s in b]
    assert flat == lens
    for b, _ in out:
        assert len(b) <= 3 and (len(b) == 1 or len(b) * max(s["input_ids"].shape[0] for s in b) <= 16)
    # the state after a batch is the index of the next batch's first sample
    starts = [0]
    for b, _ in out[:-1]:
        starts.append(starts[-1] + len(b))
    assert [st for _, st in out[:-1]] == starts[1:] and out[-1][1] is None


def test_truncate_and_filter(data):
    _, _, layout, samples = data
    s = samples[0]
    t = truncate(s, 12)
    assert t["input_ids"].shape[0] == 12 and t["taps"].shape[0] == 12
    assert bool((t["topk_rows"] + 1 < 12).all()) and t["topk_ids"].shape[0] == t["topk_rows"].shape[0]
    assert truncate(s, 1000) is s
    u = dict(s, loss_mask=torch.zeros_like(s["loss_mask"]))
    assert has_targets(s) and not has_targets(u)


def test_collate_pads_and_scatters_topk(data):
    _, _, layout, samples = data
    b = collate(samples[:3])
    Bs, T = b["input_ids"].shape
    assert Bs == 3 and T == max(int(s["input_ids"].shape[0]) for s in samples[:3])
    for i, s in enumerate(samples[:3]):
        L = int(s["input_ids"].shape[0])
        assert int(b["lengths"][i]) == L and not b["loss_mask"][i, L:].any()
        assert torch.equal(b["taps"][i, :L], s["taps"])
        rows = s["topk_rows"].long()
        assert torch.equal(b["topk_ids"][i, rows], s["topk_ids"].long())
        assert int(b["topk_valid"][i].sum()) == rows.shape[0]


def _stream(source, state=None, world=1, rank=0):
    return BatchStream(source(rank, world), max_tokens=80, max_batch_size=4, max_seq_len=25, state=state)


def _ds_source(path):
    from tapdraft.shards.reader import open_dataset

    ds = open_dataset(path)
    return lambda rank, world: (lambda epoch, st: ds.stream("train", seed=5, epoch=epoch, rank=rank,
                                                            world_size=world, state=st))


@pytest.fixture(scope="module")
def dataset(data):
    root, bundle, layout, samples = data
    return write_synthetic_dataset(root, bundle, layout, {"train": samples})


def test_resume_gives_the_same_next_batches(dataset):
    source = _ds_source(dataset)
    full = _stream(source)
    ref = [_ids(next(full)) for _ in range(20)]  # crosses epoch boundaries (24 samples, <= 4 a batch)
    s = _stream(source)
    for _ in range(7):
        next(s)
    state = s.state_dict()
    resumed = _stream(source, state=state)
    assert [_ids(next(resumed)) for _ in range(13)] == ref[7:]
    # ranks see disjoint samples within an epoch
    r0 = {i for _ in range(2) for i in _ids(next(_stream(source, world=2, rank=0)))}
    r1 = {i for _ in range(2) for i in _ids(next(_stream(source, world=2, rank=1)))}
    assert not (r0 & r1)


def test_bad_state_version_refused(dataset):
    with pytest.raises(ValueError, match="version"):
        _stream(_ds_source(dataset), state={"version": 99, "epoch": 0, "reader": None})


def test_worker_stream_resume_is_exact(dataset):
    from tapdraft.shards.reader import open_dataset
    from tapdraft.train.data import WorkerBatchStream

    ds = open_dataset(dataset)
    open_w = lambda wid, nw, epoch, st: ds.stream("train", seed=5, epoch=epoch, worker_id=wid, num_workers=nw,
                                                  state=st)
    make = lambda state=None: WorkerBatchStream(open_w, num_workers=2, max_tokens=80, max_batch_size=4,
                                                max_seq_len=25, state=state)
    full = make()
    ref = [_ids(next(full)) for _ in range(9)]
    s = make()
    for _ in range(5):  # stop mid round (after role 0 of the third round)
        next(s)
    resumed = make(s.state_dict())
    assert [_ids(next(resumed)) for _ in range(4)] == ref[5:]
    with pytest.raises(ValueError, match="same settings"):
        WorkerBatchStream(open_w, num_workers=3, max_tokens=80, max_batch_size=4, state=s.state_dict())
