"""Shared test setup: GPU-only tests skip on machines without CUDA; the tiny demo SALM every package tests on."""

import os
import signal
from pathlib import Path

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `pytest -n N`: each worker computes on one core (and the commands its tests start inherit it): N workers of
    # several threads each on N cores wait on each other at OpenMP barriers and run several times slower
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def run_order(keywords) -> int:
    """Where a test runs under ``-n 2``: the one long test first (it builds the vLLM venv and the real models, which
    the engine tests then share), the other slow tests beside it (they need neither, so the second worker never
    waits on those builds), then the engine tests, then the many short ones, which let the workers finish
    together."""
    if "long" in keywords:
        return 0
    if "engine" in keywords:
        return 2
    return 1 if "slow" in keywords else 3


def pytest_collection_modifyitems(config, items):
    """GPU-only tests skip without CUDA; the order is ``run_order``'s (a stable sort; ``--no-loadscope-reorder`` in
    pyproject keeps it: xdist would otherwise start the files with the most tests first)."""
    items.sort(key=lambda item: run_order(item.keywords))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def salm_dir(tmp_path_factory) -> Path:
    """A random-init quick-size demo SALM saved in its directory layout (built once per session)."""
    from tapdraft.demo.target import QUICK, build_demo_salm

    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("salm")
    build_demo_salm(QUICK, seed=0).save_pretrained(d)
    return d


@pytest.fixture
def terminal_signals():
    """SIGINT and SIGTERM as a terminal gives them, whatever the suite was started under (a shell starts a background
    job with SIGINT ignored, and the commands keep an ignored SIGINT ignored), restored after the test."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """A test that sets torch's thread count (a benchmark's main does) leaves the next test the count it found:
    the thread count is an input of fp32 results (a capture recorded at one count resumes at it)."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)
