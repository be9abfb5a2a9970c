"""Shared test setup: GPU-only tests skip on machines without CUDA; the tiny demo SALM every package tests on."""

import os
from pathlib import Path

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `pytest -n N`: each worker computes on one core (and the commands its tests start inherit it): N workers of
    # several threads each on N cores wait on each other at OpenMP barriers and run several times slower
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


SLOWEST_FIRST = ("long", "engine", "slow")
"""The markers that order the run, slowest first."""


def pytest_collection_modifyitems(config, items):
    """GPU-only tests skip without CUDA; the slowest kinds run first (long, engine, slow, then the rest: a stable
    sort), so that under ``-n 2`` the long files start at once and the many short tests fill in beside them, and the
    workers finish together instead of one running a long file alone at the end."""
    items.sort(key=lambda item: next((i for i, m in enumerate(SLOWEST_FIRST) if m in item.keywords), 3))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def salm_dir(tmp_path_factory) -> Path:
    """A random-init quick-size demo SALM saved in its directory layout (built once per session)."""
    from demo.target import QUICK, build_demo_salm

    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("salm")
    build_demo_salm(QUICK, seed=0).save_pretrained(d)
    return d


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """A test that sets torch's thread count (a benchmark's main does) leaves the next test the count it found:
    the thread count is an input of fp32 results (a capture recorded at one count resumes at it)."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)
