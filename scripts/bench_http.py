"""The OpenAI-compatible server under concurrent streaming clients, over loopback HTTP: what
``scripts/bench_serve.py`` measures in process, plus uvicorn, the asyncio event loop, SSE and
detokenisation (issue 11's benchmark, end to end).

The server runs in this process (uvicorn on a thread, the engine as ``specdec serve`` builds it);
for each concurrency c, c asyncio clients each send ``--requests`` streamed chat completions one
after another (GSM8K questions, T=0, ``stream_options.include_usage``). The clients run in a
process of their own (spawned), as real clients would: in the server's process their SSE parsing
would take the GIL from the engine and the event loop (``--same-process`` measures that way). Reported per level: tok/s
(completion tokens over wall seconds), time to first text p50, latency p50 / p99, and how many
replies equal the same request's text served alone first (the serial reference).

    python scripts/bench_http.py [--model M] [--draft none] [--concurrency 1 4 16 32] [--requests 4] [--json F]

``--tiny`` serves a random 4-layer model (``specdec.shapes``' "tiny", fp32) with a byte-level
vocabulary instead: on the CPU its steps take a few ms, like SmolLM2's on the H200, so the server's
own costs (event loop, SSE, detokenisation) show against the in-process loop on a CPU machine too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import threading
import time

import torch


async def _one(client, body: dict) -> tuple[str, int, float, float]:
    """(text, completion tokens, seconds to the first text, seconds in all) of one streamed request."""
    t0, first, text, tokens = time.perf_counter(), None, [], 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            for ch in ev.get("choices", []):
                piece = ch.get("delta", {}).get("content") or ""
                if piece and first is None:
                    first = time.perf_counter() - t0
                text.append(piece)
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
    total = time.perf_counter() - t0
    return "".join(text), tokens, total if first is None else first, total


async def _level(url: str, bodies: list[dict], c: int, per_client: int) -> dict:
    import httpx

    out: dict[int, str] = {}
    ttft, lat, toks = [], [], [0]
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=c + 4)) as client:
        async def worker(i: int):
            for j in range(per_client):
                idx = i * per_client + j
                text, n, t_first, t_all = await _one(client, bodies[idx])
                out[idx] = text
                ttft.append(t_first)
                lat.append(t_all)
                toks[0] += n

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(c)))
        wall = time.perf_counter() - t0
    lat.sort()
    return {"concurrency": c, "requests": len(out), "completion_tokens": toks[0], "seconds": round(wall, 3),
            "tokens_per_s": round(toks[0] / wall, 2), "ttft_p50_s": round(statistics.median(ttft), 4),
            "latency_p50_s": round(statistics.median(lat), 3),
            "latency_p99_s": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3), "outputs": out}


def _level_in_child(url: str, bodies: list[dict], c: int, per_client: int, q) -> None:
    q.put(asyncio.run(_level(url, bodies, c, per_client)))


def _run_level(url: str, bodies: list[dict], c: int, per_client: int, same_process: bool) -> dict:
    """One level's clients: in a spawned process (default), or on this process's event loop."""
    if same_process:
        return asyncio.run(_level(url, bodies, c, per_client))
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_level_in_child, args=(url, bodies, c, per_client, q), daemon=True)
    p.start()
    try:
        return q.get(timeout=600)
    finally:
        p.join(timeout=30)


def _tiny():
    """(model, tokenizer): the "tiny" shape in fp32 on the CPU, and one token per byte (EOS 256)."""
    from specdec.shapes import build_shape
    from specdec.tokenizer import Tokenizer

    model = build_shape("tiny", torch.device("cpu"), torch.float32)
    keep = [b for r in ((33, 127), (161, 173), (174, 256)) for b in range(*r)]  # GPT-2's byte -> unicode table
    extra = iter(range(256, 512))
    table = {b: chr(b) if b in keep else chr(next(extra)) for b in range(256)}
    vocab = model.config.vocab_size
    tokens = [table[b] for b in range(256)] + ["<|endoftext|>"] + [f"<|pad{i}|>" for i in range(vocab - 257)]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1] * 256 + [3] + [5] * (vocab - 257), "tokenizer.ggml.merges": [],
            "tokenizer.ggml.eos_token_id": 256, "tokenizer.ggml.add_bos_token": False,
            "tokenizer.chat_template": "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                                       "{% if add_generation_prompt %}<|assistant|>{% endif %}"}
    return model, Tokenizer.from_gguf(meta, "byte-vocab")


def main() -> None:
    import uvicorn

    from specdec.api import default_model_path
    from specdec.bench import git_commit, load_prompts, machine_description
    from specdec.engine.serve_loop import EngineLoop
    from specdec.loading import load_model
    from specdec.server.app import create_app

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default="none", help="as `specdec serve --draft` (default none)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--requests", type=int, default=4, help="requests per client (default 4)")
    ap.add_argument("-n", type=int, default=64, help="max_tokens per request (default 64)")
    ap.add_argument("--serial", type=int, default=8, help="requests in the serial reference (default 8)")
    ap.add_argument("--max-context", type=int, default=None)
    ap.add_argument("--same-process", action="store_true", help="run the clients in the server's process")
    ap.add_argument("--tiny", action="store_true", help="a random tiny model and a byte vocabulary (CPU runs)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if min(a.concurrency) < 1 or a.requests < 1 or a.n < 1:
        raise SystemExit("bench_http: --concurrency, --requests and -n must be >= 1")
    if a.tiny:
        path = "tiny (random)"
        model, tok = _tiny()
    else:
        path = a.model or default_model_path()
        lm = load_model(path, None, None)
        model, tok = lm.model, lm.tokenizer
    n_req = max(a.concurrency) * a.requests
    bodies = [{"model": "m", "messages": [{"role": "user", "content": q}], "max_tokens": a.n, "temperature": 0,
               "stream": True, "stream_options": {"include_usage": True}} for (q,) in load_prompts("gsm8k", n_req)]
    engine = EngineLoop(model, a.draft, max_slots=max(a.concurrency), max_queue=n_req, max_context=a.max_context)
    t0 = time.perf_counter()
    built = engine.warmup()
    warm_s = time.perf_counter() - t0
    with socket.socket() as s:  # a free loopback port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(engine, tok, "m"), host="127.0.0.1", port=port,
                                           log_level="warning"))
    engine.start()
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    report = {"machine": machine_description(model.device), "commit": git_commit(), "model": path,
              "draft": a.draft, "n": a.n, "requests_per_client": a.requests,
              "clients": "server's process" if a.same_process else "own process", "warmup": {"steps": built,
              "seconds": round(warm_s, 2)}, "rows": []}
    try:
        _run_level(url, bodies[:1], 1, 1, a.same_process)  # warm-up
        serial = _run_level(url, bodies[:a.serial], 1, a.serial, a.same_process)["outputs"]
        for c in a.concurrency:
            r = _run_level(url, bodies, c, a.requests, a.same_process)
            outs = r.pop("outputs")
            same = [outs[i] == serial[i] for i in serial if i in outs]
            r["equal_to_serial"] = f"{sum(same)}/{len(same)}"
            report["rows"].append(r)
            print(json.dumps(r), flush=True)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        engine.stop()
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=2)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
