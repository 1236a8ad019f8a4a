"""The HTTP app: OpenAI's completions and chat completions over a running serving engine.

A request's life: check the key, read a bounded body, parse it (``protocol``), tokenise off the
event loop, submit a ``GenRequest`` to the engine, then turn the engine's events into one JSON
reply or a stream of server-sent events. The engine calls ``on_event`` from its own thread; the
events cross into asyncio through ``loop.call_soon_threadsafe``, so the event loop never blocks
on the engine: one wake-up carries every event that arrived before the loop ran it (the engine
sends a step's events together), not one per event. A request that ends early (a stop string, a
client that went away) cancels its engine handle, which frees its slot.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import weakref

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import CheckpointError, EngineStoppedError, QueueFullError, RequestError
from ..detok import TextStream
from .metrics import CONTENT_TYPE, CountRequests, ServerMetrics
from .protocol import APIError, Parsed, bad, chunk_body, error_body, new_id, now, parse_chat, parse_completion, \
    response_body, usage

from ..engine.requests import GenRequest

DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_TOKENS_LIMIT = 4096
DISCONNECT_POLL_S = 0.5  # how often a non-streamed request checks that its client is still there


def create_app(engine, tokenizer, model_name: str, *, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT,
               context_length: int | None = None) -> FastAPI:
    """An OpenAI-compatible app serving ``engine`` (an ``EngineLoop``, already started or started later).

    ``tokenizer``: the target's :class:`~specdec.tokenizer.Tokenizer` (None: token-id prompts
    only). ``model_name``: the one id ``/v1/models`` lists and requests may name. ``api_key``:
    when set, every ``/v1`` request needs ``Authorization: Bearer KEY``. ``max_body_bytes``
    bounds a request body (413 beyond); ``max_tokens_limit`` bounds ``max_tokens`` and is the
    default when a request gives none; ``context_length`` (default: the ``context`` that
    ``engine.metrics()`` reports) bounds prompt plus ``max_tokens``.
    """
    if context_length is None:
        context_length = engine.metrics().get("context")
    server = _Server(engine, tokenizer, model_name, api_key, max_body_bytes, max_tokens_limit, context_length)
    app = FastAPI(title="specdec", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.add_middleware(CountRequests, metrics=server.metrics)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):  # unknown path, wrong method
        return JSONResponse(error_body(f"{e.detail}: {request.method} {request.url.path}"), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):  # a bug: answer it, keep serving
        return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}", "server_error"), status_code=500)

    @app.post("/v1/completions")
    async def completions(request: Request):
        server.check_key(request)
        return await server.generate(request, parse_completion(await server.read_json(request), model_name))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        server.check_key(request)
        return await server.generate(request, parse_chat(await server.read_json(request), model_name))

    @app.get("/v1/models")
    async def models(request: Request):
        server.check_key(request)
        return {"object": "list", "data": [server.model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: Request):
        server.check_key(request)
        if name != model_name:
            raise APIError(404, f"the model '{name}' does not exist", "model", "model_not_found")
        return server.model_card()

    @app.get("/health")
    async def health():
        try:
            running = engine.metrics().get("running", True)
        except Exception as e:  # an engine that cannot answer is not healthy; say why
            return JSONResponse({"status": "error", "message": f"{type(e).__name__}: {e}"}, status_code=503)
        if not running:
            return JSONResponse({"status": "stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    return app


class _Inbox:
    """Events from the engine thread for every request of one event loop, handed over in batches:
    the first event of a batch schedules one call on the loop, the ones that follow before it runs
    join it. (One ``call_soon_threadsafe`` per event woke the loop 32 times a step at 32 clients.)"""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = weakref.ref(loop)  # the server's table of inboxes must not keep a closed loop alive
        self.lock = threading.Lock()
        self.pending: list = []  # (asyncio queue, event)
        self.scheduled = False

    def put(self, queue: asyncio.Queue, ev) -> None:  # called from the engine thread
        with self.lock:
            self.pending.append((queue, ev))
            if self.scheduled:
                return
            self.scheduled = True
        loop = self.loop()
        try:
            if loop is not None:
                loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop has closed (server shutting down): nobody is listening
            pass

    def _drain(self) -> None:  # on the event loop
        with self.lock:
            box, self.pending, self.scheduled = self.pending, [], False
        for queue, ev in box:
            queue.put_nowait(ev)


class _Events:
    """One request's engine events, delivered into an asyncio queue on the event loop."""

    def __init__(self, inbox: _Inbox):
        self.inbox = inbox
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, ev) -> None:  # called from the engine thread
        self.inbox.put(self.queue, ev)


class _Server:
    def __init__(self, engine, tokenizer, model_name, api_key, max_body_bytes, max_tokens_limit, context_length):
        self.engine, self.tok, self.model_name = engine, tokenizer, model_name
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes, self.max_tokens_limit, self.context = max_body_bytes, max_tokens_limit, context_length
        self.eos_ids = list(tokenizer.eos_ids) if tokenizer is not None else []
        self.metrics = ServerMetrics(engine)
        self.created = now()
        self._inboxes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its _Inbox

    def inbox(self) -> _Inbox:
        loop = asyncio.get_running_loop()
        box = self._inboxes.get(loop)
        if box is None:
            box = self._inboxes[loop] = _Inbox(loop)
        return box

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "specdec"}

    def check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, key = auth.partition(" ")
        if not auth:
            raise APIError(401, "no API key: send the header 'Authorization: Bearer KEY'", code="invalid_api_key")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.api_key):
            raise APIError(401, "incorrect API key provided", code="invalid_api_key")

    async def read_json(self, request: Request):
        """The body as JSON, read at most ``max_body_bytes`` (a lying Content-Length cannot get more)."""
        limit = self.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"the request body is {declared} bytes; the limit is {limit}", code="body_too_large")
        data, n = [], 0
        async for piece in request.stream():
            n += len(piece)
            if n > limit:
                raise APIError(413, f"the request body exceeds the limit of {limit} bytes", code="body_too_large")
            data.append(piece)
        try:
            return json.loads(b"".join(data))
        except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise bad(f"the request body is not valid JSON ({str(e)[:200]})", code="invalid_json") from None

    def encode(self, p: Parsed) -> list[int]:
        """Prompt token ids (runs in a worker thread: a long prompt must not stall the event loop)."""
        if isinstance(p.prompt, list) and not p.chat:
            vocab = self.tok.vocab_size if self.tok is not None else None
            bad_id = next((t for t in p.prompt if t < 0 or (vocab is not None and t >= vocab)), None)
            if bad_id is not None:
                raise bad(f"token id {bad_id} is outside the vocabulary (0..{vocab - 1 if vocab else '?'})", "prompt")
            return list(p.prompt)
        param = "messages" if p.chat else "prompt"
        if self.tok is None:
            raise bad("this model has no tokenizer: send the prompt as token ids", param)
        try:
            if p.chat:
                return self.tok.encode(self.tok.apply_chat_template(p.prompt), add_special=False)
            return self.tok.encode(p.prompt)
        except (RequestError, CheckpointError) as e:  # no chat template, or one that refuses the messages
            raise bad(str(e), param) from None

    def budget(self, p: Parsed, n_prompt: int) -> int:
        """``max_tokens`` checked against the server's limit and the context (default: what fits)."""
        param = "messages" if p.chat else "prompt"
        if n_prompt == 0:
            raise bad("the prompt encodes to no tokens", param)
        if self.context is not None and n_prompt >= self.context:
            raise bad(f"the prompt has {n_prompt} tokens; the model's context is {self.context} tokens "
                      "(and at least one must be left to generate)", param, "context_length_exceeded")
        if p.max_tokens is None:
            room = self.context - n_prompt if self.context is not None else self.max_tokens_limit
            return min(self.max_tokens_limit, room)
        name = "max_completion_tokens" if p.chat else "max_tokens"
        if p.max_tokens > self.max_tokens_limit:
            raise bad(f"max_tokens is {p.max_tokens}; this server allows at most {self.max_tokens_limit}", name)
        if self.context is not None and n_prompt + p.max_tokens > self.context:
            raise bad(f"the model's context is {self.context} tokens, but {n_prompt + p.max_tokens} were requested "
                      f"({n_prompt} in the prompt, {p.max_tokens} to generate)", name, "context_length_exceeded")
        return p.max_tokens

    async def generate(self, request: Request, p: Parsed):
        if p.stop and self.tok is None:
            raise bad("stop strings need a tokenizer to decode with; this model has none", "stop")
        ids = await asyncio.to_thread(self.encode, p)
        req = GenRequest(prompt_ids=ids, max_new_tokens=self.budget(p, len(ids)), params=p.params,
                         stop_ids=list(self.eos_ids))
        events = _Events(self.inbox())
        try:
            handle = self.engine.submit(req, on_event=events.put)
        except QueueFullError as e:
            raise APIError(429, f"the server is busy ({e}); retry later", code="queue_full",
                           kind="rate_limit_error") from None
        except RequestError as e:
            raise bad(str(e), "messages" if p.chat else "prompt") from None
        except EngineStoppedError as e:
            raise APIError(503, str(e), code="engine_stopped", kind="server_error") from None
        rid, created = new_id(p.chat), now()
        if p.stream:
            return StreamingResponse(self._sse(p, len(ids), handle, events, rid, created),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        text, reason, n_out = [], None, 0
        async for kind, value, n_out in self._run(p, handle, events, request):
            if kind == "text":
                text.append(value)
            elif kind == "end":
                reason = value
            elif kind == "error":
                return JSONResponse(error_body(value, "server_error"), status_code=500)
            else:  # the client went away: nobody reads this answer
                return Response(status_code=499)
        self.metrics.count_tokens(len(ids), n_out)
        return response_body(p.chat, rid, created, self.model_name, "".join(text), reason, usage(len(ids), n_out))

    async def _sse(self, p: Parsed, n_prompt: int, handle, events: _Events, rid: str, created: int):
        def sse(obj) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        def chunk(**kw) -> str:
            return sse(chunk_body(p.chat, rid, created, self.model_name, include_usage=p.include_usage, **kw))

        if p.chat:
            yield chunk(role=True)
        async for kind, value, n_out in self._run(p, handle, events):
            if kind == "text":
                yield chunk(text=value)
            elif kind == "end":
                self.metrics.count_tokens(n_prompt, n_out)
                yield chunk(finish_reason=value)
                if p.include_usage:
                    yield chunk(use=usage(n_prompt, n_out))
            else:  # the status line has gone out: the error travels as an event of its own
                yield sse(error_body(value, "server_error"))
        yield "data: [DONE]\n\n"

    async def _run(self, p: Parsed, handle, events: _Events, request: Request | None = None):
        """The engine's events as ``(kind, value, completion_tokens)``: ``("text", delta)`` pieces,
        then one ``("end", finish_reason)`` or ``("error", message)`` (or ``("gone", None)`` when
        ``request`` is given and its client disconnected). Whoever stops reading early (a stop
        string here; a disconnect, which cancels the consuming task) cancels the engine request."""
        text = TextStream(self.tok, p.stop, self.eos_ids) if self.tok is not None else None
        n_out, over = 0, False
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(events.queue.get(), DISCONNECT_POLL_S if request else None)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        yield "gone", None, n_out
                        return
                    continue
                if ev.kind == "tokens":
                    n_out += len(ev.token_ids)
                    piece = text.push(ev.token_ids) if text is not None else ""
                    if piece:
                        yield "text", piece, n_out
                    if text is not None and text.stopped:
                        handle.cancel()  # the reply ends at the stop string: free the slot now
                        over = True
                        yield "end", "stop", n_out
                        return
                elif ev.kind == "done":
                    over = True
                    if ev.finish_reason not in ("stop", "length"):
                        yield "error", f"the engine ended the request early ({ev.finish_reason})", n_out
                        return
                    piece = text.flush() if text is not None else ""
                    if piece:
                        yield "text", piece, n_out
                    yield "end", ev.finish_reason, n_out
                    return
                else:
                    over = True
                    yield "error", ev.message or "the engine failed on this request", n_out
                    return
        finally:
            if not over:  # disconnected, or the consumer stopped reading
                handle.cancel()
