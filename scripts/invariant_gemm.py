"""The row-count-invariant GEMM (Triton, specdec/models/invariant_linear.py) checked and timed against
cuBLAS: ``y = x @ W^T`` where a row's bits never depend on how many rows ``x`` has.

cuBLAS picks its kernel by shape: on the H200 the qwen3-8b shape's o and down projections give a
row other bits at 32 rows than at 512 (scripts/check_width_invariance.py), so a step's width and
slot count change a row's bits. The Triton kernel walks K in order and accumulates in fp32.

    python scripts/invariant_gemm.py [--shape qwen3-8b] [--json out.json]

reports, per weight and row count (1..512): cuBLAS's time and whether row 0 keeps the bits it has
at 1 row; and for each tiling (BM, BN, BK, warps, stages) its time (a CUDA graph of 20 calls),
whether rows 0 and 3 keep their bits, and whether it gives the first tiling's bits (the serving
loop picks the tiling by row count, which holds only if they all agree).
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from specdec.models.invariant_linear import invariant_linear as _linear

CONFIGS = [(64, 64, 64, 4, 4), (64, 32, 128, 4, 4), (64, 128, 64, 4, 3), (128, 64, 64, 8, 3), (64, 64, 128, 4, 3),
           (128, 128, 64, 8, 3), (64, 16, 256, 4, 3), (16, 64, 128, 4, 4)]
ROWS = (1, 4, 16, 32, 64, 128, 256, 512)


def invariant_linear(x: torch.Tensor, w: torch.Tensor, cfg) -> torch.Tensor:
    """The serving loop's kernel (specdec/models/invariant_linear.py) with tiling ``cfg``."""
    return _linear(x, w, config=cfg)


def timed_us(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / reps)
    return round(best, 2)


def main() -> None:
    from specdec.shapes import shape_config
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    dev = torch.device("cuda")
    c = shape_config(a.shape)[1]
    h, kv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    shapes = {"qkv": ((h + 2 * kv) * d, c.hidden_size), "o": (c.hidden_size, h * d),
              "gate_up": (2 * c.intermediate_size, c.hidden_size), "down": (c.hidden_size, c.intermediate_size),
              "lm_head": (c.vocab_size, c.hidden_size)}
    g = torch.Generator(device=dev).manual_seed(0)
    out = {"shape": a.shape, "rows": list(ROWS), "configs": CONFIGS, "weights": {}}
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
        xs = torch.randn(max(ROWS), k, device=dev, dtype=torch.bfloat16, generator=g)
        rec = {"cublas_us": {}, "cublas_row0_same_as_1": {}, "configs": {}}
        ref_cu = F.linear(xs[:1], w)
        for m in ROWS:
            x = xs[:m].contiguous()
            rec["cublas_us"][m] = timed_us(lambda: F.linear(x, w))
            rec["cublas_row0_same_as_1"][m] = bool(torch.equal(F.linear(x, w)[:1], ref_cu))
        first = {}  # config 0's rows at each count: do other configs give the same bits?
        for cfg in CONFIGS:
            key = "x".join(map(str, cfg))
            try:
                ref = invariant_linear(xs[:1], w, cfg)
                mid = invariant_linear(xs[3:4], w, cfg)
                r = {"us": {}, "same": {}, "same_as_first_config": {}}
                for m in ROWS:
                    y = invariant_linear(xs[:m].contiguous(), w, cfg)
                    if cfg == CONFIGS[0]:
                        first[m] = y
                    r["same_as_first_config"][m] = bool(torch.equal(y, first[m]))
                for m in ROWS:
                    x = xs[:m].contiguous()
                    y = invariant_linear(x, w, cfg)
                    same = torch.equal(y[:1], ref) and (m <= 3 or torch.equal(y[3:4], mid))
                    r["us"][m] = timed_us(lambda: invariant_linear(x, w, cfg))
                    r["same"][m] = bool(same)
                r["max_abs_vs_cublas"] = float((invariant_linear(xs, w, cfg).float() - F.linear(xs, w).float()).abs().max())
            except Exception as e:  # noqa: BLE001 - a config that does not compile here
                r = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            rec["configs"][key] = r
        out["weights"][name] = rec
        print(name, json.dumps({"cublas": rec["cublas_us"], "cublas_same": rec["cublas_row0_same_as_1"]}), flush=True)
        for key, r in rec["configs"].items():
            print("  ", key, json.dumps(r.get("us", r)), "all same:", all(r.get("same", {}).values()) if "same" in r else None,
                  "same as config 0:", all(r.get("same_as_first_config", {}).values()), flush=True)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
