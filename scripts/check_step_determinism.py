"""Does the serving loop's static batched step give the same bits when replayed twice on the same
inputs? (A plain serving loop, width 1, was found to differ run to run on the H200.) Random
SmolLM2-shape target; for widths 1, 2 and 16: the captured step replayed 30 times, logits compared
with the first replay; then the attention call alone (T = width, GQA, masked) and the GEMMs alone.

    python scripts/check_step_determinism.py [--shape smollm2-135m] [--slots 32]
"""
import argparse
import json

import torch
import torch.nn.functional as F

from specdec.models.graphed_batch import GraphedBatch
from specdec.models.layers import attend
from specdec.shapes import build_shape


def same_n(fn, n=30):
    ref = fn().clone()
    return sum(torch.equal(ref, fn()) for _ in range(n - 1)) + 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--context", type=int, default=1024)
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    dev = torch.device("cuda")
    m = build_shape(a.shape, dev, torch.bfloat16)
    cfg = m.config
    res = {}
    for w in (1, 2, 16):
        cache = m.new_batch_cache(a.slots, a.context, spare=w)
        step = GraphedBatch(m, cache, w)
        ids = torch.randint(0, cfg.vocab_size, (a.slots, w), device=dev)
        starts = [int(x) for x in torch.randint(100, 600, (a.slots,))]
        # fill the cache with something: one step at each start
        step(ids, list(range(a.slots)), starts)
        res[f"step_w{w}"] = same_n(lambda: step(ids, list(range(a.slots)), starts).logits)
        h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q = torch.randn(a.slots, h, w, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(a.slots, kv, a.context + w, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        mask = torch.zeros(a.slots, 1, w, a.context + w, device=dev, dtype=torch.bfloat16)
        mask[..., 500:] = float("-inf")
        res[f"attend_w{w}"] = same_n(lambda: attend(q, k, v, mask, d ** -0.5))
        x = torch.randn(a.slots * w, cfg.hidden_size, device=dev, dtype=torch.bfloat16)
        wt = torch.randn(cfg.intermediate_size * 2, cfg.hidden_size, device=dev, dtype=torch.bfloat16)
        res[f"gemm_w{w}"] = same_n(lambda: F.linear(x, wt))
        print(json.dumps({k2: v2 for k2, v2 in res.items() if k2.endswith(f"w{w}")}), flush=True)


if __name__ == "__main__":
    main()
