"""``specdec serve``'s HTTP side against a fake engine: the OpenAI wire format (replies, SSE chunks,
usage), stop strings, every bad input's 4xx and error body, keys, limits, metrics; then a live
uvicorn on 127.0.0.1 queried with the official ``openai`` client."""

from __future__ import annotations

import json
import threading
import time

import pytest
from fastapi.testclient import TestClient  # the serve extra is part of the test extra: never skipped

from _dense_util import EOS, VOCAB, _bytes_to_unicode  # noqa: E402
from _fake_engine import FakeEngine  # noqa: E402
from specdec.server import create_app  # noqa: E402
from specdec.tokenizer import Tokenizer  # noqa: E402

MODEL = "tiny-model"
REPLY = "Hello world! Bye."
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def byte_tokenizer(template: str | None = TEMPLATE) -> Tokenizer:
    """A byte-level BPE vocabulary without merges: one token per byte, EOS = 256."""
    tokens = _bytes_to_unicode() + ["<|endoftext|>"] + [f"<|pad{i}|>" for i in range(VOCAB - 257)]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1] * 256 + [3] + [5] * (VOCAB - 257), "tokenizer.ggml.merges": [],
            "tokenizer.ggml.eos_token_id": EOS, "tokenizer.ggml.add_bos_token": False}
    if template:
        meta["tokenizer.chat_template"] = template
    return Tokenizer.from_gguf(meta, "byte-vocab")


TOK = byte_tokenizer()


def make(reply: str = REPLY, chunk: int = 2, delay: float = 0.0, **kw):
    engine = FakeEngine(TOK.encode(reply), EOS, chunk=chunk, delay=delay, max_context=256)
    engine.start()
    kw.setdefault("max_tokens_limit", 128)
    return engine, TestClient(create_app(engine, TOK, MODEL, **kw))


@pytest.fixture
def served():
    engine, client = make()
    yield engine, client
    engine.stop()


def sse_events(raw: str) -> list:
    """The ``data:`` payloads of an SSE body, checking its framing on the way."""
    assert raw.endswith("data: [DONE]\n\n"), raw[-80:]
    blocks = raw.split("\n\n")
    assert blocks[-1] == ""
    out = []
    for b in blocks[:-1]:
        assert b.startswith("data: "), b
        out.append(b[len("data: "):] if b == "data: [DONE]" else json.loads(b[len("data: "):]))
    assert out[-1] == "[DONE]" and "[DONE]" not in out[:-1]
    return out[:-1]


# --- replies ----------------------------------------------------------------------------------

def test_completion_reply_and_usage(served):
    engine, client = served
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi there", "max_tokens": 64})
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["id"].startswith("cmpl-") and d["object"] == "text_completion" and d["model"] == MODEL
    assert isinstance(d["created"], int)
    assert d["choices"] == [{"index": 0, "text": REPLY, "logprobs": None, "finish_reason": "stop"}]
    n_prompt, n_out = len("Hi there"), len(REPLY) + 1  # one token per byte, EOS counted
    assert d["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}
    req = engine.handles[0].req
    assert req.prompt_ids == TOK.encode("Hi there") and req.max_new_tokens == 64 and EOS in req.stop_ids
    assert req.params.temperature == 1.0


def test_length_and_token_id_prompt(served):
    engine, client = served
    r = client.post("/v1/completions", json={"prompt": [72, 105], "max_tokens": 5, "temperature": 0, "seed": 7})
    d = r.json()
    assert d["choices"][0]["text"] == REPLY[:5] and d["choices"][0]["finish_reason"] == "length"
    assert d["usage"]["completion_tokens"] == 5 and d["usage"]["prompt_tokens"] == 2
    assert engine.handles[0].req.params.seed == 7 and engine.handles[0].req.params.greedy
    # no max_tokens: what the context leaves, capped by the server's limit
    client.post("/v1/completions", json={"prompt": [[72, 105]]})
    assert engine.handles[1].req.max_new_tokens == 128


def test_chat_reply_uses_template(served):
    engine, client = served
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_completion_tokens": 50,
                                                  "top_k": 5, "top_p": 0.9})
    d = r.json()
    assert r.status_code == 200, d
    assert d["id"].startswith("chatcmpl-") and d["object"] == "chat.completion"
    assert d["choices"][0]["message"] == {"role": "assistant", "content": REPLY}
    expected = TOK.encode("<|system|>Be brief.\n<|user|>Hi\n<|assistant|>", add_special=False)
    req = engine.handles[0].req
    assert req.prompt_ids == expected and req.max_new_tokens == 50
    assert (req.params.top_k, req.params.top_p) == (5, 0.9)
    assert d["usage"]["prompt_tokens"] == len(expected)


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_stop_string_cuts_and_cancels(chunk):
    engine, client = make(chunk=chunk)
    r = client.post("/v1/completions", json={"prompt": "x", "stop": ["zzz", "world"], "max_tokens": 64})
    d = r.json()["choices"][0]
    assert d["text"] == "Hello " and d["finish_reason"] == "stop"
    assert engine.handles[0].cancelled.wait(5)
    # streamed: no piece of the stop string is ever sent, even when it spans events
    with client.stream("POST", "/v1/completions", json={"prompt": "x", "stop": "d! B", "stream": True}) as r:
        events = sse_events(r.read().decode())
    texts = [e["choices"][0]["text"] for e in events]
    assert "".join(texts) == "Hello worl" and events[-1]["choices"][0]["finish_reason"] == "stop"
    engine.stop()


def test_held_back_text_is_sent_when_no_stop_follows():
    engine, client = make(reply="abcab", chunk=1)
    with client.stream("POST", "/v1/completions", json={"prompt": "x", "stop": "abd", "stream": True}) as r:
        events = sse_events(r.read().decode())
    texts = [e["choices"][0]["text"] for e in events]
    # "a", "ab" held until "c" rules the stop string out; the last "ab" is held until the reply ends
    assert texts == ["abc", "ab", ""] and events[-1]["choices"][0]["finish_reason"] == "stop"
    engine.stop()


def test_multibyte_characters_are_never_split():
    engine, client = make(reply="héllo wörld ✓", chunk=1)  # one byte per event
    with client.stream("POST", "/v1/completions", json={"prompt": "x", "stream": True, "stop": "ö"}) as r:
        texts = [e["choices"][0]["text"] for e in sse_events(r.read().decode())]
    assert "".join(texts) == "héllo w" and not any("\ufffd" in t for t in texts)
    r = client.post("/v1/completions", json={"prompt": "x"})
    assert r.json()["choices"][0]["text"] == "héllo wörld ✓"
    engine.stop()


def test_sse_format_completion_and_chat(served):
    engine, client = served
    with client.stream("POST", "/v1/completions", json={"prompt": "Hi", "stream": True, "max_tokens": 64}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.read().decode())
    assert all(e["object"] == "text_completion" and e["id"] == events[0]["id"] for e in events)
    assert "usage" not in events[0]
    assert "".join(e["choices"][0]["text"] for e in events) == REPLY
    assert [e["choices"][0]["finish_reason"] for e in events].count("stop") == 1

    body = {"messages": [{"role": "user", "content": "Hi"}], "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        events = sse_events(r.read().decode())
    assert all(e["object"] == "chat.completion.chunk" and e["id"].startswith("chatcmpl-") for e in events)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == REPLY
    assert events[-2]["choices"][0]["finish_reason"] == "stop" and events[-2]["choices"][0]["delta"] == {}
    assert all(e["usage"] is None for e in events[:-1])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == len(REPLY) + 1


def test_engine_error_is_500_or_an_sse_error(served):
    engine, client = served
    engine.fail_after = 2
    r = client.post("/v1/completions", json={"prompt": "Hi"})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    with client.stream("POST", "/v1/completions", json={"prompt": "Hi", "stream": True}) as r:
        events = sse_events(r.read().decode())
    assert events[-1]["error"]["message"] == "the fake engine failed"
    engine.fail_after = None
    assert client.post("/v1/completions", json={"prompt": "Hi"}).status_code == 200  # still serving


# --- bad input --------------------------------------------------------------------------------

MSG = [{"role": "user", "content": "Hi"}]
BAD = [  # (path, body, status, param)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[" * 100000, 400, None),
    ("/v1/completions", [1, 2], 400, None),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, "a"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [VOCAB + 5]}, 400, "prompt"),
    ("/v1/completions", {"prompt": {"text": "a"}}, 400, "prompt"),
    ("/v1/completions", {"prompt": "a", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "a", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "a", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "a", "top_k": 1.5}, 400, "top_k"),
    ("/v1/completions", {"prompt": "a", "seed": -3}, 400, "seed"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": -5}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 129}, 400, "max_tokens"),  # beyond the server limit
    ("/v1/completions", {"prompt": "a" * 200, "max_tokens": 100}, 400, "max_tokens"),  # beyond the context
    ("/v1/completions", {"prompt": "a" * 300}, 400, "prompt"),  # the prompt alone is beyond the context
    ("/v1/completions", {"prompt": "a", "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": "a", "stop": ""}, 400, "stop"),
    ("/v1/completions", {"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/v1/completions", {"prompt": "a", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "a", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "a", "logprobs": 5}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "a", "frobnicate": 1}, 400, "frobnicate"),
    ("/v1/completions", {"prompt": "a", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "Hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": ["Hi"]}, 400, "messages[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "Hi"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {"messages": MSG, "max_completion_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": MSG, "temperature": 2.5}, 400, "temperature"),
]


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)])
def test_bad_input_gets_openai_error(served, path, body, status, param):
    engine, client = served
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = client.post(path, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert not engine.handles  # nothing reached the engine


def test_chat_without_template_is_400():
    engine = FakeEngine(TOK.encode(REPLY), EOS)
    client = TestClient(create_app(engine, byte_tokenizer(template=None), MODEL))
    r = client.post("/v1/chat/completions", json={"messages": MSG})
    assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]


def test_unknown_path_and_method(served):
    _, client = served
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    assert client.get("/v1/completions").status_code == 405


def test_api_key():
    engine, client = make(api_key="sekret")
    body = {"prompt": "Hi"}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic sekret"}):
        r = client.post("/v1/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert client.get("/v1/models", headers=headers).status_code == 401
    assert not engine.handles
    ok = {"Authorization": "Bearer sekret"}
    assert client.post("/v1/completions", json=body, headers=ok).status_code == 200
    assert client.get("/v1/models", headers=ok).json()["data"][0]["id"] == MODEL
    assert client.get("/health").status_code == 200  # probes need no key
    engine.stop()


def test_body_limit():
    engine, client = make(max_body_bytes=1000)
    r = client.post("/v1/completions", json={"prompt": "a" * 2000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

    def chunks():  # no Content-Length: the limit holds while reading
        for _ in range(10):
            yield b" " * 200

    r = client.post("/v1/completions", content=chunks())
    assert r.status_code == 413
    assert client.post("/v1/completions", json={"prompt": "a" * 200, "max_tokens": 8}).status_code == 200
    engine.stop()


def test_queue_full_is_429(served):
    engine, client = served
    engine.full = True
    r = client.post("/v1/completions", json={"prompt": "Hi"})
    assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"


def test_models_health_metrics(served):
    engine, client = served
    assert client.get("/v1/models").json()["data"] == [
        {"id": MODEL, "object": "model", "created": pytest.approx(time.time(), abs=60), "owned_by": "specdec"}]
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert client.get("/health").json() == {"status": "ok"}
    client.post("/v1/completions", json={"prompt": "Hi"})
    client.post("/v1/completions", json={"prompt": ""})
    text = client.get("/metrics").text
    assert 'specdec_http_requests_total{endpoint="/v1/completions",status="200"} 1.0' in text
    assert 'specdec_http_requests_total{endpoint="/v1/completions",status="400"} 1.0' in text
    assert f"specdec_completion_tokens_total {len(REPLY) + 1}.0" in text
    assert "specdec_tau 2.5" in text and "specdec_queue_depth 0.0" in text and "specdec_slots_in_use" in text
    assert 'specdec_recent_step_seconds{quantile="0.5"} 0.02' in text
    assert 'specdec_engine_steps_by_draft_tokens_total{k="4"} 3.0' in text
    assert 'specdec_engine_step_seconds_by_draft_tokens_total{k="0"} 0.01' in text
    engine.stop()
    assert client.get("/health").status_code == 503
    r = client.post("/v1/completions", json={"prompt": "Hi"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stopped"


# --- a live server and the official client ------------------------------------------------------

@pytest.fixture
def live():
    import uvicorn

    engine = FakeEngine(TOK.encode(REPLY), EOS, chunk=2, delay=0.0)
    engine.start()
    app = create_app(engine, TOK, MODEL, api_key="k-123", max_tokens_limit=128)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield engine, f"http://127.0.0.1:{port}/v1"
    server.should_exit = True
    thread.join(timeout=10)
    engine.stop()


def test_openai_client(live):
    import openai
    engine, url = live
    client = openai.OpenAI(base_url=url, api_key="k-123", max_retries=0, timeout=20)
    assert [m.id for m in client.models.list()] == [MODEL]
    c = client.completions.create(model=MODEL, prompt="Hi", max_tokens=5)
    assert c.choices[0].text == REPLY[:5] and c.choices[0].finish_reason == "length" and c.usage.total_tokens == 7
    ch = client.chat.completions.create(model=MODEL, messages=MSG, stop=["!"])
    assert ch.choices[0].message.content == "Hello world" and ch.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model=MODEL, messages=MSG, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == REPLY
    assert chunks[-1].usage.completion_tokens == len(REPLY) + 1
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="Hi", temperature=-1)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="nope", max_retries=0).models.list()


def test_closed_stream_cancels_the_request(live):
    import openai
    engine, url = live
    engine.reply, engine.chunk, engine.delay = TOK.encode("x" * 100), 1, 0.05  # ~5 s if never cancelled
    client = openai.OpenAI(base_url=url, api_key="k-123", max_retries=0, timeout=20)
    stream = client.completions.create(model=MODEL, prompt="Hi", max_tokens=100, stream=True)
    first = next(iter(stream))
    assert first.choices[0].text
    stream.close()
    h = engine.handles[-1]
    assert h.cancelled.wait(5), "closing the stream did not cancel the engine request"
    assert h.finished.wait(5)


# --- the command line ---------------------------------------------------------------------------

@pytest.mark.parametrize("flags", [[], ["--no-exact-batching"], ["--no-span-buckets"]])
def test_cli_serve_builds_engine_and_runs_uvicorn(monkeypatch, tmp_path, flags):
    import sys
    import types

    import uvicorn

    import specdec.api  # noqa: F401  imported before load_model is patched, so it keeps the real one
    from specdec import cli

    built, ran = {}, {}

    warmed = []

    class Loop(FakeEngine):
        def __init__(self, loaded, draft, **kw):
            super().__init__(TOK.encode(REPLY), EOS)
            built.update(kw, loaded=loaded, draft=draft)

        def warmup(self):  # the real loop builds its static steps here, before serving
            warmed.append(1)
            return 0

    loaded = types.SimpleNamespace(tokenizer=TOK)
    monkeypatch.setitem(sys.modules, "specdec.engine.serve_loop", types.SimpleNamespace(EngineLoop=Loop))
    monkeypatch.setattr("specdec.loading.load_model", lambda path, device, dtype, shard: loaded)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: ran.update(host=self.config.host, port=self.config.port,
                                                                       app=self.config.app))
    model = tmp_path / "tiny.gguf"
    rc = cli.main(["serve", "--model", str(model), "--draft", "ngram", "--max-slots", "3", "--max-queue", "5",
                   "--port", "0", "--api-key", "k", "--max-context", "64"] + flags)
    assert rc == 0
    assert built == {"loaded": loaded, "draft": "ngram", "max_slots": 3, "max_queue": 5, "num_draft_tokens": 4,
                     "block_size": None, "draft_vocab": None, "max_context": 64, "static_steps": None,
                     "exact": False if "--no-exact-batching" in flags else None,
                     "span_buckets": False if "--no-span-buckets" in flags else None}
    assert ran["host"] == "127.0.0.1" and ran["port"] == 0 and warmed == [1]
    client = TestClient(ran["app"])
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer k"}).json()["data"][0]["id"] == "tiny.gguf"


def test_real_engine_serves_what_generate_gives(tmp_path):
    """With the real serving engine (a tiny random Llama, SmolLM2's vocabulary slice): greedy replies
    over HTTP, whole or streamed, equal ``LLM.generate``'s."""
    from specdec.engine import serve_loop
    from _fuzz_util import smollm2_vocab, write_gguf_seed

    from specdec import LLM
    from specdec.loading import load_model

    path = str(tmp_path / "tiny.gguf")
    write_gguf_seed(path, smollm2_vocab())
    loaded = load_model(path, "cpu", "float32")
    llm = LLM(path, device="cpu")
    engine = serve_loop.EngineLoop(loaded, "ngram", max_slots=2, max_queue=4)
    engine.start()
    try:
        client = TestClient(create_app(engine, loaded.tokenizer, "tiny"))
        want = llm.generate("hello world", max_new_tokens=12)
        r = client.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 12, "temperature": 0})
        d = r.json()
        assert d["choices"][0]["text"] == want.text and d["usage"]["completion_tokens"] == len(want.token_ids)
        msgs = [{"role": "user", "content": "hi there"}]
        want = llm.generate(msgs, max_new_tokens=12)
        body = {"messages": msgs, "max_tokens": 12, "temperature": 0, "stream": True}
        with client.stream("POST", "/v1/chat/completions", json=body) as s:
            events = sse_events(s.read().decode())
        assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == want.text
        assert engine.metrics()["slots_in_use"] == 0
    finally:
        engine.stop()


def test_sixteen_concurrent_clients_get_what_each_request_gets_alone(tmp_path):
    """A bounded load test on loopback: 16 clients x 4 requests (the official client, threads) against
    a live server with the real engine and the n-gram drafter, at T=0. Every reply equals the same
    request served alone, and every slot is free at the end."""
    import openai
    import uvicorn
    from concurrent.futures import ThreadPoolExecutor

    from _fuzz_util import smollm2_vocab, write_gguf_seed
    from specdec import LLM
    from specdec.engine import serve_loop
    from specdec.loading import load_model

    path = str(tmp_path / "tiny.gguf")
    write_gguf_seed(path, smollm2_vocab())
    loaded = load_model(path, "cpu", "float32")
    alone = LLM(path, draft="ngram", device="cpu")
    prompts = [f"the {w} {n} and the {w}" for w in ("cat", "dog", "sea", "sun") for n in range(16)]
    want = {p: alone.generate(p, max_new_tokens=10).text for p in prompts}
    engine = serve_loop.EngineLoop(loaded, "ngram", max_slots=8, max_queue=64)
    engine.start()
    server = uvicorn.Server(uvicorn.Config(create_app(engine, loaded.tokenizer, "tiny"), host="127.0.0.1", port=0,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}/v1"

        def client_run(c: int) -> list[tuple[str, str]]:
            client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
            out = []
            for p in prompts[4 * c: 4 * c + 4]:
                r = client.completions.create(model="tiny", prompt=p, max_tokens=10, temperature=0)
                out.append((p, r.choices[0].text))
            return out

        t0 = time.monotonic()
        with ThreadPoolExecutor(16) as pool:
            got = [pair for part in pool.map(client_run, range(16)) for pair in part]
        assert time.monotonic() - t0 < 120
        assert len(got) == 64 and all(text == want[p] for p, text in got)
        m = engine.metrics()
        assert m["requests_finished"] == 64 and m["slots_in_use"] == 0 and m["queue_depth"] == 0
        assert m["accepted_total"] > 0  # drafts were accepted: verification and rollback ran in batches
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        engine.stop()


def test_engine_events_cross_in_batches_and_in_order():
    """Events the engine thread sends in a burst reach each request's queue in order, with one wake-up of the
    event loop for all the events that arrive before it runs: a burst sent while the loop is busy is one
    drain; events sent while the loop runs (threads interleaving as the scheduler likes) arrive in order,
    whatever the number of wake-ups."""
    import asyncio

    from specdec.server.app import _Events, _Inbox

    async def main(blocked: bool):
        inbox = _Inbox(asyncio.get_running_loop())
        drains = [0]
        real = inbox._drain
        inbox._drain = lambda: drains.__setitem__(0, drains[0] + 1) or real()
        reqs = [_Events(inbox) for _ in range(4)]

        def engine():
            for step in range(50):
                for i, ev in enumerate(reqs):
                    ev.put((i, step))
        t = threading.Thread(target=engine)
        t.start()
        if blocked:  # the loop does not run until the whole burst is in
            t.join()
        got = [[] for _ in reqs]
        for i, ev in enumerate(reqs):
            for _ in range(50):
                got[i].append(await asyncio.wait_for(ev.queue.get(), 10))
        t.join()
        return got, drains[0]
    want = [[(i, s) for s in range(50)] for i in range(4)]
    got, drains = asyncio.run(main(blocked=True))
    assert got == want and drains == 1, drains
    got, drains = asyncio.run(main(blocked=False))
    assert got == want and 1 <= drains <= 200, drains
