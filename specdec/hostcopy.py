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


import torch
from . import env

SYNC_COPIES = env.switch("SPECDEC_SYNC_COPIES")


def device_ints(values, device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)`` (nested lists too), with no stream sync on CUDA."""
    device = torch.device(device)
    if device.type != "cuda" or SYNC_COPIES:
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


class HostReader:
    """Device integers back to the host without draining the stream.

    ``tensor.tolist()`` on CUDA waits for everything queued on the stream, including work launched
    after the tensor was computed. :meth:`stage` instead queues a copy into a pinned buffer and
    records an event right behind it; :meth:`Staged.read` then waits for that event only, so the
    next step can be queued before this one's tokens are read (plain decoding's lookahead,
    engine/generate.py). ``slots`` buffers are used in turn: at most that many reads may be pending.
    On the CPU a stage is the copy itself and a read returns its list."""

    def __init__(self, device, numel: int, slots: int = 2, dtype: torch.dtype = torch.int64):
        self.cuda = torch.device(device).type == "cuda"
        self.bufs = [torch.empty(numel, dtype=dtype, pin_memory=self.cuda) for _ in range(slots)]
        self.events = [torch.cuda.Event() if self.cuda else None for _ in range(slots)]
        self.next = 0

    def stage(self, t: torch.Tensor) -> "Staged":
        i, self.next = self.next, (self.next + 1) % len(self.bufs)
        buf, event = self.bufs[i][: t.numel()], self.events[i]
        buf.copy_(t.reshape(-1), non_blocking=self.cuda)
        if event is not None:
            event.record()
        return Staged(buf, event)


class Staged:
    def __init__(self, buf: torch.Tensor, event):
        self.buf, self.event = buf, event

    def read(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.buf.tolist()
