"""A skinny GEMM (Triton) for decode and verify steps: ``y = x @ W^T (+ b)`` for at most 16 rows.

A decode step reads every weight once for 1 to 16 rows of activations. cuBLAS picks a different
kernel for each row count: a GEMV for one row, tiled GEMMs from two on, whose reduction orders
differ, so the rows of a 16-row step are not the bits of a 1-row step, and its 16-row kernels
stream the weights more slowly (the padded step cost 1.20x the 1-row one on a Qwen3-8B shape).

Here one program per block of ``BN`` output features keeps a ``[16, BN]`` fp32 accumulator and
walks K in blocks of ``BK``, in order; rows past ``M`` are loaded as zeros. Every row is computed
by the same instructions, in the same order, whatever ``M`` is (1..16): the result of a row is a
function of that row alone (tested on the CPU through Triton's interpreter where Triton imports).
No split-K: the sum over K stays in one program.

An experiment, not wired into the models: on an H200 (scripts/micro_kernels.py gemm, BENCHMARKS.md)
cuBLAS turned out to cost the same at 1 and at 16 rows for every Qwen3-8B weight, so the padded
step's extra cost is not in its GEMMs; this kernel is 1-10 % faster than cuBLAS at 16 rows there,
and slower on SmolLM2's LM head. Kept for the batch-invariance work (its rows do not depend on M).
"""

from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of torch; CPU-only installs have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

ROWS = 16  # the most rows one launch takes (one tl.dot tile)


def config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BN, BK, num_warps, num_stages) for an ``[n, k]`` weight: enough programs to fill the GPU's
    SMs (about 132 on an H200) with a deep pipeline of weight tiles each."""
    bn = 64 if n >= 132 * 64 else 32 if n >= 132 * 16 else 16
    return bn, 256 if k >= 256 else 64, 4, 4


if triton is not None:
    @triton.jit
    def _kernel(x, w, b, y, M, N, K, sxm, swn, sym, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                BN: tl.constexpr, BK: tl.constexpr):
        rm = tl.arange(0, 16)
        rn = tl.program_id(0) * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        mrow = rm[:, None] < M
        ncol = rn[:, None] < N
        acc = tl.zeros((16, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + rk
            if EVEN_K:
                xt = tl.load(x + rm[:, None] * sxm + kk[None, :], mask=mrow, other=0.0)
                wt = tl.load(w + rn[:, None] * swn + kk[None, :], mask=ncol, other=0.0)
            else:
                kin = kk[None, :] < K
                xt = tl.load(x + rm[:, None] * sxm + kk[None, :], mask=mrow & kin, other=0.0)
                wt = tl.load(w + rn[:, None] * swn + kk[None, :], mask=ncol & kin, other=0.0)
            acc = tl.dot(xt, tl.trans(wt), acc)
        if HAS_BIAS:
            acc += tl.load(b + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y + rm[:, None] * sym + rn[None, :], acc.to(y.dtype.element_ty), mask=mrow & (rn[None, :] < N))


def launch(x2: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, cfg: tuple[int, int, int, int] | None = None
           ) -> torch.Tensor:
    """``x2 [M <= 16, K]`` (rows contiguous) @ ``w [N, K]^T`` (+ ``b``) with the kernel."""
    m, k = x2.shape
    n = w.shape[0]
    bn, bk, warps, stages = cfg or config(n, k)
    y = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    _kernel[(triton.cdiv(n, bn),)](x2, w, b if b is not None else w, y, m, n, k, x2.stride(0), w.stride(0),
                                   y.stride(0), HAS_BIAS=b is not None, EVEN_K=k % bk == 0, BN=bn, BK=bk,
                                   num_warps=warps, num_stages=stages)
    return y
