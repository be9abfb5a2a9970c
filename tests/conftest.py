"""Shared test setup: GPU-only tests skip on machines without CUDA; the tiny demo SALM every package tests on."""

from pathlib import Path

import pytest
import torch


def pytest_collection_modifyitems(config, items):
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
