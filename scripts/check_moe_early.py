"""expert_kernel.EARLY_COMBINE on the GPU: a MoE block's combine loading its first row's weights before its PDL wait.

Random layers of a published MoE shape (their own weights, so the experts are not in the L2 between layers, as in a
model's step), one forward of every layer captured in a CUDA graph, with EARLY_COMBINE off and on: each replay's
outputs with it on must equal, bit for bit, the outputs with it off (the combine reads the route kernel's expert ids
before its wait: a replay that read them early would differ), for 1 row, 16 rows with 1 live, 4 and 16 rows. Also
the median replay divided by the layer count, each way (us a layer).

    python scripts/check_moe_early.py [--shape qwen3.5-35b-a3b] [--layers 12] [--replays 50] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from specdec.models import expert_kernel as ek
from specdec.models.moe import SparseMoeBlock
from specdec.shapes import shape_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3.5-35b-a3b")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("check_moe_early: needs CUDA (tests/_interpret_kernels.py moe checks the bits on the CPU)")
    _, c = shape_config(a.shape)
    if not getattr(c, "num_experts", 0):
        raise SystemExit(f"check_moe_early: shape {a.shape!r} has no MoE block")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    blocks = []
    with torch.no_grad():
        for _ in range(a.layers):
            b = SparseMoeBlock(c.hidden_size, c.moe_intermediate_size, c.shared_expert_intermediate_size,
                               c.num_experts, c.num_experts_per_tok).to(dev, torch.bfloat16)
            for p in b.parameters():
                p.normal_(0, 0.02)
            if b.shared_expert is not None:
                b.shared_expert.fuse()
            b.fuse()
            blocks.append(b)
    live1 = torch.tensor(1, device=dev)
    cases = (("1 row", 1, None), ("16 rows, 1 live", 16, live1), ("4 rows", 4, None), ("16 rows", 16, None))
    res = {"shape": a.shape, "layers": a.layers, "replays": a.replays, "cases": {}}
    saved = ek.EARLY_COMBINE
    try:
        with torch.inference_mode():
            for label, t, live in cases:
                xs = [torch.randn(t, c.hidden_size, device=dev, dtype=torch.bfloat16) for _ in blocks]
                row = {}
                outs = {}
                for early in (False, True):
                    ek.EARLY_COMBINE = early
                    for b, x in zip(blocks, xs):  # compile and warm up outside the capture
                        b(x, live)
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        ys = [b(x, live) for b, x in zip(blocks, xs)]
                    times, seen = [], []
                    for _ in range(a.replays):
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record()
                        graph.replay()
                        end.record()
                        torch.cuda.synchronize()
                        times.append(start.elapsed_time(end))
                        seen.append(torch.stack(ys).clone())
                    outs[early] = seen
                    row[f"{'early' if early else 'default'} us a layer"] = round(
                        statistics.median(times) / a.layers * 1e3, 2)
                    del graph
                ref = outs[False][0]
                row["replays equal (default)"] = all(torch.equal(ref, y) for y in outs[False])
                row["replays equal (early vs default)"] = sum(torch.equal(ref, y) for y in outs[True])
                row["ok"] = row["replays equal (default)"] and row["replays equal (early vs default)"] == a.replays
                res["cases"][label] = row
                print(json.dumps({label: row}), flush=True)
    finally:
        ek.EARLY_COMBINE = saved
    res["ok"] = all(r["ok"] for r in res["cases"].values())
    print("early combine bits:", "equal in every replay" if res["ok"] else "DIFFER", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
