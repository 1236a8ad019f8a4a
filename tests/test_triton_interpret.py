"""The Triton kernels themselves, on the CPU: tests/_interpret_kernels.py runs each in Triton's
interpreter (``TRITON_INTERPRET=1``, a fresh process with the Triton that ``make test`` installs at
.cache/triton, apart from the venv's CPU torch) against its torch reference: the split attention
kernel (and its invariances: dead keys and splits appended, a row alone), the fused recurrent Gated
DeltaNet kernel and the DeltaNet step on the cache (conv and gates, the recurrence in place, the gated norm), the routed experts' GEMVs, a MoE layer's add and norm with its router's GEMM (and a tiny Qwen3.5 MoE target on it), the row-count-invariant GEMM, the fused RoPE + KV write (one sequence and batched) and the fused
RMSNorm (with its residual add) and SwiGLU product, the fused layer's GEMM (norm prologue, SwiGLU epilogue); and the fused RoPE + KV write compiled for sm_90,
its PTX free of FMAs; with PDL on, three kernels' PTX waits before its first global access. The GPU's bits are checked on the GPU."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TRITON_DIR = Path(os.environ.get("SPECDEC_TRITON_DIR", ROOT / ".cache" / "triton"))


@pytest.mark.parametrize("kernel", ["split", "delta", "delta-step", "experts", "moe", "norm-router", "linear", "rope", "fused", "fused-layer", "hybrid-fused", "gemma-fused", "gemma4-moe", "gemma4-fused", "gemma4-small-fused", "dflash-fast", "mtp-fast", "rope-ptx", "pdl-ptx"])
def test_kernel_on_the_cpu(kernel):
    if not (TRITON_DIR / "triton" / "__init__.py").is_file():
        pytest.fail(f"no Triton for the interpreter at {TRITON_DIR}: `make test` installs it "
                    f"(or set SPECDEC_TRITON_DIR to a folder holding the triton package)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TRITON_DIR), str(ROOT)])}
    env.pop("TRITON_INTERPRET", None)
    if not kernel.endswith("-ptx"):  # the interpreter; the -ptx cases compile for the GPU instead
        env["TRITON_INTERPRET"] = "1"
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "_interpret_kernels.py"), kernel], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert lines and all(line.startswith("ok ") for line in lines), run.stdout
