"""Fused CUDA kernels (Triton) for the Gated DeltaNet's decode and verify steps: the recurrence, and
(below) the whole mixer's step on the layer's cache.

The torch recurrence (:func:`specdec.models.deltanet.recurrent_gated_delta`) launches about six
tiny kernels per position and layer; in a 16-row verify step that is ~100 launches per layer,
each far below the memory bound. Here one program per (value head, block of value channels)
keeps its slice of the state ``S [dk, BV]`` on chip and walks the step's positions in order,
writing the output and the state after every position (the rollback snapshots).

Per-position invariance holds by construction: position ``t`` is computed from the state before
it and its own row, by the same instructions whatever ``T`` is. Graphs and eager launch the same
kernel. Only used on CUDA when Triton imports; the CPU runs the torch form.
"""

from __future__ import annotations

import torch

from .. import env
from . import fused_layer, pdl

try:  # Triton ships with CUDA builds of torch; CPU-only installs have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def available(k: torch.Tensor) -> bool:
    """Whether the fused kernel can run for keys ``k [T, H, dk]``: Triton, a CUDA tensor, and a
    power-of-two key head size (one register tile per head)."""
    dk = k.shape[-1]
    return triton is not None and k.is_cuda and dk & (dk - 1) == 0


def recurrent_gated_delta_fused(q, k, v, g, beta, state):
    """Same contract as :func:`~specdec.models.deltanet.recurrent_gated_delta` (position-major fp32
    inputs) -> (out ``[T, H, dv]``, states ``[T, H, dk, dv]``); only where :func:`available`. The
    step kernel below, reading ``state`` and writing a buffer of its own."""
    t, h, dk = k.shape
    states = torch.empty(t, h, dk, v.shape[-1], dtype=torch.float32, device=q.device)
    out = _recurrence(q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
                      state.contiguous(), None, states, None)
    return out, states


# --- a whole decode/verify step of the mixer on the layer's cache (issue 10) ---------------------
#
# The torch form of a Gated DeltaNet step ran ~60 kernels a layer on the H200 (qwen3.5-9b shape, 1-row
# step 7.63 ms against a 4.23 ms bound, 1,917 kernels): the conv as cat / float / unfold / mul / sum /
# silu / cast, the gates' l2 norms, sigmoid and softplus one op each, the live state copied out of the
# cache, the per-position states written to a temporary and copied into the cache (at 16 rows 32 MB a
# layer written twice), the output norm in ten ops. Here, for steps that keep snapshots, on the cache's rings
# (cache.LinearAttnCache: the conv input of position p and the state after L positions at rows p and L modulo the
# rings' sizes, so a step reads the rows of its start and writes others: no window or state is copied, and a rollback
# writes nothing on the device):
#   conv_gates: conv + SiLU, the q/k l2 norms, v, beta and g, and the step's conv inputs written into the ring (the
#     window read where it lies);
#   recurrent_into_cache: the recurrence reading the live state from the ring and writing the state after each
#     position into it;
#   gated_norm: the output RMSNorm gated by silu(z).
# Each position is computed by the same instructions whatever the step's row count (per-position invariance:
# the recurrence walks rows one at a time, conv_gates takes them in tiles of a fixed CONV_ROWS rows); the
# values follow the torch form's roundings (the conv output rounded to the model dtype, the norm's
# product rounded before the gate), not its bits: every path of a model on CUDA takes these kernels.
# Tried and removed (session of 2026-12-07 (seventeenth), H100; code at 2d221d5): conv_gates and the recurrence as one
# kernel (a program a value head and 32 value channels redoing its key head's q/k conv, the live state loaded before
# its PDL wait). Its 1-row chained step took 3.230 ms against 3.295 for the two kernels (scripts/ab_flags.py,
# qwen3.5-35b-a3b), but on the GPU its speculative output at k = 15 differed from plain decoding (the oracle at tau 6.5:
# 1.47 realized; qwen3.5-9b too), with or without PDL and with the state loaded after the wait, while device_check's
# k = 3 and Triton's interpreter (a tiny model with the 35b's head sizes, k = 15) found every output equal: a GPU-only
# row dependence, its cause not found (scripts/check_oracle_exact.py shows it).

# conv_gates' rows a tile: fixed (a row's l2 norm is a reduction over a tile of this shape, so its bits must not
# depend on the step's row count)
CONV_ROWS = 16


def step_kernels_available(x: torch.Tensor, dk: int, dv: int) -> bool:
    """Whether the fused step kernels can run: Triton, a CUDA tensor, power-of-two head sizes."""
    return triton is not None and x.is_cuda and dk & (dk - 1) == 0 and dv & (dv - 1) == 0


if triton is not None:
    @triton.jit
    def _softplus(a):
        # torch's softplus (threshold 20) with log1p(y) computed exactly enough for small y (Kahan)
        y = tl.exp(a)
        u = 1.0 + y
        lp = tl.where(u == 1.0, y, tl.log(u) * (y / (u - 1.0)))
        return tl.where(a > 20.0, a, lp)

    @triton.jit
    def _start(start, START_PTR: tl.constexpr):
        # the step's first position: a static step's 0-d device tensor, or an int
        if START_PTR:
            return tl.load(start)
        else:
            return start

    @triton.jit(do_not_specialize=["start"])
    def _conv_gates_kernel(proj, conv, start, w, bo, ao, a_log, dt_bias, q, k, v, g, beta, T, C, NC, PS, BS, AS, HK, HV,
                           scale, DK: tl.constexpr, DV: tl.constexpr, KS: tl.constexpr, BLOCK: tl.constexpr,
                           RB: tl.constexpr, START_PTR: tl.constexpr, USE_GDC: tl.constexpr):
        # program j: segment j's channels (q heads, then k heads, then v heads) over every row of the step, RB rows
        # at a time (a fixed tile: a row's bits do not depend on T). The cache is a ring of NC rows keyed by
        # position (cache.LinearAttnCache): the window is positions S - KS + 1 .. S - 1, read in place; the step's
        # inputs go to positions S .. S + T - 1, rows no tap of this step reads (T <= NC - KS + 1)
        if USE_GDC:  # models/pdl.py
            pdl.begin()
        j = tl.program_id(0)
        r = tl.arange(0, BLOCK)
        is_v = j >= 2 * HK
        d = tl.where(is_v, DV, DK)
        c0 = tl.where(is_v, 2 * HK * DK + (j - 2 * HK) * DV, j * DK)
        m = r < d
        ch = c0 + r
        at = _start(start, START_PTR) + NC - (KS - 1)  # the window's first position, plus NC (never negative)
        rt = tl.arange(0, RB)
        for t0 in range(0, T, RB):
            t = t0 + rt
            tm = t < T
            acc = tl.zeros([RB, BLOCK], dtype=tl.float32)
            for i in tl.static_range(KS):  # full = [window (KS-1 rows) | proj]; output row t reads full[t .. t+KS-1]
                row = t + i
                wm = (m[None, :] & (row < KS - 1)[:, None]) & tm[:, None]
                xw = tl.load(conv + ((at + row) % NC)[:, None] * C + ch[None, :], mask=wm, other=0.0)
                pm = (m[None, :] & (row >= KS - 1)[:, None]) & tm[:, None]
                xp = tl.load(proj + (row - (KS - 1))[:, None] * PS + ch[None, :], mask=pm, other=0.0)
                wi = tl.load(w + ch * KS + i, mask=m, other=0.0)
                acc += (xw.to(tl.float32) + xp.to(tl.float32)) * wi[None, :]
            pr = tl.load(proj + t[:, None] * PS + ch[None, :], mask=tm[:, None] & m[None, :])
            tl.store(conv + ((at + KS - 1 + t) % NC)[:, None] * C + ch[None, :], pr, mask=tm[:, None] & m[None, :])
            out = (acc * tl.sigmoid(acc)).to(proj.dtype.element_ty).to(tl.float32)  # silu, rounded as the layer's dtype
            om = tm[:, None] & m[None, :]
            if is_v:
                hv = j - 2 * HK
                tl.store(v + (t * HV + hv)[:, None] * DV + r[None, :], out, mask=om)
                bt = tl.load(bo + t * BS + hv, mask=tm, other=0.0).to(tl.float32)
                a_t = tl.load(ao + t * AS + hv, mask=tm, other=0.0).to(tl.float32) + tl.load(dt_bias + hv).to(tl.float32)
                tl.store(beta + t * HV + hv, tl.sigmoid(bt), mask=tm)
                tl.store(g + t * HV + hv, -tl.exp(tl.load(a_log + hv).to(tl.float32)) * _softplus(a_t), mask=tm)
            else:
                ss = tl.sum(tl.where(om, out * out, 0.0), axis=1)
                y = out * (1.0 / tl.sqrt(ss + 1e-6))[:, None]
                if j < HK:
                    tl.store(q + (t * HK + j)[:, None] * DK + r[None, :], y * scale, mask=om)
                else:
                    tl.store(k + (t * HK + j - HK)[:, None] * DK + r[None, :], y, mask=om)

    @triton.jit
    def _state_in(s0, first, h, vb, H, NS, CACHE: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                  BV: tl.constexpr):
        # value head h's state slice [DK, BV] (channels vb * BV ..) from s0: CACHE, the ring's row of length first
        rk = tl.arange(0, DK)
        rv = vb * BV + tl.arange(0, BV)
        tile = h * DK * DV + rk[:, None] * DV + rv[None, :]
        if CACHE:
            return tl.load(s0 + (first % NS) * (H * DK * DV) + tile, mask=(rv < DV)[None, :], other=0.0)
        else:
            return tl.load(s0 + tile, mask=(rv < DV)[None, :], other=0.0)

    @triton.jit
    def _recur_unit(q, k, v, g, beta, s, first, states, out, ss, n, h, vb, H, REP, NS, CACHE: tl.constexpr,
                    DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, NVB: tl.constexpr, TAIL: tl.constexpr):
        # value head h's channels vb * BV .. over the first n rows from their state slice s (_state_in), the state
        # after each row to states (CACHE: the ring's row of length first + 1 + t; else row t). TAIL (the tail
        # kernel's phase one): a row's output rounded to out's dtype into out [T, H * DV] and the sum of its squares
        # (the rounded values) into ss [T, H, NVB]; else the fp32 output into out [T, H, DV]
        hk = h // REP  # the key head this value head reads
        hkn = H // REP
        rk = tl.arange(0, DK)
        rv = vb * BV + tl.arange(0, BV)
        vmask = rv < DV
        smask = vmask[None, :]
        one = H * DK * DV  # one state, all heads
        tile = h * DK * DV + rk[:, None] * DV + rv[None, :]
        for t in range(0, n):
            row = t * H + h
            kt = tl.load(k + (t * hkn + hk) * DK + rk)
            qt = tl.load(q + (t * hkn + hk) * DK + rk)
            vt = tl.load(v + row * DV + rv, mask=vmask, other=0.0)
            gt = tl.load(g + row)
            bt = tl.load(beta + row)
            s = s * tl.exp(gt)
            pred = tl.sum(s * kt[:, None], axis=0)  # S^T k
            u = bt * (vt - pred)
            s = s + kt[:, None] * u[None, :]
            o = tl.sum(s * qt[:, None], axis=0)
            if TAIL:
                ob = o.to(out.dtype.element_ty)
                tl.store(out + row * DV + rv, ob, mask=vmask)
                of = ob.to(tl.float32)
                tl.store(ss + row * NVB + vb, tl.sum(tl.where(vmask, of * of, 0.0), axis=0))
            else:
                tl.store(out + row * DV + rv, o, mask=vmask)
            if CACHE:
                tl.store(states + ((first + 1 + t) % NS) * one + tile, s, mask=smask)
            else:
                tl.store(states + t * one + tile, s, mask=smask)

    @triton.jit(do_not_specialize=["start"])
    def _recurrent_cache_kernel(q, k, v, g, beta, s0, start, states, live, out, T, H, REP, NS, CACHE: tl.constexpr,
                                LIVE: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
                                START_PTR: tl.constexpr, USE_GDC: tl.constexpr):
        # CACHE: s0 is the cache's ring of NS states keyed by length (cache.LinearAttnCache), the live state at
        # length S (the step's start), the state after position t written at length S + 1 + t. Else s0 is the
        # state and row t of states the state after t. LIVE: only the first live rows (the rest pad a static
        # step: zero outputs, no states).
        if USE_GDC:  # models/pdl.py
            pdl.begin()
        h = tl.program_id(0)
        vb = tl.program_id(1)
        first = 0
        if CACHE:
            first = _start(start, START_PTR)
        if LIVE:
            n = tl.minimum(tl.load(live), T)
        else:
            n = T
        s = _state_in(s0, first, h, vb, H, NS, CACHE, DK, DV, BV)
        _recur_unit(q, k, v, g, beta, s, first, states, out, out, n, h, vb, H, REP, NS, CACHE, DK, DV, BV, 1, False)
        rv = vb * BV + tl.arange(0, BV)
        for t in range(n, T):
            tl.store(out + (t * H + h) * DV + rv, tl.zeros([BV], dtype=tl.float32), mask=rv < DV)

    @triton.jit
    def _gated_norm_kernel(o, z, w, y, HV, ZS, eps, DV: tl.constexpr, USE_GDC: tl.constexpr):
        if USE_GDC:  # models/pdl.py
            pdl.begin()
        t = tl.program_id(0)
        h = tl.program_id(1)
        r = tl.arange(0, DV)
        base = (t * HV + h) * DV
        xf = tl.load(o + base + r).to(y.dtype.element_ty).to(tl.float32)
        var = tl.sum(xf * xf, axis=0) / DV
        n = (xf * (1.0 / tl.sqrt(var + eps))).to(y.dtype.element_ty).to(tl.float32)
        n = (n * tl.load(w + r).to(tl.float32)).to(y.dtype.element_ty).to(tl.float32)
        zf = tl.load(z + t * ZS + h * DV + r).to(tl.float32)
        tl.store(y + base + r, (n * (zf * tl.sigmoid(zf))).to(y.dtype.element_ty))

    @triton.jit
    def _now():
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)

    @triton.jit
    def _halves(w, zero, BF16: tl.constexpr):
        # int32 words of two 16-bit weights (bf16 where BF16, else fp16) -> the low and the high one as fp32, exactly.
        # zero: 0, loaded inside the caller's row loop, so that the conversions depend on the row and the compiler
        # cannot hoist the whole tile's fp32 copies out of the loop (3x the registers the words take)
        w = w ^ zero
        if BF16:
            return (w << 16).to(tl.float32, bitcast=True), (w & -65536).to(tl.float32, bitcast=True)
        else:
            lo = w.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            hi = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            return lo, hi

    @triton.jit
    def _gated(x, z, rstd, nw, dt):
        # a row's features x (fp32 of the rounded recurrence output) gated-normed as _gated_norm_kernel rounds: the
        # head's rstd, the norm's weight nw, the gate z (fp32 of the model dtype's)
        nr = (x * rstd).to(dt).to(tl.float32)
        nr = (nr * nw).to(dt).to(tl.float32)
        return (nr * (z * tl.sigmoid(z))).to(dt).to(tl.float32)

    @triton.jit(do_not_specialize=["start", "T"])
    def _tail_kernel(q, k, v, g, beta, states, start, live, z, nw, w, y, ob, ss, bar, fails, T, H, REP, NS, ZS, eps,
                     UNITS, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, NVB: tl.constexpr, HP: tl.constexpr,
                     N, BNO: tl.constexpr, NPROG: tl.constexpr, LIVE: tl.constexpr, START_PTR: tl.constexpr,
                     RESIDENT: tl.constexpr, BF16: tl.constexpr, PER_LINE: tl.constexpr, LINES: tl.constexpr,
                     PHASE: tl.constexpr, POLLS: tl.constexpr, USE_GDC: tl.constexpr, stamps=None,
                     STAMPS: tl.constexpr = False):
        # NPROG programs, every one resident at once (tail_fits). Before the PDL wait each loads its BNO rows of the
        # out_proj weight w [N, H * DV] (int32 words of two 16-bit weights) into registers (RESIDENT), else into the
        # L2 (weights never depend on the kernel before). Phase one: the recurrence's UNITS (value head, BV channels)
        # units as _recurrent_cache_kernel walks them (the rounded output and its squares' partial sums to ob and
        # ss). A grid-wide barrier. Phase two: every row's gated RMSNorm (the head's NVB partials summed in order) and
        # its GEMV with the rows in registers -> y [T, N]; padding rows zero. PHASE 1 or 2 runs one phase alone
        # (Triton's interpreter runs programs one after another: no barrier there)
        pid = tl.program_id(0)
        rn = pid * BNO + tl.arange(0, BNO)
        nm = rn < N
        kw = H * DV // 2  # words a row of features (two 16-bit values a word)
        jw = tl.arange(0, HP * (DV // 2))
        wptr = w + rn[:, None] * kw + jw[None, :]
        wmask = nm[:, None] & (jw < kw)[None, :]
        dt = y.dtype.element_ty
        u = tl.minimum(pid, UNITS - 1)  # this program's recurrence unit (programs past UNITS compute none)
        first = _start(start, START_PTR)
        if STAMPS:  # scripts/check_delta_tail.py: %globaltimer at the start, the wait, each phase's end, the barrier
            tl.store(stamps + pid * 5, _now())
        if PHASE != 2:  # the live state first (the previous step's, never the kernel before's): ahead of the weights
            s = _state_in(states, first, u // NVB, u % NVB, H, NS, True, DK, DV, BV)
        if PHASE != 1:
            if RESIDENT:
                wt = tl.load(wptr, mask=wmask, other=0)
            elif USE_GDC:
                pdl.rows_to_l2(w, tl.minimum(rn, N - 1), kw, PER_LINE, LINES)
        if USE_GDC:
            tl.extra.cuda.gdc_wait()
        if STAMPS:
            tl.store(stamps + pid * 5 + 1, _now())
        if LIVE:
            n = tl.minimum(tl.load(live), T)
        else:
            n = T
        if PHASE != 2:
            _recur_unit(q, k, v, g, beta, s, first, states, ob, ss, tl.where(pid < UNITS, n, 0), u // NVB, u % NVB, H,
                        REP, NS, True, DK, DV, BV, NVB, True)
        if STAMPS:
            tl.store(stamps + pid * 5 + 2, _now())
        if PHASE == 0:  # every program's phase-one stores reach the L2 before it counts in; the last to count in
            # resets the count and raises the generation the others poll (read before counting in)
            fused_layer._fence()
            tl.debug_barrier()
            gen = tl.atomic_add(bar + 1, 0, sem="acquire", scope="gpu")
            if tl.atomic_add(bar, 1, sem="acq_rel", scope="gpu") == NPROG - 1:
                tl.atomic_xchg(bar, 0, sem="relaxed", scope="gpu")
                tl.atomic_add(bar + 1, 1, sem="release", scope="gpu")
            else:
                seen = gen
                polls = 0
                while (seen == gen) & (polls < POLLS):  # acquire loads (atomics at one address queue up)
                    seen = tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [bar + 1],
                                                     dtype=tl.int32, is_pure=False, pack=1)
                    polls += 1
                if polls >= POLLS:  # never, with every program resident: counted, not hung
                    tl.atomic_add(fails, 1, sem="relaxed", scope="gpu")
            tl.debug_barrier()
        if STAMPS:
            tl.store(stamps + pid * 5 + 3, _now())
        if USE_GDC:  # only now (every program is resident): the next kernel's programs may take the SMs' room
            tl.extra.cuda.gdc_launch_dependents()
        if PHASE != 1:
            if not RESIDENT:
                wt = tl.load(wptr, mask=wmask, other=0)
            hh = tl.arange(0, HP)
            jj = tl.arange(0, DV // 2)
            hm = (hh < H)[:, None]
            words = hh[:, None] * (DV // 2) + jj[None, :]  # [HP, DV // 2]: word j of head h holds its features 2j, 2j+1
            nwe = tl.load(nw + 2 * jj).to(tl.float32)[None, :]
            nwo = tl.load(nw + 2 * jj + 1).to(tl.float32)[None, :]
            obw = ob.to(tl.pointer_type(tl.int32))  # rows of kw words (16-bit pairs)
            for t in range(0, n):
                part = tl.load(ss + (t * H + hh)[:, None] * NVB + tl.arange(0, NVB)[None, :], mask=hm, other=0.0,
                               cache_modifier=".cg")
                rstd = (1.0 / tl.sqrt(tl.sum(part, axis=1) / DV + eps))[:, None]  # [HP, 1]: the head's
                zero = tl.load(bar + 3)  # always 0: a value of the row (see _halves)
                oe, oo = _halves(tl.load(obw + t * kw + words, mask=hm, other=0, cache_modifier=".cg"), zero, BF16)
                ze, zo = _halves(tl.load((z + t * ZS).to(tl.pointer_type(tl.int32)) + words, mask=hm, other=0), zero,
                                 BF16)
                xe = tl.reshape(_gated(oe, ze, rstd, nwe, dt), (HP * (DV // 2),))
                xo = tl.reshape(_gated(oo, zo, rstd, nwo, dt), (HP * (DV // 2),))
                lo, hi = _halves(wt, zero, BF16)
                acc = tl.sum(lo * xe[None, :] + hi * xo[None, :], axis=1)
                tl.store(y + t * N + rn, acc.to(dt), mask=nm)
            for t in range(n, T):
                tl.store(y + t * N + rn, tl.zeros([BNO], dtype=tl.float32).to(dt), mask=nm)
        if STAMPS:
            tl.store(stamps + pid * 5 + 4, _now())

def _start_arg(start) -> tuple:
    """A step's first position as the kernels take it: ``(arg, START_PTR)`` (a 0-d device tensor: a static step's)."""
    return (start, True) if isinstance(start, torch.Tensor) else (int(start), False)


def conv_gates(proj, conv_cache, start, conv_w, b_out, a_out, a_log, dt_bias, hk: int, hv: int, dk: int, dv: int):
    """One step's conv (+SiLU) and gates. ``proj [T, C]`` (``in_proj_qkv``'s output), ``conv_cache [K-1+R, C]``
    (:class:`~specdec.cache.LinearAttnCache`'s ring: position ``p`` at row ``p mod (K-1+R)``), ``start`` the step's
    first position (an int, or a static step's 0-d int64 device tensor), ``conv_w [C, K]`` fp32, ``b_out, a_out
    [T, Hv]`` (``proj``, ``b_out`` and ``a_out`` may be column slices of one fused projection: rows strided). Reads
    the window (positions ``start-K+1 .. start-1``) in place, writes ``proj`` at positions ``start .. start+T-1``
    and returns fp32 ``q, k [T, Hk, dk]`` (l2-normalised, ``q`` scaled by ``dk ** -0.5``), ``v [T, Hv, dv]``,
    ``g, beta [T, Hv]``."""
    t, c = proj.shape
    ks = conv_w.shape[1]
    for name, x in (("proj", proj), ("b_out", b_out), ("a_out", a_out)):
        if x.stride(-1) != 1:
            raise ValueError(f"conv_gates: {name}'s columns must be contiguous")
    if conv_cache.shape[0] < ks - 1 + t or not conv_cache.is_contiguous():
        raise ValueError(f"conv_gates: a conv ring of {conv_cache.shape[0]} rows for {t} rows and a kernel of {ks}")
    f32 = dict(dtype=torch.float32, device=proj.device)
    q, k = torch.empty(t, hk, dk, **f32), torch.empty(t, hk, dk, **f32)
    v, g, beta = torch.empty(t, hv, dv, **f32), torch.empty(t, hv, **f32), torch.empty(t, hv, **f32)
    st, ptr = _start_arg(start)
    _conv_gates_kernel[(2 * hk + hv,)](proj, conv_cache, st, conv_w, b_out, a_out, a_log, dt_bias, q, k, v, g, beta, t,
                                       c, conv_cache.shape[0], proj.stride(0), b_out.stride(0), a_out.stride(0), hk, hv,
                                       dk ** -0.5, DK=dk, DV=dv, KS=ks,
                                       BLOCK=triton.next_power_of_2(max(dk, dv)), RB=CONV_ROWS, START_PTR=ptr,
                                       num_warps=4, **pdl.options(proj))
    return q, k, v, g, beta


def recurrent_into_cache(q, k, v, g, beta, states, start, live):
    """The recurrence of one step on the cache: ``states [R+1, Hv, dk, dv]`` (fp32, the cache's ring: the state
    after ``L`` positions at row ``L mod (R+1)``) holds the live state at length ``start`` (an int, or a 0-d int64
    device tensor); the state after position ``t`` goes to length ``start + 1 + t``, for the first ``live`` rows (a
    0-d int64 device tensor: a static step's real rows; the padding rows after them get zero outputs and no states;
    None: every row). ``q, k [T, Hk, dk]`` (each key head serves ``Hv / Hk`` consecutive value heads),
    ``v [T, Hv, dv]``, ``g, beta [T, Hv]`` -> out ``[T, Hv, dv]`` fp32."""
    return _recurrence(q, k, v, g, beta, states, start, states, live)


def _recurrence(q, k, v, g, beta, s0, start, states, live):
    t, hkn, dk = k.shape
    h, dv = v.shape[1], v.shape[2]
    out = torch.empty(t, h, dv, dtype=torch.float32, device=q.device)
    bv = min(32, triton.next_power_of_2(dv))
    cache, has_live = start is not None, live is not None
    st, ptr = _start_arg(start if cache else 0)
    _recurrent_cache_kernel[(h, triton.cdiv(dv, bv))](q, k, v, g, beta, s0, st, states, live if has_live else s0, out,
                                                      t, h, h // hkn, s0.shape[0], CACHE=cache, LIVE=has_live, DK=dk,
                                                      DV=dv, BV=bv, START_PTR=ptr, **pdl.options(q))
    return out


def gated_norm(o, z, weight, eps: float):
    """``GatedRMSNorm``: ``o [T, Hv, dv]`` fp32, ``z [T, Hv * dv]`` (model dtype; rows may be strided) -> ``[T, Hv * dv]``."""
    t, hv, dv = o.shape
    if z.stride(-1) != 1:
        raise ValueError("gated_norm: z's columns must be contiguous")
    y = torch.empty(t, hv * dv, dtype=z.dtype, device=z.device)
    _gated_norm_kernel[(t, hv)](o, z, weight, y, hv, z.stride(0), eps, DV=dv, **pdl.options(z))
    return y


# --- the recurrence, the output norm and out_proj as one persistent kernel (issue 10) --------------------------------
#
# After conv_gates, a step's recurrence (~5 us a layer on the qwen3.5-35b-a3b shape), gated norm (~1.3 us) and out_proj
# GEMM (~9 us for 16.8 MB: its loads start only after the norm) are a chain of kernels in which the memory bus idles.
# scripts/probe_persistent.py (2026-12-07 (fifteenth), H100) put a GEMV of that weight at 2.3 us after its input with
# its rows already in registers, 9.0 loading them after, and a grid-wide barrier at ~1 us; a register-resident GEMM of
# its own could not load early (its programs could start only as the chain's left the SMs). Here one kernel of
# N / TAIL_ROWS programs holds the SMs throughout: each loads its TAIL_ROWS weight rows before the PDL wait, runs
# recurrence units, passes a grid-wide barrier and computes its rows of every row's output. A row's bits: its
# recurrence as _recurrent_cache_kernel's, its norm's sum of squares as NVB partials summed in order, its GEMV one
# fp32 reduction over the [heads, DV] features in registers: the same instructions at any row count, not the
# three kernels' bits. Every program must be resident at once (the barrier waits for all): tail_fits allows at most
# one program an SM, and a bounded poll counts a timeout (TAIL_STATE[2]) where a hang would be.
TAIL = env.switch("SPECDEC_DELTA_TAIL")
TAIL_ROWS = 16  # out_proj rows a program (its weight rows in registers: TAIL_ROWS x Hv*dv)
TAIL_WARPS = 8
# a program's weight rows into registers before the PDL wait (held through the recurrence), else into the L2 there and
# into registers after the barrier
TAIL_RESIDENT = True
TAIL_MAX_BYTES = 128 << 10  # a program's weight rows at most (half an SM's 256 KB of registers)
POLLS = 1 << 24  # the barrier's poll bound (~seconds): a timeout is counted, never a hang
_TAIL_STATE: dict = {}
TAIL_COMPILED: dict = {}  # (warps, resident) -> the compiled kernel's registers a thread and spills (device checks)
_SMS: dict = {}


def tail_fits(weight: torch.Tensor, hv: int, dv: int) -> bool:
    """Whether :func:`recurrent_out_proj` can run out_proj's ``weight [N, hv * dv]``: Triton, CUDA (or Triton's
    interpreter), a contiguous 16-bit weight, power-of-two ``dv``, N a multiple of TAIL_ROWS, its programs' rows at
    most TAIL_MAX_BYTES each and no more programs than SMs."""
    if triton is None or not TAIL or weight.dim() != 2 or weight.dtype not in (torch.bfloat16, torch.float16):
        return False
    n, kdim = weight.shape
    if kdim != hv * dv or dv & (dv - 1) or n % TAIL_ROWS or not weight.is_contiguous():
        return False
    if TAIL_ROWS * kdim * weight.element_size() > TAIL_MAX_BYTES or hv * dv // min(32, dv) > n // TAIL_ROWS:
        return False  # (a program's weight rows past the registers' half, or more recurrence units than programs)
    if pdl.INTERPRETED:
        return True
    if not weight.is_cuda:
        return False
    dev = weight.device
    if dev not in _SMS:
        _SMS[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    return n // TAIL_ROWS <= _SMS[dev]


def tail_state(device: torch.device) -> torch.Tensor:
    """The tail kernel's barrier on ``device``: int32 ``[count, generation, timeouts, 0]``; ``[2]`` counts the
    barrier polls that gave up (0 unless a program was not resident: a check reads it)."""
    buf = _TAIL_STATE.get(device)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("delta_kernel: the tail's barrier is made by an eager call; run the step once before "
                               "capturing it (graphs.capture's warm-up does)")
        buf = _TAIL_STATE[device] = torch.zeros(4, dtype=torch.int32, device=device)
    return buf


def recurrent_out_proj(q, k, v, g, beta, states, start, live, z, norm_w, eps: float, weight, stamps=None):
    """:func:`recurrent_into_cache`, :func:`gated_norm` and ``z``'s row's out_proj (``weight [N, Hv * dv]``) as one
    kernel (:func:`tail_fits`): the arguments as theirs -> ``[T, N]`` in ``z``'s dtype (padding rows past ``live``
    zero). The states written as :func:`recurrent_into_cache` writes them."""
    t, hkn, dk = k.shape
    h, dv = v.shape[1], v.shape[2]
    n_out = weight.shape[0]
    if z.stride(-1) != 1 or weight.shape[1] != h * dv:
        raise ValueError(f"delta_kernel.recurrent_out_proj: z's columns must be contiguous and out_proj "
                         f"{tuple(weight.shape)} take {h} x {dv} features")
    if z.stride(0) % 2 or z.data_ptr() % 4:  # the kernel reads z's rows as 32-bit words
        z = z.contiguous()
    bv = min(32, dv)
    nvb = dv // bv
    nprog = n_out // TAIL_ROWS
    y = torch.empty(t, n_out, dtype=z.dtype, device=z.device)
    ob = torch.empty(t, h * dv, dtype=z.dtype, device=z.device)
    ss = torch.empty(t, h, nvb, dtype=torch.float32, device=z.device)
    bar = tail_state(z.device)
    st, ptr = _start_arg(start)
    has_live = live is not None
    words = weight.view(torch.int32)  # two 16-bit weights a word: the kernel holds them packed
    per_line, lines = pdl.l2_lines(words.shape[1], 4)
    args = (q, k, v, g, beta, states, st, live if has_live else bar, z, norm_w, words, y, ob, ss, bar, bar[2:], t, h,
            h // hkn, states.shape[0], z.stride(0), eps, h * nvb)
    const = dict(DK=dk, DV=dv, BV=bv, NVB=nvb, HP=triton.next_power_of_2(h), N=n_out, BNO=TAIL_ROWS, NPROG=nprog,
                 LIVE=has_live, START_PTR=ptr, RESIDENT=TAIL_RESIDENT, BF16=weight.dtype == torch.bfloat16,
                 PER_LINE=per_line, LINES=lines, POLLS=POLLS, num_warps=TAIL_WARPS)
    if pdl.INTERPRETED:  # programs run one after another: the phases as two launches
        for phase in (1, 2):
            _tail_kernel[(nprog,)](*args, PHASE=phase, USE_GDC=False, **const)
    else:
        extra = {} if stamps is None else {"stamps": stamps, "STAMPS": True}  # (scripts/check_delta_tail.py)
        kernel = _tail_kernel[(nprog,)](*args, PHASE=0, **const, **extra, **pdl.options(z))
        TAIL_COMPILED[(TAIL_WARPS, TAIL_RESIDENT)] = {"registers": kernel.n_regs, "spills": kernel.n_spills}
    return y
