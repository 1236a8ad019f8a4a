"""The serving loop under concurrent clients (issue 11's benchmark), in process: no HTTP, the same
``EngineLoop`` the server and self-distillation run.

For each drafter and each concurrency c, c client threads each send ``--requests`` GSM8K chat
requests one after another (T=0). Reported: throughput (new tokens / wall seconds), per-request
latency p50 / p99, tau, and how many replies equal the same prompt served alone (a serial
reference: each prompt through the same drafter's loop with no other request; with ``exact``,
the default with static steps, every reply should: ``--no-exact`` measures the other mode).

    python scripts/bench_serve.py [--model M] [--drafts none ngram dflash] [--concurrency 1 4 16 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch

from specdec.api import default_model_path
from specdec.bench import git_commit, load_prompts, machine_description
from specdec.engine.requests import GenRequest
from specdec.engine.serve_loop import EngineLoop
from specdec.loading import load_model
from specdec.sampling import SamplingParams


def _serve(loop: EngineLoop, req: GenRequest) -> tuple[list[int], float, dict]:
    t = time.perf_counter()
    ids, stats = [], {}
    for ev in loop.submit(req).events(timeout=600):
        if ev.kind == "tokens":
            ids.extend(ev.token_ids)
        elif ev.kind == "error":
            raise RuntimeError(ev.message)
        elif ev.kind == "done":
            stats = ev.stats or {}
    return ids, time.perf_counter() - t, stats


def run_level(loop: EngineLoop, reqs: list[GenRequest], c: int, per_client: int) -> dict:
    out: dict[int, list[int]] = {}
    lat: list[float] = []
    steps = [0]
    lock = threading.Lock()

    def client(i: int):
        for j in range(per_client):
            idx = i * per_client + j
            ids, dt, st = _serve(loop, reqs[idx])
            with lock:
                out[idx] = ids
                lat.append(dt)
                steps[0] += int(st.get("steps", 0))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(c)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    toks = sum(len(v) for v in out.values())
    lat.sort()
    return {"concurrency": c, "requests": len(out), "new_tokens": toks, "seconds": round(wall, 3),
            "tokens_per_s": round(toks / wall, 2), "latency_p50_s": round(statistics.median(lat), 3),
            "latency_p99_s": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3),
            "tau": round(toks / max(1, steps[0]), 3), "outputs": out}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--drafts", nargs="+", default=["none", "ngram", "dflash"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--requests", type=int, default=2, help="requests per client (default 2)")
    ap.add_argument("-n", type=int, default=64, help="max new tokens per request (default 64)")
    ap.add_argument("--serial", type=int, default=8, help="prompts in the serial reference (default 8)")
    ap.add_argument("--no-controller", action="store_true")
    ap.add_argument("--eager-steps", action="store_true", help="eager batched verify steps instead of the static "
                    "step captured as a CUDA graph (the default on CUDA)")
    ap.add_argument("--no-exact", action="store_true", help="EngineLoop(exact=False): batched eager prefill, "
                    "1-wide steps without drafts")
    ap.add_argument("--context", type=int, default=None, help="positions per slot (EngineLoop max_context; "
                    "default: the model's). Every step attends over all of them")
    ap.add_argument("--no-span-buckets", action="store_true", help="static steps attend over the whole context "
                    "(EngineLoop span_buckets=False)")
    ap.add_argument("--all-slots-drafter", action="store_true", help="DFlash drafts for every slot in one static "
                    "step (EngineLoop all_slots_drafter=True), not in a pass per slot")
    ap.add_argument("--repeat-serial", action="store_true", help="serve the serial reference twice and "
                    "report whether both passes agree (run-to-run determinism, apart from batching)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    lm = load_model(a.model or default_model_path(), None, None)
    tok = lm.tokenizer
    n_req = max(a.concurrency) * a.requests
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special=False)
               for (q,) in load_prompts("gsm8k", n_req)]
    reqs = [GenRequest(p, a.n, SamplingParams(), tuple(tok.eos_ids)) for p in prompts]
    slots = max(a.concurrency)
    report = {"machine": machine_description(lm.model.device), "commit": git_commit(), "n": a.n,
              "requests_per_client": a.requests, "controller": not a.no_controller,
              "context": a.context, "static_steps": not a.eager_steps and lm.model.device.type == "cuda", "rows": []}
    static = False if a.eager_steps else None
    exact = False if a.no_exact or a.eager_steps else None
    report["exact"] = exact is None and report["static_steps"]
    report["span_buckets"] = report["static_steps"] and not a.no_span_buckets
    report["all_slots_drafter"] = a.all_slots_drafter
    for d in a.drafts:
        loop = EngineLoop(lm, d, max_slots=slots, max_queue=n_req, controller=not a.no_controller,
                          static_steps=static, exact=exact, max_context=a.context,
                          span_buckets=False if a.no_span_buckets or a.eager_steps else None,
                          all_slots_drafter=a.all_slots_drafter)
        loop.start()
        _serve(loop, reqs[0])  # warm-up
        serial = {i: _serve(loop, reqs[i])[0] for i in range(min(a.serial, n_req))}  # each alone: the reference
        if a.repeat_serial:  # the same requests alone once more: does the loop give the same bits twice?
            again = {i: _serve(loop, reqs[i])[0] for i in serial}
            rep = {"draft": d, "serial_repeat_equal": f"{sum(again[i] == serial[i] for i in serial)}/{len(serial)}"}
            report.setdefault("serial_repeat", []).append(rep)
            print(json.dumps(rep), flush=True)
        for c in a.concurrency:
            r = run_level(loop, reqs, c, a.requests)
            outs = r.pop("outputs")
            same = [outs[i] == serial[i] for i in serial if i in outs]
            first = {i: next((j for j, (x, y) in enumerate(zip(outs[i], serial[i])) if x != y), min(len(outs[i]), len(serial[i])))
                     for i in serial if i in outs and outs[i] != serial[i]}
            r.update(draft=d, equal_to_serial=f"{sum(same)}/{len(same)}", first_difference=first)
            report["rows"].append(r)
            print(json.dumps(r), flush=True)
        loop.stop()
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=2)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
