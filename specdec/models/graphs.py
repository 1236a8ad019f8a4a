"""CUDA-graph replay of the target's fixed-length steps (decode and verify).

A decode step of a small model is a few hundred tiny kernels; launching them one by one from
Python costs far more than running them. Here each step length ``T`` (1 .. k+1) is captured once
per cache as a CUDA graph over static buffers: the token ids, the start position (a 0-d device
tensor), and attention over the whole preallocated KV cache masked by position. Replays then cost
one launch. Linear-attention caches select their live state on the device (``cur_t``) inside
the graph; their Python bookkeeping (which position is live) is done here after each replay.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..cache import KVCache, LinearAttnCache, SequenceCache
from .base import CausalLM, ForwardOut


def graphable(model: CausalLM, cache: SequenceCache, need_cuda: bool = True) -> bool:
    return (model.device.type == "cuda" or not need_cuda) and all(
        isinstance(c, (KVCache, LinearAttnCache)) for c in cache.layers)


def capture(fn, device: torch.device, warmups: int = 2):
    """Run ``fn`` ``warmups`` times on a side stream (allocator and library warm-up), then capture
    one call as a CUDA graph. Returns ``(graph, outputs)``; replaying the graph refills outputs."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


class _Step:
    def __init__(self, graph, ids, out, run=None):
        self.graph, self.ids, self.out, self.run = graph, ids, out, run

    def replay(self):
        if self.graph is not None:
            self.graph.replay()
        else:
            self.out = self.run()


class GraphedTarget:
    """Runs ``model`` on one cache, replaying a captured graph per step length.

    The returned ``logits`` are the graph's static buffer, valid until the next call; ``hidden``
    and ``captured`` are copies (drafters may keep them).
    """

    def __init__(self, model: CausalLM, cache: SequenceCache, capture: Sequence[int] = (), max_steps: int = 64,
                 pad_to: int | None = None):
        if not graphable(model, cache, need_cuda=False):
            raise ValueError("static steps need a target whose caches are all KV caches")
        # Off CUDA (tests) the same static steps run eagerly: same shapes and padding, no capture.
        self.use_graphs = model.device.type == "cuda"
        self.model, self.cache, self.capture = model, cache, tuple(capture)
        self.start = torch.zeros((), dtype=torch.int64, device=model.device)
        self.steps: dict[int, _Step] = {}
        self.max_steps = max(max_steps, pad_to or 0)
        # Batch invariance: run every step of <= pad_to tokens as one pad_to-row step, so a
        # position's logits never depend on how many tokens were verified beside it (cuBLAS and
        # attention pick kernels, hence summation orders, by shape). Plain decoding and
        # speculative decoding then compute bit-identical rows, also in bf16.
        self.pad_to = pad_to
        self.linear = [c for c in cache.layers if isinstance(c, LinearAttnCache)]
        for c in self.linear:
            c.reserve_rows(min(self.max_steps, c.snapshot_tokens))
        self._buffers = self._buffer_ids()

    def _buffer_ids(self):
        return tuple((id(c.conv), id(c.states)) for c in self.linear)

    @torch.inference_mode()
    def _capture(self, t: int) -> _Step:
        m, cache = self.model, self.cache
        ids = torch.zeros(t, dtype=torch.int64, device=m.device)
        # warm-up writes land at positions cache.length.. which this very step overwrites next
        self.start.fill_(cache.length)

        def run():
            return m.run_layers(ids, m.static_context(self.start, t, cache.max_len), cache, self.capture, "all")

        if not self.use_graphs:
            for c in self.linear:
                c.reserve_rows(min(t, c.snapshot_tokens))
            step = _Step(None, ids, None, run)
            self.steps[t] = step
            return step
        # warm-ups really run: keep the recurrent caches' live contents safe from them
        saved = [(c.conv.clone(), c.states.clone()) for c in self.linear]
        graph, out = capture(run, m.device)
        for c, (conv, states) in zip(self.linear, saved):
            c.conv.copy_(conv)
            c.states.copy_(states)
        self._buffers = self._buffer_ids()
        step = _Step(graph, ids, out)
        self.steps[t] = step
        return step

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor) -> ForwardOut:
        t = ids.shape[0]
        rows = self.pad_to if self.pad_to is not None and t <= self.pad_to else t
        if rows > self.max_steps or self.cache.length + rows > self.cache.max_len:
            return self.model(ids, self.cache, self.capture)  # eager (also raises the context error)
        if self.linear and (rows > self.linear[0].snapshot_tokens or self._buffer_ids() != self._buffers):
            if rows > self.linear[0].snapshot_tokens:
                return self.model(ids, self.cache, self.capture)
            self.steps.clear()  # an eager forward grew the recurrent buffers: recapture
        step = self.steps.get(rows) or self._capture(rows)
        start = self.cache.reserve(rows)
        self.start.fill_(start)
        step.ids[:t].copy_(ids)
        if rows > t:
            step.ids[t:] = ids[-1]  # padding rows: any token; their cache entries are dropped below
        step.replay()
        for c in self.linear:
            c.commit(start, rows, True)
        if rows > t:
            self.cache.rollback(start + t)
        o = step.out
        return ForwardOut(o.logits[:t], o.hidden[:t].clone(), None if o.captured is None else o.captured[:t].clone())
