"""Does a row's result depend on how many rows a step verifies? (issue 10/11 groundwork)

The serving loop's exact mode runs every step ``kmax + 1`` rows a slot wide, drafts or not, because
a row's bits were assumed to change with the step's width: so a step that drafts nothing costs a
wide step, and the controller cannot fall back to a plain-cost step. This measures it, on CUDA:

- the static step (span-invariant attention, as the loop runs it) at width 1 and width ``W``, the
  same last token per slot: are row 0's logits the same bits?
- each op alone at ``slots`` rows and at ``slots * W`` rows, the same first row per slot: the model's
  GEMM shapes (cuBLAS), RMSNorm, the span-invariant attention (T = 1 against T = W).

    python scripts/check_width_invariance.py [--shape smollm2-135m] [--slots 32] [--width 16]
"""
import argparse
import json

import torch
import torch.nn.functional as F

from specdec.models.graphed_batch import GraphedBatch
from specdec.models.layers import RMSNorm, _attend_span_invariant
from specdec.shapes import build_shape


def rows_equal(a: torch.Tensor, b: torch.Tensor) -> dict:
    """``a [S, ...]`` against ``b [S, ...]``: slots bit-equal, max |diff|."""
    eq = sum(torch.equal(a[i], b[i]) for i in range(a.shape[0]))
    return {"equal": f"{eq}/{a.shape[0]}", "max_abs_diff": float((a.float() - b.float()).abs().max())}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--span", type=int, default=512)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    dev = torch.device(a.device)
    m = build_shape(a.shape, dev, torch.bfloat16)
    cfg, s, w = m.config, a.slots, a.width
    res = {"shape": a.shape, "slots": s, "width": w, "span": a.span}
    g = torch.Generator(device=dev).manual_seed(0)
    cache = m.new_batch_cache(s, a.span, spare=w)
    starts = [int(x) for x in torch.randint(50, a.span - 2 * w, (s,))]
    # a context for every slot: wide steps of random tokens up to each start
    fill = GraphedBatch(m, cache, w, use_graphs=False, span=a.span, span_invariant=True)
    for off in range(0, max(starts), w):
        fill(torch.randint(cfg.vocab_size, (s, w), device=dev, generator=g), list(range(s)),
             [min(off, st) for st in starts])
    last = torch.randint(cfg.vocab_size, (s, 1), device=dev, generator=g)
    out = {}
    for width in (1, w):
        step = GraphedBatch(m, cache, width, span=a.span, span_invariant=True)
        ids = torch.cat([last, torch.randint(cfg.vocab_size, (s, width - 1), device=dev, generator=g)], 1)
        o = step(ids, list(range(s)), starts)
        out[width] = (o.logits[:, 0].clone(), o.hidden[:, 0].clone())
        o = step(ids, list(range(s)), starts)
        res[f"step_w{width}_replay_equal"] = rows_equal(out[width][0], o.logits[:, 0])["equal"]
    res["step_logits_row0"] = rows_equal(out[1][0], out[w][0])
    res["step_hidden_row0"] = rows_equal(out[1][1], out[w][1])
    res["step_argmax_row0_equal"] = int((out[1][0].argmax(-1) == out[w][0].argmax(-1)).sum())
    h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    # GEMMs: the model's weight shapes, slot rows alone against the same rows among W per slot
    shapes = {"qkv": ((h + 2 * kv) * d, cfg.hidden_size), "o": (cfg.hidden_size, h * d),
              "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size), "down": (cfg.hidden_size, cfg.intermediate_size),
              "lm_head": (cfg.vocab_size, cfg.hidden_size)}
    for name, (n_out, n_in) in shapes.items():
        wt = torch.randn(n_out, n_in, device=dev, dtype=torch.bfloat16, generator=g) * 0.05
        x = torch.randn(s, w, n_in, device=dev, dtype=torch.bfloat16, generator=g)
        narrow = F.linear(x[:, :1].contiguous(), wt)[:, 0]
        wide = F.linear(x, wt)[:, 0]
        res[f"gemm_{name}"] = rows_equal(narrow, wide)
        if s > 1:  # and one row alone (M = 1, a GEMV) against the slot rows
            res[f"gemm_{name}_m1_vs_m{s}"] = rows_equal(F.linear(x[:1, :1].contiguous(), wt)[:, 0], narrow[:1])
    norm = RMSNorm(cfg.hidden_size, 1e-6).to(dev, torch.bfloat16)
    norm.weight.data.normal_(1.0, 0.1, generator=g)
    x = torch.randn(s, w, cfg.hidden_size, device=dev, dtype=torch.bfloat16, generator=g)
    res["rmsnorm"] = rows_equal(norm(x[:, :1].contiguous())[:, 0], norm(x)[:, 0])
    q = torch.randn(s, h, w, d, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(s, kv, a.span, d, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    pos = torch.tensor(starts, device=dev)
    keys = torch.arange(a.span, device=dev)
    mask = torch.zeros(s, 1, w, a.span, device=dev, dtype=torch.bfloat16)
    mask.masked_fill_(keys[None, None, None, :] > (pos[:, None, None, None] + torch.arange(w, device=dev)[None, None, :, None]),
                      float("-inf"))
    one = _attend_span_invariant(q[:, :, :1].contiguous(), k, v, mask[:, :, :1].contiguous(), d ** -0.5, h // kv)
    many = _attend_span_invariant(q, k, v, mask, d ** -0.5, h // kv)
    res["attention_t1_vs_tw"] = rows_equal(one[:, :, 0], many[:, :, 0])
    print(json.dumps(res, indent=1), flush=True)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
