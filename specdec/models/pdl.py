"""Programmatic dependent launch (PDL) for the Triton kernels of a CUDA step (issue 10; Hopper and later).

A SmolLM2 16-row step is ~8 small kernels a layer, and under a CUDA graph each still waits for the one
before it to finish and flush before its own blocks are scheduled. With PDL the step's
Triton kernels (the fused layer's GEMM, fused_ops' norm and SwiGLU product, RoPE + the cache write, the
split attention and its combine, the MoE block's routing, gate/up and combine kernels, the Gated DeltaNet's
three step kernels) are launched with CUDA's programmatic stream serialization and begin
with ``griddepcontrol.launch_dependents`` then ``griddepcontrol.wait``: the next kernel's blocks may be
scheduled while this one runs, and each waits, before its first memory access, for the kernel before it
to complete and its writes to be visible. Every load and store stays after that wait, so what a kernel
reads and writes, and so every bit, is what it was; only the launch gaps can shrink. The fused layer's
GEMM (and the MoE kernels, for the shared expert's weights) also issues L2 prefetches of its own weight rows
before the wait (weights never depend on the kernel before): an early-launched GEMM pulls them in while the kernel before it still runs. (Kernels launched
without the attribute, cuBLAS's and torch's, are serialized as before.) On by default since measured
(H200, ``scripts/ab_flags.py``, one process, medians of 3-5 rounds): the qwen3-8b-shape 16-row step
5.447 -> 5.321 ms, SmolLM2's 1.005 -> 1.000 ms (one split) and 1.261 -> 1.229 (two splits); a random
Llama and Qwen3.5 decoded with it gave plain decoding's tokens (``scripts/device_check.py``).
``SPECDEC_PDL=0`` turns it off.

Measured and removed (session of 2026-12-06 (fifth), H100; the code at ffc55ab): an L2 look-ahead, a kernel
early among a mixer's small kernels pulling the output projection's weight into L2 (and the MoE gate/up kernel
its row's down projections). The qwen3.5-35b-a3b 1-row step went 3.641 -> 3.806 ms (out), 3.946 (both): the
2048-wide projections and the MoE combine took as long with their weights in L2 (7.7-8.7 and 10-12.6 us), so
what they wait on is not the memory bus, and the look-ahead's kernel only added its own time.
"""

from __future__ import annotations

import os

import torch
from .. import env

try:  # Triton ships with CUDA builds of torch; CPU-only installs have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

ENABLED = env.switch("SPECDEC_PDL")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's interpreter runs no PTX


def options(x: torch.Tensor) -> dict:
    """The launch keywords of a kernel whose inputs live with ``x``: ``USE_GDC`` (the kernel's
    constexpr) and Triton's ``launch_pdl``, on where PDL runs (CUDA, compute capability 9 or more,
    not Triton's interpreter), else ``USE_GDC=False`` alone."""
    on = ENABLED and x.is_cuda and not INTERPRETED and _hopper(x.device)
    return {"USE_GDC": True, "launch_pdl": True} if on else {"USE_GDC": False}


def l2_lines(n: int, element_size: int) -> tuple[int, int]:
    """``(PER_LINE, LINES)`` for :func:`rows_to_l2`: the elements of a 128-byte line, and the power of two of
    lines that covers a row of ``n`` elements."""
    per_line = 128 // element_size
    return per_line, 1 << max(-(-n // per_line) - 1, 0).bit_length()


_CAPABLE: dict = {}


def _hopper(device: torch.device) -> bool:
    if device not in _CAPABLE:
        _CAPABLE[device] = torch.cuda.get_device_capability(device)[0] >= 9
    return _CAPABLE[device]


if triton is not None:
    @triton.jit
    def to_l2(ptrs):
        """``prefetch.global.L2`` of the line each pointer falls in (the fused layer's GEMM, before its wait)."""
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def rows_to_l2(base, rows, n, PER_LINE: tl.constexpr, LINES: tl.constexpr):
        """:func:`to_l2` of every line of rows ``rows`` of a row-major ``[*, n]`` weight at ``base`` (a kernel's
        weight rows, before its wait: weights never depend on the kernel before); rows and lines past the
        weight's are the caller's to clamp (rows) or clamped here to the row's last element (lines)."""
        line = tl.minimum(tl.arange(0, LINES) * PER_LINE, n - 1)
        to_l2(base + rows[:, None] * n + line[None, :])

    @triton.jit
    def begin():
        """A kernel's first statement under ``USE_GDC``: let the next kernel launch, then wait for the
        one before to complete (before any global access)."""
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
