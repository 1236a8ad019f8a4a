"""Shared fixtures."""

import contextlib
import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest -n N: one intra-op thread a worker, no oversubscription
    torch.set_num_threads(1)


@contextlib.contextmanager
def _threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@pytest.fixture(scope="module")
def single_thread():
    """Tiny models run far faster on one intra-op thread (no thread-pool sync per small op)."""
    with _threads(1):
        yield


@pytest.fixture
def two_threads():
    """The CPU's kernels split work across threads by shape: with more than one, a row's bits can
    depend on its index in the batch (SDPA at T = 1 does). CI machines have two cores."""
    with _threads(2):
        yield
