"""Host integers to the device without a stream sync.

``torch.tensor(values, device="cuda")`` copies from pageable host memory, and PyTorch's blocking copy
waits for the stream to drain: each such call stalls the host until the GPU has run everything queued
(a drafter's captured step, say), and the GPU then idles while the host prepares its next launch. On
the H200 a DFlash decoding step ran three stream syncs where one (reading the accepted tokens) is
needed (profile, BENCHMARKS.md). :func:`device_ints` stages the values in pinned memory and copies
without blocking: the copy still runs in stream order, before any later kernel reads the tensor, and
PyTorch's caching host allocator keeps the staging block until the copy is done. Same values, so the
same outputs; ``SPECDEC_SYNC_COPIES=1`` gives the blocking copies back (to compare).
"""

from __future__ import annotations

import os

import torch

SYNC_COPIES = os.environ.get("SPECDEC_SYNC_COPIES", "0") == "1"


def device_ints(values, device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)`` (nested lists too), with no stream sync on CUDA."""
    device = torch.device(device)
    if device.type != "cuda" or SYNC_COPIES:
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
