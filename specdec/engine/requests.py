"""What a client hands the serving loop and what it gets back: a request, its events, its handle;
and the loop's own record of a request while it holds a slot (:class:`Slot`).

The engine thread produces events; any other thread consumes them through
:meth:`RequestHandle.events` (a thread-safe queue) and/or an ``on_event`` callback that runs on
the engine thread. Every request ends with exactly one ``done`` or ``error`` event.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from ..sampling import SamplingParams


@dataclass
class GenRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    params: SamplingParams  # temperature, top_p, top_k, seed (None: nondeterministic)
    stop_ids: Sequence[int] = ()  # token ids that end the reply (emitted; the caller keeps them out of the text)


@dataclass
class Event:
    kind: str  # "tokens" | "done" | "error"
    token_ids: Sequence[int] = ()  # "tokens": the newly committed ids, in order
    finish_reason: str | None = None  # "done": "stop" | "length" | "cancelled"
    stats: dict | None = None  # "done": prompt_tokens, completion_tokens, steps, tau, ...
    message: str | None = None  # "error"


class RequestHandle:
    """The client's side of one submitted request."""

    def __init__(self, id: str, on_event: Callable[[Event], None] | None = None):
        self.id = id
        self._events: queue.Queue[Event] = queue.Queue()
        self._on_event = on_event
        self._cancelled = threading.Event()
        self.finished = False  # set (on the engine thread) when the done/error event is sent

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        """Events in order as they come, blocking; ends after the ``done`` or ``error`` event.
        ``timeout``: seconds to wait for each event; raises :class:`TimeoutError` past it."""
        while True:
            try:
                ev = self._events.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"request {self.id}: no event within {timeout} s") from None
            yield ev
            if ev.kind in ("done", "error"):
                return

    def cancel(self) -> None:
        """Ask the engine to drop the request; at its next step boundary the slot is freed and a
        ``done`` event with ``finish_reason="cancelled"`` follows (unless it finished first)."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def _send(self, ev: Event) -> None:
        """Engine thread: queue ``ev`` and call the callback. A callback that raises means the
        client is gone: the request is cancelled at the next boundary (the engine keeps going)."""
        if ev.kind in ("done", "error"):
            self.finished = True
        self._events.put(ev)
        if self._on_event is not None:
            try:
                self._on_event(ev)
            except Exception:  # noqa: BLE001 - a client callback must not take the engine down
                self._cancelled.set()


def ema_acceptance(hits: float, tries: float, n: int, asked: int, ema: float) -> tuple[float, float]:
    """``(hits, tries)`` moved by ``ema`` towards a step that asked for ``asked`` drafts and accepted
    ``n``: ``n`` of the ``n + 1`` tried (``n`` of ``n`` when all were accepted); unchanged when it
    asked for none. ``hits / tries`` is the per-draft acceptance (see :meth:`Slot.record_drafts`)."""
    if not asked:
        return hits, tries
    return (1 - ema) * hits + ema * n, (1 - ema) * tries + ema * (n + (n < asked))


@dataclass
class Slot:
    """A request while it holds a slot of the serving loop (engine thread only)."""

    req: GenRequest
    handle: RequestHandle
    drafter: object | None
    gen: torch.Generator | None
    length: int  # positions in the target cache: prompt positions prefilled so far, then committed ones
    prompt: torch.Tensor | None = None
    last: int = -1  # the last committed token (not yet in the cache)
    out: list[int] = field(default_factory=list)
    stop: frozenset = frozenset()
    rows_h: list = field(default_factory=list)  # prompt rows for the drafter's begin (while prefilling)
    rows_c: list = field(default_factory=list)
    # per-draft acceptance: EMAs of accepted drafts and of drafts tried (the drafts up to and with
    # the first rejected one: those after it were never tested); the prior 1 of 2 before any step
    hits: float = 1.0
    tries: float = 2.0
    accepted: list[int] = field(default_factory=list)  # accepted drafts per step
    drafted: int = 0
    t_submit: float = 0.0  # perf_counter() at submit
    queued_s: float = 0.0  # submit -> slot taken
    ttft_s: float = 0.0  # submit -> first token (queue + prefill)
    seed: int | None = None  # the sampling generator's seed (drawn at admission when the request has none)

    @property
    def alpha(self) -> float:
        """The chance that a draft is accepted given that the ones before it were (the controller's
        model: a step with ``k`` drafts then commits ``1 + a + ... + a^k`` tokens on average)."""
        return self.hits / self.tries

    def record_drafts(self, n: int, asked: int, ema: float) -> None:
        """A step that asked the drafter for ``asked`` drafts accepted ``n``: ``n`` of the ``n + 1``
        tried (``n`` of ``n`` when all ``asked`` were accepted). A draft the drafter did not offer
        (an n-gram without a match) counts as rejected: the controller's model then predicts the
        tokens a step really commits. The estimate moves by ``ema`` towards it."""
        self.hits, self.tries = ema_acceptance(self.hits, self.tries, n, asked, ema)

    def relax(self, hits: float, tries: float, weight: float) -> None:
        """A step that asked for no drafts (the controller chose ``k = 0``) measured nothing, so the
        estimate moves by ``weight`` towards the loop's (``hits / tries``, all slots' recent drafts).
        Without it a slot whose estimate a few unlucky steps had lowered kept the controller at
        ``k = 0`` until it re-explored: on the H200 (ce828ae) 21-39 of ~90 steps of SmolLM2's DFlash
        drafter at 1 and 4 clients, where a drafting step committed ~2.7 tokens a slot."""
        self.hits = (1 - weight) * self.hits + weight * hits
        self.tries = (1 - weight) * self.tries + weight * tries

    def stats(self) -> dict:
        """The ``stats`` of the request's ``done`` event."""
        steps, acc = len(self.accepted), sum(self.accepted)
        return {"prompt_tokens": len(self.req.prompt_ids), "completion_tokens": len(self.out), "steps": steps,
                "drafted": self.drafted, "accepted": acc, "accepted_per_step": list(self.accepted),
                "tau": round((acc + steps) / steps, 4) if steps else 0.0,
                "acceptance_rate": round(acc / self.drafted, 4) if self.drafted else 0.0,
                "queued_s": round(self.queued_s, 6), "ttft_s": round(self.ttft_s, 6),
                "total_s": round(time.perf_counter() - self.t_submit, 6)}
