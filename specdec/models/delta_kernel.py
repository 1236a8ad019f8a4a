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
# layer written twice), the output norm in ten ops. Here, for steps that keep snapshots:
#   conv_gates: conv + SiLU, the q/k l2 norms, v, beta and g, and the conv inputs written to the cache;
#   recurrent_into_cache: the recurrence reading the live state from the cache and writing the state
#     before the step and after each position straight into it (the cache's layout, no copies);
#   gated_norm: the output RMSNorm gated by silu(z).
# Each program computes rows one at a time by the same instructions (per-position invariance); the
# values follow the torch form's roundings (the conv output rounded to the model dtype, the norm's
# product rounded before the gate), not its bits: every path of a model on CUDA takes these kernels.

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
    def _conv_gates_kernel(proj, win, w, bo, ao, a_log, dt_bias, conv, q, k, v, g, beta, C, PS, BS, AS, HK, HV, scale,
                           DK: tl.constexpr, DV: tl.constexpr, KS: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0)
        j = tl.program_id(1)  # segment: q heads, then k heads, then v heads
        r = tl.arange(0, BLOCK)
        is_v = j >= 2 * HK
        d = tl.where(is_v, DV, DK)
        c0 = tl.where(is_v, 2 * HK * DK + (j - 2 * HK) * DV, j * DK)
        m = r < d
        ch = c0 + r
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for i in tl.static_range(KS):  # full = [window (KS-1 rows) | proj]; output row t reads full[t .. t+KS-1]
            row = t + i
            xw = tl.load(win + row * C + ch, mask=m & (row < KS - 1), other=0.0)
            xp = tl.load(proj + (row - (KS - 1)) * PS + ch, mask=m & (row >= KS - 1), other=0.0)
            wi = tl.load(w + ch * KS + i, mask=m, other=0.0)
            acc += (xw.to(tl.float32) + xp.to(tl.float32)) * wi
        out = (acc * tl.sigmoid(acc)).to(proj.dtype.element_ty).to(tl.float32)  # silu, rounded as the layer's dtype
        # the conv inputs kept for rollback: the window (row t = 0's programs) and this row
        tl.store(conv + (KS - 1 + t) * C + ch, tl.load(proj + t * PS + ch, mask=m), mask=m)
        if t == 0:
            for i in tl.static_range(KS - 1):
                tl.store(conv + i * C + ch, tl.load(win + i * C + ch, mask=m), mask=m)
        if is_v:
            hv = j - 2 * HK
            tl.store(v + (t * HV + hv) * DV + r, out, mask=m)
            bt = tl.load(bo + t * BS + hv).to(tl.float32)
            at = tl.load(ao + t * AS + hv).to(tl.float32) + tl.load(dt_bias + hv).to(tl.float32)
            tl.store(beta + t * HV + hv, tl.sigmoid(bt))
            tl.store(g + t * HV + hv, -tl.exp(tl.load(a_log + hv).to(tl.float32)) * _softplus(at))
        else:
            ss = tl.sum(tl.where(m, out * out, 0.0), axis=0)
            y = out * (1.0 / tl.sqrt(ss + 1e-6))
            if j < HK:
                tl.store(q + (t * HK + j) * DK + r, y * scale, mask=m)
            else:
                tl.store(k + (t * HK + j - HK) * DK + r, y, mask=m)

    @triton.jit
    def _recurrent_cache_kernel(q, k, v, g, beta, s0, cur, states, live, out, T, H, REP, CACHE: tl.constexpr,
                                LIVE: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr):
        # CACHE: s0 is the cache's buffer, the live state at row cur; row 0 gets it, row 1 + t the state
        # after position t. Else s0 is the state and row t the state after t. LIVE: only the first live rows
        # (the rest pad a static step: zero outputs, no states).
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
            s = tl.load(s0 + tl.load(cur) * one + tile, mask=smask, other=0.0)
            tl.store(states + tile, s, mask=smask)  # the state before the step (this program's slice only)
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
            tl.store(states + (CACHE + t) * one + tile, s, mask=smask)
        for t in range(n, T):
            tl.store(out + (t * H + h) * DV + rv, tl.zeros([BV], dtype=tl.float32), mask=vmask)

    @triton.jit
    def _gated_norm_kernel(o, z, w, y, HV, ZS, eps, DV: tl.constexpr):
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


def conv_gates(proj, window, conv_w, b_out, a_out, a_log, dt_bias, conv_cache, hk: int, hv: int, dk: int, dv: int):
    """One step's conv (+SiLU) and gates. ``proj [T, C]`` (``in_proj_qkv``'s output), ``window
    [K-1, C]`` (a copy of the live window), ``conv_w [C, K]`` fp32, ``b_out, a_out [T, Hv]``
    (``proj``, ``b_out`` and ``a_out`` may be column slices of one fused projection: rows strided).
    Writes the window and ``proj`` into ``conv_cache`` rows ``0 .. K-2+T`` and returns fp32 ``q, k
    [T, Hk, dk]`` (l2-normalised, ``q`` scaled by ``dk ** -0.5``), ``v [T, Hv, dv]``, ``g, beta [T, Hv]``."""
    t, c = proj.shape
    ks = conv_w.shape[1]
    for name, x in (("proj", proj), ("b_out", b_out), ("a_out", a_out)):
        if x.stride(-1) != 1:
            raise ValueError(f"conv_gates: {name}'s columns must be contiguous")
    f32 = dict(dtype=torch.float32, device=proj.device)
    q, k = torch.empty(t, hk, dk, **f32), torch.empty(t, hk, dk, **f32)
    v, g, beta = torch.empty(t, hv, dv, **f32), torch.empty(t, hv, **f32), torch.empty(t, hv, **f32)
    _conv_gates_kernel[(t, 2 * hk + hv)](proj, window, conv_w, b_out, a_out, a_log, dt_bias, conv_cache, q, k, v, g, beta,
                                         c, proj.stride(0), b_out.stride(0), a_out.stride(0), hk, hv, dk ** -0.5, DK=dk, DV=dv, KS=ks,
                                         BLOCK=triton.next_power_of_2(max(dk, dv)))
    return q, k, v, g, beta


def recurrent_into_cache(q, k, v, g, beta, states, cur, live):
    """The recurrence of one step on the cache: ``states [R+1, Hv, dk, dv]`` (fp32, the cache's
    buffer) holds the live state at row ``cur`` (a 0-d int64 device tensor); row 0 gets that state
    and row ``1 + t`` the state after position ``t``, for the first ``live`` rows (a 0-d int64 device
    tensor: a static step's real rows; the padding rows after them get zero outputs and no states; None:
    every row). ``q, k [T, Hk, dk]`` (each key head serves ``Hv / Hk`` consecutive value heads),
    ``v [T, Hv, dv]``, ``g, beta [T, Hv]`` -> out ``[T, Hv, dv]`` fp32."""
    return _recurrence(q, k, v, g, beta, states, cur, states, live)


def _recurrence(q, k, v, g, beta, s0, cur, states, live):
    t, hkn, dk = k.shape
    h, dv = v.shape[1], v.shape[2]
    out = torch.empty(t, h, dv, dtype=torch.float32, device=q.device)
    bv = min(32, triton.next_power_of_2(dv))
    cache, has_live = cur is not None, live is not None
    _recurrent_cache_kernel[(h, triton.cdiv(dv, bv))](q, k, v, g, beta, s0, cur if cache else s0, states,
                                                      live if has_live else s0, out, t, h, h // hkn, CACHE=cache,
                                                      LIVE=has_live, DK=dk, DV=dv, BV=bv)
    return out


def gated_norm(o, z, weight, eps: float):
    """``GatedRMSNorm``: ``o [T, Hv, dv]`` fp32, ``z [T, Hv * dv]`` (model dtype; rows may be strided) -> ``[T, Hv * dv]``."""
    t, hv, dv = o.shape
    if z.stride(-1) != 1:
        raise ValueError("gated_norm: z's columns must be contiguous")
    y = torch.empty(t, hv * dv, dtype=z.dtype, device=z.device)
    _gated_norm_kernel[(t, hv)](o, z, weight, y, hv, z.stride(0), eps, DV=dv)
    return y
