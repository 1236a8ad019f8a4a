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
        # the same row at every position of the batch: same bits? (a GEMM kernel that splits K
        # differently per tile of rows would not give them)
        for name, (n_out, n_in) in {"qkv": ((h + 2 * kv) * d, cfg.hidden_size), "down": (cfg.hidden_size, cfg.intermediate_size),
                                    "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size),
                                    "lm_head": (cfg.vocab_size, cfg.hidden_size)}.items():
            wt = torch.randn(n_out, n_in, device=dev, dtype=torch.bfloat16) * 0.05
            xr = torch.randn(1, n_in, device=dev, dtype=torch.bfloat16).expand(a.slots * w, -1).contiguous()
            y = F.linear(xr, wt)
            res[f"gemm_{name}_rows_equal_w{w}"] = f"{sum(torch.equal(y[0], y[i]) for i in range(y.shape[0]))}/{y.shape[0]}"
        q1 = q[:1].expand_as(q).contiguous()
        k1, v1 = k[:1].expand_as(k).contiguous(), v[:1].expand_as(v).contiguous()
        m1 = mask[:1].expand_as(mask).contiguous()
        o = attend(q1, k1, v1, m1, d ** -0.5)
        res[f"attend_rows_equal_w{w}"] = f"{sum(torch.equal(o[0], o[i]) for i in range(o.shape[0]))}/{o.shape[0]}"
        print(json.dumps({k2: v2 for k2, v2 in res.items() if k2.endswith(f"w{w}")}), flush=True)


if __name__ == "__main__":
    main()
