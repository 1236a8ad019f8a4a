"""Where a serving-loop step's time goes on the host (issue 10/11): one request through
``EngineLoop.run`` (no client threads), under cProfile, after a warm-up; then the GPU time of the
static step alone (its CUDA graph replayed), to set against the loop's step time.

    python scripts/profile_serve_loop.py [--model GGUF] [--draft none|dflash|ngram] [-n 256] [--slots 32]
        [--clients C] [--kernels]

``--clients C`` serves C requests at once (C prompts); ``--kernels`` adds a torch.profiler run of
the same requests: the GPU kernels by total time (those of CUDA graphs included) and the host ops.
The drafter's own static steps (the all-slots DFlash block and context write) are timed as graph
replays beside the target's.
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
    ap.add_argument("--clients", type=int, default=1)
    ap.add_argument("--kernels", action="store_true")
    a = ap.parse_args()
    if min(a.clients, a.n, a.slots) < 1 or a.clients > a.slots:
        raise SystemExit("profile_serve_loop: --clients, -n and --slots must be >= 1, and --clients <= --slots")
    torch.set_grad_enabled(False)
    lm = load_model(a.model or default_model_path(), None, None)
    tok = lm.tokenizer
    animals = ["cat", "dog", "horse", "fox", "owl", "whale", "bee", "crow"]
    reqs = [GenRequest(tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": f"Write a long story about a {animals[i % 8]} ({i})."}]), add_special=False),
        a.n, SamplingParams(), ()) for i in range(a.clients)]  # no stop id: all n tokens
    loop = EngineLoop(lm, a.draft, max_slots=a.slots, max_queue=4)
    loop.warmup()
    loop.run(reqs)  # builds what warmup did not (prefill steps, longer spans)
    loop._step_s.clear()
    t0 = time.perf_counter()
    prof = cProfile.Profile()
    prof.enable()
    loop.run(reqs)
    prof.disable()
    wall = time.perf_counter() - t0
    steps = list(loop._step_s)
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(a.top)
    c = io.StringIO()
    pstats.Stats(prof, stream=c).sort_stats("cumulative").print_stats(a.top)
    # each static step alone (the target's and the drafter's): its CUDA graph replayed
    gpu = {}
    graphs = {str(key): step.graph for key, step in loop._static.items()}
    slots = loop._all_slots
    if slots is not None:
        graphs.update({f"drafter observe rows {n}": g for n, g in slots._observe_graphs.items()})
        graphs.update({f"drafter block rows {n} span {sp}": g for (n, sp), (g, _) in slots._blocks.items()})
    for key, graph in graphs.items():
        if graph is None:  # eager (CPU)
            continue
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        graph.replay()
        torch.cuda.synchronize()
        ev[0].record()
        for _ in range(20):
            graph.replay()
        ev[1].record()
        torch.cuda.synchronize()
        gpu[str(key)] = round(ev[0].elapsed_time(ev[1]) / 20, 4)
    kern = None
    if a.kernels:
        steps0 = loop._n["steps_total"]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as tp:
            loop.run(reqs)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        nsteps = loop._n["steps_total"] - steps0
        ka = tp.key_averages()
        kern = {"steps": nsteps,
                "gpu": ka.table(sort_by="self_device_time_total", row_limit=a.top, max_name_column_width=70),
                "host": ka.table(sort_by="self_cpu_time_total", row_limit=a.top, max_name_column_width=70)}
        print(f"kernels over {nsteps} steps"); print(kern["gpu"]); print(kern["host"])
    rep = {"draft": a.draft, "clients": a.clients, "new_tokens": a.n, "wall_s": round(wall, 3),
           "tokens_per_s": round(a.n * a.clients / wall, 1),
           "steps": len(steps), "step_ms_median": round(1e3 * statistics.median(steps), 3) if steps else None,
           "graph_replay_ms": gpu}
    print(json.dumps(rep, indent=1))
    print(s.getvalue())
    print(c.getvalue())
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump(rep | {"tottime": s.getvalue(), "cumulative": c.getvalue(), "kernels": kern}, fh, indent=1)


if __name__ == "__main__":
    main()
