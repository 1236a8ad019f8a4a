"""A candidate for a cheaper exact CPU attention (``--batch-invariant`` on the CPU): MKL's batched GEMM instead of
``cpu_exact.attention``'s six oneDNN calls a layer. Not used by specdec yet.

On the 2-core EPYC (session of 2026-12-05 (third)) ``torch.bmm`` gave a row the same bits at any row count from 8
rows on for SmolLM2's shape (not at 3: a decode step's 3 query heads a KV head, so they are padded to 8; with head 8
and 512 keys or more it took 16 rows: MKL picks kernels by shape) and at any number of extra key
columns in the scores, but the weighted sum's bits changed with its reduction length (192 against 256 keys, trailing
zeros). So here the keys are padded to a multiple of CHUNK and the weighted sum is taken per CHUNK-key chunk, the
chunks added in order by a Python loop (``loop``) or by ``sum`` over the chunk dimension (a trailing zero chunk adds
exact zeros). The sweep checks every position n < N as a 1-row step
against the same position inside verify steps of 2, 3, 5, 8 and 16 rows (SmolLM2's 9 heads, 3 KV heads, head 64);
(every STEP-th position); then it times SDPA, ``cpu_exact.attention`` and this form.

    PYTHONPATH=. python scripts/probe_cpu_bmm_attention.py N STEP CHUNK loop|sum     (e.g. 1100 1 64 loop)
"""
import sys, time, torch, torch.nn.functional as F
from specdec import cpu_exact
torch.manual_seed(0)
H, KV, D = 9, 3, 64
MIN_ROWS, CH = 8, int(sys.argv[3])
SUM = sys.argv[4]

def attn(q, k, v, mask, scale):
    h, t, d = q.shape
    kv, s = k.shape[0], k.shape[1]
    rep = h // kv
    m = rep * t
    pad_s = -s % CH
    pm = max(0, MIN_ROWS - m)
    qg = q.reshape(kv, m, d)
    if pm:
        qg = torch.cat([qg, qg.new_zeros(kv, pm, d)], dim=1)
    if pad_s:
        k = torch.cat([k, k.new_zeros(kv, pad_s, d)], dim=1)
        v = torch.cat([v, v.new_zeros(kv, pad_s, v.shape[2])], dim=1)
    S = s + pad_s
    sc = torch.bmm(qg, k.transpose(1, 2)) * scale  # [kv, M, S]
    live = torch.ones(t, S, dtype=torch.bool)
    live[:, s:] = False
    if mask is not None:
        live[:, :s] = mask
    M = m + pm
    sc[:, :m] = sc[:, :m].view(kv, rep, t, S).masked_fill(~live, float("-inf")).view(kv, m, S)
    p = torch.softmax(sc, dim=-1)  # [kv, M, S]
    c = S // CH
    pc = p.view(kv, M, c, CH).transpose(1, 2).reshape(kv * c, M, CH)
    vc = v.reshape(kv * c, CH, -1)
    parts = torch.bmm(pc, vc).view(kv, c, M, -1)
    o = parts.sum(1) if SUM == "sum" else parts[:, 0]
    for j in range(1, c if SUM == "loop" else 1):
        o = o + parts[:, j]
    return o[:, :m].reshape(h, t, -1)

def mask_for(start, t):
    qpos = torch.arange(start, start + t)[:, None]
    return torch.arange(start + t)[None, :] <= qpos

def sdpa(q, k, v, mask, scale):
    rep = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(rep, 0); v = v.repeat_interleave(rep, 0)
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=None if mask is None else mask[None, None], scale=scale)[0]

with torch.inference_mode():
    bad = total = 0; where = []
    N = int(sys.argv[1])
    K = torch.randn(KV, N + 20, D); V = torch.randn(KV, N + 20, D); Q = torch.randn(H, N + 20, D)
    t0 = time.time()
    for n in range(0, N, int(sys.argv[2])):
        ref = attn(Q[:, n:n + 1], K[:, :n + 1], V[:, :n + 1], None, 0.125)[:, 0]
        for T in (2, 3, 5, 8, 16):
            for i in range(T):
                start = n - i
                if start < 0: continue
                o = attn(Q[:, start:start + T], K[:, :start + T], V[:, :start + T], mask_for(start, T), 0.125)
                total += 1
                if not torch.equal(o[:, i], ref):
                    bad += 1; where.append((n, T, i))
    print(f"chunked: {bad} of {total} differ ({time.time()-t0:.0f} s); first {where[:10]}")
    for n in (64, 256, 1024):
        for T in (1, 5, 16):
            K = torch.randn(KV, n + T, D); V = torch.randn(KV, n + T, D); Q = torch.randn(H, T, D)
            m = mask_for(n, T) if T > 1 else None
            res = []
            for name, fn in (("sdpa", sdpa), ("exact", cpu_exact.attention), ("chunked", attn)):
                for _ in range(20): fn(Q, K, V, m, 0.125)
                t0 = time.perf_counter()
                for _ in range(200): fn(Q, K, V, m, 0.125)
                res.append(f"{name} {(time.perf_counter() - t0) / 200 * 1e6:6.1f}")
            print(f"keys {n + T:5d} rows {T:2d}: " + " | ".join(res) + " us")
