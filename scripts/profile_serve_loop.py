"""Where a serving-loop step's time goes on the host (issue 10/11): one request through
``EngineLoop.run`` (no client threads), under cProfile, after a warm-up; then the GPU time of the
static step alone (its CUDA graph replayed), to set against the loop's step time.

    python scripts/profile_serve_loop.py [--model GGUF] [--draft none|dflash|ngram] [-n 256] [--slots 32]
"""
import argparse
import cProfile
import io
import json
import pstats
import statistics
import time

import torch

from specdec.api import default_model_path
from specdec.engine.requests import GenRequest
from specdec.engine.serve_loop import EngineLoop
from specdec.loading import load_model
from specdec.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default="none")
    ap.add_argument("-n", type=int, default=256)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--top", type=int, default=35)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    lm = load_model(a.model or default_model_path(), None, None)
    tok = lm.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Write a long story about a cat."}]),
                        add_special=False)
    req = GenRequest(prompt, a.n, SamplingParams(), ())  # no stop id: all n tokens
    loop = EngineLoop(lm, a.draft, max_slots=a.slots, max_queue=4)
    loop.warmup()
    loop.run([req])  # builds what warmup did not (prefill steps, longer spans)
    loop._step_s.clear()
    t0 = time.perf_counter()
    prof = cProfile.Profile()
    prof.enable()
    loop.run([req])
    prof.disable()
    wall = time.perf_counter() - t0
    steps = list(loop._step_s)
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(a.top)
    c = io.StringIO()
    pstats.Stats(prof, stream=c).sort_stats("cumulative").print_stats(a.top)
    # the static step alone: the graph of the shape the loop ran most
    gpu = {}
    for key, step in loop._static.items():
        if step.graph is None:
            continue
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        step.graph.replay()
        torch.cuda.synchronize()
        ev[0].record()
        for _ in range(20):
            step.graph.replay()
        ev[1].record()
        torch.cuda.synchronize()
        gpu[str(key)] = round(ev[0].elapsed_time(ev[1]) / 20, 4)
    rep = {"draft": a.draft, "new_tokens": a.n, "wall_s": round(wall, 3), "tokens_per_s": round(a.n / wall, 1),
           "steps": len(steps), "step_ms_median": round(1e3 * statistics.median(steps), 3) if steps else None,
           "graph_replay_ms": gpu}
    print(json.dumps(rep, indent=1))
    print(s.getvalue())
    print(c.getvalue())
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump(rep | {"tottime": s.getvalue(), "cumulative": c.getvalue()}, fh, indent=1)


if __name__ == "__main__":
    main()
