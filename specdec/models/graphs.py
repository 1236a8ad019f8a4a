"""CUDA-graph replay of the target's fixed-length steps (decode and verify).

A decode step of a small model is a few hundred tiny kernels; launching them one by one from
Python costs far more than running them. Here each step length ``T`` (1 .. k+1) is captured once
per cache as a CUDA graph over static buffers: the token ids, the start position (a 0-d device
tensor), and attention over the whole preallocated KV cache masked by position. Replays then cost
one launch. Only targets whose every layer cache is a :class:`~specdec.cache.KVCache` qualify
(recurrent linear-attention caches keep Python-side snapshot bookkeeping); others run eagerly.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..cache import KVCache, SequenceCache
from .base import CausalLM, ForwardOut


def graphable(model: CausalLM, cache: SequenceCache) -> bool:
    return model.device.type == "cuda" and all(isinstance(c, KVCache) for c in cache.layers)


class _Step:
    def __init__(self, graph, ids, out):
        self.graph, self.ids, self.out = graph, ids, out


class GraphedTarget:
    """Runs ``model`` on one cache, replaying a captured graph per step length.

    The returned ``logits`` are the graph's static buffer, valid until the next call; ``hidden``
    and ``captured`` are copies (drafters may keep them).
    """

    def __init__(self, model: CausalLM, cache: SequenceCache, capture: Sequence[int] = (), max_steps: int = 64):
        if not graphable(model, cache):
            raise ValueError("CUDA graphs need a CUDA target whose caches are all KV caches")
        self.model, self.cache, self.capture = model, cache, tuple(capture)
        self.start = torch.zeros((), dtype=torch.int64, device=model.device)
        self.steps: dict[int, _Step] = {}
        self.pool = None
        self.max_steps = max_steps

    @torch.inference_mode()
    def _capture(self, t: int) -> _Step:
        m, cache = self.model, self.cache
        ids = torch.zeros(t, dtype=torch.int64, device=m.device)
        # warm-up writes land at positions cache.length.. which this very step overwrites next
        self.start.fill_(cache.length)

        def run():
            return m.run_layers(ids, m.static_context(self.start, t, cache.max_len), cache, self.capture, "all")

        side = torch.cuda.Stream(m.device)
        side.wait_stream(torch.cuda.current_stream(m.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                run()
        torch.cuda.current_stream(m.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = run()
        self.pool = graph.pool()
        step = _Step(graph, ids, out)
        self.steps[t] = step
        return step

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor) -> ForwardOut:
        t = ids.shape[0]
        if t > self.max_steps:
            return self.model(ids, self.cache, self.capture)
        if self.cache.length + t > self.cache.max_len:
            self.cache.reserve(t)  # raises the context error
        step = self.steps.get(t) or self._capture(t)
        start = self.cache.reserve(t)
        self.start.fill_(start)
        step.ids.copy_(ids)
        step.graph.replay()
        o = step.out
        return ForwardOut(o.logits, o.hidden.clone(), None if o.captured is None else o.captured.clone())
