"""The adaptive LK lambda uses the mean acceptance of the WHOLE data-parallel group (2 gloo ranks)."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tapdraft.train.drafters.common.divergences import kl_tv_full, lk_loss


def _inputs(rank):
    g = torch.Generator().manual_seed(100 + rank)
    n = 3 + 4 * rank  # unequal row counts per rank: the mean must weight rows, not ranks
    return torch.randn(n, 12, generator=g, dtype=torch.float64), torch.randn(n, 12, generator=g, dtype=torch.float64)


def _worker(rank, world, init_file, out_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        p, q = _inputs(rank)
        kl, tv = kl_tv_full(p, q)
        res = lk_loss(kl, tv, torch.ones(len(tv), dtype=torch.bool), "adaptive")
        torch.save(res.lam, f"{out_file}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_adaptive_lambda_is_group_wide(tmp_path):
    world = 2
    mp.spawn(_worker, args=(world, str(tmp_path / "init"), str(tmp_path / "lam")), nprocs=world, join=True)
    lams = [torch.load(tmp_path / f"lam.{r}") for r in range(world)]
    tvs = torch.cat([kl_tv_full(*_inputs(r))[1] for r in range(world)])
    want = math.exp(-3.0 * float((1 - tvs).mean()))
    assert lams[0] == pytest.approx(want, abs=1e-12) and lams[1] == pytest.approx(want, abs=1e-12)
    local = math.exp(-3.0 * float((1 - kl_tv_full(*_inputs(0))[1]).mean()))
    assert abs(local - want) > 1e-6  # the test would notice a rank-local mean
