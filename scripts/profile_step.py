"""Time and profile the target's decode (T=1) and verify (T=k+1) forwards.

    python scripts/profile_step.py --model M.gguf [--device cuda] [--steps 50] [--profile]
"""

import argparse
import time

import torch

from specdec.loading import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    lm = load_model(a.model, a.device, a.dtype)
    m = lm.model
    dev = m.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    prompt = torch.arange(100, 164)
    for t in (1, 5, 9, 16):
        cache = m.new_cache(64 + (a.steps + 3) * t + 32)
        m(prompt, cache, logits="last")
        ids = torch.arange(200, 200 + t)
        for _ in range(3):
            m(ids, cache)
        sync()
        t0 = time.perf_counter()
        for _ in range(a.steps):
            out = m(ids, cache)
            out.logits.argmax(-1).tolist()
        sync()
        dt = (time.perf_counter() - t0) / a.steps
        line = f"T={t:2d}: eager {dt * 1e3:7.2f} ms/forward"
        if dev.type == "cuda":
            from specdec.models.graphs import GraphedTarget
            cache = m.new_cache(1024 + (a.steps + 3) * t)
            m(prompt, cache, logits="last")
            g = GraphedTarget(m, cache)
            for _ in range(3):
                g(ids)
            sync()
            t0 = time.perf_counter()
            for _ in range(a.steps):
                g(ids).logits.argmax(-1).tolist()
            sync()
            dg = (time.perf_counter() - t0) / a.steps
            line += f" | CUDA graph {dg * 1e3:7.2f} ms/forward ({dt / dg:.1f}x)"
        print(line + f"  [{m.dtype} on {dev}]")
    if a.profile:
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        cache = m.new_cache(200)
        m(prompt, cache, logits="last")
        ids = torch.tensor([5])
        with profile(activities=acts) as prof:
            for _ in range(5):
                m(ids, cache).logits.argmax(-1).tolist()
        ka = prof.key_averages()
        print(ka.table(sort_by="self_cpu_time_total", row_limit=12))
        if dev.type == "cuda":
            print(ka.table(sort_by="self_cuda_time_total", row_limit=8))


if __name__ == "__main__":
    main()
