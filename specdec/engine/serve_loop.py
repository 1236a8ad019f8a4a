"""The serving loop: continuous batching with speculative decoding, one engine for batch >= 1.

A background thread owns the target's :class:`~specdec.cache.BatchCache` of ``max_slots``
sequences. Each slot holds one request: its committed length (a host int), its tokens, its own
drafter instance (``spawn()`` of one loaded drafter: shared weights, per-slot caches), its
sampling generator and its statistics. The thread repeats, at step boundaries:

1. cancelled requests free their slots; waiting requests take the free slots; every prompt not
   yet prefilled advances by up to ``prefill_chunk`` positions (so a long prompt delays the
   running requests by one chunk per step, not by its whole prefill): with ``exact``, each prompt
   on its own (static ``[1, static_prefill_chunk]`` steps, or one eager forward of its own),
   otherwise all in one right-padded forward; a prompt that is complete samples its first token
   from its last logits and its drafter ``begin``\\ s with the prompt's rows;
2. one step over every slot past its prefill: each drafter proposes ``k`` tokens (``k`` from the cost
   controller, the same for the whole step; a seeded sampled request always drafts the maximum,
   so its random stream, hence its tokens, do not depend on timing), ONE batched target forward
   verifies the rows ``[last token, d_1 .. d_k]`` (padded to the longest row; with
   ``static_steps``, on CUDA by default, one fixed-shape step over a bucket of slots replayed as a
   CUDA graph: :mod:`specdec.models.graphed_batch`, shapes checked under ``exact``, see
   :class:`EngineLoop`) with logits at every position, acceptance runs as in
   :mod:`.generate` (greedy rows together, sampled rows together, each with its own random
   stream; one host sync for the step), each slot
   advances by ``accepted + 1`` (KV entries past it are overwritten later: that is the rollback)
   and its drafter observes the committed tokens with that slot's rows.

Batch 1 is this loop with one active slot. A failure inside one request (its drafter raises)
ends that request with an ``error`` event; a failing batched forward ends the requests of that
step; the loop keeps serving the others.

Under tensor parallelism (a target loaded with a ``shard`` of two or more ranks) every rank runs
this loop: rank 0 :meth:`~EngineLoop.start`\\ s it and takes the requests, the other ranks
:meth:`~EngineLoop.follow` it. At each step boundary rank 0 decides alone (cancellations, joining
requests with their generator seeds, the step's ``k``) and hands the decision, a
:class:`Boundary`, to the followers (:mod:`specdec.parallel.boundary`), which apply it instead of
deciding: from there on every rank runs the same forwards on the same inputs. A failing forward
then ends the loop on every rank (the ranks might no longer agree), not just its requests.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..drafters.factory import make_drafter, resolve_spec
from ..errors import ConfigError, ContextOverflowError, EngineStoppedError, QueueFullError, RequestError
from ..models.base import CausalLM
from ..models.graphed_batch import GraphedBatch, GraphedPrefill
from ..models.invariant_linear import make_rows_invariant
from ..parallel.boundary import HEARTBEAT_S, BoundaryChannel
from ..sampling import SamplingParams
from .controller import DraftController
from .loop_work import SHAPE_CHECKS, SlotWork, _Row, describe
from .requests import Event, GenRequest, RequestHandle, Slot

__all__ = ["Boundary", "EngineLoop", "Event", "GenRequest", "RequestHandle"]




@dataclass(frozen=True)
class Boundary:
    """What the loop decided at one step boundary; under tensor parallelism rank 0 hands it to
    the other ranks, which apply it instead of deciding (only changes travel)."""

    cancel: tuple[int, ...] = ()  # slots whose requests were cancelled
    join: tuple[tuple[int, GenRequest, int | None], ...] = ()  # (slot, request, sampling generator seed)
    k: int = 0  # drafts in the coming step (before the per-slot caps)
    stop: bool = False  # the loop ends (followers return from follow())


class _Mirror(RequestHandle):
    """A follower's stand-in for a client: rank 0 sends the real events, these are dropped."""

    def __init__(self):
        super().__init__("follower")

    def _send(self, ev: Event) -> None:
        self.finished = self.finished or ev.kind in ("done", "error")


class EngineLoop(SlotWork):
    """Serves :class:`GenRequest`\\ s on ``loaded`` (a :class:`~specdec.loading.LoadedModel`).

    ``draft``: a drafter spec (``none``, ``ngram``, ``dflash:PATH``, ``mtp:PATH``), a drafter
    object with ``spawn()``, or a zero-argument factory returning a fresh drafter per slot.
    ``num_draft_tokens``: drafts per step at most (a DFlash drafter drafts up to
    ``block_size - 1``). ``max_context``: positions per slot (default and limit: the model's).
    ``controller``: choose ``k`` per step for throughput (:mod:`.controller`); off, every step
    drafts the maximum. ``static_steps`` (default: on CUDA): every verify step runs as one static
    step of ``[slots, width]`` tokens (all ``max_slots`` slots and ``kmax + 1``, or with
    ``slot_buckets`` the first 1, 2, 4, ... slots holding the live ones, and 1 wide when nothing is
    drafted), replayed as a CUDA graph on CUDA (:class:`~specdec.models.graphed_batch.GraphedBatch`;
    :meth:`warmup` builds them): no per-step op dispatch, and a row's verify logits are bitwise
    independent of what the other rows hold.

    ``exact`` (default: ``static_steps``; needs them): a request's bits, hence its greedy tokens,
    are the same served alone or beside any other requests (issue 11). Two things make it so:

    - each prompt prefills on its own: a prompt of at most ``static_prefill_max`` tokens in chunks
      of ``static_prefill_chunk`` through one static ``[1, static_prefill_chunk]`` step
      (:class:`~specdec.models.graphed_batch.GraphedPrefill`, a CUDA graph on CUDA), a longer one
      (or one whose padded last chunk would not fit the cache) in eager forwards of its own of
      ``prefill_chunk`` tokens: shapes set by the prompt alone, bitwise independent of the
      others too, but not graph-replayed;
    - a verify step takes a shape other than the full one (every slot, ``kmax + 1`` wide) only
      where that shape gives a row the full step's bits: 1 wide when nothing is drafted (the
      controller's ``k = 0``), and the first 1, 2, 4, ... slots holding every live one
      (``slot_buckets``). The first ``SHAPE_CHECKS`` steps of each shape also run the full one and
      compare (``_check_step``); once one differs (on the H200 cuBLAS picks other GEMM kernels for
      the qwen3-8b shape's 32 and 512 rows, not for SmolLM2's), every step takes the full shape, and
      a step without drafts saves the drafter's cost only. A kernel that sums in another order
      changes nearly every element of a row's fp32 logits and hidden state at real sizes; on a tiny
      CPU model (hidden 32) a check passed and the rows differed three steps later, so on the CPU
      exact steps always take the full shape. Not under tensor parallelism (full shape) either.

    ``invariant_gemm`` (default: with ``exact`` on CUDA, not under tensor parallelism): linear
    layers whose cuBLAS results change with the row count run a row-count-invariant Triton GEMM
    instead (:mod:`~specdec.models.invariant_linear`; found by probing each weight shape, and set
    on the model in place), so that other step shapes can give the full step's bits.

    ``span_buckets`` (default: on CUDA with static steps): a static step attends over the smallest of
    256, 512, ... positions holding every slot's, with span-invariant attention, not over the whole
    context. ``all_slots_drafter`` (default: with static steps): a drafter that offers ``for_slots``
    (DFlash) drafts for every slot in one static step and writes every slot's committed rows in one
    more (:class:`~specdec.drafters.dflash.DFlashSlots`; the first 1, 2, 4, ... slots holding the
    live ones while only greedy requests are served), instead of a pass per slot (on the H200,
    4d7866a: 1.1-1.8x the per-slot drafters' throughput at 1 to 32 clients).

    With ``exact=False`` the joining prompts prefill together in one right-padded eager forward
    (a prompt's bits then depend on which prompts join with it), and a step without drafts runs a
    second, 1-wide static step, which costs what plain decoding costs (a row's bits then depend on
    the width the controller chose, so on the load).

    Errors for the HTTP layer: ``submit`` raises :class:`RequestError` (400),
    :class:`QueueFullError` (429) and :class:`EngineStoppedError` (503); failures while serving
    arrive as ``error`` events. Requests are served in arrival order.
    """

    prefill_chunk = 512  # prompt positions per prefill forward (per boundary with exact)
    # rows of the exact prefill's static step: a step costs about the same at 32 and 128 rows on the
    # H200 (weights read once; SmolLM2's ~2.8 ms is kernel launches), so 128 means 4x fewer steps for a
    # long prompt. At 32, 32 clients' prompts took ~0.7 s of SmolLM2's 1.7 s (GSM8K prompts, ~100 tokens)
    static_prefill_chunk = 128
    static_prefill_max = 512  # longer prompts prefill in eager forwards of their own (see the class docstring)
    step_history = 256  # step times kept for metrics()
    heartbeat_s = HEARTBEAT_S  # tensor parallelism: an idle rank 0 sends an empty boundary this often

    def __init__(self, loaded, draft=None, *, max_slots: int = 8, max_queue: int = 64, num_draft_tokens: int = 4,
                 block_size: int | None = None, max_context: int | None = None, controller: bool = True,
                 static_steps: bool | None = None, exact: bool | None = None, span_buckets: bool | None = None,
                 all_slots_drafter: bool | None = None, slot_buckets: bool | None = None,
                 invariant_gemm: bool | None = None, draft_vocab: str | None = None):
        model: CausalLM = getattr(loaded, "model", loaded)
        if not model.batched:
            arch = getattr(getattr(loaded, "arch", None), "name", None) or model.config.model_type
            raise ConfigError(f"{getattr(loaded, 'path', arch)}: continuous batching is not supported for {arch} "
                              "targets yet (supported: llama, qwen3, qwen3_5, qwen3_5_moe)")
        for name, v, lo in (("max_slots", max_slots, 1), ("max_queue", max_queue, 0),
                            ("num_draft_tokens", num_draft_tokens, 0)):
            if type(v) is not int or v < lo:
                raise ConfigError(f"{name} must be an integer >= {lo}, got {v!r}")
        self.model, self.max_slots, self.max_queue = model, max_slots, max_queue
        self.draft_name, self._spawn, proto = self._drafters(draft, loaded, block_size, draft_vocab)
        self._slot_drafters: dict[int, object] = {}  # slot -> its drafter, kept across requests
        self._reuse_drafters = proto is not None and self._spawn == getattr(proto, "spawn", None)
        if proto is None:
            self.kmax = 0
        elif getattr(proto, "block_size", None):
            self.kmax = proto.block_size - 1  # a block drafter drafts up to its (possibly lowered) block
        else:
            self.kmax = num_draft_tokens
        self.capture = tuple(proto.capture_layers) if proto is not None else ()
        if max_context is not None and (type(max_context) is not int or max_context < 2):
            raise ConfigError(f"max_context must be an integer >= 2, got {max_context!r}")
        self.context = min(max_context or model.max_context, model.max_context)
        # spare rows: a short row padded to the step's longest writes up to kmax + 1 positions past its end
        self.cache = model.new_batch_cache(max_slots, self.context, spare=self.kmax + 1)
        if static_steps is None:
            static_steps = model.device.type == "cuda"
        elif type(static_steps) is not bool:
            raise ConfigError(f"static_steps must be True, False or None, got {static_steps!r}")
        # static steps with drafts all run kmax + 1 rows a slot: for a drafter whose proposals cost
        # the same for any k (flat_draft_cost), only k = 0 and k = kmax can be best
        flat = static_steps and getattr(proto, "flat_draft_cost", False)
        self.controller = (DraftController(self.kmax, choices=(0, self.kmax) if flat else None)
                           if controller and self.kmax > 0 else None)
        # every verify step as one fixed-shape step over all slots (a CUDA graph on CUDA): see graphed_batch.py
        self.static_steps = static_steps
        self._static: dict[tuple[int, int, int], GraphedBatch] = {}  # (rows, width, span) -> its step (at first use)
        if exact is None:
            exact = static_steps
        elif type(exact) is not bool:
            raise ConfigError(f"exact must be True, False or None, got {exact!r}")
        elif exact and not static_steps:
            raise ConfigError("exact=True needs static_steps (fixed-shape verify steps); pass static_steps=True")
        # a request's bits independent of the other requests: prompts prefill alone, k = 0 keeps the wide step
        self.exact = exact
        self._prefill_steps: dict[int, GraphedPrefill] = {}  # span -> the exact prefill's static step
        # exact: how many times each static step shape (rows, width, span) gave the full step's bits;
        # once one did not, every exact step takes the full shape (all slots, kmax + 1 wide). On the
        # CPU exact steps always take it: a tiny test model's check can pass by chance (below)
        # every slot's drafts: EMAs of accepted and tried (Slot.record_drafts); a new request starts
        # from it (its own drafts then move it): a slot that the controller keeps at k = 0 never learns
        # its own rate. The prior is optimistic, 9 in 10, so that the loop drafts and learns: from 1 in
        # 2, the shipped DFlash drafter (0.73 measured) looked worth 2 tokens a step at k = 15 and was
        # not tried again
        self._acceptance = [1.8, 2.0]
        self._checked: dict[tuple[int, int, int], int] = {}
        self._idle_start = 0  # where a static step's idle slots start (warmup moves it to reach a span)
        self._shapes_exact = model.device.type == "cuda"
        # static steps attend over the smallest of 256, 512, ... (and the whole cache) that holds every
        # slot's positions, not over the whole cache: with span-invariant attention (layers.py), whose
        # bits hold across spans on CUDA (measured on the H200), not on the CPU: default on CUDA only
        if span_buckets is None:
            span_buckets = static_steps and model.device.type == "cuda"
        elif type(span_buckets) is not bool or (span_buckets and not static_steps):
            raise ConfigError(f"span_buckets must be True (with static_steps), False or None, got {span_buckets!r}")
        self.span_buckets = span_buckets
        # static steps run the first 1, 2, 4, ... slots that hold every live one, not all of them;
        # with exact only the shapes checked to give the full step's bits (_check_step)
        if slot_buckets is None:
            slot_buckets = static_steps
        elif type(slot_buckets) is not bool or (slot_buckets and not static_steps):
            raise ConfigError(f"slot_buckets must be True (with static_steps), False or None, got {slot_buckets!r}")
        self.slot_buckets = slot_buckets
        # a drafter that drafts for every slot in one static step (DFlash): one instead of one per slot
        self._all_slots = None
        if all_slots_drafter is None:
            all_slots_drafter = static_steps
        elif type(all_slots_drafter) is not bool:
            raise ConfigError(f"all_slots_drafter must be True, False or None, got {all_slots_drafter!r}")
        if (all_slots_drafter and proto is not None and self._reuse_drafters and static_steps
                and callable(getattr(proto, "for_slots", None))):
            self._all_slots = proto.for_slots(max_slots, self.cache.max_len + self.kmax + 1, self.kmax + 1,
                                              self._span, self.span_buckets)
        self._shard = getattr(model, "shard", None)
        self._sync: BoundaryChannel | None = None  # tensor parallelism: set by start() / follow()
        # exact on CUDA: the linear layers whose cuBLAS results change over the row counts the verify
        # steps may run (slot buckets x widths) run a row-count-invariant Triton GEMM, so that steps of other shapes
        # can pass their checks (models/invariant_linear.py). It changes the model in place.
        if invariant_gemm is None:
            invariant_gemm = exact and self._shard is None and model.device.type == "cuda"
        elif type(invariant_gemm) is not bool:
            raise ConfigError(f"invariant_gemm must be True, False or None, got {invariant_gemm!r}")
        self.invariant_linears = []
        if invariant_gemm:  # the row counts the loop's verify steps may run
            counts = sorted({n * w for n in self._row_buckets() for w in self._widths()})
            self.invariant_linears = make_rows_invariant(model, max(counts), rows=counts)
        self.error: BaseException | None = None  # under tensor parallelism, what ended the loop

        self._cv = threading.Condition()
        self._queue: collections.deque[tuple[GenRequest, RequestHandle, float]] = collections.deque()
        self._slots: list[Slot | None] = [None] * max_slots
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._ids = itertools.count()
        self._step_s: collections.deque[float] = collections.deque(maxlen=self.step_history)
        self._outbox: list = []  # (handle, event) to send: SlotWork._deliver
        self._k_hist: collections.Counter = collections.Counter()
        self._k_seconds: collections.Counter = collections.Counter()  # k -> seconds its steps took in all
        self._n = dict.fromkeys(("requests_total", "requests_finished", "requests_failed", "requests_cancelled",
                                 "prompt_tokens_total", "tokens_total", "steps_total", "accepted_total",
                                 "drafted_total"), 0)

    @staticmethod
    def _drafters(draft, loaded, block_size, draft_vocab=None):
        """(name, per-slot factory or None, one instance to read settings from or None)."""
        # auto: the DFlash drafter shipped for the target on CUDA, else none (generate's auto adds the
        # history lookup, which here would draft slot by slot). On the H200 (BENCHMARKS.md) the shipped
        # SmolLM2 DFlash drafter served 1.91x plain at 1 client (17d6244), 1.52x at 4, 1.24x at 16 and
        # 1.10x at 32 (7b564c6), with the controller
        draft = resolve_spec(draft, loaded, serving=True)
        if draft is None or draft == "none":
            if block_size is not None:
                raise ConfigError("block_size was given but no DFlash drafter is used")
            return "none", None, None
        if callable(draft) and not isinstance(draft, str):  # a factory (a class or a function)
            if block_size is not None:
                raise ConfigError("block_size applies to drafter specs, not to a drafter factory")
            proto = draft()
            return getattr(proto, "name", "custom"), draft, proto
        proto = make_drafter(draft, loaded, block_size=block_size, draft_vocab=draft_vocab)
        if not callable(getattr(proto, "spawn", None)):
            raise ConfigError(f"drafter {type(proto).__name__} has no spawn(): the serving loop needs one "
                              "drafter instance per slot (or pass a factory)")
        return (draft if isinstance(draft, str) else proto.name), proto.spawn, proto

    # --- client side (any thread) -------------------------------------------------------
    @torch.inference_mode()
    def warmup(self) -> int:
        """Build (capture, on CUDA) the static verify steps before serving, for every span bucket,
        slot bucket and width a step may take, and run their shape checks (exact), so that no
        request waits for a capture or a check (on the H200 a qwen3-8b-shape step took ~0.25 s to
        build and check). Call it before :meth:`start` (or between :meth:`run` calls), with no
        request in the loop: the dummy rows write past every slot's length, where nothing is read.
        Returns how many steps were built; 0 without static steps or under tensor parallelism (the
        ranks would have to warm up together)."""
        if not self.static_steps or self._shard is not None:
            return 0
        if self._thread is not None or any(self._slots):
            raise RuntimeError("EngineLoop.warmup() runs before start(), with no request in the loop")
        before = len(self._static)
        spans = self._spans()
        try:
            for span in spans:
                # idle slots start here (see _verify): the steps then attend over this span
                self._idle_start = 0 if span == spans[0] else span // 2
                for n in self._row_buckets():
                    rows = [_Row(s, torch.empty(0, dtype=torch.int64), None) for s in range(n)]
                    for width in self._widths():
                        ids = torch.randint(self.model.config.vocab_size, (n, width), device=self.model.device)
                        for _ in range(SHAPE_CHECKS if self.exact else 1):  # the checks (a shape that passed runs alone)
                            self._verify(rows, ids, [self._idle_start] * n, width)
                    if self.exact and not self._other_shapes():
                        break  # a check failed: the full shape only, which the check built
        finally:
            self._idle_start = 0
        if self._all_slots is not None and callable(getattr(self._all_slots, "warmup", None)):
            self._all_slots.warmup(spans)  # the drafter's steps too (their first capture is no step's cost)
        return len(self._static) - before

    def start(self) -> None:
        """Run the loop on a background thread (idempotent)."""
        with self._cv:
            if self._stopped:
                raise EngineStoppedError("the engine was stopped; build a new EngineLoop")
            if self._thread is not None:
                return
            self._join_ranks(lead=True)
            self._thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)
            self._thread.start()

    def follow(self) -> None:
        """Ranks other than 0 of a tensor-parallel group: run the loop on this thread, applying
        rank 0's decisions, until rank 0 stops (returns) or a forward fails (raises)."""
        self._join_ranks(lead=False)
        with torch.inference_mode():
            while not (plan := self._sync.share()).stop:
                self._boundary(plan)
                if any(self._slots):
                    self._step(plan.k)

    def _join_ranks(self, lead: bool) -> None:
        """Open the channel rank 0 decides through (every rank at the same point: start or follow)."""
        rank = 0 if self._shard is None else self._shard.rank
        if (rank == 0) != lead:
            raise RuntimeError(f"rank {rank}: " + ("ranks other than 0 follow(): rank 0 starts the loop" if lead
                                                   else "rank 0 start()s the loop; follow() is for the other ranks"))
        if self._shard is not None and self._shard.world > 1:
            self._sync = BoundaryChannel(self._shard)

    def wait(self) -> None:
        """Block until the loop's thread ends: after :meth:`stop`, or under tensor parallelism
        when it failed (then :attr:`error` says why and every request got an ``error`` event)."""
        thread = self._thread
        if thread is not None:
            thread.join()

    def stop(self) -> None:
        """Stop after the current step; every queued or running request gets an ``error`` event."""
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        if thread is None:
            self._drain("the engine was stopped")

    def submit(self, req: GenRequest, on_event: Callable[[Event], None] | None = None) -> RequestHandle:
        """Queue ``req``; events arrive through the returned handle (and ``on_event``, called on
        the engine thread). Raises :class:`RequestError` for a request that cannot be served and
        :class:`QueueFullError` when ``max_queue`` requests already wait."""
        return self._enqueue(req, on_event, bounded=True)

    def _enqueue(self, req: GenRequest, on_event, bounded: bool) -> RequestHandle:
        self._check(req)
        handle = RequestHandle(f"req-{next(self._ids)}", on_event)
        with self._cv:
            if self._stopped:
                raise EngineStoppedError("the engine was stopped; no new requests are taken")
            if bounded and len(self._queue) >= self.max_queue:
                raise QueueFullError(f"{len(self._queue)} requests are waiting (max_queue={self.max_queue}); "
                                     "retry later")
            self._queue.append((req, handle, time.perf_counter()))
            self._n["requests_total"] += 1
            self._cv.notify()
        return handle

    def run(self, reqs: list[GenRequest], on_done: Callable[[int, list[int]], None] | None = None) -> list[list[int]]:
        """Serve ``reqs`` to the end on the calling thread (no server thread) and return each one's
        committed token ids, in order: batch jobs such as self-distillation run the very loop that
        serves. Requests join as slots free up, in groups of at least an eighth of the slots (their
        prompts prefilled together unless ``exact``), so the batch stays full. ``on_done(i, ids)`` as each finishes.
        A request that fails raises :class:`RequestError` naming it (after the others finish)."""
        if self._thread is not None:
            raise RuntimeError("EngineLoop.run() while the engine thread serves: use submit()")
        for r in reqs:
            self._check(r)
        out: list[list[int] | None] = [None] * len(reqs)
        failed: list[tuple[int, str]] = []

        def listener(i: int):
            got: list[int] = []

            def on_event(ev: Event) -> None:
                if ev.kind == "tokens":
                    got.extend(ev.token_ids)
                elif ev.kind == "done":
                    out[i] = got
                    if on_done is not None:
                        on_done(i, got)
                else:
                    failed.append((i, ev.message or "failed"))
            return on_event

        todo = list(range(len(reqs)))[::-1]
        group = max(1, self.max_slots // 8)
        with torch.inference_mode():
            while todo or self._queue or any(s is not None for s in self._slots):
                busy = sum(s is not None for s in self._slots) + len(self._queue)
                free = self.max_slots - busy
                if todo and (busy == 0 or free >= min(group, len(todo))):
                    for _ in range(min(free, len(todo))):
                        i = todo.pop()
                        self._enqueue(reqs[i], listener(i), bounded=False)
                plan = self._boundary()
                if any(s is not None for s in self._slots):
                    self._step(plan.k)
                if not any(s is not None and s.out for s in self._slots):
                    self._deliver()  # no step follows to send them in
            self._deliver()
        if failed:
            i, msg = failed[0]
            raise RequestError(f"request {i} failed: {msg}" + (f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""))
        return out  # type: ignore[return-value]

    def _check(self, req: GenRequest) -> None:
        if not isinstance(req.params, SamplingParams):
            raise RequestError(f"params must be a SamplingParams, got {type(req.params).__name__}")
        n, vocab = len(req.prompt_ids), self.model.config.vocab_size
        if n == 0:
            raise RequestError("the prompt is empty")
        if any(type(t) is not int or not 0 <= t < vocab for t in req.prompt_ids):
            raise RequestError(f"prompt token ids must be integers in 0..{vocab - 1}")
        if type(req.max_new_tokens) is not int or req.max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be an integer >= 1, got {req.max_new_tokens!r}")
        if n >= self.context:
            raise ContextOverflowError(f"the prompt ({n} tokens) does not fit the context of {self.context} tokens")
        if n + req.max_new_tokens > self.context:
            raise ContextOverflowError(f"prompt ({n} tokens) + max_new_tokens ({req.max_new_tokens}) = "
                                       f"{n + req.max_new_tokens} exceeds the context of {self.context} tokens")

    def metrics(self) -> dict:
        """Counters and gauges for ``/metrics`` (a consistent snapshot)."""
        with self._cv:
            m = dict(self._n)
            m.update(queue_depth=len(self._queue), slots_in_use=sum(s is not None for s in self._slots),
                     max_slots=self.max_slots, max_queue=self.max_queue, context=self.context, draft=self.draft_name,
                     max_draft_tokens=self.kmax, controller=self.controller is not None, exact=self.exact,
                     running=self._thread is not None and not self._stopped,
                     step_seconds=list(self._step_s), k_chosen=dict(self._k_hist),
                     k_seconds={k: round(v, 6) for k, v in self._k_seconds.items()},
                     checked_steps=sorted(self._checked) if self._shapes_exact else None,
                     invariant_linears=len(self.invariant_linears))
        m["acceptance_rate"] = m["accepted_total"] / m["drafted_total"] if m["drafted_total"] else 0.0
        return m

    # --- the engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        # idle under tensor parallelism: an empty boundary every heartbeat_s keeps the followers'
        # wait in the broadcast from timing out (and costs one small broadcast, no spinning)
        idle_s = None if self._sync is None else self.heartbeat_s
        with torch.inference_mode():
            while True:
                with self._cv:
                    while not self._stopped and not self._queue and not any(self._slots):
                        if not self._cv.wait(idle_s):
                            break  # a heartbeat
                    if self._stopped:
                        break
                try:
                    plan = self._boundary()
                    if any(self._slots):
                        self._step(plan.k)
                except Exception as e:  # noqa: BLE001 - a bug in the loop: fail what it held, keep serving
                    if self._sync is not None:  # the ranks may no longer agree: the loop ends on every rank
                        self.error = e
                        break
                    for s in range(self.max_slots):
                        if self._slots[s] is not None:
                            self._fail(s, e)
                if not any(s is not None and s.out for s in self._slots):
                    self._deliver()  # no step follows to send them in
            if self._sync is not None and self.error is None:
                try:
                    self._sync.share(Boundary(stop=True))  # the followers return from follow()
                except Exception as e:  # noqa: BLE001 - a follower is gone: the launcher ends the ranks
                    self.error = e
        if self.error is not None:
            with self._cv:
                self._stopped = True
        self._drain("the engine was stopped" if self.error is None
                    else f"the tensor-parallel engine failed: {describe(self.error)}")

    def _drain(self, why: str) -> None:
        self._deliver()
        with self._cv:
            waiting = list(self._queue)
            self._queue.clear()
        for _, handle, _ in waiting:
            handle._send(Event("error", message=why))
        for s in range(self.max_slots):
            if self._slots[s] is not None:
                self._fail(s, why)
        self._deliver()

    def _boundary(self, plan: Boundary | None = None) -> Boundary:
        """Cancellations, then waiting requests join the free slots, then one prefill chunk;
        returns what was decided (``k`` for the coming step). Under tensor parallelism rank 0
        shares its decision with the followers here, which pass it as ``plan``."""
        if plan is None:
            plan = self._decide()
            if self._sync is not None:
                self._sync.share(plan)
        else:  # a follower: rank 0 decided
            for s in plan.cancel:
                self._finish(s, "cancelled")
            now = time.perf_counter()
            self._admit(plan.join, [(_Mirror(), now) for _ in plan.join])
        self._prefill()
        return plan

    def _decide(self) -> Boundary:
        """Cancellations free their slots and waiting requests take them (the queue and the
        handles are read here only); then the coming step's ``k``."""
        cancel = tuple(s for s, slot in enumerate(self._slots) if slot is not None and slot.handle.cancelled)
        for s in cancel:
            self._finish(s, "cancelled")
        with self._cv:
            dropped = [p for p in self._queue if p[1].cancelled]
            if dropped:
                self._queue = collections.deque(p for p in self._queue if not p[1].cancelled)
            free = [s for s in range(self.max_slots) if self._slots[s] is None]
            joining = [self._queue.popleft() for _ in range(min(len(free), len(self._queue)))]
            self._n["requests_cancelled"] += len(dropped)
        for req, handle, _ in dropped:
            handle._send(Event("done", finish_reason="cancelled",
                               stats={"prompt_tokens": len(req.prompt_ids), "completion_tokens": 0}))
        # an unseeded sampled request gets its seed here, so that every rank samples alike
        join = tuple((s, req, req.params.seed if req.params.seed is not None or req.params.greedy
                      else int(torch.randint(0, 2**62, (1,)))) for (req, _, _), s in zip(joining, free))
        self._admit(join, [(handle, t_sub) for _, handle, t_sub in joining])
        return Boundary(cancel, join, self._choose_k())

    def _admit(self, join, clients: list[tuple[RequestHandle, float]]) -> None:
        """``join``: (slot, request, seed) each; ``clients``: each one's handle and submit time."""
        now = time.perf_counter()
        for (s, req, seed), (handle, t_sub) in zip(join, clients):
            a = self._acceptance[0] / self._acceptance[1]  # the loop's estimate so far: the new slot's prior
            self._slots[s] = Slot(req, handle, None, None, 0, prompt=torch.tensor(req.prompt_ids, dtype=torch.int64),
                                  hits=2.0 * a, tries=2.0,
                                  stop=frozenset(int(t) for t in req.stop_ids), t_submit=t_sub, queued_s=now - t_sub,
                                  seed=seed)
            self._count("prompt_tokens_total", len(req.prompt_ids))

    def _choose_k(self) -> int:
        """Drafts for the coming step: the controller's choice for the slots that will step (the
        running ones and the prompts whose last chunk this boundary prefills)."""
        if self.controller is None:
            return self.kmax
        stepping = [sl for sl in self._slots if sl is not None and (
            sl.out or sl.prompt.numel() - sl.length <= self.prefill_chunk)]
        return self.controller.choose([sl.alpha for sl in stepping],
                                      [sl.req.max_new_tokens - max(1, len(sl.out)) for sl in stepping])

    def _count(self, key: str, n: int = 1) -> None:
        with self._cv:
            self._n[key] += n
