"""The package's Triton kernels on the CPU, each run by tests/test_triton_interpret.py in a fresh process:

- ``split``, ``delta``, ``linear``: run by Triton's interpreter (``TRITON_INTERPRET=1``) against
  their torch references, plus the invariances the split attention kernel promises. The interpreter
  computes with numpy (its bf16 rounding is not the GPU's), so values are compared with a tolerance;
  the GPU's bits are checked on the GPU (scripts/check_split_attention.py, scripts/device_check.py);
- ``rope-ptx`` (interpreter off): the fused RoPE + KV write compiled for sm_90 as it is launched, its
  PTX free of FMAs (the eager ops round each product before the sum).

    TRITON_INTERPRET=1 PYTHONPATH=.cache/triton python tests/_interpret_kernels.py split|delta|linear
    PYTHONPATH=.cache/triton python tests/_interpret_kernels.py rope-ptx
Prints one line per case and exits 1 on the first failure.
"""

import os
import sys

import numpy as np
import torch

if os.environ.get("TRITON_INTERPRET") == "1":
    import triton.runtime.interpreter as interp

    # Triton 3.6's interpreter turns a scalar argument into a 1-element array and then calls int()
    # on it, which numpy >= 2.4 refuses ("only 0-dimensional arrays can be converted"): take its element.
    _patch_tensor = interp._patch_lang_tensor

    def _patched(tensor, scope):
        _patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interp._patch_lang_tensor = _patched

from specdec.models import split_attention as sa  # noqa: E402  (after the patch: kernels are built at import)


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        sys.exit(1)


def _attn_case(b, h, hkv, d, t, span, starts, window=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, d, generator=g).half().transpose(1, 2)  # the model's layout: a view of [B, T, H, d]
    k = torch.randn(b, hkv, span, d, generator=g).half()
    v = torch.randn(b, hkv, span, d, generator=g).half()
    pos = torch.tensor(starts)[:, None] + torch.arange(t)[None, :]
    mask = torch.arange(span)[None, None, :] <= pos[:, :, None]
    if window:
        mask &= torch.arange(span)[None, None, :] > pos[:, :, None] - window
    return q, k, v, mask[:, None]


def _kernel(q, k, v, mask, scale):
    return sa._launch(q, k, v, mask, scale).transpose(1, 2)


def split() -> None:
    """Against the reference; a row's bits with dead keys and splits appended (past COMBINE splits
    too), and alone against within a step of several rows."""
    many = sa.SPLIT * (sa.COMBINE + 2)  # more splits than one combine chunk
    cases = [("smollm2 heads", (2, 9, 3, 64, 5, 700, [3, 690])),
             ("qwen3-8b heads", (1, 32, 8, 128, 2, 300, [200])),
             ("qwen3.5 heads (d 256)", (1, 16, 4, 256, 2, 300, [150])),
             ("chunks", (2, 4, 2, 16, 3, many, [many - 3, 40])),
             ("window", (2, 4, 2, 16, 4, many, [many - 4, 1000]))]
    for name, (b, h, hkv, d, t, span, starts) in cases:
        q, k, v, mask = _attn_case(b, h, hkv, d, t, span, starts, window=700 if name == "window" else 0)
        scale = d ** -0.5
        got = _kernel(q, k, v, mask, scale)
        ref = sa.split_attention_reference(q, k, v, mask, scale)
        err = (got.float() - ref.float()).abs().max().item()
        check(f"split {name}: equals the reference", err < 4e-3, f"(max diff {err:.2e})")
        k2, v2 = torch.cat([k, torch.randn_like(k)], 2), torch.cat([v, torch.randn_like(v)], 2)
        mask2 = torch.cat([mask, torch.zeros_like(mask)], -1)
        check(f"split {name}: dead keys appended change no bit", torch.equal(got, _kernel(q, k2, v2, mask2, scale)))
        alone = _kernel(q[:1, :, -1:].contiguous().view(1, 1, h, d).transpose(1, 2), k[:1], v[:1], mask[:1, :, -1:], scale)
        check(f"split {name}: a row alone has its bits within the step", torch.equal(alone, got[:1, :, -1:]))


def delta() -> None:
    """The fused recurrent Gated DeltaNet kernel against the torch recurrence."""
    from specdec.models.deltanet import recurrent_gated_delta
    from specdec.models.delta_kernel import recurrent_gated_delta_fused
    g = torch.Generator().manual_seed(0)
    t, h, dk, dv = 5, 3, 16, 24
    q, k = (torch.nn.functional.normalize(torch.randn(t, h, dk, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(t, h, dv, generator=g)
    gate = -torch.rand(t, h, generator=g)
    beta = torch.rand(t, h, generator=g)
    state = torch.randn(h, dk, dv, generator=g) * 0.1
    out, states = recurrent_gated_delta_fused(q, k, v, gate, beta, state)
    ref_out, ref_states = recurrent_gated_delta(q, k, v, gate, beta, state)
    err = max((out - ref_out).abs().max().item(), (states - ref_states).abs().max().item())
    check("delta: outputs and per-position states equal the torch recurrence", err < 1e-4, f"(max diff {err:.2e})")


def linear() -> None:
    """The row-count-invariant GEMM against F.linear, and a row's bits at every row count."""
    from specdec.models.invariant_linear import config_for, run_kernel
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 96, generator=g).half()
    w = torch.randn(80, 96, generator=g).half()
    y = run_kernel(x, w, config_for(40))
    err = (y.float() - (x.float() @ w.float().T)).abs().max().item()
    check("linear: equals x @ w.T", err < 0.05, f"(max diff {err:.2e})")
    check("linear: rows 0..7 alone have their bits among 40", torch.equal(run_kernel(x[:8], w, config_for(40)), y[:8]))


def rope_ptx() -> None:
    """The fused RoPE + KV write as launched (its COMPILE_OPTIONS), compiled for an H100/H200 (sm_90):
    each product rounded (``mul.rn``), then the sum (``add.rn``); no FMA, which would skip the product's
    rounding (Triton's default contraction did, on the H200)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from specdec.models import rope_write as rw
    fn = rw._rope_write_kernel
    ptrs = {"q": "*bf16", "k": "*bf16", "v": "*bf16", "cos": "*bf16", "sin": "*bf16", "q_out": "*bf16",
            "ck": "*bf16", "cv": "*bf16", "slots": "*i64", "pos": "*i64"}
    const = {"R": 64, "HALF": 32, "D": 128}  # a partial rotary: both the rotated and the copied lanes
    sig = {n: ptrs.get(n, "constexpr" if n in const else "i32") for n in fn.arg_names}
    ptx = triton.compile(ASTSource(fn, sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                         options=dict(rw.COMPILE_OPTIONS)).asm["ptx"]
    check("rope-ptx: the product is rounded (mul.rn.bf16)", "mul.rn.bf16" in ptx)
    check("rope-ptx: then the sum (add.rn.bf16)", "add.rn.bf16" in ptx)
    check("rope-ptx: no FMA", "fma" not in ptx)


if __name__ == "__main__":
    {"split": split, "delta": delta, "linear": linear, "rope-ptx": rope_ptx}[sys.argv[1]]()
