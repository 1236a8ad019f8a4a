"""Self-distillation speed with static (CUDA-graph) batched verify steps against eager ones.

    python scripts/bench_static_batch.py --model M.gguf [--slots 64 512] [--prompts 1024] [--max-new-tokens 256]

For each slot count: ``generate_batch`` (GSM8K-train prompts, chat template, greedy) with the
eager batched step and with the static step (one CUDA graph over every slot), tokens/s of each,
and how many replies agree between the two (eager rows are not batch-invariant in bf16, so a few
may differ), and whether a few requests served alone on the same static engine reproduce their
batched replies. One JSON line per run.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from specdec.engine.batch import generate_batch
from specdec.loading import load_model
from specdec.train.data import read_prompts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--slots", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--prompts", type=int, default=1024)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--device", default="cuda", help="cuda (default), or cpu for a smoke test of this script")
    a = ap.parse_args()
    loaded = load_model(a.model, a.device, "bfloat16" if a.device.startswith("cuda") else "float32")
    sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)
    model, tok = loaded.model, loaded.tokenizer
    texts = read_prompts("gsm8k_train")[: a.prompts]
    enc = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]), add_special=False) for t in texts]
    for slots in a.slots:
        replies = {}
        for static in (False, True):
            sync()
            t0 = time.perf_counter()
            replies[static] = generate_batch(model, enc, a.max_new_tokens, set(tok.eos_ids), slots=slots,
                                             static_steps=static)
            sync()
            secs = time.perf_counter() - t0
            toks = sum(len(r) for r in replies[static])
            print(json.dumps({"slots": slots, "static_steps": static, "tok_s": round(toks / secs), "tokens": toks,
                              "seconds": round(secs, 2)}), flush=True)
        same = sum(x == y for x, y in zip(replies[False], replies[True]))
        print(json.dumps({"slots": slots, "replies_equal_eager_static": f"{same}/{len(enc)}"}), flush=True)
    # Batch invariance: a few requests served alone on an engine of the same shape (slots, context)
    # against their replies in the full static run. The prompt's prefill is still eager (its shape
    # depends on the prompts prefilled together), so a mismatch here points at the prefill.
    from specdec.engine.serve_loop import EngineLoop, GenRequest
    from specdec.sampling import SamplingParams
    slots = a.slots[-1]
    context = max(len(p) for p in enc) + a.max_new_tokens
    probe = list(range(0, len(enc), max(1, len(enc) // 8)))
    same = 0
    for i in probe:
        loop = EngineLoop(model, "none", max_slots=min(slots, len(enc)), max_queue=0, controller=False,
                          max_context=min(context, model.max_context), static_steps=True)
        same += loop.run([GenRequest(enc[i], a.max_new_tokens, SamplingParams(), tuple(tok.eos_ids))])[0] == replies[True][i]
    print(json.dumps({"slots": slots, "static_alone_equals_batched": f"{same}/{len(probe)}"}), flush=True)

if __name__ == "__main__":
    main()
