"""Routed experts of a static step in Triton: one GEMV per (row, chosen expert) pair, reading the
expert's weights where they lie (issue 10).

The torch static forms (:meth:`Experts._gather`, :meth:`Experts._dense`) either copy every pair's
weights out of the expert stack (~3x the pair's bytes moved) or run every expert on every row; which
one depends on the step's shape. On the H200 the qwen3.5-35b-a3b shape's padded 16-row step (plain
decoding's, one real row) ran the dense form: 23.4 ms against 7.4 ms for a 1-row step. Here:

- ``_gate_up_kernel``: program ``(pair slot of a group of rows, block of BN intermediate channels)``
  computes each of its rows' pair's gate and up rows, walking the hidden size in BK blocks in order, then
  ``act(gate) * up`` with the torch form's roundings (gate and up rounded to the model dtype, the
  activation rounded, the product rounded); :func:`pairs` gives every row its own programs;
- ``_down_kernel``: program ``(pair, block of BN hidden channels)``: the pair's down projection.

:func:`moe` runs a whole routed-plus-shared MoE block's static step in four kernels (issue 10; on the H200 the
qwen3.5-35b-a3b shape's block took ~20 kernels a layer: softmax, top-k as two kernels, renormalisation, the
pairs, their weighted sum, the shared expert's GEMMs, its gate's GEMV and sigmoid, the products and the sum),
each launched with PDL (models/pdl.py) so that it starts while the one before it finishes:

- the router's GEMM over the router's rows and the shared expert's gate as one more (``SparseMoeBlock.fuse``):
  ``fused_layer.linear`` (a row's bits its own, whatever the row count), its logits rounded to the model dtype
  as ``F.linear`` rounds them; in a Qwen3.5 MoE layer (``SparseMoeBlock.add_forward``) inside the kernel of the
  post-mixer residual add and norm instead (:func:`norm_router`, :data:`NORM_ROUTER`), one kernel fewer;
- ``_route_kernel``: program ``row``: the fp32 softmax of the router's logits, the top k (largest first,
  the lowest id among equal values; one max a pick over int64 keys), renormalised over them and rounded to the
  model dtype, and the shared expert's gate ``sigmoid(logit)`` as the row's weight number k;
- ``_gate_up_kernel`` over k + 1 pairs a row, the shared expert the last pair (its fused gate/up weight, pulled
  into the L2 before the PDL wait: it never depends on the routing);
- ``_combine_kernel``: program ``(group of rows, block of BN hidden channels)``: every pair's down projection
  of each of its rows, PC pairs' weight rows loaded at once, each rounded to the model dtype, times its weight
  (rounded), summed in pair order in fp32 and rounded once: the block's output, with no ``[T, k, H]``
  intermediate.

Its bits differ from the torch forms' (other roundings and sum orders) but depend on the row's input
alone, so plain and speculative decoding, which both run it, stay equal. ``SPECDEC_FUSED_MOE=0`` keeps the
routing, the weighted sum and the shared expert in torch ops around :func:`pairs`.

A pair's bits depend on its row and its expert only: never on the other rows, their experts or the
row count (per-row invariance, whatever the step's shape). Rows at or past ``live`` (a static step's
padding, :class:`~specdec.models.base.StepContext`) read no weights and give zeros.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from .. import env
from ..cpu_linear import linear
from . import fused_layer, fused_ops, pdl
from .layers import gelu_tanh

try:  # Triton ships with CUDA builds of torch; CPU-only installs have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

ENABLED = env.switch("SPECDEC_EXPERT_KERNEL")
FUSED_MOE = env.switch("SPECDEC_FUSED_MOE")
# The router's GEMM inside the add-and-norm kernel before the block (norm_router): a MoE layer's post-mixer residual
# add, its RMSNorm and every router logit in one kernel, each program's ROUTER_ROWS router rows loaded before its PDL
# wait (the weights never depend on the kernel before). The router's GEMM alone cost ~4.6-4.9 us a layer for 1 MB,
# latency-bound at any split, the norm kernel before it ~2 us; the one kernel adds 2.7 us (H100, qwen3.5-35b-a3b shape).
# Its sum and norm are the norm kernel's bits; its logits' bits are its own (a row's own, at any row count), not the
# GEMM's: every forward the MoE kernels take routes on them. On since measured (session of 2026-12-07 (sixteenth),
# H100, scripts/ab_flags.py, one process): the 35b shape's 1-row step 3.646 -> 3.475 ms, its padded step 3.918 ->
# 3.696 (5 rounds); ROUTER_ROWS 1 / 2 / 4 within noise of each other. SPECDEC_NORM_ROUTER=0: the norm, then the GEMM.
NORM_ROUTER = env.switch("SPECDEC_NORM_ROUTER")
ROUTER_ROWS = 2
BN, BK = 16, 256  # rows of a weight and features of the input a program step holds
# moe()'s tiles: (BN, BK, warps) of the gate/up kernel and (BN, BK, warps, PC) of the combine kernel (PC: the
# pairs whose down rows one load takes): fixed per build (a row's bits depend on them), the fastest of
# scripts/sweep_moe_kernel.py's on the H200 (qwen3.5-35b-a3b's block, one row; BENCHMARKS.md)
GATE_UP_TILE = (4, 1024, 4)
COMBINE_TILE = (1, 512, 1, 16)
# (hidden, expert width) -> (GATE_UP_TILE, COMBINE_TILE) for a block whose own sweep found other tiles faster (a row's
# bits still fixed per shape). The gemma4-26b-a4b shape's (2816 x 704 experts, top 8 of 128): on an H100
# (scripts/sweep_moe_kernel.py --shape gemma4-26b-a4b, 1 row, us a layer, each kernel's sweep beside the other's
# default) gate/up (2, 2048, 2) 49.82 and combine (2, 256, 8, 8) 46.75 against the defaults' 58.82 (the combine's
# 512-wide blocks left 27 % of its lanes masked on 704-wide experts); both (--combos) 60.0 -> 47.4 at 1 row, 472 -> 421
# at 16, but 134 -> 143 at 4 rows; in the 1-row step (scripts/ab_flags.py defaults+moe-tiles0) 4.485 -> 4.433 ms
# (session of 2026-12-07 (twelfth))
SHAPE_TILES: dict[tuple[int, int], tuple[tuple[int, int, int], tuple[int, int, int, int]]] = {
    (2816, 704): ((2, 2048, 2), (2, 256, 8, 8)),
}
# moe()'s programs each take rows g, g + G, ... of a step (G = min(rows, ROW_GROUPS)): a static step of 16 rows
# with one live (plain decoding's) then launches G/16 of the programs a program a row would, where a padding row's
# programs did nothing but start (on the H200, qwen3.5-35b-a3b: the two kernels 1.08 -> 1.58 ms a step from 1 to
# 16 rows with one live). A row's bits do not depend on G: each (row, pair, block) is computed alike.
ROW_GROUPS = 4
# the routing kernel's warps (a row's softmax and its K max passes over the E keys: with one warp each reduction is
# register shuffles, with more each also crosses shared memory and a barrier); fixed per build (its softmax sum's order
# follows the layout, so a row's bits do)
ROUTE_WARPS = 4
# The combine as a persistent kernel (_combine_stream_kernel): STREAM_PROGRAMS programs an SM, each walking blocks of
# STREAM_TILE = (BN hidden channels, warps), a row's hidden vectors loaded once a program and the next block's down
# rows while it sums this one's. The one-shot combine's 2,048 one-warp programs each re-read the row's 9 x 512 hidden
# values and hold [16, 512] tiles of weights and values: ptxas gives the COMBINE_TILE build 255 registers a thread and
# spills (sm_90a), so at most 8 of its warps fit an SM: two waves for the qwen3.5-35b-a3b block. It took 10-12.6 us a
# layer for 18.9 MB, with its weights in L2 or not (H100). The persistent build on (1, 4): 160 registers, no spills
# (three 4-warp programs an SM fit); (2, 4): 225 (two fit). Rows in ROW_GROUPS groups, as the one-shot kernel's: each
# group its own STREAM_PROGRAMS programs an SM (a padded step's groups of padding rows only store zeros). Off by default
# until measured (scripts/ab_flags.py defaults+combine-stream); experts at most STREAM_MAX_INTER wide (one block of the
# intermediate)
COMBINE_STREAM = False
STREAM_TILE = (1, 4)
STREAM_PROGRAMS = 3
STREAM_MAX_INTER = 1024
# Tried and removed (session of 2026-12-06 (eighth), H100; code at 74ec58b): the router's GEMM and the routing as one
# kernel (SPECDEC_ROUTER_ROUTES; the GEMM on the router's tiling, the last program to finish routing the rows; the same
# bits). The routing's share of the qwen3.5-35b-a3b step went 7.31 -> 7.19 us a layer at 1 row and 7.28 -> 13.28 at 4
# (profile_shape_step --timeline); the 1-row step 3.645 -> 3.632 ms, the padded one 3.884 -> 4.159 (ab_flags). So the
# routing's ~3 us is mostly its own chain (softmax, 8 top-k passes), not the launch it saved; the two effects (a kernel
# less, the routing in a 2-warp program over 4-row blocks) are not separated by these numbers.
# Tried and removed (session of 2026-12-06 (fifth), H100; code at 442c10c): the combine loading its first row's weights
# before its PDL wait (the gate/up kernel letting it launch only after its own wait, once the routing was complete).
# Same bits in 50 replays a case, but slower: the qwen3.5-35b-a3b block 32.38 -> 35.44 us a layer (1 row) and 35.25 ->
# 42.15 (16 rows, 1 live) in scripts/check_moe_early.py; the shape's padded step 3.975 -> 4.202 ms (1-row 3.683 -> 3.646).


def usable(x: torch.Tensor, act) -> bool:
    """Whether the kernels can run: enabled, Triton, a CUDA tensor, a SiLU- or GELU-tanh-gated expert
    (:func:`~.layers.gelu_tanh`: Gemma 4's)."""
    return ENABLED and triton is not None and x.is_cuda and (act is F.silu or act is gelu_tanh)


if triton is not None:
    @triton.jit
    def _pads(t, live, LIVE: tl.constexpr):
        # whether row t pads a static step (at or past its live rows); no row does without LIVE
        if LIVE:
            return t >= tl.load(live)
        else:
            return t < 0

    @triton.jit
    def _live_rows(T, live, LIVE: tl.constexpr):
        # the rows a static step computes: its live rows (StepContext.live), else all T
        if LIVE:
            return tl.minimum(tl.load(live).to(tl.int32), T)
        else:
            return T + 0

    @triton.jit
    def _gate_up_kernel(x, idx, w, sw, h, live, T, G, K, P, H, INTER, LIVE: tl.constexpr, BN: tl.constexpr,
                        BK: tl.constexpr, PER_LINE: tl.constexpr, LINES: tl.constexpr, USE_GDC: tl.constexpr,
                        GELU: tl.constexpr = False):
        # program (row group g and pair slot j: axis 0 = g * P + j; block of BN intermediate channels): pair j of
        # rows g, g + G, ... below the live rows (a padding row's h is never read); pair number K of a row
        # (P = K + 1) is the shared expert, whose fused gate/up weight is sw
        g = tl.program_id(0) // P
        j = tl.program_id(0) % P
        nb = tl.program_id(1)
        rn = nb * BN + tl.arange(0, BN)
        nm = rn < INTER
        dt = h.dtype.element_ty
        if USE_GDC:  # models/pdl.py; meanwhile a shared-expert program pulls its weight rows into L2 (the routed
            # experts are known only after the wait)
            tl.extra.cuda.gdc_launch_dependents()
            if j == K:  # the gate rows, then the up rows
                rows = tl.minimum(rn, INTER - 1)
                pdl.rows_to_l2(sw, rows, H, PER_LINE, LINES)
                pdl.rows_to_l2(sw, rows + INTER, H, PER_LINE, LINES)
            tl.extra.cuda.gdc_wait()
        for t in range(g, _live_rows(T, live, LIVE), G):
            if j < K:
                e = tl.load(idx + t * K + j).to(tl.int64)
                base = w + e * (2 * INTER) * H
            else:
                base = sw + 0
            acc_g = tl.zeros([BN], dtype=tl.float32)
            acc_u = tl.zeros([BN], dtype=tl.float32)
            for k0 in range(0, H, BK):
                rk = k0 + tl.arange(0, BK)
                km = rk < H
                xv = tl.load(x + t * H + rk, mask=km, other=0.0).to(tl.float32)
                m2 = nm[:, None] & km[None, :]
                wg = tl.load(base + rn[:, None] * H + rk[None, :], mask=m2, other=0.0).to(tl.float32)
                wu = tl.load(base + (INTER + rn[:, None]) * H + rk[None, :], mask=m2, other=0.0).to(tl.float32)
                acc_g += tl.sum(wg * xv[None, :], axis=1)
                acc_u += tl.sum(wu * xv[None, :], axis=1)
            gv = acc_g.to(dt).to(tl.float32)
            if GELU:  # Gemma 4's experts (the fused GEMM's GELU-tanh)
                a = fused_layer.glu_act(gv, True).to(dt).to(tl.float32)
            else:
                a = (gv * tl.sigmoid(gv)).to(dt).to(tl.float32)
            tl.store(h + (t * P + j) * INTER + rn, (a * acc_u.to(dt).to(tl.float32)).to(dt), mask=nm)

    @triton.jit
    def _down_rows(hv_ptr, base, rn, nm, INTER, BN: tl.constexpr, BK: tl.constexpr):
        # rows rn of one expert's down projection (at base, [H, INTER]) times a pair's hidden vector, fp32,
        # the intermediate walked in BK blocks in order
        acc = tl.zeros([BN], dtype=tl.float32)
        for k0 in range(0, INTER, BK):
            rk = k0 + tl.arange(0, BK)
            km = rk < INTER
            hv = tl.load(hv_ptr + rk, mask=km, other=0.0).to(tl.float32)
            wd = tl.load(base + rn[:, None] * INTER + rk[None, :], mask=nm[:, None] & km[None, :], other=0.0)
            acc += tl.sum(wd.to(tl.float32) * hv[None, :], axis=1)
        return acc

    @triton.jit
    def _down_kernel(hin, idx, w, y, live, K, H, INTER, LIVE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        p = tl.program_id(0)
        nb = tl.program_id(1)
        t = p // K
        rn = nb * BN + tl.arange(0, BN)
        nm = rn < H
        if _pads(t, live, LIVE):
            tl.store(y + p * H + rn, tl.zeros([BN], dtype=tl.float32).to(y.dtype.element_ty), mask=nm)
        else:
            e = tl.load(idx + p).to(tl.int64)
            acc = _down_rows(hin + p * INTER, w + e * H * INTER, rn, nm, INTER, BN, BK)
            tl.store(y + p * H + rn, acc.to(y.dtype.element_ty), mask=nm)

    @triton.jit
    def _route_kernel(logits, idx, wts, live, pes, E, LS, P, LIVE: tl.constexpr, SHARED: tl.constexpr,
                      K: tl.constexpr, KB: tl.constexpr, BE: tl.constexpr, USE_GDC: tl.constexpr,
                      SCALED: tl.constexpr = False):
        # program row t: the top K of the softmax of its E logits (row stride LS), renormalised (SCALED: each times
        # its expert's scale pes[id], Gemma 4's per_expert_scale), and (SHARED) the shared expert's gate, the
        # sigmoid of logit number E, as weight number K; a padding row routes to expert 0 with weight 0. The top K
        # in one max a pick: a probability (never negative, so its bits order as it does) in the high word of an
        # int64 key, BE - 1 - id in the low word (the lowest id wins a tie)
        if USE_GDC:  # models/pdl.py
            pdl.begin()
        t = tl.program_id(0)
        rk = tl.arange(0, KB)
        dt = wts.dtype.element_ty
        if _pads(t, live, LIVE):
            tl.store(idx + t * K + rk, tl.zeros([KB], dtype=tl.int32), mask=rk < K)
            tl.store(wts + t * P + rk, tl.zeros([KB], dtype=tl.float32).to(dt), mask=rk < P)
        else:
            re = tl.arange(0, BE)
            em = re < E
            lg = tl.load(logits + t * LS + re, mask=em, other=float("-inf")).to(tl.float32)
            ex = tl.exp(lg - tl.max(lg, 0))
            prob = ex / tl.sum(ex, 0)
            key = (prob.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (BE - 1 - re).to(tl.int64)
            key = tl.where(em, key, -1)  # taken or past E: below every key
            top = tl.zeros([KB], dtype=tl.float32)
            ids = tl.zeros([KB], dtype=tl.int32)
            for i in tl.static_range(K):
                best = tl.max(key, 0)
                top = tl.where(rk == i, (best >> 32).to(tl.int32).to(tl.float32, bitcast=True), top)
                ids = tl.where(rk == i, (BE - 1 - (best & 0xFFFFFFFF)).to(tl.int32), ids)
                key = tl.where(key == best, -1, key)
            tl.store(idx + t * K + rk, ids, mask=rk < K)
            wk = top / tl.sum(top, 0)
            if SCALED:
                wk = wk * tl.load(pes + ids, mask=rk < K, other=0.0).to(tl.float32)
            wk = wk.to(dt)
            if SHARED:
                gl = tl.load(logits + t * LS + E).to(tl.float32)
                wk = tl.where(rk == K, tl.sigmoid(gl).to(dt), wk)
            tl.store(wts + t * P + rk, wk, mask=rk < P)

    @triton.jit
    def _combine_kernel(hin, idx, wts, w, sw, y, live, T, G, H, INTER, K: tl.constexpr, P: tl.constexpr,
                        LIVE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PC: tl.constexpr,
                        PER_LINE: tl.constexpr, LINES: tl.constexpr, USE_GDC: tl.constexpr):
        # program (row group g, block of BN hidden channels): for rows g, g + G, ... the row's pairs' down
        # projections, each rounded, times its weight (rounded), summed in pair order in fp32 (pair K, P = K + 1,
        # the shared expert); a padding row gives zeros. PC pairs' weight rows are loaded at once ([PC, BN, BK]):
        # the pairs' loads in flight together, where a pair at a time waited for each in turn
        g = tl.program_id(0)
        nb = tl.program_id(1)
        rn = nb * BN + tl.arange(0, BN)
        nm = rn < H
        dt = y.dtype.element_ty
        if USE_GDC:  # models/pdl.py; meanwhile the shared expert's down rows into L2 (never the kernel before's)
            tl.extra.cuda.gdc_launch_dependents()
            if P > K:
                pdl.rows_to_l2(sw, tl.minimum(rn, H - 1), INTER, PER_LINE, LINES)
            tl.extra.cuda.gdc_wait()
        n = _live_rows(T, live, LIVE)
        rc = tl.arange(0, PC)
        for t in range(g, T, G):
            tot = tl.zeros([BN], dtype=tl.float32)
            if t < n:
                for j0 in tl.static_range(0, P, PC):
                    pj = j0 + rc
                    pm = pj < P
                    e = tl.load(idx + t * K + pj, mask=pj < K, other=0).to(tl.int64)
                    rows = rn[None, :, None] * INTER
                    at = tl.where((pj < K)[:, None, None], w + e[:, None, None] * H * INTER + rows, sw + rows)
                    acc = tl.zeros([PC, BN], dtype=tl.float32)
                    for k0 in range(0, INTER, BK):
                        rk = k0 + tl.arange(0, BK)
                        km = rk < INTER
                        hv = tl.load(hin + (t * P + pj)[:, None] * INTER + rk[None, :], mask=pm[:, None] & km[None, :],
                                     other=0.0).to(tl.float32)
                        wd = tl.load(at + rk[None, None, :], mask=pm[:, None, None] & nm[None, :, None] &
                                     km[None, None, :], other=0.0)
                        acc += tl.sum(wd.to(tl.float32) * hv[:, None, :], axis=2)
                    wj = tl.load(wts + t * P + pj, mask=pm, other=0.0).to(tl.float32)
                    c = (acc.to(dt).to(tl.float32) * wj[:, None]).to(dt).to(tl.float32)
                    for i in tl.static_range(PC):
                        if j0 + i < P:
                            tot += tl.sum(tl.where(rc[:, None] == i, c, 0.0), axis=0)
            tl.store(y + t * H + rn, tot.to(dt), mask=nm)


    @triton.jit
    def _combine_stream_kernel(hin, idx, wts, w, sw, y, live, T, G, H, INTER, K: tl.constexpr, SHARED: tl.constexpr,
                               LIVE: tl.constexpr, BN: tl.constexpr, BI: tl.constexpr, KP: tl.constexpr,
                               USE_GDC: tl.constexpr):
        # COMBINE_STREAM's combine, persistent: program (p, g) takes blocks p, p + NP, ... of BN hidden channels (NP
        # the grid's first axis) of rows g, g + G, ... For each row it loads the row's pairs' hidden vectors once (not
        # once a block), and the next block's down rows while it sums this block's: the routed pairs as one [KP, BN,
        # BI] tile (KP = K rounded up to a power of two), the shared expert's as one [BN, BI] of its own. A block's
        # output: each pair's dot over the whole intermediate (one block of BI), rounded to the model dtype, times its
        # weight (rounded), summed in pair order in fp32 (the shared expert, pair K, last), rounded once; a padding
        # row gives zeros
        pid = tl.program_id(0)
        npg = tl.num_programs(0)
        g = tl.program_id(1)
        nblocks = tl.cdiv(H, BN)
        dt = y.dtype.element_ty
        P = K + SHARED
        if USE_GDC:  # models/pdl.py
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        n = _live_rows(T, live, LIVE)
        rc = tl.arange(0, KP)
        km = rc < K
        ri = tl.arange(0, BI)
        im = ri < INTER
        rb = tl.arange(0, BN)
        lm = km[:, None, None] & im[None, None, :]
        for t in range(g, T, G):
            if t < n:
                e = tl.load(idx + t * K + rc, mask=km, other=0).to(tl.int64)
                at = w + e[:, None, None] * H * INTER + ri[None, None, :]
                hv = tl.load(hin + (t * P + rc)[:, None] * INTER + ri[None, :], mask=km[:, None] & im[None, :],
                             other=0.0).to(tl.float32)
                wj = tl.load(wts + t * P + rc, mask=km, other=0.0).to(tl.float32)
                rn = pid * BN + rb
                cur = tl.load(at + rn[None, :, None] * INTER, mask=lm & (rn < H)[None, :, None], other=0.0)
                if SHARED:
                    hs = tl.load(hin + (t * P + K) * INTER + ri, mask=im, other=0.0).to(tl.float32)
                    ws_ = tl.load(wts + t * P + K).to(tl.float32)
                    scur = tl.load(sw + rn[:, None] * INTER + ri[None, :], mask=(rn < H)[:, None] & im[None, :],
                                   other=0.0)
                for nb in range(pid, nblocks, npg):
                    rn = nb * BN + rb
                    rn2 = rn + npg * BN  # the next block's rows, loaded before this block's sums
                    nm2 = rn2 < H
                    nxt = tl.load(at + rn2[None, :, None] * INTER, mask=lm & nm2[None, :, None], other=0.0)
                    if SHARED:
                        snxt = tl.load(sw + rn2[:, None] * INTER + ri[None, :], mask=nm2[:, None] & im[None, :],
                                       other=0.0)
                    acc = tl.sum(cur.to(tl.float32) * hv[:, None, :], axis=2)
                    c = (acc.to(dt).to(tl.float32) * wj[:, None]).to(dt).to(tl.float32)
                    tot = tl.zeros([BN], dtype=tl.float32)
                    for i in tl.static_range(K):
                        tot += tl.sum(tl.where(rc[:, None] == i, c, 0.0), axis=0)
                    if SHARED:
                        sacc = tl.sum(scur.to(tl.float32) * hs[None, :], axis=1)
                        tot += (sacc.to(dt).to(tl.float32) * ws_).to(dt).to(tl.float32)
                        scur = snxt
                    tl.store(y + t * H + rn, tot.to(dt), mask=rn < H)
                    cur = nxt
            else:
                for nb in range(pid, nblocks, npg):
                    rn = nb * BN + rb
                    tl.store(y + t * H + rn, tl.zeros([BN], dtype=tl.float32).to(dt), mask=rn < H)

    @triton.jit
    def _norm_router_kernel(x, res, w, s, y, rw, logits, live, N, E, eps, LIVE: tl.constexpr, RB: tl.constexpr,
                            BLOCK: tl.constexpr, USE_GDC: tl.constexpr):
        # program (block b of RB router rows, row t): s = x + res (rounded), y = RMSNorm(s) as fused_ops' norm kernel
        # computes it, stored by the block-0 program; the block's logits y . router rows, fp32, rounded to the model
        # dtype. A padding row (at or past live) gets s and y, no logits (the routing skips it)
        b = tl.program_id(0)
        t = tl.program_id(1)
        i = tl.arange(0, BLOCK)
        m = i < N
        re = b * RB + tl.arange(0, RB)
        em = re < E
        if USE_GDC:  # models/pdl.py
            tl.extra.cuda.gdc_launch_dependents()
        wt = tl.load(rw + re[:, None] * N + i[None, :], mask=em[:, None] & m[None, :], other=0.0)  # before the wait
        if USE_GDC:
            tl.extra.cuda.gdc_wait()
        real = t < _live_rows(tl.num_programs(1), live, LIVE)
        if (b == 0) | real:
            v = tl.load(x + t * N + i, mask=m, other=0.0)
            r = tl.load(res + t * N + i, mask=m, other=0.0)
            v = (v.to(tl.float32) + r.to(tl.float32)).to(v.dtype)
            out = fused_ops.rms_scaled(v, w, i, m, N, eps).to(v.dtype)
            if b == 0:
                tl.store(s + t * N + i, v, mask=m)
                tl.store(y + t * N + i, out, mask=m)
            if real:
                lg = tl.sum(wt.to(tl.float32) * out.to(tl.float32)[None, :], axis=1)
                tl.store(logits + t * E + re, lg.to(v.dtype), mask=em)


def norm_router(x: torch.Tensor, delta: torch.Tensor, scale: torch.Tensor, eps: float, router: torch.Tensor,
                live: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A MoE layer's post-mixer add and norm with the router's GEMM (:data:`NORM_ROUTER`): ``x, delta [T, H]``
    (contiguous, one dtype), the norm's fp32 ``scale [H]`` and ``eps``, the ``router`` weight ``[E', H]`` (the
    shared gate's row last, as :func:`moe` takes it) -> ``(x + delta, rms_norm(x + delta), logits [T, E'])``: the
    sum and the norm the bits of ``fused_ops.rms_norm(x, scale, eps, residual=delta)``, the logits rounded to the
    model dtype as ``F.linear`` rounds them (its bits this kernel's). ``live``: rows from it on get no logits."""
    t, n = x.shape
    if delta.shape != x.shape or router.shape[1] != n or not (x.is_contiguous() and delta.is_contiguous()):
        raise ValueError(f"expert_kernel.norm_router: x {tuple(x.shape)}, delta {tuple(delta.shape)}, router "
                         f"{tuple(router.shape)}: want contiguous [T, H] inputs and an [E, H] router")
    e = router.shape[0]
    s, y = torch.empty_like(x), torch.empty_like(x)
    logits = torch.empty(t, e, dtype=x.dtype, device=x.device)
    if t:
        block = fused_ops.block_size(n)
        _norm_router_kernel[(triton.cdiv(e, ROUTER_ROWS), t)](
            x, delta, scale, s, y, router.contiguous(), logits, live if live is not None else x, n, e, eps,
            LIVE=live is not None, RB=ROUTER_ROWS, BLOCK=block, num_warps=4 if block <= 2048 else 8, **pdl.options(x))
    return s, y, logits


def pairs(x: torch.Tensor, idx: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
          live: torch.Tensor | None = None, gelu: bool = False) -> torch.Tensor:
    """Each (row, expert) pair's output ``[T, k, H]``: ``x [T, H]``, ``idx [T, k]`` (expert ids),
    ``gate_up [E, 2I, H]``, ``down [E, H, I]``; ``live`` (0-d int64 device tensor): rows from it on
    give zeros (None: every row is real); ``gelu``: GELU-tanh-gated experts (Gemma 4), else SiLU."""
    t, k = idx.shape
    e, two_i, hidden = gate_up.shape
    inter = two_i // 2
    x, idx = x.contiguous(), idx.contiguous()
    has_live = live is not None
    live = live if has_live else idx  # a stand-in pointer, never read without LIVE
    h = torch.empty(t * k, inter, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(t * k, triton.cdiv(inter, BN))](x, idx, gate_up, gate_up, h, live, t, t, k, k, hidden, inter,
                                                     LIVE=has_live, BN=BN, BK=BK, PER_LINE=1, LINES=1, USE_GDC=False,
                                                     GELU=gelu)
    y = torch.empty(t * k, hidden, dtype=x.dtype, device=x.device)
    _down_kernel[(t * k, triton.cdiv(hidden, BN))](h, idx, down, y, live, k, hidden, inter, LIVE=has_live,
                                                   BN=BN, BK=BK)
    return y.view(t, k, hidden)


def moe(x: torch.Tensor, router: torch.Tensor, top_k: int, gate_up: torch.Tensor, down: torch.Tensor,
        shared: tuple[torch.Tensor, torch.Tensor] | None = None, live: torch.Tensor | None = None,
        tiles: tuple | None = None, router_x: torch.Tensor | None = None, expert_scale: torch.Tensor | None = None,
        gelu: bool = False, logits: torch.Tensor | None = None) -> torch.Tensor:
    """A MoE block's output ``[T, H]`` (the module docstring's kernels): ``x [T, H]``, the ``router`` weight
    ``[E, H]`` (with a shared expert ``[E + 1, H]``: its gate's row last), ``gate_up [E, 2I, H]``, ``down [E, H,
    I]``; ``shared``: the shared expert's ``(fused gate/up [2I, H], down [H, I])`` (its width that of the routed
    experts) or None; ``live`` as in :func:`pairs`; ``tiles``: ``(GATE_UP_TILE, COMBINE_TILE)`` for the sweep
    script (default: the shape's in SHAPE_TILES, else those two). Gemma 4's router: ``router_x`` (the router's own
    input ``[T, H]``, else ``x``), ``expert_scale`` ``[E]``
    (each chosen weight times its expert's scale, after the renormalisation) and ``gelu`` (GELU-tanh experts).
    ``logits``: the router's logits ``[T, E (+1)]`` already computed (:func:`norm_router`), its GEMM skipped."""
    t, hidden = x.shape
    e, two_i, _ = gate_up.shape
    inter = two_i // 2
    p = top_k + (shared is not None)
    if router.shape != (e + (shared is not None), hidden):
        raise ValueError(f"expert_kernel.moe: router {tuple(router.shape)} for {e} experts"
                         f"{' and a shared gate' if shared is not None else ''} of {hidden} features")
    (gbn, gbk, gw), (cbn, cbk, cw, cpc) = tiles or SHAPE_TILES.get((hidden, inter)) or (GATE_UP_TILE, COMBINE_TILE)
    x = x.contiguous()
    has_live = live is not None
    sgu, sdown = shared if shared is not None else (gate_up, down)  # stand-ins, never read
    rx = x if router_x is None else router_x.contiguous()
    idx, wts = routing(rx, router, top_k, shared is not None, live, scale=expert_scale, logits=logits)
    live_ptr = live if has_live else idx
    gdc = pdl.options(x)
    per_line, h_lines = pdl.l2_lines(hidden, x.element_size())
    i_lines = pdl.l2_lines(inter, x.element_size())[1]
    g = min(t, ROW_GROUPS)
    h = torch.empty(t * p, inter, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(g * p, triton.cdiv(inter, gbn))](x, idx, gate_up, sgu, h, live_ptr, t, g, top_k, p, hidden,
                                                      inter, LIVE=has_live, BN=gbn, BK=gbk, PER_LINE=per_line,
                                                      LINES=h_lines, num_warps=gw, GELU=gelu, **gdc)
    y = torch.empty(t, hidden, dtype=x.dtype, device=x.device)
    if COMBINE_STREAM and inter <= STREAM_MAX_INTER:
        sbn, sw_ = STREAM_TILE
        grid = min(triton.cdiv(hidden, sbn), STREAM_PROGRAMS * _sm_count(x.device))
        _combine_stream_kernel[(grid, g)](h, idx, wts, down, sdown, y, live_ptr, t, g, hidden, inter, K=top_k,
                                        SHARED=shared is not None, LIVE=has_live, BN=sbn,
                                        BI=triton.next_power_of_2(inter), KP=triton.next_power_of_2(top_k),
                                        num_warps=sw_, **gdc)
    else:
        _combine_kernel[(g, triton.cdiv(hidden, cbn))](h, idx, wts, down, sdown, y, live_ptr, t, g, hidden, inter,
                                                       K=top_k, P=p, LIVE=has_live, BN=cbn, BK=cbk, PC=cpc,
                                                       PER_LINE=per_line, LINES=i_lines, num_warps=cw, **gdc)
    return y


def _sm_count(device: torch.device) -> int:
    """The device's SM count (the persistent combine's grid; 4 on the CPU, where the interpreter runs it)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def routing(x: torch.Tensor, router: torch.Tensor, top_k: int, shared: bool, live: torch.Tensor | None = None,
            out: tuple[torch.Tensor, torch.Tensor] | None = None, scale: torch.Tensor | None = None,
            logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`moe`'s routing: ``x [T, H]`` (contiguous), the ``router`` weight (the shared gate's row last where
    ``shared``) -> (expert ids ``[T, k]`` int32, weights ``[T, k (+1: the shared gate)]`` in ``x``'s dtype): the
    router's GEMM, then :func:`_route_kernel`; a padding row (from ``live`` on) gets expert 0, weight 0. ``out``:
    the two tensors to write (the interpreter test's, filled beforehand); ``scale`` ``[E]``: each chosen weight
    times its expert's scale (Gemma 4); ``logits``: the router's ``[T, E (+1)]``, computed already (no GEMM here)."""
    t = x.shape[0]
    e = router.shape[0] - shared
    p = top_k + shared
    idx, wts = out if out is not None else (torch.empty(t, top_k, dtype=torch.int32, device=x.device),
                                            torch.empty(t, p, dtype=x.dtype, device=x.device))
    live_ptr = live if live is not None else idx  # a stand-in pointer, never read without LIVE
    # the router's logits in the model dtype, as F.linear rounds them: a Triton GEMM (PDL, a row's bits its own)
    if logits is None:
        logits = fused_layer.linear(x, router) if fused_layer.usable(x) else linear(x, router)
    elif logits.shape != (t, router.shape[0]) or logits.stride(-1) != 1:
        raise ValueError(f"expert_kernel.routing: logits {tuple(logits.shape)} for {t} rows of a router "
                         f"{tuple(router.shape)}")
    if scale is not None and scale.shape != (e,):
        raise ValueError(f"expert_kernel.routing: expert scales {tuple(scale.shape)} for {e} experts")
    _route_kernel[(t,)](logits, idx, wts, live_ptr, logits if scale is None else scale, e, logits.stride(0), p,
                        LIVE=live is not None, SHARED=shared, K=top_k, KB=triton.next_power_of_2(p),
                        BE=triton.next_power_of_2(e), SCALED=scale is not None, num_warps=ROUTE_WARPS,
                        **pdl.options(x))
    return idx, wts


def moe_reference(x: torch.Tensor, router: torch.Tensor, top_k: int, gate_up: torch.Tensor, down: torch.Tensor,
                  shared: tuple[torch.Tensor, torch.Tensor] | None = None, router_x: torch.Tensor | None = None,
                  expert_scale: torch.Tensor | None = None, gelu: bool = False) -> torch.Tensor:
    """:func:`moe`'s arithmetic in torch ops (fp32, rounded where the kernels round): the CPU equivalent
    that the interpreter test compares the kernels with."""
    dt = x.dtype
    e = gate_up.shape[0]
    logits = ((x if router_x is None else router_x).float() @ router.float().T).to(dt).float()
    probs = torch.softmax(logits[:, :e], dim=-1)
    top, idx = torch.topk(probs, top_k, dim=-1)
    w = top / top.sum(-1, keepdim=True)
    w = (w if expert_scale is None else w * expert_scale[idx].float()).to(dt)
    gu = torch.einsum("tkoh,th->tko", gate_up[idx].float(), x.float())
    dws = [down[idx]]
    if shared is not None:
        sgu, sdown = shared
        w = torch.cat([w, torch.sigmoid(logits[:, e]).to(dt)[:, None]], 1)
        gu = torch.cat([gu, (x.float() @ sgu.float().T)[:, None]], 1)
        dws.append(sdown[None, None].expand(x.shape[0], 1, -1, -1))
    gate, up = gu.to(dt).float().chunk(2, dim=-1)
    hmid = ((gelu_tanh if gelu else torch.nn.functional.silu)(gate).to(dt).float() * up).to(dt).float()
    y = torch.einsum("tkhi,tki->tkh", torch.cat(dws, 1).float(), hmid).to(dt).float()
    return (y * w.float()[..., None]).to(dt).float().sum(1).to(dt)
