"""Static (CUDA-graph) batched verify steps for the serving loop.

An eager batched verify step of a small target is thousands of tiny kernels launched one by one
from Python (SmolLM2-135M: ~6,400 aten ops, ~60 ms of host time on the H200 whatever the batch),
so serving and self-distillation are bound by the host, not the GPU. The eager step cannot be
captured as a CUDA graph because its shapes change every step (active slots, drafts, span).

:class:`GraphedBatch` runs every verify step with ONE fixed shape: ``[S, W]`` token ids where
``S`` is every slot of the cache (row ``r`` is slot ``r``; idle slots run dummy rows) and
``W = kmax + 1`` (rows with fewer drafts are right-padded); attention reads positions
``0 .. span-1`` of every slot masked by position (``span``: the whole preallocated cache, or a
span bucket the serving loop picks, one static step per (width, span); a row's bits then hold
across spans only with ``span_invariant``), and the start positions live in a static device tensor.
On CUDA the step is captured once and replayed (one launch); elsewhere the very same function runs
eagerly, so CPU tests check the exact math the graph runs. With one shape, every step runs the same
kernels: a row's logits do not depend on what the other rows hold or how many are live, so in bf16
a request's output equals the same request served alone.

Rows are slots, in order, so each layer's cache is read as a view (``slots=range(S)``): a tensor
of slot indices would gather (copy) every layer's whole KV cache on each step.

:class:`GraphedPrefill` is the prefill's static step: ONE prompt chunk of at most ``C`` tokens
into one slot, ``[1, C]`` (right-padded with token 0), whatever else the loop serves, so a
prompt's KV cache, hidden rows and first token have the same bits served alone or beside others.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..cache import BatchCache, BatchLinearCache
from ..hostcopy import device_ints
from .base import CausalLM, ForwardOut
from .graphs import capture as capture_graph
from .layers import static_step_attention


class _StaticStep:
    """What both static steps share: a batched model, its cache, a step width, captured layers and
    the graph (captured at the first call, with ``use_graphs``: default on CUDA)."""

    def __init__(self, model: CausalLM, cache: BatchCache, width: int, capture: Sequence[int],
                 use_graphs: bool | None, span: int | None = None, span_invariant: bool = False):
        model.check_batched()
        if span is not None and not width <= span <= cache.max_len:
            raise ValueError(f"static step span {span} must lie in {width}..{cache.max_len}")
        # attention reads positions 0 .. span-1 of each slot (default: the whole cache); steps of
        # several spans give a row the same bits only with span_invariant (layers.span_invariant_attention)
        self.span = cache.max_len if span is None else span
        self.span_invariant = span_invariant
        self.use_graphs = model.device.type == "cuda" if use_graphs is None else use_graphs
        if self.use_graphs and model.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.model, self.cache, self.width, self.capture = model, cache, width, tuple(capture)
        self.graph = None
        self.out: ForwardOut | None = None

    def _attention(self):
        """The step's attention (layers.static_step_attention): a row's bits never depend on its slot."""
        return static_step_attention(self.span_invariant, self.model.device.type == "cuda")


class GraphedBatch(_StaticStep):
    """Runs verify steps of ``width`` tokens for every slot of ``cache`` as one static step.

    ``use_graphs`` (default: on CUDA) captures the step at its first call and replays it after;
    without it the same step runs eagerly. The cache needs ``width`` spare rows past the longest
    sequence: an idle or short row writes up to ``width`` positions past its start, where nobody
    reads (positions past a sequence's length are masked and overwritten later).
    """

    def __init__(self, model: CausalLM, cache: BatchCache, width: int, capture: Sequence[int] = (),
                 use_graphs: bool | None = None, span: int | None = None, span_invariant: bool = False,
                 rows: int | None = None):
        super().__init__(model, cache, width, capture, use_graphs, span, span_invariant)
        # rows: the step runs the cache's first ``rows`` slots (default: all of them)
        s, dev = cache.slots if rows is None else rows, model.device
        if not 1 <= s <= cache.slots:
            raise ValueError(f"static step rows {rows} must lie in 1..{cache.slots}")
        self.rows = s
        # the step's inputs: static buffers, refilled before each run (never reallocated: the graph reads them)
        self.ids = torch.zeros(s, width, dtype=torch.int64, device=dev)
        self.starts = torch.zeros(s, dtype=torch.int64, device=dev)

    def _run(self) -> ForwardOut:
        """The static step: shapes depend on (rows, width, cache length) only; no host sync."""
        with self._attention():
            return self.model.forward_batch(self.ids, self.cache, self.starts, slots=range(self.rows), span=self.span,
                                            capture=self.capture, logits="all")

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, slots: Sequence[int], starts: Sequence[int]) -> ForwardOut:
        """Verify ``ids [b, width]`` (row ``i`` in slot ``slots[i]``, below ``rows``) with every slot
        ``s`` of the step starting at ``starts[s]`` (one per slot: a live row's length; an idle
        slot's any position at or past its committed length). Returns logits ``[rows, width, V]``
        (the static buffer under graphs: valid until the next call), hidden ``[rows, width, H]``
        and captured ``[rows, width, n*H]`` (copies: drafters keep them), indexed by slot."""
        if ids.shape[1] != self.width or len(starts) != self.rows or max(slots) >= self.rows:
            raise ValueError(f"static batched step takes ids [b, {self.width}] in slots below {self.rows} and "
                             f"{self.rows} starts, got ids {list(ids.shape)}, slots up to {max(slots)} and "
                             f"{len(starts)} starts")
        dev = self.ids.device
        if max(starts) + self.width > self.span:  # an index past the span would be a device fault
            raise RuntimeError(f"static batched step at position {max(starts)} does not fit its span of "
                               f"{self.span} positions")
        self.starts.copy_(device_ints(list(starts), dev))
        self.ids.index_copy_(0, device_ints(list(slots), dev), ids.to(dev))
        if not self.use_graphs:
            o = self._run()
            return ForwardOut(o.logits, o.hidden, o.captured)
        if self.graph is None:
            # the warm-ups run this very step (same inputs, same writes), then the capture records it
            self.graph, self.out = capture_graph(self._run, dev)
        self.graph.replay()
        o = self.out
        return ForwardOut(o.logits, o.hidden.clone(), None if o.captured is None else o.captured.clone())


class GraphedPrefill(_StaticStep):
    """Prefills one slot's prompt chunk by chunk as a static step of ``[1, width]`` tokens.

    The step reads the whole cache of its slot (the slot index, start position and real length are
    static device tensors) and commits linear-attention states after the chunk's real positions
    (the prefill form of :meth:`~specdec.models.base.CausalLM.forward_batch`). Its inputs are the
    chunk, zero padding and the slot's own cache, so its bits never depend on other slots. The
    cache needs ``width`` positions from the chunk's start (the padding writes past the chunk's
    end, where nobody reads). ``use_graphs`` as in :class:`GraphedBatch`.
    """

    def __init__(self, model: CausalLM, cache: BatchCache, width: int, capture: Sequence[int] = (),
                 use_graphs: bool | None = None, span: int | None = None, span_invariant: bool = False):
        super().__init__(model, cache, width, capture, use_graphs, span, span_invariant)
        dev = model.device
        self.ids = torch.zeros(1, width, dtype=torch.int64, device=dev)
        self.start, self.slot, self.n = (torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(3))

    def _run(self) -> ForwardOut:
        c = self.cache
        with self._attention():
            return self.model.forward_batch(self.ids, c, self.start, slots=self.slot, span=self.span,
                                            capture=self.capture, last=self.n - 1, commit=self.n)

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, slot: int, start: int) -> ForwardOut:
        """Run the prompt chunk ``ids [m]`` (``0 < m <= width``) at positions ``start ..`` of
        ``slot``. Returns copies of the logits ``[1, V]`` of its last position, hidden
        ``[1, width, H]`` and captured ``[1, width, n*H]`` (rows past ``m``: padding)."""
        m = ids.numel()
        if not 0 < m <= self.width:
            raise ValueError(f"static prefill step takes 1..{self.width} tokens, got {m}")
        if start + self.width > self.span:
            raise RuntimeError(f"static prefill step at position {start} does not fit its span of "
                               f"{self.span} positions")
        self.ids.copy_(torch.nn.functional.pad(ids.reshape(1, m).to(self.ids.device), (0, self.width - m)))
        self.start.fill_(start)
        self.slot.fill_(slot)
        self.n.fill_(m)
        if not self.use_graphs:
            return self._run()
        if self.graph is None:
            # the warm-ups and the capture run this step too: KV writes repeat, but a linear-attention
            # layer would read the state its previous run committed, so the slot's states are restored
            linear = [c for c in self.cache.layers if isinstance(c, BatchLinearCache)]
            saved = [(c.conv[slot].clone(), c.state[slot].clone()) for c in linear]
            self.graph, self.out = capture_graph(self._run, self.ids.device)
            for c, (conv, state) in zip(linear, saved):
                c.conv[slot].copy_(conv)
                c.state[slot].copy_(state)
        self.graph.replay()
        o = self.out
        return ForwardOut(o.logits.clone(), o.hidden.clone(), None if o.captured is None else o.captured.clone())
