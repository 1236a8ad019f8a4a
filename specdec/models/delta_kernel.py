"""A fused CUDA kernel (Triton) for the recurrent Gated DeltaNet form of decode and verify steps.

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


if triton is not None:
    @triton.jit
    def _recurrent_kernel(q, k, v, g, beta, s0, out, states, T, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                          BV: tl.constexpr):
        h = tl.program_id(0)
        vb = tl.program_id(1)
        rk = tl.arange(0, DK)
        rv = vb * BV + tl.arange(0, BV)
        vmask = rv < DV
        smask = vmask[None, :]
        s = tl.load(s0 + h * DK * DV + rk[:, None] * DV + rv[None, :], mask=smask, other=0.0)
        for t in range(0, T):
            row = t * H + h
            kt = tl.load(k + row * DK + rk)
            qt = tl.load(q + row * DK + rk)
            vt = tl.load(v + row * DV + rv, mask=vmask, other=0.0)
            gt = tl.load(g + row)
            bt = tl.load(beta + row)
            s = s * tl.exp(gt)
            pred = tl.sum(s * kt[:, None], axis=0)  # S^T k
            u = bt * (vt - pred)
            s = s + kt[:, None] * u[None, :]
            o = tl.sum(s * qt[:, None], axis=0)
            tl.store(out + row * DV + rv, o, mask=vmask)
            tl.store(states + row * DK * DV + rk[:, None] * DV + rv[None, :], s, mask=smask)


def recurrent_gated_delta_fused(q, k, v, g, beta, state):
    """Same contract as :func:`~specdec.models.deltanet.recurrent_gated_delta` (position-major fp32
    inputs) -> (out ``[T, H, dv]``, states ``[T, H, dk, dv]``); only where :func:`available`."""
    t, h, dk = k.shape
    dv = v.shape[-1]
    q, k, v, g, beta, state = (x.contiguous() for x in (q, k, v, g, beta, state))
    out = torch.empty(t, h, dv, dtype=torch.float32, device=q.device)
    states = torch.empty(t, h, dk, dv, dtype=torch.float32, device=q.device)
    bv = min(32, triton.next_power_of_2(dv))
    _recurrent_kernel[(h, triton.cdiv(dv, bv))](q, k, v, g, beta, state, out, states, t, H=h, DK=dk, DV=dv, BV=bv)
    return out, states
