"""The fused RMSNorm / residual add + RMSNorm / SwiGLU product kernels (specdec/models/fused_ops.py)
and the fused RoPE + KV write on the GPU:

- each kernel against the torch ops (max difference: other bits are expected, not other values),
  and a row's bits alone and among 16 and 64 rows (bitwise: what exact decoding relies on);
- one sequence's captured static step (GraphedTarget, padded to 16 rows, as exact decoding runs it)
  of a random-weight shape with the kernels on and off: its time, the logits' difference, and how
  many kernels it launches (torch.profiler, uncaptured).

    python scripts/check_fused_ops.py [--shapes smollm2-135m qwen3-8b] [--json F]
"""
import argparse
import json

import torch
import torch.nn.functional as F

import specdec.models.layers as layers
from specdec.models import fused_ops
from specdec.models.graphs import GraphedTarget
from specdec.models.layers import RMSNorm
from specdec.shapes import build_shape


def unit() -> list[dict]:
    out = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for n, zc in ((576, False), (4096, False), (4096, True), (128, False)):
        norm = RMSNorm(n, 1e-6, zero_centered=zc).cuda()
        norm.weight.data = torch.randn(n, device="cuda", generator=g) * 0.1 + (0.0 if zc else 1.0)
        x = torch.randn(64, n, device="cuda", generator=g).bfloat16()
        d = torch.randn(64, n, device="cuda", generator=g).bfloat16()
        with torch.no_grad():
            fused_ops.ENABLED = False
            want, want_sum = norm(x), x + d
            want_add = norm(want_sum)
            fused_ops.ENABLED = True
            got = norm(x)
            s, got_add = norm.add(x, d)
        alone = all(torch.equal(fused_ops.rms_norm(x[:r], norm.fp32_scale(), 1e-6), got[:r]) for r in (1, 16))
        row = {"kernel": "rms_norm", "n": n, "zero_centered": zc,
               "max_diff": (got.float() - want.float()).abs().max().item(),
               "add_sum_equal": torch.equal(s, want_sum), "add_max_diff": (got_add.float() - want_add.float()).abs().max().item(),
               "rows_alone_equal": alone}
        out.append(row)
        print(json.dumps(row), flush=True)
    for i in (1536, 12288):
        gu = torch.randn(64, 2 * i, device="cuda", generator=g).bfloat16()
        want = F.silu(gu[:, :i]) * gu[:, i:]
        got = fused_ops.silu_mul(gu)
        row = {"kernel": "silu_mul", "i": i, "max_diff": (got.float() - want.float()).abs().max().item(),
               "bits_equal_torch": torch.equal(got, want),
               "rows_alone_equal": all(torch.equal(fused_ops.silu_mul(gu[:r]), got[:r]) for r in (1, 16))}
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def step(shape: str) -> list[dict]:
    m = build_shape(shape, torch.device("cuda"), torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(2)
    prompt = torch.randint(m.config.vocab_size, (150,), device="cuda", generator=g)
    ids = torch.randint(m.config.vocab_size, (1,), device="cuda", generator=g)
    res, rows = {}, []
    for name, norm, rope in (("torch ops", False, False), ("rope fused", False, True), ("rope + norms fused", True, True)):
        fused_ops.ENABLED, layers.FUSED_ROPE_WRITE = norm, rope
        cache = m.new_cache(600, spare=16)
        m(prompt, cache, logits="last")
        n = cache.length
        timing = {}
        for graphs in (True, False):
            st = GraphedTarget(m, cache, (), max_steps=16, pad_to=16, use_graphs=graphs)
            logits = st(ids).logits.clone()
            cache.rollback(n)
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            ev[0].record()
            for _ in range(20):
                st(ids)
                cache.rollback(n)
            ev[1].record()
            torch.cuda.synchronize()
            timing["captured_ms" if graphs else "uncaptured_ms"] = round(ev[0].elapsed_time(ev[1]) / 20, 4)
            if not graphs:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    st(ids)
                    cache.rollback(n)
                    torch.cuda.synchronize()
                timing["kernels"] = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        res[name] = logits
        row = {"shape": shape, "mode": name, **timing,
               "logits_max_diff_vs_torch_ops": (logits - res["torch ops"]).abs().max().item()}
        rows.append(row)
        print(json.dumps(row), flush=True)
    fused_ops.ENABLED, layers.FUSED_ROPE_WRITE = True, True
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["smollm2-135m", "qwen3-8b"])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rep = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "unit": unit(), "steps": []}
    for shape in a.shapes:
        rep["steps"] += step(shape)
    bad = [r for r in rep["unit"] if not r["rows_alone_equal"] or not r.get("add_sum_equal", True)]
    rep["failures"] = len(bad)
    print(f"failures: {len(bad)}")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump(rep, fh, indent=1)


if __name__ == "__main__":
    main()
