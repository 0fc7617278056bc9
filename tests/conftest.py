"""Shared test setup."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """The tests run many small ops on tiny tensors: intra-op threads only add contention on a 2-core machine
    (measured: up to 40× slower when the cores are shared). Restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
