"""Linear layers whose rows do not depend on the row count, for exact serving (issue 10/11).

The serving loop's exact mode lets a static step take a shape other than the full one (fewer
slots, 1 row a slot without drafts) only where that gives a row the full step's bits. cuBLAS picks
its GEMM kernel by shape, and for some weights the kernels it picks for 1..512 rows sum in other
orders: on the H200 the qwen3-8b shape's o and down projections give a row other bits at 32 rows
than at 512 (scripts/check_width_invariance.py, BENCHMARKS.md), while its qkv, gate_up and LM
head, and every SmolLM2 weight, keep them. :func:`make_rows_invariant` finds the ``nn.Linear``
weights of a model for which cuBLAS varies over the loop's row counts and runs them through
:func:`invariant_linear` instead: a Triton GEMM with one tile config per weight (never per row
count) that tiles the output ``BM x BN``, walks K in ``BK`` blocks in order and accumulates in
fp32, so every row goes through the same instructions in the same order for any M (M is not
specialised on). Programs run M-tile fastest: the M-tiles of one weight tile run side by side and
read it from L2. On the H200 (``scripts/invariant_gemm.py``, 1..512 rows) every config tried kept
every row's bits, and gave the other configs' bits too (see ``CONFIGS``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..cpu_linear import linear, plain

try:  # Triton ships with CUDA builds of torch; CPU-only installs have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

# (BM, BN, BK, warps, stages) by row count. Every config keeps K in order, in k16 steps
# accumulated in fp32 one after another, so the tiling does not change a row's bits: on the H200
# (torch 2.11, Triton 3.5; scripts/invariant_gemm.py) 8 configs gave bit-identical results at 1..512
# rows for every qwen3-8b weight. The serving loop's shape checks compare anyway. The pick, per
# row count, is the fastest measured there (down projection 35.5 us at 1-64 rows, 45.8 at 128,
# 64.8 at 256, 104 at 512; cuBLAS 29-70).
CONFIGS = ((128, (64, 32, 128, 4, 4)), (256, (64, 64, 128, 4, 3)), (1 << 62, (128, 128, 64, 8, 3)))


def config_for(rows: int) -> tuple[int, int, int, int, int]:
    return next(cfg for top, cfg in CONFIGS if rows <= top)


if triton is not None:
    @triton.jit(do_not_specialize=["M"])
    def _kernel(x, w, y, M, N, K, sxm, swn, sym, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BM)
        pid_m = pid % num_m
        pid_n = pid // num_m
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + rk
            a = tl.load(x + rm[:, None] * sxm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
            b = tl.load(w + rn[None, :] * swn + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
            acc = tl.dot(a, b, acc)
        tl.store(y + rm[:, None] * sym + rn[None, :], acc.to(y.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))


def invariant_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
                     config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """``x @ w.T (+ b)`` on CUDA with the row-count-invariant kernel (``cpu_linear.linear`` elsewhere);
    ``config``: the tiling (default: :func:`config_for` the row count)."""
    if triton is None or not x.is_cuda:
        return linear(x, w, b)
    x2 = x.reshape(-1, x.shape[-1])
    y = run_kernel(x2, w, config or config_for(x2.shape[0])).reshape(*x.shape[:-1], w.shape[0])
    return y if b is None else y + b


def run_kernel(x2: torch.Tensor, w: torch.Tensor, config: tuple[int, int, int, int, int]) -> torch.Tensor:
    """The kernel itself: ``x2 [M, K] @ w.T`` with the tiling ``config`` (tests run it on the CPU
    through Triton's interpreter)."""
    bm, bn, bk, warps, stages = config
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    m, k = x2.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    _kernel[(triton.cdiv(m, bm) * triton.cdiv(n, bn),)](x2, w, y, m, n, k, x2.stride(0), w.stride(0), y.stride(0),
                                                       BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages)
    return y


class InvariantLinear(nn.Module):
    """An ``nn.Linear``'s weight and bias (the same tensors) run through :func:`invariant_linear`."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(x, self.weight, self.bias)


def cublas_varies(weight: torch.Tensor, rows: list[int], seed: int = 0) -> bool:
    """Whether ``F.linear`` gives row 0 other bits at some count in ``rows`` than alone: random
    inputs, the weight's own values."""
    g = torch.Generator(device=weight.device).manual_seed(seed)
    x = torch.randn(max(rows), weight.shape[1], device=weight.device, dtype=weight.dtype, generator=g)
    ref = F.linear(x[:1], weight)
    return any(not torch.equal(F.linear(x[:m], weight)[:1], ref) for m in rows)


def row_counts(max_rows: int) -> list[int]:
    """The counts to try: 1, 2, 4, ... up to ``max_rows``, and ``max_rows`` itself."""
    out, m = [], 1
    while m < max_rows:
        out.append(m)
        m *= 2
    return out + [max_rows]


@torch.inference_mode()
def make_rows_invariant(model: nn.Module, max_rows: int, varies=cublas_varies, force: bool = False,
                        rows: list[int] | None = None) -> list[str]:
    """Replace every ``nn.Linear`` of ``model`` whose cuBLAS results vary with the row count
    (``rows``, default 1, 2, 4, ... ``max_rows``) by an :class:`InvariantLinear` over the same
    tensors; returns their names. Needs CUDA and Triton (else nothing is replaced; ``force``:
    probe anyway, for tests). Weight shapes are probed once each."""
    if not force and (triton is None or next(model.parameters()).device.type != "cuda"):
        return []
    rows = row_counts(max_rows) if rows is None else sorted(set(rows))
    verdict: dict[tuple, bool] = {}
    swapped = []
    for name, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            if not plain(child):  # (an InvariantLinear: swapped for an earlier loop)
                continue
            key = (tuple(child.weight.shape), child.weight.dtype)
            if key not in verdict:
                verdict[key] = varies(child.weight, rows)
            if verdict[key]:
                setattr(mod, child_name, InvariantLinear(child))
                swapped.append(f"{name}.{child_name}" if name else child_name)
    return swapped
