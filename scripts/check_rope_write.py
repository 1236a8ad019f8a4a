"""The fused RoPE + KV-cache write (specdec/models/rope_write.py) on the GPU, before it is turned on:

- the kernel against the eager ops (``layers.apply_rope`` + ``BatchKVCache.update``), bitwise, for
  the SmolLM2, qwen3-8b and qwen3.5 (partial rotary) head layouts;
- whole static steps of a random-weight shape (``specdec.shapes``), captured as CUDA graphs with
  the fused kernel and without: logits, hidden rows and the KV cache bitwise equal, and each
  graph's replay time (what the kernel is for: fewer kernels a step); batched (GraphedBatch) and
  one sequence's (GraphedTarget, padded to 16 rows).

    python scripts/check_rope_write.py [--shapes smollm2-135m qwen3-8b] [--json F]
"""
import argparse
import json

import torch

import specdec.models.layers as layers
from specdec.cache import BatchKVCache, BatchWrite
from specdec.models.graphed_batch import GraphedBatch
from specdec.models.layers import RotaryEmbedding, apply_rope
from specdec.models.rope_write import rope_write, supported
from specdec.shapes import build_shape

HEADS = {"smollm2": (9, 3, 64, 64), "qwen3-8b": (32, 8, 128, 128), "qwen3.5 partial": (16, 4, 256, 64)}  # H, Hkv, d, rotary


def unit(name, h, hkv, d, r, b, t) -> dict:
    g = torch.Generator(device="cuda").manual_seed(b * 100 + t)
    qkv = torch.randn(b, t, (h + 2 * hkv) * d, device="cuda", generator=g, dtype=torch.bfloat16)
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], -1)  # views of one GEMM output, as the model has them
    q, k, v = q.view(b, t, h, d), k.view(b, t, hkv, d), v.view(b, t, hkv, d)
    slots = torch.randperm(40, device="cuda", generator=g)[:b]
    # positions inside the 256-position cache (start + t - 1 <= 255): past it the eager write's
    # index asserts on the device (the H200 run of 2026-12-01 (sixth) died of that at b=1, t=128)
    pos = torch.randint(0, 256 - t + 1, (b, 1), device="cuda", generator=g) + torch.arange(t, device="cuda")[None, :]
    cos, sin = RotaryEmbedding(d, 1e6, partial_factor=r / d).cos_sin(pos.reshape(-1), torch.bfloat16)
    w = BatchWrite(slots, pos, 256)
    eager, fused = (BatchKVCache(40, hkv, d, 256, torch.bfloat16, "cuda") for _ in range(2))
    qe = apply_rope(q.transpose(1, 2), cos.view(b, 1, t, -1), sin.view(b, 1, t, -1))
    eager.update(w, apply_rope(k.transpose(1, 2), cos.view(b, 1, t, -1), sin.view(b, 1, t, -1)), v.transpose(1, 2))
    assert supported(q, k, cos, fused, w)
    qf = rope_write(q, k, v, cos, sin, fused, w)
    return {"heads": name, "b": b, "t": t, "q_equal": torch.equal(qf, qe), "k_equal": torch.equal(fused.k, eager.k),
            "v_equal": torch.equal(fused.v, eager.v)}


def replay_ms(step: GraphedBatch, n: int = 20) -> float:
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    step.graph.replay()
    torch.cuda.synchronize()
    ev[0].record()
    for _ in range(n):
        step.graph.replay()
    ev[1].record()
    torch.cuda.synchronize()
    return round(ev[0].elapsed_time(ev[1]) / n, 4)


def steps(shape: str) -> list[dict]:
    m = build_shape(shape, torch.device("cuda"), torch.bfloat16)
    out = []
    for rows, width in ((1, 1), (32, 1), (32, 16)):
        res, caches = {}, {}
        for fused in (False, True):
            layers.FUSED_ROPE_WRITE = fused
            cache = m.new_batch_cache(32, 512, spare=16)
            step = GraphedBatch(m, cache, width, span=512, span_invariant=True, rows=rows)
            g = torch.Generator(device="cuda").manual_seed(1)
            ids = torch.randint(m.config.vocab_size, (rows, width), device="cuda", generator=g)
            starts = [100 + 7 * i for i in range(rows)]
            o = step(ids, list(range(rows)), starts)
            res[fused] = (o.logits.clone(), o.hidden.clone(), replay_ms(step))
            caches[fused] = cache.layers[0].k[:rows].clone()
        layers.FUSED_ROPE_WRITE = False
        row = {"shape": shape, "rows": rows, "width": width, "logits_equal": torch.equal(res[0][0], res[1][0]),
               "hidden_equal": torch.equal(res[0][1], res[1][1]), "cache_equal": torch.equal(caches[0], caches[1]),
               "replay_ms_eager_ops": res[0][2], "replay_ms_fused": res[1][2]}
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def one_sequence(shape: str) -> list[dict]:
    """One sequence's static steps (GraphedTarget: generate, bench), with the fused kernel and without:
    a prompt, then 1-row and 16-row steps (padded to 16, as exact decoding runs them)."""
    from specdec.models.graphs import GraphedTarget
    m = build_shape(shape, torch.device("cuda"), torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(2)
    prompt = torch.randint(m.config.vocab_size, (150,), device="cuda", generator=g)
    steps_ids = [torch.randint(m.config.vocab_size, (t,), device="cuda", generator=g) for t in (1, 16, 5)]
    res = {}
    for fused in (False, True):
        layers.FUSED_ROPE_WRITE = fused
        cache = m.new_cache(600, spare=16)
        m(prompt, cache, logits="last")
        st = GraphedTarget(m, cache, (), max_steps=16, pad_to=16)
        outs = [st(ids) for ids in steps_ids]
        logits = torch.cat([o.logits.clone() for o in outs])
        hidden = torch.cat([o.hidden for o in outs])
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        n = cache.length
        ev[0].record()
        for _ in range(20):
            st(steps_ids[0])
            cache.rollback(n)
        ev[1].record()
        torch.cuda.synchronize()
        res[fused] = (logits, hidden, cache.layers[0].k[:, :n].clone(), round(ev[0].elapsed_time(ev[1]) / 20, 4))
    layers.FUSED_ROPE_WRITE = False
    row = {"shape": shape, "one_sequence": True, "logits_equal": torch.equal(res[0][0], res[1][0]),
           "hidden_equal": torch.equal(res[0][1], res[1][1]), "cache_equal": torch.equal(res[0][2], res[1][2]),
           "step_ms_eager_ops": res[0][3], "step_ms_fused": res[1][3]}
    print(json.dumps(row), flush=True)
    return [row]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["smollm2-135m", "qwen3-8b"])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    rep = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "unit": [], "steps": []}
    for name, (h, hkv, d, r) in HEADS.items():
        for b, t in ((1, 1), (32, 16), (1, 128)):
            row = unit(name, h, hkv, d, r, b, t)
            rep["unit"].append(row)
            print(json.dumps(row), flush=True)
    for shape in a.shapes:
        rep["steps"] += steps(shape) + one_sequence(shape)
    bad = [r for r in rep["unit"] if not (r["q_equal"] and r["k_equal"] and r["v_equal"])]
    bad += [r for r in rep["steps"] if not (r["logits_equal"] and r["hidden_equal"] and r["cache_equal"])]
    rep["failures"] = len(bad)
    print(f"failures: {len(bad)}")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump(rep, fh, indent=1)


if __name__ == "__main__":
    main()
