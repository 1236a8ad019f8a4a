"""The MoE block's static step on the GPU: models/expert_kernel.py's fused form (:func:`moe`) over its tiles
against the torch-op form around the pair kernels, on random layers of a published MoE shape.

Each timing is a CUDA graph of one block forward per layer over ``--layers`` layers with their own
weights (so the active experts are not in the L2 between calls, as in a model's step), replayed
``--reps`` times: the median replay divided by the layer count. The fused form runs each tile of the
sweep (the gate/up kernel's with the combine kernel's default, then the other way round); the bits of a
row alone and beside 15 others are compared for the defaults.

    python scripts/sweep_moe_kernel.py [--shape qwen3.5-35b-a3b | gemma4-26b-a4b] [--layers 12] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
from micro_kernels import _time_graph  # scripts/ (this script's folder) is on the path

from specdec.models import expert_kernel as ek
from specdec.models.moe import SparseMoeBlock
from specdec.shapes import shape_config


def graph_ms(fn, reps: int) -> float:
    """Median ms of one ``fn()`` (a forward of every layer), captured in a CUDA graph (micro_kernels' timer)."""
    return _time_graph(fn, reps, inner=1) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3.5-35b-a3b")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", default=None)
    ap.add_argument("--defaults-only", action="store_true", help="time the block's defaults only (no sweep)")
    ap.add_argument("--combos", nargs="*", default=[], metavar="GU/CB",
                    help="instead of the sweep, time these tile pairs at every row count, e.g. 4,1024,4/2,512,4,16")
    a = ap.parse_args()
    _, c = shape_config(a.shape)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    blocks = []
    with torch.no_grad():
        for _ in range(a.layers):
            # a Gemma 4 shape: no shared expert, top_k_experts (its GELU experts and router options cost the same
            # bytes and kernels: the tiles' timing is that of this block without a shared expert)
            b = SparseMoeBlock(c.hidden_size, c.moe_intermediate_size, getattr(c, "shared_expert_intermediate_size", 0),
                               c.num_experts, getattr(c, "num_experts_per_tok", None) or c.top_k_experts
                               ).to(dev, torch.bfloat16)
            for p in b.parameters():
                p.normal_(0, 0.02)
            if b.shared_expert is not None:
                b.shared_expert.fuse()
            if hasattr(b, "fuse"):  # (an older tree's block has none)
                b.fuse()
            blocks.append(b)
    res = {"shape": a.shape, "layers": a.layers, "per_layer_us": {}}
    xs = {t: torch.randn(t, c.hidden_size, device=dev, dtype=torch.bfloat16) for t in (1, 4, 16)}
    live1 = torch.tensor(1, device=dev)
    cases = (("1 row", 1, None), ("16 rows, 1 live", 16, live1), ("4 rows", 4, None), ("16 rows", 16, None))

    def run_blocks(t, live, tiles=None):
        def fn():
            for b in blocks:
                if tiles is None:
                    b(xs[t], live)
                else:
                    ek.moe(xs[t], b._router_weight(), b.top_k, b.experts.gate_up_proj, b.experts.down_proj,
                           b._shared_weights(), live, tiles)
        return fn

    with torch.inference_mode():
        for label, t, live in cases:
            for fused in (False, True):
                ek.FUSED_MOE = fused
                us = graph_ms(run_blocks(t, live), a.reps) / a.layers * 1e3
                res["per_layer_us"][f"{label}, {'fused' if fused else 'torch ops + pairs'}"] = round(us, 2)
                print(f"{label:16s} {'fused' if fused else 'torch ops + pairs':18s} {us:8.2f} us a layer", flush=True)
        ek.FUSED_MOE = True
        if a.defaults_only:
            return dump(res, a.json)
        if a.combos:
            res["combos_us"] = {}
            for combo in a.combos:
                gu, cb = (tuple(int(v) for v in part.split(",")) for part in combo.split("/"))
                row = {label: round(graph_ms(run_blocks(t, live, (gu, cb)), a.reps) / a.layers * 1e3, 2)
                       for label, t, live in cases}
                res["combos_us"][combo] = row
                print(f"{combo:24s} " + "  ".join(f"{k} {v:7.2f}" for k, v in row.items()), flush=True)
            return dump(res, a.json)
        sweep = {}
        grids = {"gate_up": itertools.product((2, 4, 8), (256, 512, 1024, 2048), (2, 4, 8)),
                 "combine": itertools.product((2, 4, 8), (256, 512), (4, 8), (1, 2, 4, 8, 16))}
        for which, grid in grids.items():
            for tile in grid:
                tiles = (tile, ek.COMBINE_TILE) if which == "gate_up" else (ek.GATE_UP_TILE, tile)
                name = f"{which} {','.join(map(str, tile))}"
                try:
                    us = graph_ms(run_blocks(1, None, tiles), a.reps) / a.layers * 1e3
                except Exception as e:  # a tile Triton cannot build: noted, skipped
                    print(f"{name}: {type(e).__name__}", flush=True)
                    continue
                sweep[name] = round(us, 2)
                print(f"{name:24s} {us:8.2f} us a layer (1 row)", flush=True)
        res["sweep_1row_us"] = sweep
        for which in ("gate_up", "combine"):
            best = min((v, k) for k, v in sweep.items() if k.startswith(which))
            print(f"best {which}: {best[1]} {best[0]} us", flush=True)
        b = blocks[0]
        x = xs[16]
        many = b(x)
        alone = torch.cat([b(x[i:i + 1]) for i in range(16)])
        res["row_bits_alone_equal_beside"] = bool(torch.equal(many, alone))
        ek.FUSED_MOE = False
        ref = b(x)
        ek.FUSED_MOE = True
        res["max_abs_diff_to_torch_ops"] = (many.float() - ref.float()).abs().max().item()
        print(f"a row's bits alone = beside 15 others: {res['row_bits_alone_equal_beside']}; "
              f"max |fused - torch ops| {res['max_abs_diff_to_torch_ops']:.3e} (values ~{ref.float().abs().mean().item():.3e})")
    dump(res, a.json)


def dump(res: dict, path: str | None) -> None:
    if path:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
