"""The serving loop under concurrent clients (issue 11's benchmark), in process: no HTTP, the same
``EngineLoop`` the server and self-distillation run.

For each drafter and each concurrency c, c client threads each send ``--requests`` GSM8K chat
requests one after another (T=0). Reported: throughput (new tokens / wall seconds), per-request
latency p50 / p99, tau, and how many replies equal the same prompt served alone (a serial
reference: each prompt through the same drafter's loop with no other request; with ``exact``,
the default with static steps, every reply should: ``--no-exact`` measures the other mode).

    python scripts/bench_serve.py [--model M] [--drafts none ngram dflash] [--concurrency 1 4 16 32]

``--rounds R`` builds every drafter's loop first, then measures each level R times with the
drafters side by side, and sums up medians and ranges: on the H200 two plain runs a minute apart
differed by up to 9 % at one level, more than the 3 % the controller is held to.

``--shape qwen3-8b`` serves a random target of that shape (``specdec bench --shape``) with random
prompts and no stop token; its drafts are ``none`` and ``oracle``. The ORACLE proposes the reply
this same loop gives the prompt (taken in a first pass in which its drafts are all spoiled), each
draft spoiled with the probability giving ``--oracle-tau`` tokens per step at ``--oracle-k`` drafts:
what a drafter of that tau would give on this target, not a real drafter.
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
from specdec.bench_shape import oracle_spoil
from specdec.drafters.base import Proposal
from specdec.engine.requests import GenRequest
from specdec.engine.serve_loop import EngineLoop
from specdec.errors import ConfigError
from specdec.loading import load_model
from specdec.sampling import SamplingParams
from specdec.shapes import build_shape


class ServeOracle:
    """ORACLE (benchmarks only): proposes ``refs[prompt]`` (the reply the loop gives the prompt) from
    the reply position, each draft replaced by a wrong id with probability ``spoil``; an unknown
    prompt gets only wrong ids. One per request (a drafter factory)."""

    name = "oracle"
    capture_layers: tuple[int, ...] = ()
    flat_draft_cost = True

    def __init__(self, refs: dict, vocab: int, spoil: float, seed: int):
        self.refs, self.vocab, self.spoil = refs, vocab, spoil
        self.rng = torch.Generator().manual_seed(seed)

    def begin(self, prompt_ids, out) -> None:
        self.ref, self.n, self.device = self.refs.get(tuple(prompt_ids.tolist())), 0, out.hidden.device

    def observe(self, tokens, out) -> None:
        self.n += tokens.numel()  # the reply's tokens before the last one

    def propose(self, last_token, k, params, gen) -> Proposal:
        spoil = 1.0 if self.ref is None else self.spoil
        ref = self.ref or []
        toks = (ref[self.n + 1:self.n + 1 + k] + [0] * k)[:k]
        for i in range(k):
            if float(torch.rand(1, generator=self.rng)) < spoil:
                toks[i] = (toks[i] + 1 + int(torch.randint(self.vocab - 1, (1,), generator=self.rng))) % self.vocab
        return Proposal(torch.tensor(toks, dtype=torch.int64, device=self.device))


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


def prepare(a, d: str, lm, reqs, slots: int, n_req: int, report: dict, static, exact, vocab, spoil):
    """Drafter ``d``'s loop, built, warmed up and started, and its serial reference (each of the first
    ``--serial`` prompts served alone); for the oracle, first the replies it proposes."""
    draft, refs = d, {}
    if d == "oracle":
        if not a.shape:
            raise SystemExit("--drafts oracle needs --shape")
        seeds = iter(range(10 ** 9))
        draft = lambda: ServeOracle(refs, vocab, spoil, next(seeds))  # noqa: E731
    loop = EngineLoop(lm, draft, max_slots=slots, max_queue=n_req, controller=not a.no_controller,
                      num_draft_tokens=a.oracle_k if d == "oracle" else 4,
                      static_steps=static, exact=exact, max_context=a.context,
                      span_buckets=False if a.no_span_buckets or a.eager_steps else None,
                      all_slots_drafter=False if a.per_slot_drafters else None,
                      invariant_gemm=False if a.no_invariant_gemm else None)
    report.setdefault("invariant_linears", {})[d] = len(loop.invariant_linears)
    if a.full_steps:
        loop._shapes_exact = False
    t0 = time.perf_counter()
    report.setdefault("warmup", {})[d] = {"steps": loop.warmup(), "seconds": round(time.perf_counter() - t0, 2)}
    loop.start()
    _serve(loop, reqs[0])  # warm-up
    if d == "oracle":  # the replies this loop gives (its drafts all spoiled), all at once: the oracle's reference
        ref_pass = run_level(loop, reqs, slots, a.requests)["outputs"]
        refs.update({tuple(reqs[i].prompt_ids): v for i, v in ref_pass.items()})
    serial = {i: _serve(loop, reqs[i])[0] for i in range(min(a.serial, n_req))}  # each alone: the reference
    if d == "oracle":  # the reference pass ran batched: exact, its replies are the serial ones
        rep = {"draft": d, "reference_equal_to_serial": f"{sum(ref_pass[i] == serial[i] for i in serial)}/{len(serial)}"}
        report["oracle_reference"] = rep
        print(json.dumps(rep), flush=True)
    if a.repeat_serial:  # the same requests alone once more: does the loop give the same bits twice?
        again = {i: _serve(loop, reqs[i])[0] for i in serial}
        rep = {"draft": d, "serial_repeat_equal": f"{sum(again[i] == serial[i] for i in serial)}/{len(serial)}"}
        report.setdefault("serial_repeat", []).append(rep)
        print(json.dumps(rep), flush=True)
    return loop, serial


def summarize(rows: list[dict], drafts: list[str]) -> list[dict]:
    """Per drafter and concurrency: the median tok/s over the rounds, its range, the median's ratio
    to plain decoding's (the first drafter's when there is no ``none``), and the median of the
    rounds' own ratios (paired: a round's drafters ran minutes apart at most)."""
    base = "none" if "none" in drafts else drafts[0]
    out, med = [], {}
    for d in drafts:
        for c in sorted({r["concurrency"] for r in rows}):
            v = sorted(r["tokens_per_s"] for r in rows if r["draft"] == d and r["concurrency"] == c)
            med[d, c] = statistics.median(v)
            out.append({"draft": d, "concurrency": c, "rounds": len(v), "tokens_per_s_median": round(med[d, c], 2),
                        "tokens_per_s_range": [v[0], v[-1]]})
    per_round = {(r["draft"], r["concurrency"], r.get("round", 0)): r["tokens_per_s"] for r in rows}
    for line in out:
        d, c = line["draft"], line["concurrency"]
        line["x_" + base] = round(med[d, c] / med[base, c], 3)
        # each round's ratio (the drafters ran one after another at that level), their median
        paired = [v / per_round[base, c, rnd] for (dd, cc, rnd), v in per_round.items()
                  if dd == d and cc == c and (base, c, rnd) in per_round]
        line["x_" + base + "_paired"] = round(statistics.median(paired), 3)
    return out


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
    ap.add_argument("--per-slot-drafters", action="store_true", help="DFlash drafts in a pass per slot "
                    "(EngineLoop all_slots_drafter=False), not for every slot in one static step (the default)")
    ap.add_argument("--no-invariant-gemm", action="store_true", help="keep cuBLAS for every linear layer "
                    "(EngineLoop invariant_gemm=False)")
    ap.add_argument("--full-steps", action="store_true", help="exact steps all take the full shape (every slot, "
                    "kmax + 1 wide): no 1-wide steps without drafts, no slot buckets, no checks")
    ap.add_argument("--repeat-serial", action="store_true", help="serve the serial reference twice and "
                    "report whether both passes agree (run-to-run determinism, apart from batching)")
    ap.add_argument("--shape", default=None, help="a random target of this shape (specdec bench --shape), "
                    "random prompts, drafts none and oracle")
    ap.add_argument("--prompt-len", type=int, default=256, help="--shape: prompt tokens (default 256)")
    ap.add_argument("--oracle-tau", type=float, default=4.0, help="--shape: the oracle's tokens per step (default 4)")
    ap.add_argument("--oracle-k", type=int, default=15, help="--shape: the oracle's drafts per step (default 15)")
    ap.add_argument("--rounds", type=int, default=1, help="measure every level this many times, the drafters "
                    "side by side at each (all loops built first); the summary gives medians and ranges")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.rounds < 1:
        raise SystemExit(f"bench_serve: --rounds must be >= 1, got {a.rounds}")
    n_req = max(a.concurrency) * a.requests
    if a.shape:
        spoil = oracle_spoil(a.oracle_tau, a.oracle_k)
        lm = build_shape(a.shape, torch.device("cuda" if torch.cuda.is_available() else "cpu"),
                         torch.bfloat16 if torch.cuda.is_available() else torch.float32)
        vocab, dev = lm.config.vocab_size, lm.device
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(vocab, (a.prompt_len,), generator=g).tolist() for _ in range(n_req)]
        reqs = [GenRequest(p, a.n, SamplingParams(), ()) for p in prompts]
        if a.drafts == ap.get_default("drafts"):
            a.drafts = ["none", "oracle"]
        if a.context is None:
            a.context = 2048
    else:
        lm = load_model(a.model or default_model_path(), None, None)
        tok, dev = lm.tokenizer, lm.model.device
        prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special=False)
                   for (q,) in load_prompts("gsm8k", n_req)]
        reqs = [GenRequest(p, a.n, SamplingParams(), tuple(tok.eos_ids)) for p in prompts]
    slots = max(a.concurrency)
    report = {"machine": machine_description(dev), "commit": git_commit(), "n": a.n, "shape": a.shape,
              "requests_per_client": a.requests, "controller": not a.no_controller,
              "context": a.context, "static_steps": not a.eager_steps and dev.type == "cuda", "rows": []}
    if a.shape:
        report.update(prompt_len=a.prompt_len, oracle_tau=a.oracle_tau, oracle_k=a.oracle_k, oracle_spoil=spoil)
    static = False if a.eager_steps else None
    exact = False if a.no_exact or a.eager_steps else None
    report["exact"] = exact is None and report["static_steps"]
    report["span_buckets"] = report["static_steps"] and not a.no_span_buckets
    report["all_slots_drafter"] = not a.per_slot_drafters
    report["full_steps"] = a.full_steps
    loops = {}
    for d in dict.fromkeys(a.drafts):  # every drafter's loop built, warmed and referenced first
        loops[d] = prepare(a, d, lm, reqs, slots, n_req, report, static, exact, vocab if a.shape else None,
                           spoil if a.shape else None)
    seen = {d: (m["k_chosen"], m["k_seconds"]) for d, (loop, _) in loops.items() for m in [loop.metrics()]}
    for rnd in range(a.rounds):  # then the levels, drafters side by side at each (spread: --rounds)
        for c in a.concurrency:
            for d, (loop, serial) in loops.items():
                r = run_level(loop, reqs, c, a.requests)
                outs = r.pop("outputs")
                same = [outs[i] == serial[i] for i in serial if i in outs]
                first = {i: next((j for j, (x, y) in enumerate(zip(outs[i], serial[i])) if x != y),
                                 min(len(outs[i]), len(serial[i])))
                         for i in serial if i in outs and outs[i] != serial[i]}
                m = loop.metrics()
                # this level's steps and their seconds by k (the rest of the wall time: prefill, joins, idle)
                n0, s0 = seen.get(d, ({}, {}))
                seen[d] = (m["k_chosen"], m["k_seconds"])
                r["steps_by_k"] = {k: v - n0.get(k, 0) for k, v in m["k_chosen"].items() if v - n0.get(k, 0)}
                r["step_ms_by_k"] = {k: round(1e3 * (m["k_seconds"][k] - s0.get(k, 0.0)) / n, 3)
                                     for k, n in r["steps_by_k"].items()}
                r["outside_steps_s"] = round(r["seconds"] - sum(m["k_seconds"][k] - s0.get(k, 0.0)
                                                                for k in r["steps_by_k"]), 3)
                r.update(draft=d, round=rnd, equal_to_serial=f"{sum(same)}/{len(same)}", first_difference=first,
                         k_chosen=m["k_chosen"], checked_steps=m["checked_steps"])
                report["rows"].append(r)
                print(json.dumps(r), flush=True)
    for loop, _ in loops.values():
        loop.stop()
    report["summary"] = summarize(report["rows"], list(loops))
    for line in report["summary"]:
        print(json.dumps(line), flush=True)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=2)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    try:
        main()
    except ConfigError as e:  # bad input: one line, no traceback
        raise SystemExit(f"bench_serve: {e}") from None
