"""Two gloo ranks on CPU: the loss denominator spans the DP group, and the loop runs under DDP."""

import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tapdraft.train.drafters.base import combine_terms


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _grad_worker(rank, world, port, rows, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 1, bias=False)
    x, y, w = rows
    mine = slice(0, 3) if rank == 0 else slice(3, None)  # uneven split: 3 rows vs 7 rows
    err = (lin(x[mine]).squeeze(-1) - y[mine]) ** 2
    terms = {"mse": ((w[mine] * err).sum(), w[mine].sum(), 1.0)}
    loss, vals = combine_terms(terms)
    loss.backward()
    g = lin.weight.grad.clone()
    dist.all_reduce(g)
    g /= world  # what DDP does
    if rank == 0:
        torch.save({"grad": g, "value": vals["mse"]}, out)
    dist.destroy_process_group()


@pytest.mark.slow
def test_denominator_is_summed_over_the_dp_group(tmp_path):
    g = torch.Generator().manual_seed(1)
    rows = (torch.randn(10, 4, generator=g), torch.randn(10, generator=g), torch.rand(10, generator=g))
    out = str(tmp_path / "r.pt")
    mp.spawn(_grad_worker, args=(2, _free_port(), rows, out), nprocs=2, join=True)
    got = torch.load(out)
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 1, bias=False)
    x, y, w = rows
    loss = (w * (lin(x).squeeze(-1) - y) ** 2).sum() / w.sum()
    loss.backward()
    assert torch.allclose(got["grad"], lin.weight.grad, atol=1e-6)
    assert abs(got["value"] - float(loss)) < 1e-6


def _train_worker(rank, world, port, root, out):
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from tapdraft.train.config import load_run_config
    from tapdraft.train.loop import train

    run = load_run_config("dflash_b8", overrides=["max_steps=3", "max_tokens=160", "max_batch_size=4",
                                                  "progress=false", "log_every=1", "device=cpu"])
    train(run, root, out)


@pytest.mark.slow
def test_loop_under_two_gloo_ranks(tmp_path):
    from dflash_fixtures import synthetic_samples, tiny_bundle, tiny_layout, write_synthetic_dataset

    bundle = tiny_bundle(tmp_path / "ds")
    layout = tiny_layout(bundle)
    path = write_synthetic_dataset(tmp_path / "ds", bundle, layout,
                                   {"train": synthetic_samples(bundle, layout, 8, min_len=16, max_len=24)})
    mp.spawn(_train_worker, args=(2, _free_port(), path, str(tmp_path / "run")), nprocs=2, join=True)
    lines = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in lines] == [1, 2, 3]
    from tapdraft.train.checkpoints import latest_checkpoint, load_checkpoint

    ck = load_checkpoint(latest_checkpoint(tmp_path / "run"))
    assert len(ck.data_states) == 2 and ck.data_states[0] != ck.data_states[1]
