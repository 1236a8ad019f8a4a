"""A probe for issue 10's persistent-kernel question, on the GPU: what a qwen3.5-35b-a3b layer's dependent chain would
cost inside one kernel of P programs instead of ~11 kernels (BENCHMARKS.md, 2026-12-07 (thirteenth): 85 % of the bound
needs the chain gone and the 2048-wide projections at full rate).

    python scripts/probe_persistent.py [--programs 128] [--rounds 20] [--json out.json]

It times, with %globaltimer (ns) inside the kernels:

- ``barrier``: all P programs passing a grid-wide barrier (each counts in with a release atomic, then polls the count
  with acquire loads until it reaches P); the latency from the last program's arrival to the last one's departure;
- ``gemv``: a 1-row GEMV of the out_proj's [2048, 4096] bf16 weight (BN rows a program) that waits for a flag another
  program raises after a delay (what a persistent kernel's next phase waits for), from the flag to the last program's
  store: with each program's weight rows loaded into registers before the flag (``resident``: streamed while the
  phase before runs) and after it (``streamed``, as a kernel of its own loads them), the flag raised 4, 8 or 30 us
  after the kernel's start (``--delays``), the weight read from memory (copies in turn past the L2);
- for reference, the shipped GEMM (``fused_layer.linear``) on that weight at 1 row, one call of 50 in a captured graph,
  its weight rotating through copies past the L2.

Every program must be resident at once (P at most the SM count): a bounded poll records a timeout (never a hang) where
one is not. Nothing here is a kernel that decoding runs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

POLLS = 1 << 22  # a poll's bound: a program gives up (and says so) after this many reads

if triton is not None:
    @triton.jit
    def _now():
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)

    @triton.jit
    def _barrier_kernel(count, times, fails, P: tl.constexpr, ROUNDS: tl.constexpr, POLLS: tl.constexpr):
        pid = tl.program_id(0)
        for r in range(ROUNDS):
            t0 = _now()
            seen = tl.atomic_add(count, 1, sem="release", scope="gpu") + 1
            n = 0
            while (seen < (r + 1) * P) & (n < POLLS):
                seen = tl.atomic_add(count, 0, sem="acquire", scope="gpu")
                n += 1
            t1 = _now()
            tl.store(times + (r * P + pid) * 2, t0)
            tl.store(times + (r * P + pid) * 2 + 1, t1)
            tl.atomic_add(fails, (n >= POLLS).to(tl.int32))

    @triton.jit
    def _gemv_kernel(w, x, y, flag, times, fails, delay_ns, K: tl.constexpr, BN: tl.constexpr,
                     RESIDENT: tl.constexpr, POLLS: tl.constexpr):
        pid = tl.program_id(0)
        rn = pid * BN + tl.arange(0, BN)
        rk = tl.arange(0, K)
        if RESIDENT:  # this program's rows into registers while the phase before still runs
            wt = tl.load(w + rn[:, None] * K + rk[None, :])
        if pid == 0:  # the phase before: a wait, then the flag
            t0 = _now()
            t = t0
            while t - t0 < delay_ns:
                t = _now()
            tl.atomic_xchg(flag, 1, sem="release", scope="gpu")
            tl.store(times, _now())
        f = tl.atomic_add(flag, 0, sem="acquire", scope="gpu")
        n = 0
        while (f == 0) & (n < POLLS):
            f = tl.atomic_add(flag, 0, sem="acquire", scope="gpu")
            n += 1
        xv = tl.load(x + rk).to(tl.float32)
        if not RESIDENT:
            wt = tl.load(w + rn[:, None] * K + rk[None, :])
        acc = tl.sum(wt.to(tl.float32) * xv[None, :], axis=1)
        tl.store(y + rn, acc.to(y.dtype.element_ty))
        tl.store(times + 1 + pid, _now())
        tl.atomic_add(fails, (n >= POLLS).to(tl.int32))


def barrier(p: int, rounds: int, dev) -> dict:
    count = torch.zeros(1, dtype=torch.int32, device=dev)
    fails = torch.zeros(1, dtype=torch.int32, device=dev)
    times = torch.zeros(rounds, p, 2, dtype=torch.int64, device=dev)
    _barrier_kernel[(p,)](count, times, fails, P=p, ROUNDS=rounds, POLLS=POLLS, num_warps=4)
    torch.cuda.synchronize(dev)
    t = times.double().cpu()
    lat = [(t[r, :, 1].max() - t[r, :, 0].max()).item() / 1e3 for r in range(rounds)]
    spread = [(t[r, :, 0].max() - t[r, :, 0].min()).item() / 1e3 for r in range(rounds)]
    return {"programs": p, "rounds": rounds, "timeouts": int(fails.item()),
            "us_last_arrival_to_last_departure": round(statistics.median(lat[1:]), 3),
            "us_arrival_spread": round(statistics.median(spread[1:]), 3)}


def gemv(p: int, n: int, k: int, resident: bool, reps: int, dev, delay_us: float) -> dict:
    """The GEMV after a flag raised ``delay_us`` after the kernel starts, its weight one of 6 copies in turn (96 MB:
    each rep reads its copy from memory, not the L2)."""
    bn = n // p
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(6)]
    x = torch.randn(k, device=dev, dtype=torch.bfloat16)
    lat, fails_total, err = [], 0, 0.0
    for i in range(reps):
        w = ws[i % len(ws)]
        y = torch.empty(n, device=dev, dtype=torch.bfloat16)
        flag = torch.zeros(1, dtype=torch.int32, device=dev)
        fails = torch.zeros(1, dtype=torch.int32, device=dev)
        times = torch.zeros(1 + p, dtype=torch.int64, device=dev)
        torch.cuda._sleep(1000)  # (a queue ahead of the launch: the programs start together)
        _gemv_kernel[(p,)](w, x, y, flag, times, fails, int(delay_us * 1e3), K=k, BN=bn, RESIDENT=resident,
                           POLLS=POLLS, num_warps=8)
        torch.cuda.synchronize(dev)
        t = times.double().cpu()
        lat.append((t[1:].max() - t[0]).item() / 1e3)
        fails_total += int(fails.item())
        ref = (w.float() @ x.float()).to(torch.bfloat16)  # (after the kernel: this read puts w in the L2)
        err = max(err, (y.float() - ref.float()).abs().max().item())
    return {"form": "resident" if resident else "streamed", "delay_us": delay_us, "programs": p, "rows_a_program": bn,
            "n": n, "k": k,
            "timeouts": fails_total, "max_abs_err_vs_fp32": round(err, 4),
            "us_flag_to_last_store": round(statistics.median(lat), 3), "us_min": round(min(lat), 3)}


def shipped(n: int, k: int, dev) -> dict:
    from micro_kernels import _time_graph  # (scripts/ is the script's folder)
    from specdec.models import fused_layer

    copies = itertools.cycle([torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(6)])  # past the L2
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    us = _time_graph(lambda: fused_layer.linear(x, next(copies)), reps=10)  # each captured call on the next copy
    return {"form": "fused_layer.linear, 1 row, one of 50 in a graph", "n": n, "k": k,
            "tiling": list(fused_layer.tile_for(n, k, False)), "us": round(us, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--programs", type=int, default=128, help="programs of the probe kernels (at most the SM count)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--delays", default="4,8,30", help="us before the flag (the phase before's length), comma-separated")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if triton is None or not torch.cuda.is_available():
        raise SystemExit("probe_persistent: needs a CUDA GPU and Triton")
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    if a.programs > sms:
        raise SystemExit(f"probe_persistent: --programs {a.programs} exceeds the {sms} SMs (the barrier would hang)")
    res = {"device": torch.cuda.get_device_name(dev), "sms": sms,
           "barrier": barrier(a.programs, a.rounds, dev),
           "gemv": [gemv(a.programs, 2048, 4096, r, a.reps, dev, float(d)) for d in a.delays.split(",")
                    for r in (True, False)],
           "shipped": shipped(2048, 4096, dev)}
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
