"""Micro-benchmarks on the GPU for the two kernels a decode step is made of (issue 10, issue 14).

    python scripts/micro_kernels.py gemm [--shape qwen3-8b] [--sweep]   # one GPU
    python scripts/micro_kernels.py allreduce                            # two GPUs

``gemm``: for each weight of one layer (and the LM head) of the shape, the time of ``F.linear``
(cuBLAS) at 1 and 16 rows, and of the skinny Triton kernel (``specdec.models.skinny``) at 16
rows (with ``--sweep``: every config of a small grid), with its bitwise row checks: the rows of
an M-row launch equal those of the 16-row launch, for M = 1..16. Weights rotate through copies
that together exceed the L2 cache, so each call reads its weight from memory.

``allreduce``: two processes, NCCL; for [1, hidden] and [16, hidden] bf16 tensors, the time of
one all-reduce inside a captured CUDA graph (64 in a row): NCCL, and symmetric memory's
one-shot all-reduce (P2P loads, no multicast), with a check that both ranks hold the same bits
and that they equal NCCL's sum.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F


def _time_graph(fn, reps: int = 20, inner: int = 50) -> float:
    """Median microseconds of one ``fn()``, captured ``inner`` times in one CUDA graph."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        with torch.cuda.graph(g, stream=s):
            for _ in range(inner):
                fn()
    torch.cuda.current_stream().wait_stream(s)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / inner)
    times.sort()
    return times[len(times) // 2]


def gemm(args) -> dict:
    import skinny_gemm as skinny

    h, inter, nq, nkv, d, vocab = {
        "qwen3-8b": (4096, 12288, 32, 8, 128, 151936),
        "qwen3.5-9b": (4096, 12288, 16, 4, 256, 248320),
        "smollm2-135m": (576, 1536, 9, 3, 64, 49152),
    }[args.shape]
    weights = {"qkv": (nq * d + 2 * nkv * d, h), "o": (h, nq * d), "gate_up": (2 * inter, h),
               "down": (h, inter), "lm_head": (vocab, h)}
    dev = "cuda"
    bw_x = torch.empty(1 << 28, dtype=torch.uint8, device=dev)
    bw = _time_graph(lambda: bw_x[: 1 << 27].copy_(bw_x[1 << 27:]), inner=10)
    bandwidth = 2 * (1 << 27) / (bw * 1e-6)
    grid = [(bn, bk, wp, st) for bn in (16, 32, 64) for bk in (128, 256, 512) for wp in (4,) for st in (3, 4, 6)]
    out = {"shape": args.shape, "copy_bandwidth_GBps": bandwidth / 1e9, "weights": {}}
    for name, (n, k) in weights.items():
        copies = max(2, int(200e6 // (n * k * 2)) + 1)
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x16 = torch.randn(16, k, device=dev, dtype=torch.bfloat16)
        it = [0]

        def nxt():
            it[0] = (it[0] + 1) % copies
            return ws[it[0]]

        def t(fn):
            return _time_graph(lambda: fn(nxt()))
        row = {"n": n, "k": k, "bytes": n * k * 2,
               "cublas_1": t(lambda w: F.linear(x16[:1], w)), "cublas_16": t(lambda w: F.linear(x16, w))}
        cfgs = grid if args.sweep else [skinny.config(n, k)]
        best = None
        for cfg in cfgs:
            if k % cfg[1] and k < cfg[1]:
                continue
            try:
                us = t(lambda w: skinny.launch(x16, w, None, cfg))
            except Exception as e:  # a config that does not fit (shared memory)
                row.setdefault("failed", []).append(f"{cfg}: {type(e).__name__}")
                continue
            row.setdefault("configs", {})[str(cfg)] = us
            if best is None or us < best[1]:
                best = (cfg, us)
        row["default_cfg"] = str(skinny.config(n, k))
        row["skinny_16_default"] = row.get("configs", {}).get(str(skinny.config(n, k)))
        row["best_cfg"], row["skinny_16_best"] = str(best[0]), best[1]
        w = ws[0]
        y16 = skinny.launch(x16, w, None, best[0])
        row["prefix_equal_all_M"] = all(torch.equal(skinny.launch(x16[:m].contiguous(), w, None, best[0]), y16[:m])
                                        for m in range(1, 17))
        row["default_prefix_equal"] = all(torch.equal(skinny.launch(x16[:m].contiguous(), w, None), skinny.launch(x16, w, None)[:m])
                                          for m in (1, 5, 16))
        ref = x16.float() @ w.float().T
        row["max_rel_err_vs_fp32"] = ((y16.float() - ref).abs().max() / ref.abs().max()).item()
        row["cublas_16_row0_equals_cublas_1"] = torch.equal(F.linear(x16, w)[:1], F.linear(x16[:1], w))
        for key in ("cublas_1", "cublas_16", "skinny_16_best"):
            row[key + "_GBps"] = n * k * 2 / (row[key] * 1e-6) / 1e9
        out["weights"][name] = row
        print(f"{name:8s} [{n}x{k}] cublas M=1 {row['cublas_1']:.1f} us, M=16 {row['cublas_16']:.1f} us; skinny M=16 "
              f"default {row['skinny_16_default']} best {best[1]:.1f} us {best[0]}; "
              f"{row['skinny_16_best_GBps']:.0f} GB/s of {bandwidth / 1e9:.0f}; M-invariant {row['prefix_equal_all_M']}",
              flush=True)
        del ws
    return out


def _ar_worker(rank: int, world: int, port: int, hidden: int, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    res = {}
    try:
        import torch.distributed._symmetric_memory as symm
        group = dist.group.WORLD
        buf = symm.empty(16 * hidden, dtype=torch.bfloat16, device=f"cuda:{rank}")
        symm.rendezvous(buf, group.group_name)
        have_symm = True
    except Exception as e:
        res["symm_error"] = f"{type(e).__name__}: {e}"
        have_symm = False
    for rows in (1, 16):
        torch.manual_seed(rank * 100 + rows)
        x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        y = x.clone()
        dist.all_reduce(y)
        nccl_bits = y.clone()
        z = x.clone()
        res[f"nccl_{rows}"] = _time_graph(lambda: dist.all_reduce(z))
        if have_symm:
            try:
                n = rows * hidden
                view = buf[:n]

                def one_shot():
                    view.copy_(x.view(-1))
                    return torch.ops.symm_mem.one_shot_all_reduce(view, "sum", group.group_name)
                o = one_shot().view(rows, hidden)
                res[f"symm_one_shot_equals_nccl_{rows}"] = torch.equal(o, nccl_bits)
                gathered = [torch.empty_like(o) for _ in range(world)]
                dist.all_gather(gathered, o.contiguous())
                res[f"symm_same_on_ranks_{rows}"] = all(torch.equal(gathered[0], g) for g in gathered)
                res[f"symm_one_shot_{rows}"] = _time_graph(one_shot)
            except Exception as e:
                res[f"symm_error_{rows}"] = f"{type(e).__name__}: {e}"
    if rank == 0:
        q.put(res)
    dist.barrier()
    dist.destroy_process_group()


def allreduce(args) -> dict:
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    mp.start_processes(_ar_worker, args=(2, 29531, args.hidden, q), nprocs=2, join=True, start_method="spawn")
    res = q.get()
    res.update(hidden=args.hidden, env={k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_SYMM"))})
    print(json.dumps(res, indent=1), flush=True)
    return res


def attn(args) -> dict:
    """Is a masked SDPA row the same bits whatever the span of cache it reads (the masked tail
    growing)? The serving loop could then attend over the live context only."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    out = {}
    torch.manual_seed(0)
    for b, h, hkv, d in ((32, 9, 3, 64), (1, 32, 8, 128)):
        for t in (1, 16):
            q = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(b, h, 8192, d, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            live = 300
            for name, be in (("default", None), ("efficient", SDPBackend.EFFICIENT_ATTENTION), ("math", SDPBackend.MATH)):
                def run(span):
                    m = torch.full((b, 1, t, span), float("-inf"), device="cuda", dtype=torch.bfloat16)
                    m[..., :live] = 0
                    if be is None:
                        return F.scaled_dot_product_attention(q, k[:, :, :span], v[:, :, :span], attn_mask=m)
                    with sdpa_kernel([be]):
                        return F.scaled_dot_product_attention(q, k[:, :, :span], v[:, :, :span], attn_mask=m)
                ref = run(512)
                key = f"b{b}_h{h}_d{d}_t{t}_{name}"
                out[key] = {str(sp): torch.equal(ref, run(sp)) for sp in (1024, 2048, 4096, 8192)}
                out[key + "_us"] = {str(sp): _time_graph(lambda: run(sp), reps=5, inner=10) for sp in (512, 8192)}
    print(json.dumps(out, indent=1), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["gemm", "allreduce", "attn"])
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("micro_kernels: needs CUDA")
    res = {"gemm": gemm, "allreduce": allreduce, "attn": attn}[args.what](args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
