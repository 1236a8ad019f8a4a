"""Which CPU kernels give a row the same bits at every row count (the groundwork for an exact CPU eager path).

1. oneDNN's fp32 matmul (``specdec.cpu_linear``): row 0 of an M-row product against row 0 of a 2-row one, for
   M = 2..600, and every 37th row of a 600-row product against the same row in a 2-row one; then 1 row (a GEMV).
2. The CPU's SDPA: row 0's bits at 1..16 query rows (masked by position, the live keys only).
3. An attention written on oneDNN GEMMs (per KV head: scores and the weighted sum as linears, fp32 softmax): the
   same check, and its time against SDPA's.

    PYTHONPATH=. python scripts/probe_cpu_row_invariance.py [--threads 2]

On the 2-core AMD EPYC of the session of 2026-12-04 (sixth): (1) invariant from 2 rows on, 1 row differs; (2) not
invariant; (3) invariant at 1-16 rows, 300-380 us a layer against SDPA's 81-399 us (SmolLM2's 9 heads, 3 KV heads).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def onednn(x, w):
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def gemm_check() -> None:
    counts = list(range(2, 34)) + [47, 64, 65, 100, 128, 129, 200, 256, 300, 512, 600]
    for n, k in [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (64, 32), (97, 32)]:
        w, x = torch.randn(n, k), torch.randn(600, k)
        ref = onednn(x[:2], w)[0]
        differ = [m for m in counts if not torch.equal(onednn(x[:m], w)[0], ref)]
        full = onednn(x, w)
        rows = [j for j in range(0, 600, 37) if not torch.equal(full[j], onednn(torch.stack([x[j], x[0]]), w)[0])]
        one = torch.equal(onednn(x[:1], w)[0], ref)
        print(f"oneDNN {n} x {k}: row 0 differs at M = {differ}; rows of a 600-row product that differ: {rows}; "
              f"1 row gives the same bits: {one}")


def attention_rowinv(q, k, v, pos0, scale, rep):
    """``q [H, T, d]``, ``k, v [Hkv, L, d]``; row t sees keys up to ``pos0 + t``."""
    t, n = q.shape[1], k.shape[1]
    seen = torch.arange(n)[None, :] <= (pos0 + torch.arange(t))[:, None]
    outs = []
    for g in range(k.shape[0]):
        s = onednn(q[g * rep:(g + 1) * rep].reshape(rep * t, -1), k[g]) * scale
        p = torch.softmax(s.view(rep, t, n).masked_fill(~seen, float("-inf")), dim=-1).view(rep * t, n)
        outs.append(onednn(p, v[g].t()).view(rep, t, -1))
    return torch.cat(outs, 0)


def attention_sdpa(q, k, v, pos0, scale, rep):
    t, n = q.shape[1], k.shape[1]
    seen = torch.arange(n)[None, :] <= (pos0 + torch.arange(t))[:, None]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0), attn_mask=seen)


def attention_check(heads: int = 9, kv_heads: int = 3, d: int = 64) -> None:
    rep = heads // kv_heads
    for ctx in (64, 300, 1000):
        k, v, q = torch.randn(kv_heads, ctx + 16, d), torch.randn(kv_heads, ctx + 16, d), torch.randn(heads, 16, d)

        def run(t, f):
            return f(q[:, :t], k[:, :ctx + t], v[:, :ctx + t], ctx, d ** -0.5, rep)

        line = [f"context {ctx}:"]
        for name, f in (("SDPA", attention_sdpa), ("oneDNN attention", attention_rowinv)):
            ref = run(1, f)[:, 0]
            differ = [t for t in range(1, 17) if not torch.equal(run(t, f)[:, 0], ref)]
            times = []
            for t in (1, 16):
                for _ in range(20):
                    run(t, f)
                t0 = time.perf_counter()
                for _ in range(200):
                    run(t, f)
                times.append((time.perf_counter() - t0) / 200 * 1e6)
            line.append(f"{name}: row 0 differs from 1 row at T = {differ}, {times[0]:.0f} / {times[1]:.0f} us at 1 / 16 rows;")
        print(" ".join(line))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    with torch.inference_mode():
        gemm_check()
        attention_check()


if __name__ == "__main__":
    main()
