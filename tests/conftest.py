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


@pytest.fixture(autouse=True)
def static_steps_for_batch_invariant(request, monkeypatch):
    """``batch_invariant=True`` on the CPU takes the unpadded exact steps for a Llama-family target
    (specdec/cpu_exact.py). Most tests that ask for it check CUDA's static steps (padding, chunks, captured
    spans) on the CPU instead, so the suite turns that path off unless a test is marked ``cpu_exact``
    (tests/test_cpu_exact.py, tests/test_invariance.py, the CLI's)."""
    if request.node.get_closest_marker("cpu_exact") is None:
        from specdec.engine import generate as engine_mod
        monkeypatch.setattr(engine_mod, "CPU_EXACT", False)


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
