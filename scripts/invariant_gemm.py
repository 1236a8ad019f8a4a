"""A row-count-invariant GEMM (Triton) and its check against cuBLAS: ``y = x @ W^T`` where a row's
bits never depend on how many rows ``x`` has (issue 10/11 groundwork; an experiment, not wired in).

cuBLAS picks its kernel by shape: on the H200 the qwen3-8b shape's o and down projections give a
row other bits at 32 rows than at 512 (scripts/check_width_invariance.py), so a step's width and
slot count change a row's bits, and exact serving must run every step at one shape. Here one kernel
config per weight (never per row count) tiles the output ``BM x BN``, walks K in ``BK`` blocks in
order and accumulates in fp32: every row goes through the same instructions in the same order for
any M; M is not specialised on. Programs run M-tile fastest, so the M-tiles of one weight tile run
side by side and read it from L2, not once each from memory.

    python scripts/invariant_gemm.py [--shape qwen3-8b] [--json out.json]

reports, per weight and row count, cuBLAS and each config's time (CUDA graph of 20 calls), and
whether row 0 (and a middle row) keeps the bits it has at 1 row.
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs have no Triton
    triton = None

CONFIGS = [(64, 64, 64, 4, 4), (64, 32, 128, 4, 4), (64, 128, 64, 4, 3), (128, 64, 64, 8, 3), (64, 64, 128, 4, 3),
           (128, 128, 64, 8, 3), (64, 16, 256, 4, 3), (16, 64, 128, 4, 4)]
ROWS = (1, 4, 16, 32, 64, 128, 256, 512)

if triton is not None:
    @triton.jit(do_not_specialize=["M"])
    def _kernel(x, w, y, M, N, K, sxm, swn, sym, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BM)
        pid_m = pid % num_m
        pid_n = pid // num_m
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + rk
            a = tl.load(x + rm[:, None] * sxm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
            b = tl.load(w + rn[None, :] * swn + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
            acc = tl.dot(a, b, acc)
        tl.store(y + rm[:, None] * sym + rn[None, :], acc.to(y.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def invariant_linear(x: torch.Tensor, w: torch.Tensor, cfg=CONFIGS[0]) -> torch.Tensor:
    bm, bn, bk, warps, stages = cfg
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    m, k = x2.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _kernel[grid](x2, w, y, m, n, k, x2.stride(0), w.stride(0), y.stride(0), BM=bm, BN=bn, BK=bk,
                  num_warps=warps, num_stages=stages)
    return y.reshape(*x.shape[:-1], n)


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
