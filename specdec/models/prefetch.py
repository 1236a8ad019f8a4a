"""The next layer's weights pulled into the GPU's L2 cache while this layer runs (issue 10).

A SmolLM2 step reads 212 MB of layer weights, far more than the H200's L2 (50 MB), so every GEMM of
a step finds its weights in HBM; its few programs (16 to 96 for 16 rows) then wait out HBM latency
a block at a time. In isolation, with the weights hot in L2, the fused layer's four GEMMs took
2.4-3.8 us (``scripts/check_fused_layer.py``), against ~37 us a layer in the step. With
``SPECDEC_L2_PREFETCH=1`` a fused-layer model's forward forks a side stream before each layer that
issues ``prefetch.global.L2`` for every 128-byte line of the next layer's four weights (7.1 MB for
SmolLM2), and joins it at the end of the forward: under a CUDA graph the prefetches are a parallel
branch, on a few SMs the latency-bound main chain leaves idle. Only caches change: every kernel reads
and writes what it did, so the bits do not. Off until measured on the GPU.
"""

from __future__ import annotations

import os

import torch

try:  # Triton ships with CUDA builds of torch; CPU-only installs have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

ENABLED = os.environ.get("SPECDEC_L2_PREFETCH", "0") == "1"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's interpreter runs no PTX
LINE = 128  # bytes a prefetch covers
BLOCK = 256  # lines a program prefetches

if triton is not None:
    @triton.jit
    def to_l2(ptrs):
        """``prefetch.global.L2`` of the line each pointer falls in (also the fused layer's GEMM's, under PDL)."""
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _kernel(p, n_lines, PER_LINE: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        i = tl.minimum(i, n_lines - 1).to(tl.int64)  # lanes past the end prefetch the last line again
        to_l2(p + i * PER_LINE)


def enabled_for(x: torch.Tensor) -> bool:
    """Whether a forward on ``x`` prefetches (on, CUDA, not Triton's interpreter, not compiling)."""
    return ENABLED and triton is not None and x.is_cuda and not INTERPRETED and not torch.compiler.is_compiling()


_STREAMS: dict = {}


def _side(device: torch.device) -> torch.cuda.Stream:
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]


def fork(weights: list[torch.Tensor]) -> None:
    """Prefetch ``weights`` into L2 on the side stream, after what the current stream has queued."""
    dev = weights[0].device
    side = _side(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for w in weights:
            per_line = LINE // w.element_size()
            lines = -(-w.numel() // per_line)
            _kernel[(triton.cdiv(lines, BLOCK),)](w, lines, PER_LINE=per_line, BLOCK=BLOCK, num_warps=4)


def join(device: torch.device) -> None:
    """The current stream waits for the side stream's prefetches (before a forward ends, so that a
    captured graph's branch rejoins it)."""
    if device in _STREAMS:
        torch.cuda.current_stream(device).wait_stream(_STREAMS[device])
