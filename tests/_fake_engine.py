"""A stand-in for the serving engine (``specdec.engine.serve_loop.EngineLoop``'s interface): it
"generates" a scripted reply, a few tokens per event, from a thread of its own, so the server's
HTTP behaviour is tested without a model."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

from specdec.errors import EngineStoppedError, QueueFullError, RequestError


@dataclass
class Event:
    kind: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: dict | None = None
    message: str | None = None


class FakeHandle:
    def __init__(self, rid: str, req):
        self.id, self.req = rid, req
        self.cancelled = threading.Event()
        self.finished = threading.Event()
        self._q: queue.Queue = queue.Queue()

    def events(self, timeout=None):
        while True:
            ev = self._q.get(timeout=timeout)
            yield ev
            if ev.kind != "tokens":
                return

    def cancel(self) -> None:
        self.cancelled.set()


class FakeEngine:
    """Replies with ``reply`` (token ids) ``chunk`` tokens per event, ``delay`` seconds apart,
    then EOS (``eos``) when the reply is whole; honours ``max_new_tokens`` and cancellation.
    ``full``: submit raises QueueFullError; ``fail_after``: an "error" event after that many events.
    ``max_context``: submit refuses a request beyond it with RequestError."""

    def __init__(self, reply: list[int], eos: int, chunk: int = 2, delay: float = 0.0, max_context: int = 256):
        self.reply, self.eos, self.chunk, self.delay = list(reply), eos, chunk, delay
        self.max_context = max_context
        self.full = False
        self.fail_after: int | None = None
        self.handles: list[FakeHandle] = []
        self.running = False
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        self.running = True

    def stop(self) -> None:
        self.running = False
        for h in self.handles:
            h.cancel()
        for t in self._threads:
            t.join(timeout=5)

    def submit(self, req, on_event=None) -> FakeHandle:
        if not self.running:
            raise EngineStoppedError("the engine was stopped; no new requests are taken")
        if self.full:
            raise QueueFullError("2 requests are queued, the limit is 2")
        if len(req.prompt_ids) + req.max_new_tokens > self.max_context:
            raise RequestError(f"prompt plus max_new_tokens exceed the context of {self.max_context}")
        h = FakeHandle(f"req-{len(self.handles)}", req)
        self.handles.append(h)
        t = threading.Thread(target=self._run, args=(h, on_event), daemon=True)
        self._threads.append(t)
        t.start()
        return h

    def _run(self, h: FakeHandle, on_event) -> None:
        def emit(ev):
            h._q.put(ev)
            if on_event is not None:
                on_event(ev)

        out = self.reply + [self.eos]
        n, events = 0, 0
        while True:
            if h.cancelled.is_set():
                emit(Event("done", finish_reason="cancelled", stats=self._stats(h, n)))
                break
            if self.fail_after is not None and events >= self.fail_after:
                emit(Event("error", message="the fake engine failed"))
                break
            piece = out[n:n + min(self.chunk, h.req.max_new_tokens - n)]
            stop = next((i for i, t in enumerate(piece) if t in h.req.stop_ids), None)
            if stop is not None:
                piece = piece[:stop + 1]
            if not piece:  # the script ran out without an EOS among the stop ids
                emit(Event("done", finish_reason="length", stats=self._stats(h, n)))
                break
            n += len(piece)
            emit(Event("tokens", token_ids=piece))
            events += 1
            if stop is not None or n >= h.req.max_new_tokens:
                emit(Event("done", finish_reason="stop" if stop is not None else "length", stats=self._stats(h, n)))
                break
            time.sleep(self.delay)
        h.finished.set()

    @staticmethod
    def _stats(h: FakeHandle, n: int) -> dict:
        return {"prompt_tokens": len(h.req.prompt_ids), "completion_tokens": n, "steps": n, "tau": 1.0}

    def metrics(self) -> dict:
        busy = sum(1 for h in self.handles if not h.finished.is_set())
        return {"queue_depth": 0, "slots_in_use": busy, "max_slots": 4, "requests_total": len(self.handles),
                "tokens_total": 10, "steps_total": 4, "accepted_total": 6, "drafted_total": 8,
                "step_seconds": [0.01, 0.02, 0.03], "k_chosen": {0: 1, 4: 3}, "k_seconds": {0: 0.01, 4: 0.05},
                "context": self.max_context, "running": self.running}
