"""RMSNorm (with the residual add before it) and SwiGLU's ``silu(gate) * up`` in one Triton kernel
each, for eager CUDA forwards without gradients (issue 10: fewer, larger kernels).

An uncompiled SmolLM2 step on the H200 ran ~29 kernels a layer (862 a step, BENCHMARKS.md): each
RMSNorm three (the fp32 copy, ``rms_norm``, the scaled product), the residual add one more, SwiGLU's
activation and product two. Here a norm is one kernel, a residual add and the norm after it one, the
activation and product one.

Bits: one program per row, the row's sum of squares in a fixed order (the row's width decides it):
a row's result never depends on the other rows, their count or the step. They are not the bits of
the torch ops (another summation order), so every eager CUDA forward without gradients takes these
kernels (prefill, static steps, batched steps, drafters), and plain and speculative decoding compute
the same rows. Under torch.compile, with gradients, on the CPU or for other inputs, the torch ops
run (:func:`usable`). ``SPECDEC_FUSED_NORM=0`` turns the kernels off.
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

ENABLED = env.switch("SPECDEC_FUSED_NORM")
# A sandwich-normed layer's (Gemma 3's and 4's) post-attention norm, its residual add and the pre-feed-forward norm (and
# Gemma 4's post-feed-forward norms: the experts' norm, the sum with the MLP's and the norm of that sum)
# as one kernel (rms_norm's ``residual_scale``) instead of two: the same arithmetic, each value rounded where the two
# kernels round it, so the same bits. SPECDEC_PRENORM_ADD=0 off.
PRENORM_ADD = env.switch("SPECDEC_PRENORM_ADD")
# Gemma 4's MoE layer tail, ``(x + norm(norm_1(f) + norm_2(m))) * layer_scalar``, as one kernel (:func:`sandwich_tail`)
# instead of four (the MLP's norm, the experts' norm + the sum + its norm, the residual add, the scalar): each value
# rounded where the torch ops round it. SPECDEC_SANDWICH_TAIL=0 off.
SANDWICH_TAIL = env.switch("SPECDEC_SANDWICH_TAIL")
# Gemma 4's dense layer tail on the fused path: ``(x + norm(f)) * layer_scalar`` as one kernel (:func:`add_norm`) instead
# of three; a small model's (E2B, E4B) with its per-layer input, ``x + norm(f)``, ``gelu_tanh(gate) * p`` and
# ``(x + norm(proj)) * layer_scalar`` as three (:func:`add_norm`, :func:`glu_mul`) instead of seven. The norms, adds and
# product rounded where the torch ops round them; the GELU is the fused GEMM's (``fused_layer.glu_act``), not torch's
# bits. SPECDEC_DENSE_TAIL=0 off.
DENSE_TAIL = env.switch("SPECDEC_DENSE_TAIL")


def usable(x: torch.Tensor) -> bool:
    """Whether the kernels take ``x`` here: CUDA, a float dtype, a contiguous
    last dimension, not inside torch.compile (inductor fuses the torch ops itself). The caller checks
    that no gradient is wanted (the kernels have no backward)."""
    return (ENABLED and triton is not None and x.is_cuda
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and x.stride(-1) == 1
            and not torch.compiler.is_compiling())


def _as_rows(x: torch.Tensor):
    """``x [..., N]`` as rows at two strided levels: ``(x', rows, inner, s_out, s_in)``, row ``r`` at
    ``(r // inner) * s_out + (r % inner) * s_in`` of ``x'`` (``x`` itself unless it had more than two
    leading dimensions that do not merge)."""
    if x.dim() == 1:
        x = x[None]
    if x.dim() == 2:
        return x, x.shape[0], 1, x.stride(0), x.stride(0)
    if x.dim() > 3:
        x = x.reshape(-1, *x.shape[-2:])
    return x, x.shape[0] * x.shape[1], x.shape[1], x.stride(0), x.stride(1)


if triton is not None:
    @triton.jit(do_not_specialize=["inner", "s_out", "s_in", "sr_out", "sr_in"])
    def _norm_kernel(x, res, w, y, s, N, inner, s_out, s_in, sr_out, sr_in, eps, wr, eps_r,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr, USE_GDC: tl.constexpr, RES_NORM: tl.constexpr = False):
        if USE_GDC:  # models/pdl.py
            pdl.begin()
        row = tl.program_id(0)
        at = (row // inner) * s_out + (row % inner) * s_in
        i = tl.arange(0, BLOCK)
        m = i < N
        v = tl.load(x + at + i, mask=m, other=0.0)
        if HAS_RES:  # s = x + res, rounded to the model dtype as the torch add is; the norm reads s
            r = tl.load(res + (row // inner) * sr_out + (row % inner) * sr_in + i, mask=m, other=0.0)
            if RES_NORM:  # res RMS-normed first (scale wr), rounded as the norm's own kernel rounds it
                rf = r.to(tl.float32)
                rms = tl.sum(rf * rf, 0) / N
                r = (rf * (1.0 / tl.sqrt_rn(rms + eps_r)) * tl.load(wr + i, mask=m, other=0.0)).to(v.dtype)
            v = (v.to(tl.float32) + r.to(tl.float32)).to(v.dtype)
            tl.store(s + row * N + i, v, mask=m)
        f = v.to(tl.float32)
        ms = tl.sum(f * f, 0) / N
        scale = tl.load(w + i, mask=m, other=0.0)  # fp32 (RMSNorm.fp32_scale)
        out = f * (1.0 / tl.sqrt_rn(ms + eps)) * scale
        tl.store(y + row * N + i, out.to(v.dtype), mask=m)

    @triton.jit
    def rms_scaled(v, w, i, m, N, eps):
        """A row's RMSNorm times its fp32 scale, in fp32 (as _norm_kernel computes it)."""
        f = v.to(tl.float32)
        ms = tl.sum(f * f, 0) / N
        return f * (1.0 / tl.sqrt_rn(ms + eps)) * tl.load(w + i, mask=m, other=0.0)

    @triton.jit
    def _add_out(y, xv, p, sc, row, N, i, m, SCALAR: tl.constexpr):
        """A layer tail's last ops into row ``row`` of ``y``: ``xv + p``, times ``sc`` with SCALAR, each rounded to the
        model dtype (as the torch add and product)."""
        dt = xv.dtype
        t = (xv.to(tl.float32) + p.to(tl.float32)).to(dt)
        if SCALAR:
            t = (t.to(tl.float32) * tl.load(sc).to(tl.float32)).to(dt)
        tl.store(y + row * N + i, t, mask=m)

    @triton.jit
    def _tail_kernel(x, f, e, w1, w2, w, sc, y, N, eps1, eps2, eps, BLOCK: tl.constexpr, USE_GDC: tl.constexpr):
        # y = (x + norm_w(norm_w1(f) + norm_w2(e))) * sc, every op's result rounded to the model dtype
        if USE_GDC:  # models/pdl.py
            pdl.begin()
        row = tl.program_id(0)
        i = tl.arange(0, BLOCK)
        m = i < N
        dt = y.dtype.element_ty
        a = rms_scaled(tl.load(f + row * N + i, mask=m, other=0.0), w1, i, m, N, eps1).to(dt)
        b = rms_scaled(tl.load(e + row * N + i, mask=m, other=0.0), w2, i, m, N, eps2).to(dt)
        u = (a.to(tl.float32) + b.to(tl.float32)).to(dt)
        p = rms_scaled(u, w, i, m, N, eps).to(dt)
        _add_out(y, tl.load(x + row * N + i, mask=m, other=0.0), p, sc, row, N, i, m, True)

    @triton.jit
    def _add_norm_kernel(x, v, w, sc, y, N, eps, BLOCK: tl.constexpr, USE_GDC: tl.constexpr, SCALAR: tl.constexpr):
        # y = x + norm_w(v) (times sc with SCALAR), every op's result rounded to the model dtype
        if USE_GDC:  # models/pdl.py
            pdl.begin()
        row = tl.program_id(0)
        i = tl.arange(0, BLOCK)
        m = i < N
        p = rms_scaled(tl.load(v + row * N + i, mask=m, other=0.0), w, i, m, N, eps).to(y.dtype.element_ty)
        _add_out(y, tl.load(x + row * N + i, mask=m, other=0.0), p, sc, row, N, i, m, SCALAR)

    @triton.jit(do_not_specialize=["I", "sg", "su"])
    def _silu_mul_kernel(g, u, y, I, sg, su, BLOCK: tl.constexpr, USE_GDC: tl.constexpr, GELU: tl.constexpr = False):
        if USE_GDC:  # models/pdl.py
            pdl.begin()
        row, blk = tl.program_id(0), tl.program_id(1)
        i = blk * BLOCK + tl.arange(0, BLOCK)
        m = i < I
        gate = tl.load(g + row * sg + i, mask=m, other=0.0)
        up = tl.load(u + row * su + i, mask=m, other=0.0)
        gf = gate.to(tl.float32)
        act = fused_layer.glu_act(gf, GELU).to(gate.dtype)  # silu (or GELU-tanh), rounded as the torch op's output is
        tl.store(y + row * I + i, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=m)


def block_size(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             residual_scale: torch.Tensor | None = None, residual_eps: float = 0.0):
    """``x [..., N]`` -> its RMSNorm times the fp32 ``scale [N]``, contiguous, in ``x``'s dtype; with a
    ``residual`` (same shape), ``(x + residual, norm(x + residual))``; with ``residual_scale`` too, the residual
    RMS-normed first (``r = rms_norm(residual, residual_scale, residual_eps)``, then ``(x + r, norm(x + r))``, each the
    bits of those calls). Callers check :func:`usable`."""
    n = x.shape[-1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    s = torch.empty_like(y) if residual is not None else y
    xr, rows, inner, s_out, s_in = _as_rows(x)
    sr_out, sr_in, res = 0, 0, xr
    if residual is not None:
        res, _, r_inner, sr_out, sr_in = _as_rows(residual if residual.stride(-1) == 1 else residual.contiguous())
        if residual.shape != x.shape or r_inner != inner:
            raise ValueError(f"rms_norm: residual of shape {tuple(residual.shape)} for x of shape {tuple(x.shape)}")
    if rows:
        block = block_size(n)
        _norm_kernel[(rows,)](xr, res, scale, y, s, n, inner, s_out, s_in, sr_out, sr_in, eps,
                              scale if residual_scale is None else residual_scale, residual_eps,
                              HAS_RES=residual is not None, BLOCK=block, num_warps=4 if block <= 2048 else 8,
                              RES_NORM=residual is not None and residual_scale is not None, **pdl.options(x))
    return (s, y) if residual is not None else y


def sandwich_tail(x: torch.Tensor, f: torch.Tensor, e: torch.Tensor, scales: tuple, eps: tuple,
                  scalar: torch.Tensor) -> torch.Tensor:
    """Gemma 4's MoE layer tail: ``(x + norm(norm_1(f) + norm_2(e))) * scalar`` for ``x``, ``f``, ``e [T, N]``
    (contiguous, one dtype): ``scales`` the three norms' fp32 scales ``(w_1, w_2, w)``, ``eps`` their epsilons,
    ``scalar`` a one-element tensor of ``x``'s dtype. Each op rounded as the torch ops round it. Callers check
    :func:`usable`."""
    rows, n = x.shape
    if f.shape != x.shape or e.shape != x.shape or not (x.is_contiguous() and f.is_contiguous() and e.is_contiguous()):
        raise ValueError(f"sandwich_tail: inputs {tuple(x.shape)}, {tuple(f.shape)}, {tuple(e.shape)}: want one "
                         "contiguous [T, N] shape")
    y = torch.empty_like(x)
    if rows:
        block = block_size(n)
        _tail_kernel[(rows,)](x, f, e, *scales, scalar, y, n, *eps, BLOCK=block, num_warps=4 if block <= 2048 else 8,
                              **pdl.options(x))
    return y


def add_norm(x: torch.Tensor, v: torch.Tensor, scale: torch.Tensor, eps: float,
             scalar: torch.Tensor | None = None) -> torch.Tensor:
    """``x + rms_norm(v, scale, eps)`` for ``x``, ``v [T, N]`` (contiguous, one dtype), times ``scalar`` (a
    one-element tensor of ``x``'s dtype) when given: Gemma 4's dense layer tail (:data:`DENSE_TAIL`). Each op rounded
    as the norm kernel and the torch add and product round it. Callers check :func:`usable`."""
    if v.shape != x.shape or x.dim() != 2 or not (x.is_contiguous() and v.is_contiguous()):
        raise ValueError(f"add_norm: inputs {tuple(x.shape)}, {tuple(v.shape)}: want one contiguous [T, N] shape")
    y = torch.empty_like(x)
    rows, n = x.shape
    if rows:
        block = block_size(n)
        _add_norm_kernel[(rows,)](x, v, scale, x if scalar is None else scalar, y, n, eps, BLOCK=block,
                                  num_warps=4 if block <= 2048 else 8, SCALAR=scalar is not None, **pdl.options(x))
    return y


def glu_mul(gate: torch.Tensor, up: torch.Tensor, gelu: bool = False) -> torch.Tensor:
    """``silu(gate) * up`` (``gelu``: ``gelu_tanh(gate) * up``) for ``gate``, ``up [T, I]`` of one dtype whose last
    dimensions are contiguous (rows strided: a view of a fused projection, or of Gemma 4's per-layer inputs): the
    fused GEMM's activation (``fused_layer.glu_act``) rounded to the dtype, then the product rounded."""
    if gate.dim() != 2 or up.shape != gate.shape or gate.stride(-1) != 1 or up.stride(-1) != 1 or up.dtype != gate.dtype:
        raise ValueError(f"glu_mul: gate {tuple(gate.shape)}, up {tuple(up.shape)}: want one [T, I] shape and dtype, "
                         "contiguous last dimensions")
    rows, i = gate.shape
    y = torch.empty(rows, i, dtype=gate.dtype, device=gate.device)
    if rows:
        block = min(1024, block_size(i))
        _silu_mul_kernel[(rows, triton.cdiv(i, block))](gate, up, y, i, gate.stride(0), up.stride(0), BLOCK=block,
                                                        num_warps=4, GELU=gelu, **pdl.options(gate))
    return y


def silu_mul(gate_up: torch.Tensor, gelu: bool = False) -> torch.Tensor:
    """``gate_up [..., 2I]`` (gate, then up; a contiguous last dimension) -> ``silu(gate) * up [..., I]``; ``gelu``:
    ``gelu_tanh(gate) * up`` (Gemma's MLPs)."""
    if gate_up.dim() != 2:
        return silu_mul(gate_up.reshape(-1, gate_up.shape[-1]), gelu).view(*gate_up.shape[:-1], -1)
    i = gate_up.shape[1] // 2
    return glu_mul(gate_up[:, :i], gate_up[:, i:], gelu)
