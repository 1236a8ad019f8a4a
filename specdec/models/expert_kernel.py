"""Routed experts of a static step in Triton: one GEMV per (row, chosen expert) pair, reading the
expert's weights where they lie (issue 10).

The torch static forms (:meth:`Experts._gather`, :meth:`Experts._dense`) either copy every pair's
weights out of the expert stack (~3x the pair's bytes moved) or run every expert on every row; which
one depends on the step's shape. On the H200 the qwen3.5-35b-a3b shape's padded 16-row step (plain
decoding's, one real row) ran the dense form: 23.4 ms against 7.4 ms for a 1-row step. Here:

- ``_gate_up_kernel``: program ``(pair, block of BN intermediate channels)`` computes the pair's gate
  and up rows, walking the hidden size in BK blocks in order, then ``act(gate) * up`` with the torch
  form's roundings (gate and up rounded to the model dtype, the activation rounded, the product rounded);
- ``_down_kernel``: program ``(pair, block of BN hidden channels)``: the pair's down projection.

A pair's bits depend on its row and its expert only: never on the other rows, their experts or the
row count (per-row invariance, whatever the step's shape). Rows at or past ``live`` (a static step's
padding, :class:`~specdec.models.base.StepContext`) read no weights and give zeros.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

try:  # Triton ships with CUDA builds of torch; CPU-only installs have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

ENABLED = os.environ.get("SPECDEC_EXPERT_KERNEL", "1") != "0"
BN, BK = 16, 256  # rows of a weight and features of the input a program step holds


def usable(x: torch.Tensor, act) -> bool:
    """Whether the kernels can run: enabled, Triton, a CUDA tensor, a SiLU-gated expert."""
    return ENABLED and triton is not None and x.is_cuda and act is F.silu


if triton is not None:
    @triton.jit
    def _pads(t, live, LIVE: tl.constexpr):
        # whether row t pads a static step (at or past its live rows); no row does without LIVE
        if LIVE:
            return t >= tl.load(live)
        else:
            return t < 0

    @triton.jit
    def _gate_up_kernel(x, idx, w, h, live, K, H, INTER, LIVE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        p = tl.program_id(0)
        nb = tl.program_id(1)
        t = p // K
        rn = nb * BN + tl.arange(0, BN)
        nm = rn < INTER
        if _pads(t, live, LIVE):
            tl.store(h + p * INTER + rn, tl.zeros([BN], dtype=tl.float32).to(h.dtype.element_ty), mask=nm)
        else:
            e = tl.load(idx + p).to(tl.int64)
            base = w + e * (2 * INTER) * H
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
            dt = h.dtype.element_ty
            g = acc_g.to(dt).to(tl.float32)
            a = (g * tl.sigmoid(g)).to(dt).to(tl.float32)
            tl.store(h + p * INTER + rn, (a * acc_u.to(dt).to(tl.float32)).to(dt), mask=nm)

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
            base = w + e * H * INTER
            acc = tl.zeros([BN], dtype=tl.float32)
            for k0 in range(0, INTER, BK):
                rk = k0 + tl.arange(0, BK)
                km = rk < INTER
                hv = tl.load(hin + p * INTER + rk, mask=km, other=0.0).to(tl.float32)
                wd = tl.load(base + rn[:, None] * INTER + rk[None, :], mask=nm[:, None] & km[None, :], other=0.0)
                acc += tl.sum(wd.to(tl.float32) * hv[None, :], axis=1)
            tl.store(y + p * H + rn, acc.to(y.dtype.element_ty), mask=nm)


def pairs(x: torch.Tensor, idx: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
          live: torch.Tensor | None = None) -> torch.Tensor:
    """Each (row, expert) pair's output ``[T, k, H]``: ``x [T, H]``, ``idx [T, k]`` (expert ids),
    ``gate_up [E, 2I, H]``, ``down [E, H, I]``; ``live`` (0-d int64 device tensor): rows from it on
    give zeros (None: every row is real)."""
    t, k = idx.shape
    e, two_i, hidden = gate_up.shape
    inter = two_i // 2
    x, idx = x.contiguous(), idx.contiguous()
    has_live = live is not None
    live = live if has_live else idx  # a stand-in pointer, never read without LIVE
    h = torch.empty(t * k, inter, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(t * k, triton.cdiv(inter, BN))](x, idx, gate_up, h, live, k, hidden, inter, LIVE=has_live,
                                                     BN=BN, BK=BK)
    y = torch.empty(t * k, hidden, dtype=x.dtype, device=x.device)
    _down_kernel[(t * k, triton.cdiv(hidden, BN))](h, idx, down, y, live, k, hidden, inter, LIVE=has_live,
                                                   BN=BN, BK=BK)
    return y.view(t, k, hidden)
