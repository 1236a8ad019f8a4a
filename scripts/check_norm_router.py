"""A MoE layer's post-mixer add and norm with the router's GEMM (``expert_kernel.norm_router``) on the GPU, at a
shape's sizes (hidden size, router rows with the shared gate's):

- the sum and the norm against ``fused_ops.rms_norm`` (bitwise: the two kernels must agree where both run);
- the logits against the torch form (``F.linear`` of the norm: other bits expected, not other values) and against the
  router's GEMM of the MoE kernels (``fused_layer.linear``);
- a row's bits alone, among 4 and among 16 rows, and with padding rows (``live``);
- the two forms' time: the norm kernel then the router's GEMM, against the one kernel (a CUDA graph of 40 of each, one
  weight copy each so that the router is read from memory as in a step; the best of 5 replays).

    python scripts/check_norm_router.py [--shape qwen3.5-35b-a3b] [--json F]
"""
import argparse
import json

import torch
import torch.nn.functional as F

from invariant_gemm import timed_us  # scripts/: a CUDA graph's replay time
from specdec.models import expert_kernel, fused_layer, fused_ops
from specdec.shapes import SHAPES


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3.5-35b-a3b")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    d = SHAPES[a.shape]
    n, e = d["hidden_size"], d["num_experts"] + (1 if d.get("shared_expert_intermediate_size") else 0)
    g = torch.Generator(device="cuda").manual_seed(0)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x, dl = torch.randn(16, n, generator=g, **bf), torch.randn(16, n, generator=g, **bf)
    scale = 1.0 + 0.1 * torch.randn(n, device="cuda", generator=g)
    routers = [torch.randn(e, n, generator=g, **bf) * 0.05 for _ in range(40)]
    r = routers[0]
    out = {"shape": a.shape, "hidden": n, "router_rows": e}
    with torch.no_grad():
        s, y, lg = expert_kernel.norm_router(x, dl, scale, 1e-6, r)
        ws, wy = fused_ops.rms_norm(x, scale, 1e-6, residual=dl)
        out["sum_norm_bits_equal"] = bool(torch.equal(s, ws) and torch.equal(y, wy))
        out["max_diff_vs_torch"] = (lg.float() - F.linear(wy, r).float()).abs().max().item()
        out["max_diff_vs_gemm"] = (lg.float() - fused_layer.linear(wy, r).float()).abs().max().item()
        out["logit_scale"] = lg.float().abs().max().item()
        rows = {}
        for t in (1, 4, 16):
            rows[t] = torch.equal(expert_kernel.norm_router(x[:t], dl[:t], scale, 1e-6, r)[2], lg[:t])
        out["row_bits_alone_and_among"] = {str(t): bool(v) for t, v in rows.items()}
        live = torch.tensor(3, device="cuda")
        ps, py, pl = expert_kernel.norm_router(x, dl, scale, 1e-6, r, live)
        out["padding_rows_ok"] = bool(torch.equal(ps, s) and torch.equal(py, y) and torch.equal(pl[:3], lg[:3]))
        for t in (1, 16):
            xs, ds = x[:t].contiguous(), dl[:t].contiguous()

            def old():
                for w in routers:
                    _, h = fused_ops.rms_norm(xs, scale, 1e-6, residual=ds)
                    fused_layer.linear(h, w)

            def new():
                for w in routers:
                    expert_kernel.norm_router(xs, ds, scale, 1e-6, w)
            for name, fn in (("old", old), ("new", new)):  # best of 5 replays of a graph of the 40
                out[f"us_{name}_rows{t}"] = round(timed_us(fn, reps=1) / len(routers), 2)
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
