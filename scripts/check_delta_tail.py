"""The Gated DeltaNet tail kernel (delta_kernel.recurrent_out_proj: the recurrence, the output norm and out_proj as
one persistent kernel) alone on the GPU, at the qwen3.5-35b-a3b shape's sizes, against the three kernels it replaces
(recurrent_into_cache, gated_norm, fused_layer.linear):

- time: 30 layers (each its own out_proj weight, read from memory) in one CUDA graph, us a layer, at 1, 4 and 16 rows;
- where its time goes: %globaltimer stamps of each program (its start, the PDL wait, the recurrence's end, the
  barrier, its end) in one eager launch: medians across programs, us from the earliest start;
- bits: a 16-row step's rows against 16 chained 1-row steps (each row's bits its own), for both forms; the tail's
  output against the three kernels' (not bit-equal: another sum order);
- its barrier's timeouts (0).

    python scripts/check_delta_tail.py [--layers 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from micro_kernels import _time_graph  # scripts/ (this script's folder) is on the path

from specdec.models import delta_kernel, fused_layer

H, HK, DK, DV, N, NS = 32, 16, 128, 128, 2048, 17  # the 35b shape's DeltaNet: value/key heads, head sizes, hidden


def inputs(t: int, dev, seed: int = 0):
    g0 = torch.Generator(device="cpu").manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g0).to(dev)
    q = torch.nn.functional.normalize(r(t, HK, DK), dim=-1) * DK ** -0.5
    k = torch.nn.functional.normalize(r(t, HK, DK), dim=-1)
    v = r(t, H, DV)
    g = -torch.rand(t, H, generator=g0).to(dev) * 0.5
    beta = torch.rand(t, H, generator=g0).to(dev)
    z = r(t, H * DV).to(torch.bfloat16)
    return q, k, v, g, beta, z


def three(q, k, v, g, beta, states, start, z, nw, w):
    o = delta_kernel.recurrent_into_cache(q, k, v, g, beta, states, start, None)
    return fused_layer.linear(delta_kernel.gated_norm(o, z, nw, 1e-6), w)


def tail(q, k, v, g, beta, states, start, z, nw, w, stamps=None):
    return delta_kernel.recurrent_out_proj(q, k, v, g, beta, states, start, None, z, nw, 1e-6, w, stamps)


def chained(fn, ins, states, start, nw, w):
    """Row by row: 1-row steps from ``start``, each on the state the one before left."""
    outs = []
    for i in range(ins[0].shape[0]):
        q, k, v, g, beta, z = (x[i:i + 1] for x in ins)
        outs.append(fn(q, k, v, g, beta, states, start + i, z, nw, w))
    return torch.cat(outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("check_delta_tail: needs a CUDA GPU")
    dev = torch.device("cuda")
    delta_kernel.TAIL = True
    nw = (1 + 0.1 * torch.randn(DV, device=dev)).float()
    ws = [torch.randn(N, H * DV, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(a.layers)]
    if not delta_kernel.tail_fits(ws[0], H, DV):
        raise SystemExit("check_delta_tail: the tail kernel does not fit this GPU (tail_fits)")
    base = torch.randn(NS, H, DK, DV, device=dev) * 0.1
    res = {"device": torch.cuda.get_device_name(dev), "layers": a.layers, "rows": {}}
    for t in (1, 4, 16):
        ins = inputs(t, dev)
        st = [base.clone() for _ in range(a.layers)]
        row = {}
        for name, fn, form in (("three", three, None), ("tail", tail, (8, True)), ("tail16", tail, (16, True)),
                               ("tail_l2", tail, (8, False))):
            if form:
                delta_kernel.TAIL_WARPS, delta_kernel.TAIL_RESIDENT = form
            row[f"{name}_us_a_layer"] = round(_time_graph(
                lambda: [fn(*ins[:5], st[i], 3, ins[5], nw, ws[i]) for i in range(a.layers)], reps=10, inner=1)
                / a.layers, 2)
        delta_kernel.TAIL_WARPS, delta_kernel.TAIL_RESIDENT = 8, True
        y3 = three(*ins[:5], base.clone(), 3, ins[5], nw, ws[0])
        yt = tail(*ins[:5], base.clone(), 3, ins[5], nw, ws[0])
        row["tail_vs_three_max_rel"] = float(((yt.float() - y3.float()).abs().max() / y3.float().abs().max()).item())
        if t > 1:  # a row's bits: in the t-row step against chained 1-row steps
            for name, fn in (("three", three), ("tail", tail)):
                full = fn(*ins[:5], base.clone(), 3, ins[5], nw, ws[0])
                rows = chained(fn, ins, base.clone(), 3, nw, ws[0])
                row[f"{name}_rows_equal_chained"] = bool(torch.equal(full, rows))
        stamps = torch.zeros(N // delta_kernel.TAIL_ROWS, 5, dtype=torch.int64, device=dev)
        torch.cuda._sleep(1000)  # (a queue ahead of the launch: the programs start together)
        tail(*ins[:5], base.clone(), 3, ins[5], nw, ws[-1], stamps)
        torch.cuda.synchronize()
        s = (stamps - stamps[:, 0].min()).double().cpu() / 1e3
        row["stamps_us_median"] = {k: round(statistics.median(s[:, i].tolist()), 2)
                                   for i, k in enumerate(("start", "waited", "recurrence", "barrier", "end"))}
        row["stamps_us_max"] = {k: round(max(s[:, i].tolist()), 2)
                                for i, k in enumerate(("start", "waited", "recurrence", "barrier", "end"))}
        res["rows"][t] = row
        print(t, json.dumps(row), flush=True)
    res["timeouts"] = int(delta_kernel.tail_state(dev)[2].item())
    res["compiled"] = {str(k): c for k, c in delta_kernel.TAIL_COMPILED.items()}
    print(json.dumps({k: res[k] for k in ("device", "timeouts", "compiled")}))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
