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
from . import pdl

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
#   step (ONE_KERNEL, on): the conv + SiLU, the q/k l2 norms, v, beta and g, and the recurrence in one kernel, the
#     step's conv inputs and its state after each position written into the rings;
#   or (SPECDEC_DELTA_ONE_KERNEL=0) conv_gates (the conv and gates, the conv inputs written) then
#     recurrent_into_cache (the recurrence) as two kernels;
#   gated_norm: the output RMSNorm gated by silu(z).
# Each position is computed by the same instructions whatever the step's row count (per-position invariance:
# the recurrence walks rows one at a time, conv_gates takes them in tiles of a fixed CONV_ROWS rows); the
# values follow the torch form's roundings (the conv output rounded to the model dtype, the norm's
# product rounded before the gate), not its bits: every path of a model on CUDA takes these kernels.
# ONE_KERNEL's q/k norms are its own reductions, so its bits are not the two kernels' (one switch for every path).
# Its step kernel takes T unspecialised: Triton compiles a kernel for T == 1 apart from the general one, and that
# build's row-0 bits differed from the general build's by ~1e-9 (H100, session of 2026-12-07 (eighteenth):
# scripts/check_delta_rows.py, a 4- or 16-row step's rows against chained 1-row steps, at the qwen3.5-35b-a3b
# shape's sizes; with T unspecialised every row equal). That was the speculative-output difference that had this
# kernel removed in the session before (code at 2d221d5). Measured (H100, scripts/ab_flags.py, qwen3.5-35b-a3b, context
# 512, one process): plain decoding's chained 1-row step 3.295 -> 3.230 ms (seventeenth), 3.275 -> 3.242 (eighteenth;
# the 1-row step with its rollback 3.322 -> 3.287; the padded 16-row step 3.559 -> 3.673, a step row-exact targets do
# not run). SPECDEC_DELTA_ONE_KERNEL=0: the two kernels.
ONE_KERNEL = env.switch("SPECDEC_DELTA_ONE_KERNEL")
# the step kernel loads the live state before its PDL wait (scripts/ab_flags.py defaults-delta-early: after it)
STATE_EARLY = True

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
        hk = h // REP  # the key head this value head reads
        hkn = H // REP
        rk = tl.arange(0, DK)
        rv = vb * BV + tl.arange(0, BV)
        vmask = rv < DV
        smask = vmask[None, :]
        one = H * DK * DV  # one state, all heads
        tile = h * DK * DV + rk[:, None] * DV + rv[None, :]
        if CACHE:
            first = _start(start, START_PTR)
            s = tl.load(s0 + (first % NS) * one + tile, mask=smask, other=0.0)
        else:
            s = tl.load(s0 + tile, mask=smask, other=0.0)
        if LIVE:
            n = tl.minimum(tl.load(live), T)
        else:
            n = T
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
            tl.store(out + row * DV + rv, o, mask=vmask)
            if CACHE:
                tl.store(states + ((first + 1 + t) % NS) * one + tile, s, mask=smask)
            else:
                tl.store(states + t * one + tile, s, mask=smask)
        for t in range(n, T):
            tl.store(out + (t * H + h) * DV + rv, tl.zeros([BV], dtype=tl.float32), mask=vmask)

    @triton.jit(do_not_specialize=["start", "T"])
    def _step_kernel(proj, conv, start, w, bo, ao, a_log, dt_bias, states, live, out, T, C, NC, NS, PS, BS, AS, HK, HV,
                     scale, LIVE: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, KS: tl.constexpr,
                     START_PTR: tl.constexpr, USE_GDC: tl.constexpr, EARLY: tl.constexpr = True):
        # ONE_KERNEL: conv_gates and the recurrence as one kernel. Program (value head h, block vb of BV value
        # channels): for each live row in order, the conv (+ SiLU) of its key head's q and k channels and of its
        # own v channels, the l2 norms, beta and g, then the recurrence, as the two kernels compute them (the q/k
        # conv redone by each program of a key head: 2 x DK channels of 4 taps). The rings (cache.LinearAttnCache):
        # taps of positions before S read in the conv ring, the others in proj; row t's inputs written at position
        # S + t (the q/k channels by one program of the key head), its state at length S + 1 + t; no tap or state
        # this step reads is a row it writes, so the programs need no order among them. EARLY: the live state is
        # loaded before the PDL wait: only this layer's kernel writes its ring, in an earlier forward (each forward
        # starts with kernels that wait for all before them), never at length S in this one
        h = tl.program_id(0)
        vb = tl.program_id(1)
        rep = HV // HK
        hk = h // rep
        rk = tl.arange(0, DK)
        rv = vb * BV + tl.arange(0, BV)
        vmask = rv < DV
        one = HV * DK * DV
        tile = h * DK * DV + rk[:, None] * DV + rv[None, :]
        qc = hk * DK + rk  # conv channels: q heads, k heads, v heads
        kc = HK * DK + qc
        vc = 2 * HK * DK + h * DV + rv
        if USE_GDC:  # models/pdl.py
            tl.extra.cuda.gdc_launch_dependents()
            if not EARLY:
                tl.extra.cuda.gdc_wait()
        first = _start(start, START_PTR)
        s = tl.load(states + (first % NS) * one + tile, mask=vmask[None, :], other=0.0)
        if USE_GDC and EARLY:
            tl.extra.cuda.gdc_wait()
        if LIVE:
            n = tl.minimum(tl.load(live), T)
        else:
            n = T
        dt = proj.dtype.element_ty
        a_neg = -tl.exp(tl.load(a_log + h).to(tl.float32))
        dtb = tl.load(dt_bias + h).to(tl.float32)
        writer = (h % rep == 0) & (vb == 0)
        at = first + NC - (KS - 1)  # the window's first position, plus NC (never negative)
        for t in range(0, n):
            aq = tl.zeros([DK], dtype=tl.float32)
            ak = tl.zeros([DK], dtype=tl.float32)
            av = tl.zeros([BV], dtype=tl.float32)
            for i in tl.static_range(KS):  # tap i of row t: position S + t + i - (KS - 1)
                ring = t + i < KS - 1
                fresh = t + i >= KS - 1
                cr = conv + ((at + t + i) % NC) * C
                pr = proj + (t + i - (KS - 1)) * PS
                xq = tl.load(cr + qc, mask=ring, other=0.0).to(tl.float32) + \
                    tl.load(pr + qc, mask=fresh, other=0.0).to(tl.float32)
                xk = tl.load(cr + kc, mask=ring, other=0.0).to(tl.float32) + \
                    tl.load(pr + kc, mask=fresh, other=0.0).to(tl.float32)
                xv = tl.load(cr + vc, mask=vmask & ring, other=0.0).to(tl.float32) + \
                    tl.load(pr + vc, mask=vmask & fresh, other=0.0).to(tl.float32)
                aq += xq * tl.load(w + qc * KS + i)
                ak += xk * tl.load(w + kc * KS + i)
                av += xv * tl.load(w + vc * KS + i, mask=vmask, other=0.0)
            row_in = proj + t * PS
            dst = conv + ((at + KS - 1 + t) % NC) * C
            tl.store(dst + vc, tl.load(row_in + vc, mask=vmask), mask=vmask)
            if writer:
                tl.store(dst + qc, tl.load(row_in + qc))
                tl.store(dst + kc, tl.load(row_in + kc))
            xq = (aq * tl.sigmoid(aq)).to(dt).to(tl.float32)  # silu, rounded as the layer's dtype
            xk = (ak * tl.sigmoid(ak)).to(dt).to(tl.float32)
            vt = (av * tl.sigmoid(av)).to(dt).to(tl.float32)
            qt = xq * (1.0 / tl.sqrt(tl.sum(xq * xq, axis=0) + 1e-6)) * scale
            kt = xk * (1.0 / tl.sqrt(tl.sum(xk * xk, axis=0) + 1e-6))
            bt = tl.sigmoid(tl.load(bo + t * BS + h).to(tl.float32))
            gt = a_neg * _softplus(tl.load(ao + t * AS + h).to(tl.float32) + dtb)
            s = s * tl.exp(gt)
            pred = tl.sum(s * kt[:, None], axis=0)  # S^T k
            u = bt * (vt - pred)
            s = s + kt[:, None] * u[None, :]
            o = tl.sum(s * qt[:, None], axis=0)
            tl.store(out + (t * HV + h) * DV + rv, o, mask=vmask)
            tl.store(states + ((first + 1 + t) % NS) * one + tile, s, mask=vmask[None, :])
        for t in range(n, T):
            tl.store(out + (t * HV + h) * DV + rv, tl.zeros([BV], dtype=tl.float32), mask=vmask)

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
    _check_step(proj, b_out, a_out, conv_cache, ks, t)
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


def _check_step(proj, b_out, a_out, conv_cache, ks: int, t: int) -> None:
    for name, x in (("proj", proj), ("b_out", b_out), ("a_out", a_out)):
        if x.stride(-1) != 1:
            raise ValueError(f"delta_kernel: {name}'s columns must be contiguous")
    if conv_cache.shape[0] < ks - 1 + t or not conv_cache.is_contiguous():
        raise ValueError(f"delta_kernel: a conv ring of {conv_cache.shape[0]} rows for {t} rows and a kernel of {ks}")


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


def step(proj, conv_cache, states, start, live, conv_w, b_out, a_out, a_log, dt_bias, hk: int, hv: int, dk: int,
         dv: int):
    """:func:`conv_gates` then :func:`recurrent_into_cache` as one kernel (:data:`ONE_KERNEL`), on the cache's rings
    ``conv_cache`` and ``states``, from position ``start``: the recurrence's output ``[T, Hv, dv]`` fp32."""
    t, c = proj.shape
    _check_step(proj, b_out, a_out, conv_cache, conv_w.shape[1], t)
    out = torch.empty(t, hv, dv, dtype=torch.float32, device=proj.device)
    bv = min(32, dv)
    st, ptr = _start_arg(start)
    _step_kernel[(hv, triton.cdiv(dv, bv))](proj, conv_cache, st, conv_w, b_out, a_out, a_log, dt_bias, states,
                                            live if live is not None else states, out, t, c, conv_cache.shape[0],
                                            states.shape[0], proj.stride(0), b_out.stride(0), a_out.stride(0), hk, hv,
                                            dk ** -0.5, LIVE=live is not None, DK=dk, DV=dv, BV=bv,
                                            KS=conv_w.shape[1], START_PTR=ptr, EARLY=STATE_EARLY, num_warps=4,
                                            **pdl.options(proj))
    return out


def gated_norm(o, z, weight, eps: float):
    """``GatedRMSNorm``: ``o [T, Hv, dv]`` fp32, ``z [T, Hv * dv]`` (model dtype; rows may be strided) -> ``[T, Hv * dv]``."""
    t, hv, dv = o.shape
    if z.stride(-1) != 1:
        raise ValueError("gated_norm: z's columns must be contiguous")
    y = torch.empty(t, hv * dv, dtype=z.dtype, device=z.device)
    _gated_norm_kernel[(t, hv)](o, z, weight, y, hv, z.stride(0), eps, DV=dv, **pdl.options(z))
    return y
