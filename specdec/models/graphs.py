"""CUDA-graph replay of the target's fixed-length steps (decode and verify).

A decode step of a small model is a few hundred tiny kernels; launching them one by one from
Python costs far more than running them. Here each step length ``T`` (1 .. k+1) is captured once
per cache as a CUDA graph over static buffers: the token ids, the start position (a 0-d device
tensor), and attention over the whole preallocated KV cache masked by position (on CUDA the split
attention kernel of :mod:`.split_attention`, whose cost follows the live context, not the cache's
size). Replays then cost one launch. Linear-attention caches find their live rows on the device from the start
position inside the graph (rings keyed by position); their Python bookkeeping (the length) is done here after each
replay.
Without graphs (``--no-cuda-graphs``, or the CPU in batch-invariant mode) the same static steps
run eagerly: one step function, two ways to launch it, the same numerics.

``--compile`` (:func:`maybe_compile`) hands each static step function to torch.compile before it is
warmed up and captured: inductor fuses the hundreds of tiny kernels into a few, so the captured
graph (or the eager call on the CPU) runs fewer, larger kernels. Compilation happens at the step's
first call, i.e. in :func:`capture`'s warm-up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
from typing import Sequence

import torch

from .. import env
from ..cache import KVCache, LinearAttnCache, SequenceCache
from ..errors import CompileError
from . import layers, split_attention
from .base import CausalLM, ForwardOut
from .layers import live_context_attention

# A row-exact target's steps (CausalLM.row_exact: every attention on the split kernel) whose rows all lie within
# the first split (split_attention.split_keys of the head size) attend over those positions only, in steps
# captured for that span: one split, so the split kernel writes the output itself (split_attention.DIRECT) and
# no combine kernel runs.
# The kernel gives a row the same bits at any span (it depends on the keys the row sees only), so plain and
# speculative steps stay equal whichever span each ran. On the H200 (9d33038, real SmolLM2 GGUF, GSM8K first 80,
# -n 128, alternated): plain 1,003 / 1,001 -> 1,137 / 1,140 tok/s, DFlash 2,395 -> 2,669, MTP 1,629 -> 1,792;
# every output equal to plain (BENCHMARKS.md). SPECDEC_SHORT_SPAN=0 turns it off.
SHORT_SPAN = env.switch("SPECDEC_SHORT_SPAN")
# ... and past the first split, over the smallest of twice, four times, ... the first split's positions that holds the
# step's rows (the whole cache last): the split kernel launches a program for every split of the span and its combine
# walks them, so a step over a cache much longer than its context paid for the empty splits (H100, 2026-12-06 (third),
# scripts/profile_shape_step.py, qwen3-8b shape, 1-row step at 512 live keys: 6.16 ms with a cache of ~1k positions,
# 6.39 with 16,900: the split kernel 0.355 -> 0.598 ms, its combine 0.076 -> 0.152). A row's bits as with SHORT_SPAN;
# a row count's steps are captured for every span at once (a 16,900-position cache: 7 spans, not 2). On since the session
# of 2026-12-06 (fourth): on an H100 (scripts/ab_flags.py, one process, 3 rounds, qwen3-8b shape at 512 live keys in a
# 16,900-position cache) the 1-row step 6.500 -> 6.183 ms and the padded one 7.097 -> 6.563; bench --shape qwen3-8b's
# step at 4,096 live keys 77.2 -> 84.1 % of the bound, its oracle's output equal to plain. SPECDEC_SPAN_BUCKETS=0 off.
SPAN_BUCKETS = env.switch("SPECDEC_SPAN_BUCKETS")


def split_kernel_attends(model: CausalLM) -> bool:
    """Whether ``model``'s static steps attend on the split kernel (CUDA with Triton, the split attention
    on): the one attention whose bits do not depend on the span (tests stand its torch form in)."""
    return model.device.type == "cuda" and split_attention.triton is not None and layers.SPLIT_ATTENTION


def graphable(cache: SequenceCache) -> bool:
    """Whether static steps can run on ``cache`` (every layer cache has static buffers)."""
    return all(isinstance(c, (KVCache, LinearAttnCache)) for c in cache.layers)


def maybe_compile(fn, on: bool):
    """``fn`` (a static step: no arguments, static shapes) itself, or with ``on`` compiled by
    torch.compile as one graph (inductor, ``dynamic=False``, ``fullgraph=True``). Compilation runs
    at the first call; torch.compile being unavailable, or failing on the step, is a
    :class:`CompileError` naming ``--compile`` instead of a compiler traceback."""
    if not on:
        return fn
    import torch._dynamo

    # Each static step (a row count, a cache size, a drafter's context capacity) is one graph of
    # the same few Python functions, and dynamo counts them against one limit per function (8 by
    # default; under fullgraph, hitting it is an error): allow more.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    try:
        compiled = torch.compile(fn, dynamic=False, fullgraph=True)
    except (AttributeError, RuntimeError) as e:  # no torch.compile, or e.g. a Python version this torch cannot compile for
        raise CompileError(f"--compile: torch.compile is unavailable here: {_first_line(e)}") from e
    failed = (torch._dynamo.exc.TorchDynamoException, getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", ()))
    first = [True]

    @functools.wraps(fn)
    def run():
        if first[0]:
            # One eager run before the first compiled one fills lazy caches the step reads (e.g. RoPE's
            # per-device inverse frequencies): traced empty, their first fill would force a recompile
            # at a later call, possibly under CUDA-graph capture. Seen on the H200: a compiled step
            # captured before any eager forward of the process failed ("operation not permitted when
            # stream is capturing"); this is the likely cause, not yet confirmed there. Static steps
            # are safe to repeat (their warm-ups do the same).
            first[0] = False
            fn()
        try:
            return compiled()
        except failed as e:  # compile-time failures only; a runtime error of the step passes through
            raise CompileError(f"--compile: torch.compile failed on a static step ({type(e).__name__}: "
                               f"{_first_line(e)}); run without --compile") from e

    return run


def _first_line(e: Exception) -> str:
    line = (str(e).strip().splitlines() or [""])[0]
    return line if len(line) <= 200 else line[:200] + "..."


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
    with no_gc(), torch.cuda.graph(graph):
        out = fn()
    return graph, out


@contextlib.contextmanager
def no_gc():
    """Python's garbage collector held off: a collection during a capture may free an old graph
    (e.g. a drafter dropped since), whose reset is a CUDA call that invalidates the capture
    ("operation not permitted when stream is capturing"; seen in `specdec train`'s held-out tau).
    No collection first: in a large process one costs tens of milliseconds, and torch no longer
    runs one before a capture either."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class _Step:
    def __init__(self, graph, ids, out, run=None):
        self.graph, self.ids, self.out, self.run = graph, ids, out, run

    def replay(self):
        if self.graph is not None:
            self.graph.replay()
        else:
            self.out = self.run()


class GraphedTarget:
    """Runs ``model`` on one cache as static steps, replaying a captured graph per step length.

    A static step has shapes that depend on its row count only: attention runs over the whole
    preallocated cache masked by position (on CUDA by the split kernel, which skips the keys no row
    sees: its cost follows the live context), linear-attention layers select their live state on the
    device, MoE layers gather their experts. ``use_graphs`` (default: on CUDA) captures each step
    once and replays it; without it the very same step runs eagerly (``--no-cuda-graphs``, and the
    CPU), so graphs and eager compute the same bits. ``compile``: each step function is compiled
    with torch.compile (:func:`maybe_compile`) before it is captured or run.

    The returned ``logits`` are the step's static buffer, valid until the next call; ``hidden``
    and ``captured`` are copies (drafters may keep them).
    """

    def __init__(self, model: CausalLM, cache: SequenceCache, capture: Sequence[int] = (), max_steps: int = 16,
                 pad_to: int | None = None, use_graphs: bool | None = None, compile: bool = False):
        if not graphable(cache):
            raise ValueError("static steps need a target whose caches are all KV or linear-attention caches")
        self.use_graphs = model.device.type == "cuda" if use_graphs is None else use_graphs
        if self.use_graphs and model.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.model, self.cache, self.capture, self.compile = model, cache, tuple(capture), compile
        self.start = torch.zeros((), dtype=torch.int64, device=model.device)
        # captured steps by (rows, span): the positions their attention covers (see SHORT_SPAN)
        self.steps: dict[tuple[int, int], _Step] = {}
        self.greedy_steps: dict[tuple[int, int], _Step] = {}
        self._chain: int | None = None  # the position the next unseeded greedy_step must start at
        self._chain_step: _Step | None = None  # the greedy step that ran last (its token feeds the next)
        dims = {c.k.shape[-1] for c in cache.layers if isinstance(c, KVCache)}
        short = split_attention.split_keys(dims.pop()) if len(dims) == 1 else None
        # (not compiled: each span would compile its own steps, and the generator runs no row-exact steps then)
        self.short_span = (short if short and SHORT_SPAN and not compile and cache.max_len > short and model.row_exact()
                           and split_kernel_attends(model) else None)
        spans = [self.short_span] if self.short_span else []
        while SPAN_BUCKETS and spans and spans[-1] * 2 < cache.max_len:
            spans.append(spans[-1] * 2)
        self.spans = tuple(spans) + (cache.max_len,)  # ascending: a step takes the first that holds its rows
        self.max_steps = max(max_steps, pad_to or 0)
        # Batch invariance: run every step of <= pad_to tokens as one pad_to-row step, so a
        # position's logits never depend on how many tokens were verified beside it (cuBLAS and
        # attention pick kernels, hence summation orders, by shape). Plain decoding and
        # speculative decoding then compute bit-identical rows, also in bf16.
        self.pad_to = pad_to
        self.linear = [c for c in cache.layers if isinstance(c, LinearAttnCache)]
        # the real rows of the step being replayed (StepContext.live: kernels skip the padding rows' work);
        # _live_rows mirrors it on the host, so a step writes it only when it changes (not once a decode step)
        self.live = torch.full((), self.max_steps, dtype=torch.int64, device=model.device)
        self._live_rows = self.max_steps
        for c in self.linear:
            if self.max_steps > c.snapshot_tokens:
                raise ValueError(f"static steps of {self.max_steps} rows exceed the linear-attention caches' "
                                 f"{c.snapshot_tokens} snapshot rows")
            c.reserve_rows(self.max_steps)
        self._versions = self._buffer_versions()

    def _buffer_versions(self):
        # a counter bumped whenever a cache reallocates its buffers (never an id(): ids are recycled)
        return tuple(c.version for c in self.linear)

    def _span(self, rows: int) -> int:
        """The positions a step of ``rows`` rows at the cache's length attends over (see SHORT_SPAN, SPAN_BUCKETS)."""
        need = self.cache.length + rows
        return next(span for span in self.spans if need <= span or span == self.cache.max_len)

    def _step(self, rows: int, greedy: bool = False) -> _Step:
        """The captured step of ``rows`` rows for the current position's span; a row count's steps are
        captured for every span at once (never one in the middle of a generation)."""
        steps = self.greedy_steps if greedy else self.steps
        span = self._span(rows)
        if (rows, span) not in steps:
            for other in self.spans:
                self._capture(rows, greedy, other)
        return steps[(rows, span)]

    @torch.inference_mode()
    def _capture(self, t: int, greedy: bool, span: int) -> _Step:
        """The step of ``t`` rows attending over the first ``span`` positions; ``greedy``: the greedy-chain
        variant (:meth:`greedy_step`), whose output is its argmax token, written into its own ids for the
        next replay."""
        m, cache = self.model, self.cache
        ids = torch.zeros(t, dtype=torch.int64, device=m.device)

        # Compiled, the step always returns every layer, whatever the drafter reads: inductor fuses
        # a graph by its outputs, so a step returning other layers would compute other bits (seen
        # on the H200: bf16 logits 0.31 apart). One graph for every capture keeps plain and
        # speculative decoding on the same kernels; the wanted layers are picked outside it.
        layers = tuple(range(len(m.layers))) if self.compile else self.capture

        def step():
            ctx = dataclasses.replace(m.static_context(self.start, t, span), live=self.live)
            return m.run_layers(ids, ctx, cache, layers, "all")

        run = maybe_compile(step, self.compile)
        if self.compile:
            compiled, pick = run, torch.tensor(self.capture, dtype=torch.long, device=m.device)

            @functools.wraps(compiled)
            def run():
                o = compiled()
                if not self.capture:
                    return ForwardOut(o.logits, o.hidden, None)
                return ForwardOut(o.logits, o.hidden, o.captured.view(t, len(layers), -1)[:, pick].reshape(t, -1))

        if greedy:
            layer_step, tok = run, torch.zeros(1, dtype=torch.int64, device=m.device)

            def run():
                # row 0's argmax (the real token; the others pad), as accept_greedy takes it from the
                # same logits; it becomes every row of the next step's ids, as the padding would; the
                # position moves on by one
                torch.argmax(layer_step().logits[:1], -1, out=tok)
                ids.copy_(tok.expand(t))
                self.start.add_(1)
                return tok

        steps = self.greedy_steps if greedy else self.steps
        if not self.use_graphs:
            step = _Step(None, ids, None, run)
            steps[(t, span)] = step
            return step
        # warm-up writes land at positions cache.length.. which this very step overwrites next
        self.start.fill_(cache.length)
        # warm-ups really run: keep the recurrent caches' live contents safe from them
        saved = [(c.conv.clone(), c.states.clone()) for c in self.linear]
        graph, out = capture(run, m.device)
        for c, (conv, states) in zip(self.linear, saved):
            c.conv.copy_(conv)
            c.states.copy_(states)
        # keep ``run`` alive with the graph: its closure owns tensors the graph reads (the compiled
        # step's ``pick`` indices); freed, their memory is reused and the replay reads garbage
        step = _Step(graph, ids, out, run)
        steps[(t, span)] = step
        return step

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, rows: int | None = None) -> ForwardOut:
        """One step over ``ids``, padded to ``pad_to`` rows where they fit, or to ``rows`` if given."""
        t = ids.shape[0]
        if rows is None:
            rows = self.pad_to if self.pad_to is not None and t <= self.pad_to else t
        elif rows < t:
            raise ValueError(f"a static step of {rows} rows cannot take {t} tokens")
        self._check_fit(rows)
        self._chain = None
        with live_context_attention():  # captured (or run eagerly) with the split attention kernel on CUDA
            step = self._step(rows)
            start = self.cache.reserve(rows)
            self.start.fill_(start)
            step.ids[:t].copy_(ids)
            self._set_live(t)
            if rows > t:
                step.ids[t:] = ids[-1]  # padding rows: any token; their cache entries are dropped below
            step.replay()
        self._commit(start, rows, t)
        o = step.out
        return ForwardOut(o.logits[:t], o.hidden[:t].clone(), None if o.captured is None else o.captured[:t].clone())

    def _commit(self, start: int, rows: int, live: int) -> None:
        """After a replay of ``rows`` rows at ``start``: the linear-attention caches' bookkeeping, and the padding
        rows (past ``live``) dropped (their rings' rows are never read: no device write)."""
        for c in self.linear:
            c.commit(start, rows, True)
        if rows > live:
            self.cache.rollback(start + live)

    def _set_live(self, rows: int) -> None:
        if rows != self._live_rows:
            self.live.fill_(rows)
            self._live_rows = rows

    def _check_fit(self, rows: int) -> None:
        # Never fall back to an eager forward mid-generation: its numerics differ. The engine sizes
        # the cache (spare rows for padding) and the step length so that every step fits.
        if rows > self.max_steps or self.cache.length + rows > self.cache.max_len:
            raise RuntimeError(f"static step of {rows} rows at position {self.cache.length} does not fit "
                               f"(max {self.max_steps} rows, cache of {self.cache.max_len})")
        self._check_buffers()

    def _check_buffers(self) -> None:
        if self._buffer_versions() != self._versions:  # an eager forward grew the recurrent buffers
            self.steps.clear()
            self.greedy_steps.clear()
            self._chain = self._chain_step = None  # a new greedy step's ids hold no token yet
            self._versions = self._buffer_versions()

    @torch.inference_mode()
    def greedy_step(self, seed: torch.Tensor | None = None) -> torch.Tensor:
        """One plain greedy decoding step whose argmax runs inside the step (plain decoding's
        ``SPECDEC_GREEDY_CHAIN``): its token is the step's output (a 1-element device buffer, valid
        until the next greedy step) and the next step's input, and the step moves its own start on,
        so a chain of steps needs no host launch but the replay. ``seed`` (a 1-element device
        tensor) starts a chain at the cache's length; without it the step continues the previous
        greedy step's chain (any other step in between breaks it: RuntimeError). The step is the
        ``pad_to``-row step (1 row unpadded) with row 0 real and the token padding the rest, as
        ``self(ids)`` runs it, so its logits and token are those of ``self(ids)`` and
        ``accept_greedy``."""
        rows = self.pad_to or 1
        self._check_fit(rows)
        if seed is None and self._chain != self.cache.length:
            raise RuntimeError("greedy_step without a seed must follow a greedy step")
        with live_context_attention():
            step = self._step(rows, greedy=True)
            start = self.cache.reserve(rows)
            if seed is not None:
                self.start.fill_(start)
                step.ids.copy_(seed.reshape(1).expand(rows))
            elif step is not self._chain_step:  # the chain moves to another span's step: hand its token over
                step.ids.copy_(self._chain_step.out.reshape(1).expand(rows))
            self._set_live(1)
            step.replay()
        self._chain_step = step
        self._commit(start, rows, 1)
        self._chain = start + 1
        return step.out
