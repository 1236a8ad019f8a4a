"""The issue-10 speed flags against none of them, in one process.

Separate processes drift on the H200 (the bench's copy bandwidth moved 3645..3857 GB/s between runs,
plain decoding 623..661 tok/s for one configuration), so one run per flag cannot rank changes of a
few percent. Here one random target of a published shape is built once; every round times each
variant in turn (new static steps, captured under that variant's flags): plain decoding's step
(``STEP_ROWS`` rows at position ``--context`` over a cache sized as ``generate`` sizes it, prompt +
``-n``) and one propose of random DFlash and MTP drafters (their static steps). The table gives
each variant's median over the rounds and its ratio to ``base``.

    PYTHONPATH=. python scripts/ab_flags.py --shape smollm2-135m --context 300 --rounds 5 [--json out.json]

Variants: ``base`` (every flag off), ``fold`` (SPECDEC_FOLD_RESIDUAL), ``direct``
(SPECDEC_SPLIT_DIRECT), ``drafter-split`` (SPECDEC_DRAFTER_SPLIT), ``fused-layer`` (SPECDEC_FUSED_LAYER),
``fused+direct`` (the defaults' target step since the session of 2026-12-03), ``fused+direct+pdl``
(SPECDEC_PDL too; its L2-prefetch companion, measured no faster, was removed: the code at 0afadd6),
``fused+direct+pdl+small-tiles`` (SPECDEC_SPLIT_SMALL_TILES; the defaults since the session of 2026-12-03 (second)),
``all``; ``defaults`` (every flag the package turns on by default: all of them since the session of
2026-12-03 (seventh)) and ``defaults-<flag>`` (one flag off: ``defaults-fold``, ``defaults-delta-proj``
(SPECDEC_DELTA_PROJ: a Gated DeltaNet's in-projections as one GEMM; hybrid shapes only), ``defaults-fused-moe``
(SPECDEC_FUSED_MOE: a MoE block's step in three kernels; MoE shapes only), ``defaults-expert-kernel``
(SPECDEC_EXPERT_KERNEL: a static step's routed experts as one GEMV a pair, not torch's gather or dense forms), ...): each turns
its flags on and the others off; ``defaults+split64`` (128, 256, 512): the defaults with SPECDEC_SPLIT_KEYS at
that value; ``defaults+rowgroups16``: the fused MoE kernels with a program a row (expert_kernel.ROW_GROUPS); ``defaults-wide``
(fused_layer.WIDE off: 4096-wide and q/k-normed layers back on cuBLAS), ``defaults-split-k`` (fused_layer.SPLIT_K off:
every GEMM tiling unsplit), ``defaults-hybrid`` (qwen35.HYBRID_FUSED off: a dense Qwen3.5 target's GEMMs on cuBLAS,
its steps padded), ``defaults+pfall`` / ``defaults+pf0``
(fused_layer.PREFETCH_BYTES: whole weights or nothing prefetched into L2), ``defaults+cut4`` / ``+cut16`` (the combine's cut: 4 x 8, the default, or 16 x 32), ``defaults+o2`` / ``+qkv4`` / ``+down4`` (the qwen3-8b shape's GEMMs with K
split, see SETTINGS), ``defaults+route-w1`` / ``+route-w2`` (expert_kernel.ROUTE_WARPS: the routing kernel on 1 or 2 warps, not 4), ``defaults+combine-stream`` (expert_kernel.COMBINE_STREAM: the MoE combine as a persistent kernel; with
``AB_STREAM='BN,WARPS,PROGRAMS_AN_SM'`` also ``defaults+stream-tile``: that tiling), ``defaults+combine-bk256`` (the
qwen3.5-35b-a3b block's one-shot combine on 256-wide blocks of the intermediate), ``defaults+moe-bmm`` (moe.GROUPED_BMM: a MoE prefill's experts as two batched GEMMs; its
``prefill_ms``), ``defaults-buckets`` (graphs.SPAN_BUCKETS off: steps over the whole cache, not power-of-two multiples of the first split;
with a cache much longer than the context, ``-n``), ``defaults+far0`` (split_attention.schedule without far splits: one
split size at any context), ``defaults+far2048`` (512-key splits past 2,048 positions; also ``defaults+split128+far2048``), ``defaults-norm-rope`` (layers.NORM_ROPE off: the q/k norms as kernels of their own), ``defaults-prenorm``
(fused_ops.PRENORM_ADD off: Gemma 3's and 4's post-attention norm a kernel of its own), ``defaults-rope-table``
(layers.ROPE_TABLE off: a static step's cos/sin computed, not looked up), ``defaults-norm-router``
(expert_kernel.NORM_ROUTER off: a MoE layer's router as a GEMM of its own after the add-and-norm kernel), ``defaults-delta-one``
(delta_kernel.ONE_KERNEL off: a Gated DeltaNet step's conv and gates, then its recurrence, as two kernels), ``defaults-delta-early``
(delta_kernel.STATE_EARLY off: the step kernel loads the live state after its PDL wait), ``defaults+index-select``
(layers.INDEX_LOOKUPS off: the token embeddings and RoPE tables looked up by index_select, not indexing), ``defaults-small-fused`` (gemma4.SMALL_FUSED
off: Gemma 4's small models, KV-shared layers and per-layer inputs, on cuBLAS with padded steps), ``defaults-dense-tail``
(fused_ops.DENSE_TAIL off: Gemma 4's dense layer tail as the torch ops), ``defaults-gate-split`` (layers.GATE_IN_SPLIT
off: gated attention's sigmoid gate as two torch kernels after the split kernel). Each
variant times the padded plain step (``plain_step_ms``) and a 1-row one (``row_step_ms``: what a row-exact target runs), each
with the rollback after it, and (CUDA) plain greedy decoding's own chained steps, no rollback between them
(``chain_step_ms``: the padded step where the target pads, else 1-row). The flags are module attributes read as a step
is built, so a variant's steps are built with them set and the defaults come back after.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch

FLAGS = {"fold": ("specdec.models.base", "FOLD_RESIDUAL"), "direct": ("specdec.models.split_attention", "DIRECT"),
         "drafter-split": ("specdec.models.layers", "DRAFTER_SPLIT"),
         "fused-layer": ("specdec.models.fused_layer", "ENABLED"), "pdl": ("specdec.models.pdl", "ENABLED"),
         "small-tiles": ("specdec.models.split_attention", "SMALL_TILES"),
         "delta-proj": ("specdec.models.deltanet", "FUSED_PROJ"),
         "fused-moe": ("specdec.models.expert_kernel", "FUSED_MOE"),
         "expert-kernel": ("specdec.models.expert_kernel", "ENABLED"),
         "pipeline": ("specdec.models.split_attention", "PIPELINE"),
         "wide": ("specdec.models.fused_layer", "WIDE"),
         "split-k": ("specdec.models.fused_layer", "SPLIT_K"),
         "hybrid": ("specdec.models.qwen35", "HYBRID_FUSED"),
         "norm-rope": ("specdec.models.layers", "NORM_ROPE"),
         "prenorm": ("specdec.models.fused_ops", "PRENORM_ADD"),
         "tail": ("specdec.models.fused_ops", "SANDWICH_TAIL"),
         "dense-tail": ("specdec.models.fused_ops", "DENSE_TAIL"),
         "small-fused": ("specdec.models.gemma4", "SMALL_FUSED"),
         "buckets": ("specdec.models.graphs", "SPAN_BUCKETS"),
         "rope-table": ("specdec.models.layers", "ROPE_TABLE"),
         "norm-router": ("specdec.models.expert_kernel", "NORM_ROUTER"),
         "delta-one": ("specdec.models.delta_kernel", "ONE_KERNEL"),
         "delta-early": ("specdec.models.delta_kernel", "STATE_EARLY"),
         "gate-split": ("specdec.models.layers", "GATE_IN_SPLIT")}
# settings other than on/off, each on top of the defaults: defaults+split64 (SPECDEC_SPLIT_KEYS=64), ...
SETTINGS = {f"split{n}": ("specdec.models.split_attention", "_SPLIT_ENV", n) for n in (64, 128, 256, 512)}
SETTINGS["rowgroups16"] = ("specdec.models.expert_kernel", "ROW_GROUPS", 16)  # the MoE kernels: a program a row
SETTINGS["pfall"] = ("specdec.models.fused_layer", "PREFETCH_BYTES", 1 << 40)  # the fused GEMM prefetches whole weights
SETTINGS["cut4"] = ("specdec.models.split_attention", "COMBINE_CUT", (4, 8))  # combine programs of 4 rows x 8 features
SETTINGS["cut16"] = ("specdec.models.split_attention", "COMBINE_CUT", (16, 32))  # ... 16 x 32 (the default to 2026-12-04)
SETTINGS["pf0"] = ("specdec.models.fused_layer", "PREFETCH_BYTES", 0)  # ... or nothing
# the qwen3-8b shape's GEMMs with K split (fused_layer.SPLIT_K; over SPECDEC_FUSED_LAYER_TILES): o_proj 2 ways, q/k/v 4
# ways on (64, 128) tiles, down_proj 4 ways on 3 stages
SETTINGS["o2"] = ("specdec.models.fused_layer", "_FORCED", {(4096, 4096, 0): (64, 256, 4, 4, 2)})
SETTINGS["qkv4"] = ("specdec.models.fused_layer", "_FORCED", {(6144, 4096, 0): (64, 128, 4, 4, 4)})
SETTINGS["down4"] = ("specdec.models.fused_layer", "_FORCED", {(4096, 12288, 0): (64, 256, 4, 3, 4)})
SETTINGS["route-w1"] = ("specdec.models.expert_kernel", "ROUTE_WARPS", 1)  # the routing kernel on one warp
SETTINGS["route-w2"] = ("specdec.models.expert_kernel", "ROUTE_WARPS", 2)
SETTINGS["combine-stream"] = ("specdec.models.expert_kernel", "COMBINE_STREAM", True)  # the persistent MoE combine
# the one-shot combine on 256-wide blocks of the qwen3.5-35b-a3b shape's intermediate (164 registers, no spills)
SETTINGS["combine-bk256"] = ("specdec.models.expert_kernel", "SHAPE_TILES", {(2048, 512): ((4, 1024, 4), (1, 256, 1, 16))})
SETTINGS["moe-tiles0"] = ("specdec.models.expert_kernel", "SHAPE_TILES", {})  # the MoE kernels' default tiles for every shape
SETTINGS["moe-bmm"] = ("specdec.models.moe", "GROUPED_BMM", True)  # a MoE prefill's experts as two batched GEMMs
SETTINGS["index-select"] = ("specdec.models.layers", "INDEX_LOOKUPS", False)  # table lookups by index_select
SETTINGS["far0"] = ("specdec.models.split_attention", "_FAR_ENV", (0, 0))  # one split size (no far splits)
SETTINGS["far2048"] = ("specdec.models.split_attention", "_FAR_ENV", (2048, 512))  # 512-key splits past 2,048 positions
# AB_STREAM='BN,WARPS,PER_SM': defaults+stream-tile, the persistent combine on that tiling
if os.environ.get("AB_STREAM"):
    try:
        _bn, _w, _per = (int(v) for v in os.environ["AB_STREAM"].split(","))
    except ValueError:
        sys.exit(f"ab_flags: AB_STREAM={os.environ['AB_STREAM']!r}: want 'BN,WARPS,PER_SM' (three integers, e.g. 2,4,2)")
    SETTINGS["stream-tile"] = [("specdec.models.expert_kernel", "COMBINE_STREAM", True),
                               ("specdec.models.expert_kernel", "STREAM_TILE", (_bn, _w)),
                               ("specdec.models.expert_kernel", "STREAM_PROGRAMS", _per)]
# AB_TILES='{"N,K,silu": [BN, BK, warps, stages(, split)], ...}' (check_fused_layer.py --sweep's best_tiles): defaults+tiles
# runs those tilings over the table, in the same process as the defaults
if os.environ.get("AB_TILES"):
    SETTINGS["tiles"] = ("specdec.models.fused_layer", "_FORCED", {tuple(int(v) for v in key.split(",")): tuple(t)
                                                                    for key, t in json.loads(os.environ["AB_TILES"]).items()})
VARIANTS = {"base": (), "fold": ("fold",), "direct": ("direct",), "drafter-split": ("drafter-split",),
            "fused-layer": ("fused-layer",), "fused+direct": ("fused-layer", "direct"),
            "fused+direct+pdl": ("fused-layer", "direct", "pdl"),
            "fused+direct+pdl+small-tiles": ("fused-layer", "direct", "pdl", "small-tiles"),
            "all": tuple(FLAGS)}
VARIANTS["defaults"] = tuple(FLAGS)  # what ships today: every flag on
for _n in FLAGS:  # each flag's question against what ships: defaults-fold, defaults-delta-proj, ...
    VARIANTS[f"defaults-{_n}"] = tuple(n for n in FLAGS if n != _n)
for _n in SETTINGS:
    VARIANTS[f"defaults+{_n}"] = tuple(FLAGS) + (_n,)
VARIANTS["defaults+split128+far2048"] = tuple(FLAGS) + ("split128", "far2048")


@contextlib.contextmanager
def flags(names):
    import importlib
    saved = []
    try:
        for n in FLAGS:
            mod = importlib.import_module(FLAGS[n][0])
            saved.append((mod, FLAGS[n][1], getattr(mod, FLAGS[n][1])))
            setattr(mod, FLAGS[n][1], n in names)
        for n in names:
            if n in SETTINGS:  # one (module, attribute, value) or a list of them
                for modname, attr, value in SETTINGS[n] if isinstance(SETTINGS[n], list) else [SETTINGS[n]]:
                    mod = importlib.import_module(modname)
                    saved.append((mod, attr, getattr(mod, attr)))
                    setattr(mod, attr, value)
        yield
    finally:
        for mod, attr, value in reversed(saved):
            setattr(mod, attr, value)


CHAIN = 8  # greedy-chain steps a timed call (chain_step_ms)


def time_variant(model, ids: torch.Tensor, context: int, new_tokens: int, reps: int, drafters: dict) -> dict:
    from specdec.bench_shape import _median_ms, _time_drafter
    from specdec.engine.generate import STEP_ROWS
    from specdec.models.graphs import GraphedTarget

    from specdec.models import fused_layer
    dev = model.device
    for layer in model.layers:  # the variant's fused-layer eligibility (the wide flag), as fuse_projections sets it
        if hasattr(layer, "fused_path"):
            layer.fused_path = fused_layer.eligible(layer)
    chain_steps = CHAIN * (reps + 3)  # the greedy chain's positions (_median_ms's warm-up calls included)
    cache = model.new_cache(context + max(new_tokens, chain_steps + 1), spare=STEP_ROWS)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    with torch.inference_mode():  # the prefill, timed once (a variant's first round includes its kernels' compiles)
        model(ids[:context], cache, logits="last", snapshots=False)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    prefill_ms = (time.perf_counter() - t0) * 1e3
    steps = GraphedTarget(model, cache, (), max_steps=STEP_ROWS, use_graphs=dev.type == "cuda")
    row = ids[context:context + 1]

    def one():  # plain decoding's padded step: STEP_ROWS rows, one of them real (as bench --shape's plain step)
        steps(row, rows=STEP_ROWS)
        cache.rollback(context)
    def one_row():  # a row-exact target's plain step (CausalLM.row_exact): 1 row, unpadded
        steps(row, rows=1)
        cache.rollback(context)
    out = {"plain_step_ms": _median_ms(one, dev, reps), "row_step_ms": _median_ms(one_row, dev, reps),
           "row_exact": float(model.row_exact()), "prefill_ms": round(prefill_ms, 2)}
    if dev.type == "cuda":  # plain greedy decoding's own loop: CHAIN chained steps a call, no rollback between them
        # (the steps above roll back after each, which costs a tree's caches what it costs them)
        steps.greedy_step(row[:1])

        def chain():
            for _ in range(CHAIN):
                steps.greedy_step()
        out["chain_step_ms"] = round(_median_ms(chain, dev, reps) / CHAIN, 4)
        cache.rollback(cache.length)
    for label, make in drafters.items():
        out[f"{label}_propose_ms"] = _time_drafter(model, make, ids[:context], reps)["ms"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", required=True, help="a published shape (specdec bench --shape names them)")
    ap.add_argument("--context", type=int, default=300, help="prompt positions before the timed step (default 300)")
    ap.add_argument("-n", "--new-tokens", type=int, default=128, help="the cache holds context + this (default 128)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds; each times every variant once (default 5)")
    ap.add_argument("--reps", type=int, default=20, help="timed calls per measurement, median (default 20)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--no-drafters", action="store_true", help="time the target's step only")
    ap.add_argument("--device", default=None)
    ap.add_argument("--json", default=None, help="also write the table to this file")
    a = ap.parse_args(argv)
    if a.context < 1 or a.new_tokens < 1 or a.rounds < 1 or a.reps < 1:
        ap.error("--context, -n, --rounds and --reps must be >= 1")
    from specdec.bench_shape import drafter_makers
    from specdec.errors import SpecdecError
    from specdec.loading import resolve_device, resolve_dtype
    from specdec.shapes import build_shape, shape_config

    try:
        limit = shape_config(a.shape)[1].max_position_embeddings
        if a.context + a.new_tokens > limit:
            raise SpecdecError(f"--context {a.context} + -n {a.new_tokens} exceeds shape {a.shape}'s {limit} positions")
        dev = resolve_device(a.device)
        model = build_shape(a.shape, dev, resolve_dtype(None, dev))
    except SpecdecError as e:
        print(f"ab_flags: {e}", file=sys.stderr)
        return 2
    ids = torch.randint(0, model.config.vocab_size, (a.context + 1,), generator=torch.Generator().manual_seed(3)).to(dev)
    drafters = {} if a.no_drafters else drafter_makers(model)
    runs = {v: [] for v in a.variants}
    for r in range(a.rounds):
        for v in a.variants:
            with flags(VARIANTS[v]):
                runs[v].append(time_variant(model, ids, a.context, a.new_tokens, a.reps, drafters))
            print(f"round {r + 1}/{a.rounds} {v}: {runs[v][-1]}", file=sys.stderr, flush=True)
    keys = list(runs[a.variants[0]][0])
    table = {v: {k: round(statistics.median(x[k] for x in runs[v]), 4) for k in keys} for v in a.variants}
    base = table.get("base")
    print(f"shape {a.shape}, context {a.context}, cache {a.context + a.new_tokens}, {dev}, {a.rounds} rounds x {a.reps} reps "
          "(median ms; ratio to base)")
    print("| variant | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for v, row in table.items():
        cells = [f"{row[k]}" + (f" ({row[k] / base[k]:.3f})" if base and base[k] and v != "base" else "") for k in keys]
        print(f"| {v} | " + " | ".join(cells) + " |")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump({"shape": a.shape, "context": a.context, "new_tokens": a.new_tokens, "device": str(dev),
                       "rounds": a.rounds, "reps": a.reps, "median_ms": table, "runs": runs}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
