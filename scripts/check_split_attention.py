"""The split attention kernel (specdec/models/split_attention.py) on the GPU: its outputs against
the torch reference of the same algorithm and against SDPA; a row's bits at other spans, other step
widths, other batch sizes and tile positions (each must be equal, bitwise); its time against the
memory-efficient SDPA kernel the static steps used (query groups folded).

    python scripts/check_split_attention.py [--json F] [--only gemma4-full ...]
"""
import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from specdec.models import split_attention as sa
from specdec.models.split_attention import split_attention, split_attention_reference, supported

# heads, kv heads, d (gemma4-full: the gemma4-26b-a4b shape's full-attention layers, 512-wide heads)
SHAPES = {"smollm2": (9, 3, 64), "qwen3-8b": (32, 8, 128), "qwen3.5-9b": (16, 4, 256), "gemma4-full": (16, 2, 512)}


def inputs(b, h, hkv, d, t, span, starts, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, t, h, d, device="cuda", generator=g, dtype=torch.bfloat16).transpose(1, 2)  # the model's layout
    k = torch.randn(b, hkv, span, d, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(b, hkv, span, d, device="cuda", generator=g, dtype=torch.bfloat16)
    pos = torch.tensor(starts, device="cuda")[:, None] + torch.arange(t, device="cuda")[None, :]
    mask = (torch.arange(span, device="cuda")[None, None, :] <= pos[:, :, None])[:, None]
    return q, k, v, mask


def memeff(q, k, v, mask, scale):
    b, h, t, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    qf = q.reshape(b, hkv, g * t, d)
    m = mask.unsqueeze(2).expand(b, 1, g, t, mask.shape[-1]).reshape(b, 1, g * t, -1)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        o = F.scaled_dot_product_attention(qf, k, v, attn_mask=m, scale=scale)
    return o.reshape(b, h, t, d)


def timed(fn, n=20):
    """Microseconds a call, the calls captured in a CUDA graph (as the static steps run them)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    for _ in range(5):
        graph.replay()
    ev[1].record()
    torch.cuda.synchronize()
    return round(ev[0].elapsed_time(ev[1]) / (5 * n) * 1000, 2)


def without_pipeline(fn):
    """fn() with the split kernel's branch-a-block walk (split_attention.PIPELINE off), as before the pipelined one."""
    before, sa.PIPELINE = sa.PIPELINE, False
    try:
        return fn()
    finally:
        sa.PIPELINE = before


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", nargs="+", choices=tuple(SHAPES), help="these head shapes only (default: all)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("check_split_attention: needs CUDA (a GPU run; tests/_interpret_kernels.py split checks the kernel on the CPU)")
    rep = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "checks": [], "times_us": []}
    failures = 0
    for name, (h, hkv, d) in SHAPES.items():
        if a.only and name not in a.only:
            continue
        scale = d ** -0.5
        # spans of 8,192: rows past 4,096 positions (split_attention.schedule's far splits for heads of 128)
        for b, t, span in ((1, 1, 2048), (4, 16, 2048), (32, 16, 2048), (1, 128, 2048), (1, 1, 8192), (4, 16, 8192)):
            starts = [(97 * i + 200) % 1800 + span - 2048 for i in range(b)]
            q, k, v, mask = inputs(b, h, hkv, d, t, span, starts)
            assert supported(q, k, mask)
            o = split_attention(q, k, v, mask, scale)
            ref = split_attention_reference(q, k, v, mask, scale)
            sd = memeff(q, k, v, mask, scale)
            row = {"shape": name, "b": b, "t": t, "span": span, "max_diff_reference": (o.float() - ref.float()).abs().max().item(),
                   "max_diff_sdpa": (o.float() - sd.float()).abs().max().item(),
                   "sdpa_vs_reference": (sd.float() - ref.float()).abs().max().item()}
            # the same rows at a larger span (masked keys appended): bitwise
            q2, k2, v2, mask2 = inputs(b, h, hkv, d, t, 2 * span, starts)
            k2[:, :, :span], v2[:, :, :span] = k, v
            row["span_doubled_equal"] = torch.equal(o, split_attention(q, k2, v2, mask2, scale))
            # each query position alone (width 1), and sequence 0 alone (batch 1): bitwise
            alone = [split_attention(q[:, :, i:i + 1], k, v, mask[:, :, i:i + 1], scale) for i in range(min(t, 4))]
            row["width_1_equal"] = all(torch.equal(x, o[:, :, i:i + 1]) for i, x in enumerate(alone))
            row["batch_1_equal"] = torch.equal(split_attention(q[:1], k[:1], v[:1], mask[:1], scale), o[:1])
            row["pipeline_off_equal"] = torch.equal(o, without_pipeline(lambda: split_attention(q, k, v, mask, scale)))
            ok = row["span_doubled_equal"] and row["width_1_equal"] and row["batch_1_equal"] and \
                row["pipeline_off_equal"] and row["max_diff_reference"] < 2e-2
            failures += not ok
            row["ok"] = ok
            rep["checks"].append(row)
            print(json.dumps(row))
        for b, t in ((1, 1), (4, 16), (32, 1), (32, 16)):
            for span in (256, 1024, 4096):
                starts = [span - t - 7 * i - 1 for i in range(b)]
                q, k, v, mask = inputs(b, h, hkv, d, t, span, starts)
                row = {"shape": name, "b": b, "t": t, "span": span,
                       "split": timed(lambda: split_attention(q, k, v, mask, scale)),
                       "split_no_pipeline": without_pipeline(lambda: timed(lambda: split_attention(q, k, v, mask, scale))),
                       "sdpa_memeff": timed(lambda: memeff(q, k, v, mask, scale))}
                rep["times_us"].append(row)
                print(json.dumps(row))
    rep["failures"] = failures
    print(f"failures: {failures}")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump(rep, fh, indent=1)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
