"""Where a speculative decoding step's time goes: the engine's own split (draft / verify+observe /
other) per step, then a torch.profiler table of the heaviest host and device ops.

    python scripts/profile_engine.py --model M.gguf --draft dflash [--compile] [--prompts 6]
    python scripts/profile_engine.py --shape smollm2-135m --draft dflash   # random weights, random drafter (dflash, mtp)
    python scripts/profile_engine.py --shape smollm2-135m --draft none -t 1   # sampled decoding's step
    python scripts/profile_engine.py --shape qwen3-8b --draft oracle -k 15 --tau 6.5   # bench --shape's oracle

``--draft oracle`` (``--shape`` only): bench --shape's ORACLE drafter (each prompt's plain greedy continuation, spoiled
to a mean of ``--tau`` tokens a step; not a real drafter), so the step's split shows the engine's own time around a
verify whose drafts it does not wait for.
"""

from __future__ import annotations

import argparse
import time

import torch

from specdec.bench import load_prompts
from specdec.drafters.factory import make_drafter
from specdec.engine import SpeculativeGenerator
from specdec.loading import load_model
from specdec.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--shape", default=None, help="a bench --shape name: random weights and prompts, no tokenizer")
    ap.add_argument("--draft", default="dflash")
    ap.add_argument("-k", type=int, default=None)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("-t", "--temperature", type=float, default=0.0, help="sampled decoding at this temperature (seeded)")
    ap.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                    help="padded static steps (default: the engine's, on for CUDA, off for the CPU)")
    ap.add_argument("--shapes", action="store_true", help="group the profile table by input shapes")
    ap.add_argument("--tau", type=float, default=6.5, help="--draft oracle: the mean tokens a step it aims at")
    a = ap.parse_args()
    if a.draft == "oracle" and not a.shape:
        raise SystemExit("profile_engine: --draft oracle needs --shape (its drafter proposes a random target's own "
                         "continuation)")
    if a.shape:
        from specdec.bench_shape import _dflash, _mtp
        from specdec.shapes import build_shape

        makers = {"none": lambda m: None, "oracle": lambda m: None, "dflash": lambda m: _dflash(m)[0],
                  "mtp": lambda m: _mtp(m)[0]}  # bench --shape's random drafters
        if a.draft not in makers:
            raise SystemExit(f"profile_engine: --shape takes --draft {', '.join(makers)} (random drafters), "
                             f"not {a.draft!r}")
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model = build_shape(a.shape, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)
        d = makers[a.draft](model)
        eos = ()
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, min(1000, model.config.vocab_size), (int(torch.randint(60, 200, (1,), generator=gen)),), generator=gen).tolist()
                   for _ in range(2 * a.prompts)]
    else:
        lm = load_model(a.model, None, None)
        model, tok = lm.model, lm.tokenizer
        d, eos = make_drafter(a.draft, lm), tok.eos_ids
        prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special=False)
                   for (q,) in load_prompts("gsm8k", 2 * a.prompts)]
    k = a.k if a.k is not None else (d.block_size - 1 if hasattr(d, "block_size") else 4) if d else 0
    g = SpeculativeGenerator(model, d, k, batch_invariant=a.batch_invariant, compile=a.compile)
    oracles = {}
    if a.draft == "oracle":
        from specdec.bench_shape import OracleDrafter, oracle_spoil
        k = a.k or 15
        plain = SpeculativeGenerator(model, None, 0, batch_invariant=a.batch_invariant, compile=a.compile)
        for i, p in enumerate(prompts):
            ref = p + plain.generate(p, a.n, SamplingParams()).token_ids
            oracles[i] = OracleDrafter(ref, model.config.vocab_size, oracle_spoil(a.tau, k), i)
        g = SpeculativeGenerator(model, oracles[0], k, batch_invariant=a.batch_invariant, compile=a.compile)

    def run(ps):
        tot = {"draft": 0.0, "verify": 0.0, "prefill": 0.0, "total": 0.0, "steps": 0, "tokens": 0}
        for i, p in enumerate(ps):
            if oracles:  # each prompt's own continuation (the generator takes no drafter state of its own)
                g.drafter = oracles[prompts.index(p)]
            r = g.generate(p, a.n, SamplingParams(temperature=a.temperature, seed=i), eos_ids=eos)
            s = r.stats
            tot["draft"] += s.draft_s
            tot["verify"] += s.verify_s
            tot["prefill"] += s.prefill_s
            tot["total"] += s.total_s
            tot["steps"] += s.steps
            tot["tokens"] += s.new_tokens
        return tot

    t = time.perf_counter()
    run(prompts[: a.prompts])  # warm-up: compile, capture
    print(f"warm-up {time.perf_counter() - t:.1f}s", flush=True)
    tot = run(prompts[a.prompts:])
    n = max(1, tot["steps"])
    print({"draft": a.draft, "temperature": a.temperature, "compile": a.compile, "k": k, "tok_per_s": round(tot["tokens"] / tot["total"], 1),
           "tau": round(tot["tokens"] / n, 2), "ms_per_step": round(1e3 * (tot["total"] - tot["prefill"]) / n, 3),
           "draft_ms": round(1e3 * tot["draft"] / n, 3), "verify_observe_ms": round(1e3 * tot["verify"] / n, 3),
           "prefill_ms_per_prompt": round(1e3 * tot["prefill"] / a.prompts, 2)}, flush=True)
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch.profiler.profile(activities=acts, record_shapes=a.shapes) as prof:
        run(prompts[a.prompts: a.prompts + 2])
    print(prof.key_averages(group_by_input_shape=a.shapes).table(sort_by="self_cpu_time_total", row_limit=a.rows,
                                                                 max_name_column_width=60))
    if torch.cuda.is_available():
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
