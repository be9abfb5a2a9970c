"""Trainer tests run single-threaded: tiny tensors on a shared 2-core box are 100x slower when
torch's two OpenMP threads fight other processes for the cores."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
