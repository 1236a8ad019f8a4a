"""Which CPU kernels give a row the same bits at every row count (the groundwork for an exact CPU eager path).

1. oneDNN's fp32 matmul (``specdec.cpu_linear``): row 0 of an M-row product against row 0 of a 2-row one, for
   M = 2..600, and every 37th row of a 600-row product against the same row in a 2-row one; then 1 row (a GEMV).
2. The CPU's SDPA: row 0's bits at 1..16 query rows (masked by position, the live keys only).
3. The packed layout (``cpu_linear.packed``): the plain layout's bits?, 1 row alone and padded to 2 rows.
4. An attention written on oneDNN GEMMs (per KV head: scores and the weighted sum as linears, fp32 softmax): the
   same check, and its time against SDPA's.

    PYTHONPATH=. python scripts/probe_cpu_row_invariance.py [--threads 2]

On the 2-core AMD EPYC of the session of 2026-12-04 (sixth): (1) invariant from 2 rows on, 1 row differs; (2) not
invariant; (4) invariant at 1-16 rows, 300-380 us a layer against SDPA's 81-399 us (SmolLM2's 9 heads, 3 KV heads).
Session of 2026-12-05 (``benchmarks/session33_cpu/probe_cpu_row_invariance.txt``): (3) the plain layout's bits at 2 rows
or more, a row's bits at 2..64 rows, 1 row alone differs where K > 576 (1,536, 4,096), 1 row padded to 2 rows has
the bits and costs the same or less (576 x 1,536: 140 -> 117 us; the head 4,685 -> 4,782 us). With packed weights and
1-row calls padded to 2, every linear is row-invariant at no cost; the attention (4: ~18 us a oneDNN call, 6 a layer)
is what an exact CPU eager path would pay for.
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


def packed_check() -> None:
    """oneDNN's packed layout (``cpu_linear.packed``): its bits against the plain layout's at 2, 5 and 16 rows, whether
    a row keeps them from 2 to 64 rows, and whether 1 row (alone, or padded to 2) has them; time of 1 row alone
    and padded to 2 rows, weights cycled out of the caches."""
    for n, k in [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (4096, 4096)]:
        w, x = torch.randn(n, k), torch.randn(64, k)
        p = torch.ops.mkldnn._reorder_linear_weight(w, 16)
        as_plain = all(torch.equal(onednn(x[:m], p), onednn(x[:m], w)) for m in (2, 5, 16))
        full = onednn(x, p)
        keeps = all(torch.equal(onednn(x[j:j + 2], p)[0], full[j]) for j in range(0, 63, 7))
        one = torch.equal(onednn(x[:1], p)[0], full[0])
        padded = torch.equal(onednn(torch.cat([x[:1], torch.zeros(1, k)]), p)[0], full[0])
        copies = [torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k), 16) for _ in range(max(2, int(4e7 / (n * k * 4))))]
        times = []
        for rows in (x[:1], torch.cat([x[:1], torch.zeros(1, k)])):
            for c in copies:
                onednn(rows, c)
            t0 = time.perf_counter()
            for _ in range(5):
                for c in copies:
                    onednn(rows, c)
            times.append((time.perf_counter() - t0) / (5 * len(copies)) * 1e6)
        print(f"packed {n} x {k}: the plain layout's bits at 2/5/16 rows {as_plain}; a row's bits at 2..64 rows {keeps}; "
              f"1 row has them {one}, padded to 2 rows {padded}; 1 row {times[0]:.0f} us, padded {times[1]:.0f} us")


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
        packed_check()
        attention_check()


if __name__ == "__main__":
    main()
