"""Where a batched decode step's time goes (distillation speed; the server's steps).

    python scripts/profile_batch.py --model M.gguf [--slots 256 512] [--span 400] [--prompts 2048]

For each slot count and both GQA forms (expanded by SDPA's ``enable_gqa`` / folded query groups,
``layers.FOLD_GQA_BATCHED``): the decode step's wall time at a fixed span, its top CUDA kernels,
and end-to-end ``generate_batch`` tokens/s on GSM8K-train prompts with the chat template. Prints
one JSON line per configuration.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from specdec.engine.batch import generate_batch
from specdec.loading import load_model
from specdec.models import layers
from specdec.train.data import read_prompts


def step_ms(model, slots: int, span: int, reps: int = 10) -> float:
    cache = model.new_batch_cache(slots, span + 8)
    ids = torch.randint(100, 1000, (slots, 1), device=model.device)
    starts = torch.full((slots,), span, device=model.device)
    last = torch.zeros(slots, dtype=torch.long, device=model.device)
    for _ in range(3):
        model.forward_batch(ids, cache, starts, span=span + 1, last=last)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        model.forward_batch(ids, cache, starts, span=span + 1, last=last)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1000


def top_kernels(model, slots: int, span: int, n: int = 12) -> list:
    from torch.profiler import ProfilerActivity, profile

    cache = model.new_batch_cache(slots, span + 8)
    ids = torch.randint(100, 1000, (slots, 1), device=model.device)
    starts = torch.full((slots,), span, device=model.device)
    last = torch.zeros(slots, dtype=torch.long, device=model.device)
    model.forward_batch(ids, cache, starts, span=span + 1, last=last)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        model.forward_batch(ids, cache, starts, span=span + 1, last=last)
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:n]
    return [(e.key[:60], round(e.device_time_total / 1000, 3), e.count) for e in rows]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--slots", type=int, nargs="+", default=[256, 512])
    ap.add_argument("--span", type=int, default=400)
    ap.add_argument("--prompts", type=int, default=2048)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    a = ap.parse_args()
    loaded = load_model(a.model, "cuda", "bfloat16")
    model, tok = loaded.model, loaded.tokenizer
    texts = read_prompts("gsm8k_train")[: a.prompts]
    enc = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]), add_special=False) for t in texts]
    for fold in (False, True):
        layers.FOLD_GQA_BATCHED = fold
        for slots in a.slots:
            t0 = time.perf_counter()
            replies = generate_batch(model, enc, a.max_new_tokens, set(tok.eos_ids), slots=slots)
            secs = time.perf_counter() - t0
            toks = sum(len(r) for r in replies)
            print(json.dumps({"fold_gqa": fold, "slots": slots, "step_ms": round(step_ms(model, slots, a.span), 2),
                              "span": a.span, "generate_tok_s": round(toks / secs), "tokens": toks,
                              "top_kernels_ms": top_kernels(model, slots, a.span)}), flush=True)


if __name__ == "__main__":
    main()
