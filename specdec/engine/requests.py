"""What a client hands the serving loop and what it gets back: a request, its events, its handle.

The engine thread produces events; any other thread consumes them through
:meth:`RequestHandle.events` (a thread-safe queue) and/or an ``on_event`` callback that runs on
the engine thread. Every request ends with exactly one ``done`` or ``error`` event.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

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
