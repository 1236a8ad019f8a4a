"""Shared fixtures."""

import pytest
import torch


@pytest.fixture(scope="module")
def single_thread():
    """Tiny models run far faster on one intra-op thread (no thread-pool sync per small op)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
