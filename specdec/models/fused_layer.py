"""A Llama-family decoder layer in four GEMM kernels, each with its neighbours fused in (issue 10:
fewer, larger kernels).

A 16-row SmolLM2 step on the H200 ran ~11.7 kernels a layer (351 a step, 1.37 ms, for weights that
take 0.07 ms to read): the step is its launches. Here, without changing what is computed:

- ``norm_linear`` (q/k/v): the residual add of the layer before, RMSNorm and the fused q/k/v GEMM;
- (RoPE + the cache write, and the split attention: their own kernels, as before)
- ``norm_linear`` (o): the output projection, a plain GEMM;
- ``norm_linear`` (gate/up): the residual add after attention, RMSNorm, the gate/up GEMM and
  ``silu(gate) * up``;
- ``norm_linear`` (down): a plain GEMM, whose output the next layer's first kernel adds.

From ~10.5 kernels a layer to ~6.5. Each program computes ``BM = 16`` rows by ``BN`` outputs: the
norm's statistics of its rows first (fp32, in fixed chunks of ``NB`` features, in order), then the
GEMM over K in ``BK`` blocks in order, accumulating in fp32; the sum ``x + delta`` is written by the
programs of the first output block. A row's bits depend on its own inputs only (never on the row
count, the other rows or the step), so one kernel serves prefill chunks, decode and verify steps and
batched steps alike; a model takes these kernels for every CUDA forward without gradients
(:func:`usable`) or for none, so plain and speculative decoding compute the same rows.

The rounding follows the torch ops': the sum to the model dtype, the norm's product to the model
dtype before the GEMM, the gate and up outputs to the model dtype before the activation, the
activation before the product. The GEMM's own summation is not cuBLAS's, so the logits are not the
unfused path's bits (a model runs one path or the other, never both). Which models take it:
:func:`eligible`; ``SPECDEC_FUSED_LAYER=0`` turns it off. ``scripts/check_fused_layer.py`` compares
it with the torch ops and times it on the GPU; tests/_interpret_kernels.py runs it on the CPU.
"""

from __future__ import annotations

import os

import torch

try:  # Triton ships with CUDA builds of torch; CPU-only installs have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

ENABLED = os.environ.get("SPECDEC_FUSED_LAYER", "1") != "0"
MAX_HIDDEN = 2048  # larger layers: 16-row tiles would re-read big weights per tile in a prefill
BM = 16  # rows a program: fixed (a row's bits must not depend on the tile it shares)
NB = 128  # features per chunk of the norm's sum of squares: fixed, in order
# (BN, BK, warps, stages): the tiling of the outputs and of K; not the bits (K in order in k16 steps)
TILE = tuple(int(v) for v in os.environ.get("SPECDEC_FUSED_LAYER_TILE", "32,64,4,3").split(","))


def usable(x: torch.Tensor) -> bool:
    """Whether a forward with input ``x`` takes the kernels: CUDA, bf16/fp16, no gradient wanted,
    not inside torch.compile (inductor fuses the torch ops itself), the kernels on."""
    return (ENABLED and triton is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and not torch.is_grad_enabled() and not torch.compiler.is_compiling())


def eligible(layer) -> bool:
    """Whether a ``llama.DenseDecoderLayer`` has what these kernels compute: no q/k norm, no biases,
    no output gate, one process (no shard), fused projections, a hidden size of at most MAX_HIDDEN.
    The config's question only: whether a forward runs the kernels is :func:`usable`'s."""
    a, mlp = layer.self_attn, layer.mlp
    return (a.q_norm is None and not a.gated and a._fused is not None
            and a._fused[1] is None and type(a.o_proj) is torch.nn.Linear and a.o_proj.bias is None
            and mlp._fused is not None and mlp._fused[1] is None and type(mlp).act is _silu_act()
            and type(mlp.down_proj) is torch.nn.Linear and mlp.down_proj.bias is None
            and layer.config.hidden_size <= MAX_HIDDEN)


def _silu_act():
    from .layers import SwiGLU
    return SwiGLU.act


if triton is not None:
    @triton.jit(do_not_specialize=["M"])
    def _kernel(x, res, s, scale, w, y, M, N, K, eps, sx, sr, ss, sy,
                HAS_NORM: tl.constexpr, HAS_RES: tl.constexpr, SILU: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NB: tl.constexpr):
        # programs run M-tile fastest: the row tiles of one weight block run side by side (L2)
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BM)
        pid_m, pid_n = pid % num_m, pid // num_m
        rm = pid_m * BM + tl.arange(0, BM)
        mm = rm < M
        rn = pid_n * BN + tl.arange(0, BN)
        mn = rn < N
        if HAS_NORM:  # the rows' statistics: NB features at a time, in order
            sq = tl.zeros([BM], dtype=tl.float32)
            for k0 in range(0, K, NB):
                kn = k0 + tl.arange(0, NB)
                at = mm[:, None] & (kn[None, :] < K)
                v = tl.load(x + rm[:, None] * sx + kn[None, :], mask=at, other=0.0)
                if HAS_RES:  # the sum, rounded to the model dtype as the torch add is
                    r = tl.load(res + rm[:, None] * sr + kn[None, :], mask=at, other=0.0)
                    v = (v.to(tl.float32) + r.to(tl.float32)).to(v.dtype)
                    if pid_n == 0:
                        tl.store(s + rm[:, None] * ss + kn[None, :], v, mask=at)
                f = v.to(tl.float32)
                sq += tl.sum(f * f, 1)
            inv = 1.0 / tl.sqrt_rn(sq / K + eps)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        if SILU:
            acc_up = tl.zeros([BM, BN], dtype=tl.float32)
        rk = tl.arange(0, BK)
        for k0 in range(0, K, BK):
            kk = k0 + rk
            at = mm[:, None] & (kk[None, :] < K)
            a = tl.load(x + rm[:, None] * sx + kk[None, :], mask=at, other=0.0)
            if HAS_NORM:
                if HAS_RES:
                    r = tl.load(res + rm[:, None] * sr + kk[None, :], mask=at, other=0.0)
                    a = (a.to(tl.float32) + r.to(tl.float32)).to(r.dtype)
                sc = tl.load(scale + kk, mask=kk < K, other=0.0)  # fp32
                a = (a.to(tl.float32) * inv[:, None] * sc[None, :]).to(w.dtype.element_ty)
            wm = mn[None, :] & (kk[:, None] < K)
            b = tl.load(w + rn[None, :] * K + kk[:, None], mask=wm, other=0.0)
            acc = tl.dot(a, b, acc)
            if SILU:  # the up rows follow the N gate rows
                bu = tl.load(w + (N + rn)[None, :] * K + kk[:, None], mask=wm, other=0.0)
                acc_up = tl.dot(a, bu, acc_up)
        if SILU:  # silu(gate) * up, each rounded where the torch ops round
            gf = acc.to(y.dtype.element_ty).to(tl.float32)
            act = (gf / (1.0 + tl.exp(-gf))).to(y.dtype.element_ty)
            out = (act.to(tl.float32) * acc_up.to(y.dtype.element_ty).to(tl.float32)).to(y.dtype.element_ty)
        else:
            out = acc.to(y.dtype.element_ty)
        tl.store(y + rm[:, None] * sy + rn[None, :], out, mask=mm[:, None] & mn[None, :])


def _rows(t: torch.Tensor) -> torch.Tensor:
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def norm_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None, eps: float = 0.0,
                delta: torch.Tensor | None = None, silu: bool = False, tile: tuple | None = None):
    """``x [..., K]`` -> ``y [..., N]``: ``norm(x (+ delta)) @ w.T`` (``scale``: the norm's fp32
    weight; None: no norm, a plain GEMM, ``delta`` not allowed), and with ``silu`` (``w``: the gate
    rows, then as many up rows) ``silu(gate) * up``. With ``delta``, returns ``(x + delta, y)``.
    Contiguous outputs in ``x``'s dtype; ``w [N or 2N, K]`` contiguous."""
    if delta is not None and scale is None:
        raise ValueError("norm_linear: a residual delta needs a norm")
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = _rows(x)
    m = x2.shape[0]
    n = w.shape[0] // 2 if silu else w.shape[0]
    if w.shape[1] != k or not w.is_contiguous() or (silu and w.shape[0] % 2):
        raise ValueError(f"norm_linear: weight {tuple(w.shape)} for input features {k}")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    r2 = _rows(delta) if delta is not None else x2
    s = torch.empty_like(x2) if delta is not None else x2
    if delta is not None and r2.shape != x2.shape:
        raise ValueError(f"norm_linear: delta of shape {tuple(delta.shape)} for x of shape {tuple(x.shape)}")
    bn, bk, warps, stages = tile or TILE
    if m:
        _kernel[(triton.cdiv(m, BM) * triton.cdiv(n, bn),)](
            x2, r2, s, scale if scale is not None else x2, w, y, m, n, k, eps,
            x2.stride(0), r2.stride(0), s.stride(0), y.stride(0),
            HAS_NORM=scale is not None, HAS_RES=delta is not None, SILU=silu,
            BM=BM, BN=bn, BK=bk, NB=NB, num_warps=warps, num_stages=stages)
    y = y.view(*lead, n)
    return (s.view(*lead, k), y) if delta is not None else y


def reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None, eps: float = 0.0,
              delta: torch.Tensor | None = None, silu: bool = False):
    """:func:`norm_linear` in torch ops (fp32 GEMM), the CPU equivalent the checks compare it with."""
    s = x if delta is None else (x.float() + delta.float()).to(x.dtype)
    h = s
    if scale is not None:
        f = s.float()
        inv = 1.0 / torch.sqrt(f.pow(2).mean(-1, keepdim=True) + eps)
        h = (f * inv * scale.float()).to(w.dtype)
    if silu:
        n = w.shape[0] // 2
        g = (h.float() @ w[:n].float().T).to(x.dtype).float()
        u = (h.float() @ w[n:].float().T).to(x.dtype).float()
        y = (torch.nn.functional.silu(g).to(x.dtype).float() * u).to(x.dtype)
    else:
        y = (h.float() @ w.float().T).to(x.dtype)
    return (s, y) if delta is not None else y
