"""Registers and spills of the MoE step's Triton kernels at given tiles, on the CPU: each kernel compiled for sm_90a
(PTX) and assembled by the ptxas Triton ships (``ptxas -v``). A kernel whose threads need many registers fits few
warps an SM (65,536 registers an SM on Hopper): the qwen3.5-35b-a3b block's one-shot combine (2,048 one-warp
programs at 255 registers, spilling) fits 8 warps an SM, two waves. No GPU, no timing: what occupancy a tiling allows.

    PYTHONPATH=.cache/triton:. python scripts/kernel_regs.py [--sm 90]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile


def ptxas_report(fn, ptrs: dict, const: dict, warps: int, sm: int) -> tuple[int, int]:
    """(registers a thread, spill-store bytes) of ``fn`` built with these constexprs and ``warps``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    const = {**const, "USE_GDC": True}
    sig = {n: ptrs.get(n, "constexpr" if n in const else "i32") for n in fn.arg_names}
    k = triton.compile(ASTSource(fn, sig, constexprs=const), target=GPUTarget("cuda", sm, 32),
                       options={"num_warps": warps})
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    try:
        out = subprocess.run([ptxas, f"-arch=sm_{sm}a", "-v", f.name, "-o", os.devnull], capture_output=True,
                             text=True, check=True).stderr
    finally:
        os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes spill stores", out)
    return int(regs.group(1)) if regs else -1, int(spill.group(1)) if spill else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sm", type=int, default=90, help="compute capability (default 90: Hopper)")
    a = ap.parse_args(argv)
    try:
        from specdec.models import expert_kernel as ek
        if ek.triton is None:
            raise ImportError("no triton")
    except ImportError as err:
        sys.exit(f"kernel_regs: Triton is needed ({err}); PYTHONPATH=.cache/triton:. after `make triton`")
    bf = {n: "*bf16" for n in ("hin", "wts", "w", "sw", "y", "x", "h", "logits", "pes")}
    ptrs = bf | {"idx": "*i32", "live": "*i64"}
    # the qwen3.5-35b-a3b block: 2,048 hidden, 512-wide experts, top 8 and a shared expert
    cases = [(f"combine one-shot {t}", ek._combine_kernel, {"K": 8, "P": 9, "LIVE": True, "BN": t[0], "BK": t[1],
                                                           "PC": t[3], "PER_LINE": 64, "LINES": 8}, t[2])
             for t in (ek.COMBINE_TILE, (1, 256, 1, 16))]
    cases += [(f"combine persistent (BN {bn}, {w} warps)", ek._combine_stream_kernel,
               {"K": 8, "SHARED": True, "LIVE": True, "BN": bn, "BI": 512, "KP": 8}, w) for bn, w in ((1, 4), (2, 4))]
    g = ek.GATE_UP_TILE
    cases.append((f"gate/up {g}", ek._gate_up_kernel, {"LIVE": True, "BN": g[0], "BK": g[1], "PER_LINE": 64,
                                                       "LINES": 32, "GELU": False}, g[2]))
    cases.append((f"routing ({ek.ROUTE_WARPS} warps)", ek._route_kernel, {"LIVE": True, "SHARED": True, "K": 8, "KB": 16,
                                                                          "BE": 256, "SCALED": False}, ek.ROUTE_WARPS))
    print(f"sm_{a.sm}a | kernel | registers a thread | spill stores (bytes) | warps | its programs an SM (registers)")
    for name, fn, const, warps in cases:
        regs, spill = ptxas_report(fn, ptrs, const, warps, a.sm)
        fit = 65536 // max(1, regs * 32 * warps) if regs > 0 else 0
        print(f"| {name} | {regs} | {spill} | {warps} | {fit} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
