"""models/fused_layer.py on the GPU: its GEMM on a layer's four weights (q/k/v, o, gate/up with the
SwiGLU epilogue, down) against its torch reference, a row's bits at every row count, its time against
cuBLAS (and fused_ops' silu_mul), optionally every tiling of SWEEP (WIDE_SWEEP past fused_layer.MAX_HIDDEN); each
timed call reads another copy of its weight than the call before (L2_BYTES of copies); then a random-weight shape's logits
with the fused layers on and off.

    PYTHONPATH=. python scripts/check_fused_layer.py [--shape smollm2-135m] [--sweep] [--head] [--rows 16] [--json out.json]
    PYTHONPATH=. python scripts/check_fused_layer.py --shape qwen3.5-35b-a3b --list   # the shape's weights (no GPU)

Prints one line per check (``ok`` / ``FAIL``) and the kernel times (us, CUDA graphs of 50 calls); with
``--sweep`` the fastest tilings and the ``SPECDEC_FUSED_LAYER_TILES`` value that selects them (a MoE router: ROUTER_SWEEP;
an output projection of at most 2,048 outputs over twice as many inputs: NARROW_SWEEP, K split too). Exits 1
if a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

from specdec.models import fused_layer as fl
from specdec.models import fused_ops

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from micro_kernels import _time_graph  # noqa: E402

FAILED = []


def check(name, ok, detail=""):
    print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        FAILED.append(name)


def graph_us(fn) -> float:
    """Median per-call microseconds of ``fn`` captured 50 times in one CUDA graph (micro_kernels.py's timer)."""
    return _time_graph(fn, reps=5, inner=50)


SWEEP = [(bn, bk, wp, st) for bn in (16, 32, 64) for bk in (64, 128, 256) for wp in (2, 4) for st in (2, 3, 4)]
# layers wider than fused_layer.MAX_HIDDEN (the qwen3-8b shape's 4096): the session of 2026-12-04 (third)'s best
# tilings (more warps, deeper pipelines), each unsplit and with K split 2, 3, 4 ways (fused_layer.SPLIT_K)
WIDE_SWEEP = [t + (sp,) for t in ((64, 256, 4, 4), (64, 256, 8, 4), (64, 256, 4, 3), (32, 256, 4, 4), (32, 128, 4, 4),
                                  (64, 128, 4, 4), (128, 128, 4, 3), (128, 128, 8, 3), (128, 64, 4, 4))
              for sp in (1, 2, 3, 4)]
# int8 rows (--int8: half the bytes a K block): wider K blocks, and the wide tilings' best; K split 1, 2, 4 ways
INT8_SWEEP = [t + (sp,) for t in ((64, 512, 4, 3), (64, 512, 8, 3), (64, 512, 4, 4), (32, 512, 4, 4), (128, 256, 4, 3),
                                  (128, 256, 8, 3), (64, 256, 4, 4), (32, 256, 4, 4)) for sp in (1, 2, 4)]
WIDE_HEAD_SWEEP = [(bn, bk, wp, st) for bn in (32, 64, 128) for bk in (64, 128) for wp in (4, 8) for st in (3, 4)]
L2_BYTES = 256 << 20  # a timed call cycles over copies of its weight at least this large: no call finds it in L2
# the LM head (vocab outputs): wider output tiles too
HEAD_SWEEP = SWEEP + [(bn, bk, wp, st) for bn in (128,) for bk in (64, 128) for wp in (4, 8) for st in (2, 3, 4)]
# a MoE router (+ the shared expert's gate: a few hundred outputs over a wide hidden size): few output tiles, so K split
# too (2-8 ways)
ROUTER_SWEEP = [(bn, bk, wp, st, sp) for bn in (16, 32) for bk in (128, 256) for wp in (2, 4) for st in (2, 3)
                for sp in (1, 2, 4, 8)]
# an output projection with few outputs over a wider K (qwen3.5-35b-a3b's o_proj / out_proj, 2048 x 4096: 32 tiles of 64
# outputs): narrower tiles and K split 1-4 ways, so the programs fill the SMs
NARROW_SWEEP = [(bn, bk, wp, st, sp) for bn in (16, 32, 64) for bk in (128, 256) for wp in (2, 4) for st in (3, 4)
                for sp in (1, 2, 4)]


def weight_shapes(shape: str) -> dict:
    """The GEMM weights a step of ``shape`` runs on the fused kernel, by role: ``{name: (rows, K, silu)}`` (``rows``:
    the weight's, 2 x the gate outputs with ``silu``), from the shape's model on the meta device, one of each shape:
    q/k/v (+ Qwen3.5's output gate), o_proj, a Gated DeltaNet's in- and out-projections, gate/up + SwiGLU, down_proj
    (a MoE block's experts run their own kernels), the LM head."""
    from specdec.models.deltanet import GatedDeltaNet
    from specdec.models.gemma4 import Gemma4Attention, Gemma4Router
    from specdec.models.layers import Attention, SwiGLU
    from specdec.models.moe import SparseMoeBlock
    from specdec.shapes import meta_model
    m = meta_model(shape)
    m.fuse_projections()
    out, seen = {}, set()

    def add(name, w, silu=False):
        key = (w.shape[0], w.shape[1], silu)
        if key not in seen:  # (a second shape of one role, e.g. Gemma 4 E2B's double-wide MLPs: named by its shape)
            seen.add(key)
            out[name if name not in out else f"{name}_{key[0]}x{key[1]}"] = key
    for layer in m.layers:
        for mod in layer.children():
            if isinstance(mod, (Attention, Gemma4Attention)):  # (Gemma 4: a sliding and a full layer's, suffixed)
                sfx = "" if isinstance(mod, Attention) else f"_{mod.head_dim}"
                if getattr(mod, "shared", False):  # a KV-shared layer (Gemma 4's E2B/E4B): q alone
                    add("q_shared" + sfx, mod.q_proj.weight)
                else:
                    add("qkv" + sfx, mod._fused[0])
                add("o" + sfx, mod.o_proj.weight)
            elif isinstance(mod, Gemma4Router):
                add("router", mod.proj.weight)
            elif isinstance(mod, GatedDeltaNet):
                add("delta_in", mod._fused[0])
                add("delta_out", mod.out_proj.weight)
            elif isinstance(mod, SwiGLU):
                add("gate_up+silu", mod._fused[0], True)
                add("down", mod.down_proj.weight)
            elif isinstance(mod, SparseMoeBlock):  # the router (+ the shared expert's gate) on the fused GEMM
                mod.fuse()
                add("router", mod._router_weight())
        if getattr(layer, "per_layer", False):  # a Gemma 4 small model's per-layer input: its gate and projection
            add("per_layer_gate", layer.per_layer_input_gate.weight)
            add("per_layer_proj", layer.per_layer_projection.weight)
    if hasattr(m, "per_layer_model_projection"):  # (the embeddings' projection to every layer's per-layer input)
        add("per_layer_model", m.per_layer_model_projection.weight)
    hidden = m.config.hidden_size
    if hidden > fl.MAX_HIDDEN:  # a drafter's weights on a wide target: DFlash's fc (5 target layers) and context K/V
        # (5 layers x 8 KV heads of 128), an MTP block's fc
        out.update(dflash_fc=(hidden, 5 * hidden, False), dflash_kv=(5 * 2 * 8 * 128, hidden, False),
                   mtp_fc=(hidden, 2 * hidden, False))
    w = m.head_weight()
    out["head"] = (w.shape[0], w.shape[1], False)
    return out


def _bytes(w) -> int:
    return w.nbytes() if isinstance(w, fl.Int8Rows) else w.numel() * w.element_size()


def _clone(w):
    return fl.Int8Rows(w.q.clone(), w.scale.clone()) if isinstance(w, fl.Int8Rows) else w.clone()


def kernels(shapes: dict, rows: int, res: dict, sweep: bool = False, int8: bool = False) -> None:
    """Check and time each weight of ``shapes`` (:func:`weight_shapes`' form) at ``rows`` rows; with ``sweep`` every
    tiling of the sweep lists too. ``int8``: the weights as ``fl.Int8Rows`` (a drafter's ``--draft-int8``), each
    also timed in bf16 on the fused kernel (``bf16``)."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=g, device=dev) * s).to(dt)
    cases = {name: (rnd(512, k), rnd(n, k, s=k ** -0.5), silu) for name, (n, k, silu) in shapes.items()}
    best_tiles = {}
    for name, (inp, w, silu) in cases.items():
        wb = w
        if int8:
            w = fl.Int8Rows.of(w)
        full = fl.linear(inp, w, silu=silu)
        ref = fl.reference(inp, w, silu=silu)
        err = (full.float() - ref.float()).abs().max().item()
        scale_ref = ref.float().abs().max().item()
        check(f"{name}: equals the torch reference", err <= 0.02 * max(scale_ref, 1.0), f"(max diff {err:.3g}, |ref| {scale_ref:.3g})")
        bad = [m for m in (1, 2, 5, 15, 16, 17, 31, 64, 128, 200) if not torch.equal(fl.linear(inp[:m], w, silu=silu), full[:m])]
        check(f"{name}: rows keep their bits at 1..512 rows", not bad, f"(differ at {bad})" if bad else "")
        xi = inp[:rows]
        ws = [w] + [_clone(w) for _ in range(-(-L2_BYTES // _bytes(w)) - 1)]
        turn = [0]

        def nxt():  # the next copy: each captured call reads a weight the call before did not
            turn[0] += 1
            return ws[turn[0] % len(ws)]
        fused_us = graph_us(lambda: fl.linear(xi, nxt(), silu=silu))
        wbs = [wb] + [wb.clone() for _ in range(-(-L2_BYTES // _bytes(wb)) - 1)] if int8 else ws
        tb = [0]

        def nxt_b():  # the bf16 weight's next copy (cuBLAS's, and with int8 the fused kernel's on bf16)
            tb[0] += 1
            return wbs[tb[0] % len(wbs)]
        unfused_us = graph_us(lambda: fused_ops.silu_mul(F.linear(xi, nxt_b())) if silu else F.linear(xi, nxt_b()))
        n = w.shape[0] // 2 if silu else w.shape[0]
        gbs = _bytes(w) / fused_us / 1e3
        res.setdefault("kernels_us", {})[name] = {"fused": round(fused_us, 2), "cublas": round(unfused_us, 2),
                                                 "copies": len(ws), "fused_gb_s": round(gbs),
                                                 "tile": list(fl.tile_for(n, w.shape[1], silu, int8))}
        if int8:
            bf16_us = graph_us(lambda: fl.linear(xi, nxt_b(), silu=silu))
            res["kernels_us"][name]["bf16"] = round(bf16_us, 2)
            print(f"  {name}: {rows} rows, bf16 on the fused kernel {bf16_us:.2f} us", flush=True)
        print(f"  {name}: {rows} rows, triton{' int8' if int8 else ''} {fused_us:.2f} us, "
              f"cuBLAS{' + silu_mul' if silu else ''} {unfused_us:.2f} us", flush=True)
        if sweep:
            times = {}
            narrow = not silu and w.shape[0] <= 2048 and w.shape[1] >= 2 * w.shape[0]
            for tile in (INT8_SWEEP if int8 else ROUTER_SWEEP if name == "router" else NARROW_SWEEP if narrow and name != "head" else
                         ({True: WIDE_HEAD_SWEEP, False: HEAD_SWEEP} if name == "head"
                          else {True: WIDE_SWEEP, False: SWEEP})[min(w.shape) > fl.MAX_HIDDEN]):
                try:
                    times[tile] = graph_us(lambda: fl.linear(xi, nxt(), silu=silu, tile=tile))
                except Exception as e:  # a tiling the compiler refuses (shared memory)
                    print(f"  {name}: tile {tile} failed: {str(e).splitlines()[0][:100]}")
            best = sorted(times, key=times.get)[:5]
            full_b = fl.linear(inp, w, silu=silu, tile=best[0])
            err = (full_b.float() - ref.float()).abs().max().item()
            bad = [m for m in (1, 2, 5, 16, 17, 64, 200) if not torch.equal(fl.linear(inp[:m], w, silu=silu, tile=best[0]), full_b[:m])]
            check(f"{name}: best tile {best[0]}: the torch reference, rows keep their bits", not bad and err <= 0.02 * max(scale_ref, 1.0),
                  f"(max diff {err:.3g}{', differ at ' + str(bad) if bad else ''})")
            res.setdefault("sweep_us", {})[name] = {",".join(map(str, t)): round(v, 2) for t, v in times.items()}
            best_tiles[f"{n},{w.shape[1]},{int(silu)}"] = list(best[0])
            print(f"  {name}: best tiles " + ", ".join(f"{t} {times[t]:.2f} us" for t in best), flush=True)
    if sweep:
        res["best_tiles"] = best_tiles
        print("SPECDEC_FUSED_LAYER_TILES='" + json.dumps(best_tiles) + "'")


def model_check(shape: str, res: dict, layers: int = 4) -> None:
    """The shape's model with the fused path on and off: its wiring (norms, RoPE, residuals) checked on the
    first ``layers`` layers, where bf16 rounding has not yet grown; the whole model's difference is reported
    only (over 36 random layers, rounding alone moves it by percents: qwen3-8b 3.7e-2 on 2026-12-04)."""
    from specdec.shapes import build_shape
    m = build_shape(shape, torch.device("cuda"), torch.bfloat16)
    on = [layer.fused_path for layer in m.layers]
    check(f"{shape}: every layer takes the fused path", all(on), f"({sum(on)}/{len(on)})")
    ids = torch.randint(0, 1000, (160,), generator=torch.Generator().manual_seed(1)).cuda()
    full = m.layers
    for label, kept in ((f"first {layers} layers", full[:layers]), ("whole model", full)):
        m.layers = kept
        outs, before = {}, fl.ENABLED
        for enabled in (False, True):
            fl.ENABLED = enabled
            try:
                with torch.inference_mode():
                    outs[enabled] = m(ids, m.new_cache(200), logits="all").logits.float()
            finally:
                fl.ENABLED = before
        a, b = outs[False], outs[True]
        rel = ((a - b).norm() / a.norm()).item()
        agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
        res[f"logits_rel_diff_{len(kept)}"], res[f"argmax_agree_{len(kept)}"] = rel, agree
        detail = f"(relative diff {rel:.2e}, argmax agree {agree:.3f})"
        if kept is full:
            print(f"info {shape}: logits fused vs unfused, {label}: {detail}")
        else:
            check(f"{shape}: logits fused vs unfused, {label}", rel < 0.02 and agree > 0.9, detail)
    m.layers = full


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--rows", type=int, default=16, help="rows of the timed calls (default 16)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--sweep", action="store_true", help="also time every tiling of SWEEP at --rows rows")
    ap.add_argument("--head", action="store_true", help="also the LM head (vocab x hidden), as SPECDEC_ROW_EXACT runs it")
    ap.add_argument("--only", nargs="+", metavar="WEIGHT",
                    help="check and time only these weights (names as --list prints them; default: all but the head)")
    ap.add_argument("--int8", action="store_true", help="the weights as int8 rows (a drafter's --draft-int8), "
                    "each also timed in bf16")
    ap.add_argument("--list", action="store_true", help="print the shape's weights (name: rows, K, silu) and exit")
    ap.add_argument("--no-model", action="store_true", help="skip the whole shape's logits with the fused path on and off")
    a = ap.parse_args(argv)
    from specdec.errors import SpecdecError
    try:
        shapes = weight_shapes(a.shape)
    except SpecdecError as e:
        print(f"check_fused_layer: {e}", file=sys.stderr)
        return 2
    if a.list:
        for name, (n, k, silu) in shapes.items():
            print(f"{name}: {n} x {k}{' (SwiGLU)' if silu else ''}")
        return 0
    if a.only and set(a.only) - set(shapes):
        print(f"check_fused_layer: --only {' '.join(sorted(set(a.only) - set(shapes)))}: {a.shape} has {', '.join(shapes)}",
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("check_fused_layer: needs CUDA", file=sys.stderr)
        return 2
    keep = set(a.only or [n for n in shapes if n != "head" or a.head])
    res = {"shape": a.shape, "rows": a.rows, "tile": list(fl.TILE)}
    res["int8"] = a.int8
    kernels({n: v for n, v in shapes.items() if n in keep}, a.rows, res, a.sweep, a.int8)
    if not a.no_model:
        model_check(a.shape, res)
    res["failed"] = FAILED
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump(res, fh, indent=1)
    print(f"{len(FAILED)} failed")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
