"""models/fused_layer.py on the GPU: its four kernels against their torch reference, a row's bits at
every row count, their times against the unfused ops (cuBLAS and fused_ops), and a random-weight
shape's logits and greedy tokens with the fused layers on and off.

    PYTHONPATH=. python scripts/check_fused_layer.py [--shape smollm2-135m] [--json out.json]

Prints one line per check (``ok`` / ``FAIL``) and a table of kernel times (us, CUDA graphs of 50
calls); exits 1 if a check failed.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from specdec.models import fused_layer as fl
from specdec.models import fused_ops

FAILED = []


def check(name, ok, detail=""):
    print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        FAILED.append(name)


def graph_us(fn, calls=50, reps=5) -> float:
    """Median per-call time of ``fn`` captured ``calls`` times in one CUDA graph."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


def kernels(hidden: int, inter: int, qkv: int, rows: int, res: dict) -> None:
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=g, device=dev) * s).to(dt)
    x, d = rnd(512, hidden), rnd(512, hidden)
    scale = torch.rand(hidden, generator=g, device=dev) + 0.5
    w_qkv, w_o = rnd(qkv, hidden, s=hidden ** -0.5), rnd(hidden, hidden, s=hidden ** -0.5)
    w_gu, w_d = rnd(2 * inter, hidden, s=hidden ** -0.5), rnd(hidden, inter, s=inter ** -0.5)
    act_in = rnd(512, inter)
    cases = {"qkv (add+norm)": (x, w_qkv, dict(scale=scale, eps=1e-5, delta=d)),
             "o (gemm)": (x, w_o, {}),
             "gate_up (add+norm+silu)": (x, w_gu, dict(scale=scale, eps=1e-5, delta=d, silu=True)),
             "down (gemm)": (act_in, w_d, {})}
    for name, (inp, w, kw) in cases.items():
        def run(m, inp=inp, w=w, kw=kw):
            kk = dict(kw)
            if "delta" in kk:
                kk["delta"] = kk["delta"][:m]
            out = fl.norm_linear(inp[:m], w, **kk)
            return out[1] if "delta" in kk else out
        full = run(512)
        ref = fl.reference(inp, w, **kw)
        ref = ref[1] if "delta" in kw else ref
        err = (full.float() - ref.float()).abs().max().item()
        scale_ref = ref.float().abs().max().item()
        check(f"{name}: equals the torch reference", err <= 0.02 * max(scale_ref, 1.0), f"(max diff {err:.3g}, |ref| {scale_ref:.3g})")
        bad = [m for m in (1, 2, 5, 15, 16, 17, 31, 64, 128, 200) if not torch.equal(run(m), full[:m])]
        check(f"{name}: rows keep their bits at 1..512 rows", not bad, f"(differ at {bad})" if bad else "")
        fused_us = graph_us(lambda: run(rows))
        # the unfused ops this kernel replaces
        xi, di = inp[:rows], (kw["delta"][:rows] if "delta" in kw else None)

        def unfused(xi=xi, di=di, w=w, kw=kw):
            h = xi
            if "scale" in kw:
                h = fused_ops.rms_norm(xi, kw["scale"], 1e-5, residual=di)[1] if di is not None else fused_ops.rms_norm(xi, kw["scale"], 1e-5)
            y = F.linear(h, w)
            return fused_ops.silu_mul(y) if kw.get("silu") else y
        res.setdefault("kernels_us", {})[name] = {"fused": round(fused_us, 2), "unfused": round(graph_us(unfused), 2)}
        print(f"  {name}: {rows} rows, fused {fused_us:.2f} us, unfused {res['kernels_us'][name]['unfused']:.2f} us", flush=True)


def model_check(shape: str, res: dict) -> None:
    from specdec.shapes import build_shape
    m = build_shape(shape, torch.device("cuda"), torch.bfloat16)
    on = [layer.fused_path for layer in m.layers]
    check(f"{shape}: every layer takes the fused path", all(on), f"({sum(on)}/{len(on)})")
    ids = torch.randint(0, 1000, (160,), generator=torch.Generator().manual_seed(1)).cuda()
    outs = {}
    for enabled in (False, True):
        fl.ENABLED = enabled
        try:
            with torch.inference_mode():
                outs[enabled] = m(ids, m.new_cache(200), logits="all").logits
        finally:
            fl.ENABLED = True
    a, b = outs[False], outs[True]
    rel = ((a - b).norm() / a.norm()).item()
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    res["logits_rel_diff"], res["argmax_agree"] = rel, agree
    check(f"{shape}: logits fused vs unfused", rel < 0.02 and agree > 0.9, f"(relative diff {rel:.2e}, argmax agree {agree:.3f})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--rows", type=int, default=16, help="rows of the timed calls (default 16)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("check_fused_layer: needs CUDA", file=sys.stderr)
        return 2
    from specdec.shapes import shape_config
    c = shape_config(a.shape)[1]
    qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    res = {"shape": a.shape, "rows": a.rows, "tile": list(fl.TILE)}
    kernels(c.hidden_size, c.intermediate_size, qkv, a.rows, res)
    model_check(a.shape, res)
    res["failed"] = FAILED
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump(res, fh, indent=1)
    print(f"{len(FAILED)} failed")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
