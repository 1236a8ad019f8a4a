"""Static (CUDA-graph) batched verify steps for the serving loop.

An eager batched verify step of a small target is thousands of tiny kernels launched one by one
from Python (SmolLM2-135M: ~6,400 aten ops, ~60 ms of host time on the H200 whatever the batch),
so serving and self-distillation are bound by the host, not the GPU. The eager step cannot be
captured as a CUDA graph because its shapes change every step (active slots, drafts, span).

:class:`GraphedBatch` runs every verify step with ONE fixed shape: ``[S, W]`` token ids where
``S`` is every slot of the cache (row ``r`` is slot ``r``; idle slots run dummy rows) and
``W = kmax + 1`` (rows with fewer drafts are right-padded); attention reads the whole
preallocated cache masked by position, and the start positions live in a static device tensor.
On CUDA the step is captured once and replayed (one launch); elsewhere the very same function runs
eagerly, so CPU tests check the exact math the graph runs. With one shape, every step runs the same
kernels: a row's logits do not depend on what the other rows hold or how many are live, so in bf16
a request's output equals the same request served alone.

Rows are slots, in order, so each layer's cache is read as a view (``slots=range(S)``): a tensor
of slot indices would gather (copy) every layer's whole KV cache on each step.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..cache import BatchCache
from .base import CausalLM, ForwardOut
from .graphs import capture as capture_graph


class GraphedBatch:
    """Runs verify steps of ``width`` tokens for every slot of ``cache`` as one static step.

    ``use_graphs`` (default: on CUDA) captures the step at its first call and replays it after;
    without it the same step runs eagerly. The cache needs ``width`` spare rows past the longest
    sequence: an idle or short row writes up to ``width`` positions past its start, where nobody
    reads (positions past a sequence's length are masked and overwritten later).
    """

    def __init__(self, model: CausalLM, cache: BatchCache, width: int, capture: Sequence[int] = (),
                 use_graphs: bool | None = None):
        model.check_batched()
        self.use_graphs = model.device.type == "cuda" if use_graphs is None else use_graphs
        if self.use_graphs and model.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.model, self.cache, self.width, self.capture = model, cache, width, tuple(capture)
        s, dev = cache.slots, model.device
        # the step's inputs: static buffers, refilled before each run (never reallocated: the graph reads them)
        self.ids = torch.zeros(s, width, dtype=torch.int64, device=dev)
        self.starts = torch.zeros(s, dtype=torch.int64, device=dev)
        self.graph = None
        self.out: ForwardOut | None = None

    def _run(self) -> ForwardOut:
        """The static step: shapes depend on (slots, width, cache length) only; no host sync."""
        c = self.cache
        return self.model.forward_batch(self.ids, c, self.starts, slots=range(c.slots), span=c.max_len,
                                        capture=self.capture, logits="all")

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, slots: Sequence[int], starts: Sequence[int]) -> ForwardOut:
        """Verify ``ids [b, width]`` (row ``i`` in slot ``slots[i]``) with every slot ``s`` of the
        cache starting at ``starts[s]`` (one per slot: a live row's length; an idle slot's any
        position at or past its committed length). Returns logits ``[S, width, V]`` (the static
        buffer under graphs: valid until the next call), hidden ``[S, width, H]`` and captured
        ``[S, width, n*H]`` (copies: drafters keep them), indexed by slot."""
        if ids.shape[1] != self.width or len(starts) != self.cache.slots:
            raise ValueError(f"static batched step takes ids [b, {self.width}] and {self.cache.slots} starts, "
                             f"got ids {list(ids.shape)} and {len(starts)} starts")
        dev = self.ids.device
        if max(starts) + self.width > self.cache.max_len:  # an index past the cache would be a device fault
            raise RuntimeError(f"static batched step at position {max(starts)} does not fit the cache of "
                               f"{self.cache.max_len} positions")
        self.starts.copy_(torch.tensor(list(starts), dtype=torch.int64))
        self.ids.index_copy_(0, torch.tensor(list(slots), dtype=torch.int64, device=dev), ids.to(dev))
        if not self.use_graphs:
            o = self._run()
            return ForwardOut(o.logits, o.hidden, o.captured)
        if self.graph is None:
            # the warm-ups run this very step (same inputs, same writes), then the capture records it
            self.graph, self.out = capture_graph(self._run, dev)
        self.graph.replay()
        o = self.out
        return ForwardOut(o.logits, o.hidden.clone(), None if o.captured is None else o.captured.clone())
