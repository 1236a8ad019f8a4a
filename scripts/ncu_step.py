"""One static target step of a random-weight shape for Nsight Compute: the step runs eagerly (the kernels a
captured step replays, one launch each) a few times to build its kernels, then once between
``torch.cuda.profiler.start()`` and ``stop()``, so that ``ncu --profile-from-start off`` profiles that step only.

    ncu --profile-from-start off --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        --section Occupancy --section LaunchStats --section WarpStateStats -o step \\
        python scripts/ncu_step.py --shape qwen3.5-35b-a3b --layers 4 --rows 1

``--layers N``: the shape with its first N layers only (the kernels of a layer do not depend on the layer count;
the step's bytes do). Under ncu each kernel runs alone (no PDL overlap) with the caches flushed before it.
"""

from __future__ import annotations

import argparse

import torch

from specdec import shapes
from specdec.models.graphs import GraphedTarget


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3.5-35b-a3b")
    ap.add_argument("--layers", type=int, default=0, help="keep the first N layers (0: all)")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--warm", type=int, default=3, help="steps before the profiled one")
    ap.add_argument("--device", default="cuda", help="cuda (cpu: a smoke test in fp32)")
    a = ap.parse_args()
    name = a.shape
    if name not in shapes.SHAPES:
        ap.error(f"unknown shape '{name}' (known: {', '.join(shapes.SHAPES)})")
    if a.layers:
        if a.layers < 1:
            ap.error("--layers must be positive")
        name = f"{a.shape}@{a.layers}"
        d = shapes.SHAPES[name] = {**shapes.SHAPES[a.shape], "num_hidden_layers": a.layers}
        if "layer_types" in d:  # a per-layer list, where the shape gives one
            d["layer_types"] = d["layer_types"][:a.layers]
    dev = torch.device(a.device)
    m = shapes.build_shape(name, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)
    cache = m.new_cache(a.context + 4 * a.rows + 8, spare=a.rows)
    vocab = min(1000, m.config.vocab_size)
    with torch.inference_mode():
        m(torch.randint(0, vocab, (a.context,), device=dev), cache, logits="last")
    st = GraphedTarget(m, cache, (), max_steps=a.rows, use_graphs=False)
    ids = torch.randint(0, vocab, (a.rows,), device=dev)
    for _ in range(a.warm):
        st(ids)
        cache.rollback(a.context)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
    st(ids)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    print(f"profiled one {a.rows}-row step of {name}")


if __name__ == "__main__":
    main()
