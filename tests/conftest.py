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
