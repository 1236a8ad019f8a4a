"""The package's Triton kernels on the CPU, each run by tests/test_triton_interpret.py in a fresh process:

- ``split``, ``delta``, ``linear``, ``rope``, ``fused``, ``fused-layer``, ``dflash-fast``, ``mtp-fast``,
  ``gemma4-moe``, ...: run by Triton's interpreter (``TRITON_INTERPRET=1``) against
  their torch references, plus the invariances the split attention kernel promises. The interpreter
  computes with numpy (its bf16 rounding is not the GPU's), so values are compared with a tolerance;
  the GPU's bits are checked on the GPU (scripts/check_split_attention.py, scripts/device_check.py);
- ``rope-ptx``, ``pdl-ptx`` (interpreter off): the RoPE kernels compiled for sm_90 as they are launched, their
  PTX free of FMAs (the eager ops round each product before the sum); the PDL kernels' wait before any access.

    TRITON_INTERPRET=1 PYTHONPATH=.cache/triton python tests/_interpret_kernels.py split|delta|linear|rope|fused|fused-layer|...
    PYTHONPATH=.cache/triton python tests/_interpret_kernels.py rope-ptx|pdl-ptx
Prints one line per case and exits 1 on the first failure.
"""

import copy
import dataclasses
import itertools
import os
import sys
import types

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

    # The interpreter computes tl.dot by np.matmul, i.e. by the machine's BLAS, whose blocking (and
    # threading) picks per shape, core type and thread count how each output's sum is ordered: on a
    # 2-core AMD EPYC with numpy 2.3-2.4 a row's bits changed with the rows beside it, which says
    # nothing of the kernel on a GPU. Here a dot sums each output in float64 (products of fp32 values
    # are exact there) by einsum's own loops, the same order for every row, and rounds once.
    _builder = interp.InterpreterBuilder

    def _row_wise_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:  # fp8: none here
            return _plain_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        prod = np.einsum("...ik,...kj->...ij", a.data.astype(np.float64), b.data.astype(np.float64))
        return interp.TensorHandle(prod.astype(d.data.dtype) + d.data, d.dtype.scalar)

    _plain_dot = _builder.create_dot
    _builder.create_dot = _row_wise_dot

    # The interpreter patches triton.language (inspect.getmembers over tl, tl.tensor, tl.math) at each kernel
    # launch and again at each @triton.jit helper's call inside it, a program at a time: a sixth of a case's time.
    # Inside a launch the language is patched already (the launch restores it when it ends), so a helper's call
    # whose language modules the launch patched skips it. Speed only: every op runs as before.
    _patch_lang = interp._patch_lang
    _launches: list = []  # each running launch: the language modules patched in it so far
    _langs_of: dict = {}

    def _langs(fn) -> set:
        langs = _langs_of.get(fn)
        if langs is None:
            langs = _langs_of[fn] = {v for v in fn.__globals__.values() if v is interp.tl or v is interp.tl.core}
        return langs

    def _patch_lang_once(fn):
        if _launches and _langs(fn) <= _launches[-1]:
            return interp._LangPatchScope()
        scope = _patch_lang(fn)
        if _launches:  # (a helper's patch is never restored: it holds to the launch's end and beyond)
            _launches[-1] |= _langs(fn)
        return scope

    _launch = interp.GridExecutor.__call__

    def _counted_launch(self, *args, **kwargs):
        _launches.append(set())
        try:
            return _launch(self, *args, **kwargs)
        finally:
            _launches.pop()

    interp._patch_lang = _patch_lang_once
    interp.GridExecutor.__call__ = _counted_launch

    # Each integer op also checks for int32 overflow by redoing it in int64 (three ops more, a third of a case's
    # time). The cases' tensors hold thousands of elements, their offsets nowhere near 2**31: the check could not
    # fire here. Off; the integer ops themselves are unchanged.
    interp.interpreter_builder.options = dataclasses.replace(interp.interpreter_builder.options,
                                                             sanitize_overflow=False)

from specdec.models import split_attention as sa  # noqa: E402  (after the patch: kernels are built at import)


# The model cases' MoE blocks (hidden 64, experts 32 wide) on tiles of few programs: the interpreter's time goes by
# programs, not elements, and the default combine tile's one channel a program made it most of a case's time. The
# default tiles themselves are ``moe``'s (and a shape's SHAPE_TILES, as these are, its own).
FEW_MOE_PROGRAMS = {(64, 32): ((16, 64, 4), (16, 32, 4, 4))}


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
    many = sa.split_keys(16) * (sa.COMBINE + 2)  # more splits than one combine chunk
    s128 = sa.split_keys(128)  # heads of 128 (split_keys): three splits, the combine, and a window across them
    three = 3 * s128 - s128 // 2
    cases = [("smollm2 heads", (2, 9, 3, 64, 5, 700, [3, 690]), 0),
             ("qwen3-8b heads", (1, 32, 8, 128, 2, 300, [200]), 0),
             ("qwen3-8b heads, one query", (1, 32, 8, 128, 1, 300, [290]), 0),  # 4 rows: the combine's small cut
             ("qwen3.5 heads (d 256)", (1, 16, 4, 256, 2, 300, [150]), 0),
             ("gemma4 full heads (d 512)", (1, 16, 2, 512, 2, 300, [150]), 0),
             ("heads of 128, three splits", (1, 8, 4, 128, 2, three, [three - 100]), 0),
             ("heads of 128, three splits, window", (1, 8, 4, 128, 2, three, [three - 100]), s128 + 40),
             ("chunks", (2, 4, 2, 16, 3, many, [many - 3, 40]), 0),
             ("window", (2, 4, 2, 16, 4, many, [many - 4, 1000]), 700)]
    for name, (b, h, hkv, d, t, span, starts), window in cases:
        q, k, v, mask = _attn_case(b, h, hkv, d, t, span, starts, window=window)
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
        # sa.PIPELINE: a split's blocks walked to its last seen one without a branch a block (blocks no row sees,
        # a window's, walked too) against the walk that skips each unseen block
        saved_pipe, sa.PIPELINE = sa.PIPELINE, not sa.PIPELINE
        try:
            other = _kernel(q, k, v, mask, scale)
        finally:
            sa.PIPELINE = saved_pipe
        check(f"split {name}: the pipelined walk has the branching walk's bits", torch.equal(got, other))
    # sa.schedule's tiers: 256-key splits over the first 512 positions, 512-key ones to 1,536, 1,024-key ones past them
    # (six splits: a far split cut by the span, a window across the tiers' boundaries and across two far splits)
    saved_far, sa.FAR = sa.FAR, {16: (512, 512, 1536, 1024)}
    try:
        span = 2800
        check("split far: six splits", len(sa.split_bounds(span, 16)) == 6 == sa.n_splits(span, *sa.schedule(16)))
        for name, starts, window in [("far", [span - 3, 300], 0), ("far, window", [1800, 2700], 700)]:
            q, k, v, mask = _attn_case(2, 4, 2, 16, 3, span, starts, window=window)
            got = _kernel(q, k, v, mask, 0.25)
            err = (got.float() - sa.split_attention_reference(q, k, v, mask, 0.25).float()).abs().max().item()
            check(f"split {name}: equals the reference", err < 4e-3, f"(max diff {err:.2e})")
            sa.FAR = {}
            one_size = _kernel(q, k, v, mask, 0.25)
            sa.FAR = {16: (512, 512, 1536, 1024)}
            check(f"split {name}: other bits than one split size (the schedule is used)", not torch.equal(got, one_size))
            k2, v2 = torch.cat([k, torch.randn_like(k)], 2), torch.cat([v, torch.randn_like(v)], 2)
            mask2 = torch.cat([mask, torch.zeros_like(mask)], -1)
            check(f"split {name}: dead keys appended change no bit", torch.equal(got, _kernel(q, k2, v2, mask2, 0.25)))
            alone = _kernel(q[:1, :, -1:].contiguous().view(1, 1, 4, 16).transpose(1, 2), k[:1], v[:1], mask[:1, :, -1:], 0.25)
            check(f"split {name}: a row alone has its bits within the step", torch.equal(alone, got[:1, :, -1:]))
    finally:
        sa.FAR = saved_far
    # a span of one split: the direct launch (no combine, sa.DIRECT) writes the combine's bits
    saved = sa.DIRECT
    try:
        for name, (b, h, hkv, d, t, span, starts) in [("smollm2 heads", (2, 9, 3, 64, 4, 200, [3, 190])),
                                                         ("qwen3-8b heads", (1, 32, 8, 128, 3, sa.split_keys(128), [250])),
                                                         ("qwen3.5 heads (d 256)", (1, 16, 4, 256, 2, sa.split_keys(256), [40])),
                                                         ("gemma4 full heads (d 512)", (1, 16, 2, 512, 1, sa.split_keys(512), [40]))]:
            q, k, v, mask = _attn_case(b, h, hkv, d, t, span, starts)
            scale = d ** -0.5
            sa.DIRECT = False
            two = _kernel(q, k, v, mask, scale)
            sa.DIRECT = True
            one = _kernel(q, k, v, mask, scale)
            check(f"split one split, {name}: the direct launch has the combine's bits", torch.equal(one, two))
            check(f"split one split, {name}: one split, then two", span <= sa.split_keys(d) < 2 * span)
            k2, v2 = torch.cat([k, torch.randn_like(k)], 2), torch.cat([v, torch.randn_like(v)], 2)
            mask2 = torch.cat([mask, torch.zeros_like(mask)], -1)  # two splits: the combine runs
            check(f"split one split, {name}: equals the two-split launch", torch.equal(one, _kernel(q, k2, v2, mask2, scale)))
    finally:
        sa.DIRECT = saved
    split_gated()


def split_gated() -> None:
    """Gated attention's gate in the kernel that writes the output (layers.GATE_IN_SPLIT): the combine's and the
    direct launch's outputs against the ungated output times torch's sigmoid (the torch ops' roundings) and the
    gated reference; the two launches' bits equal; a row alone has its bits within the step."""
    saved = sa.DIRECT
    try:
        for name, (b, h, hkv, d, t, span, starts) in [("qwen3.5 heads (d 256)", (1, 8, 2, 256, 2, sa.split_keys(256), [40])),
                                                         ("two sequences, heads of 64", (2, 6, 3, 64, 3, 200, [3, 190]))]:
            q, k, v, mask = _attn_case(b, h, hkv, d, t, span, starts)
            # the gate as the projection gives it: a view of [B, T, H, 2d] (each head's query, then its gate)
            gate = torch.randn(b, t, h, 2 * d, generator=torch.Generator().manual_seed(3)).half()[..., d:]
            scale = d ** -0.5
            k2, v2 = torch.cat([k, torch.randn_like(k)], 2), torch.cat([v, torch.randn_like(v)], 2)
            mask2 = torch.cat([mask, torch.zeros_like(mask)], -1)  # two splits: the combine runs
            for direct in (True, False):
                sa.DIRECT = direct
                got = sa._launch(q, k, v, mask, scale, gate).transpose(1, 2)
                want = _kernel(q, k, v, mask, scale) * torch.sigmoid(gate.transpose(1, 2))
                err = (got.float() - want.float()).abs().max().item()
                differ = (got != want).sum().item()
                check(f"split gated {name}, direct {direct}: the ungated output times torch's sigmoid",
                      err <= 1e-3 and differ <= want.numel() // 1000, f"(max diff {err:.1e}, {differ} of "
                      f"{want.numel()} differ)")
                ref = sa.split_attention_reference(q, k, v, mask, scale, gate=gate)
                err = (got.float() - ref.float()).abs().max().item()
                check(f"split gated {name}, direct {direct}: equals the gated reference", err < 4e-3,
                      f"(max diff {err:.2e})")
                two = sa._launch(q, k2, v2, mask2, scale, gate).transpose(1, 2)
                check(f"split gated {name}, direct {direct}: the combine's bits (two splits)", torch.equal(got, two))
                alone = sa._launch(q[:1, :, -1:].contiguous().view(1, 1, h, d).transpose(1, 2), k[:1], v[:1],
                                   mask[:1, :, -1:], scale, gate[:1, -1:]).transpose(1, 2)
                check(f"split gated {name}, direct {direct}: a row alone has its bits within the step",
                      torch.equal(alone, got[:1, :, -1:]))
    finally:
        sa.DIRECT = saved
    try:
        sa.split_attention(*_attn_case(1, 4, 2, 16, 2, 40, [5])[:3], _attn_case(1, 4, 2, 16, 2, 40, [5])[3], 0.25,
                           torch.zeros(1, 2, 4, 8).half())
        check("split gated: a gate of the wrong shape refused", False)
    except ValueError as e:
        check("split gated: a gate of the wrong shape refused", "gate (1, 2, 4, 8)" in str(e), f"({e})")


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


def delta_step() -> None:
    """deltanet.GatedDeltaNet.step_fused (delta_kernel's step kernel, or conv_gates then recurrent_into_cache, then
    gated_norm) against the layer's torch form on the same cache: outputs, and the conv inputs and per-position
    states the cache's rings keep, across a rollback (the next step starting at a length inside the last); each
    kernel on rings that wrap (taps, inputs and states past the rings' ends); a static step's padding rows; a
    row's bits in a 5-row step equal its bits as a 1-row step, for both forms."""
    from types import SimpleNamespace

    from specdec.models import delta_kernel
    from specdec.models.deltanet import GatedDeltaNet
    torch.manual_seed(0)
    hidden, hk, hv, dk, dv, ks = 32, 2, 4, 16, 16, 4
    layer = GatedDeltaNet(hidden, hk, hv, dk, dv, ks, 1e-6).half()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        layer.A_log.copy_(torch.rand(hv) - 1)  # g = -exp(A_log) * softplus(.): gates of a trained layer's size
        layer.dt_bias.copy_(torch.randn(hv) * 3 - 1)  # softplus on both sides of 0 and past its threshold
    layer.fuse()  # one in-projection GEMM: the kernels read its outputs as column slices (strided rows)
    xs = [torch.randn(n, hidden).half() for n in (3, 5, 4, 5)]

    def run(fused: bool, xs, rollback=1):
        cache = layer.make_cache(torch.float16, "cpu", snapshot_tokens=8)
        cache.reserve_rows(5)  # rings of 8 conv rows and 6 states: the steps below wrap them
        outs = []
        for i, x in enumerate(xs):
            t, pos = x.shape[0], cache.length
            with torch.no_grad():
                if fused:
                    outs.append(layer.step_fused(*layer.project(x), cache, pos))
                    cache.commit(pos, t, True)
                else:
                    outs.append(layer(x, SimpleNamespace(start=pos, snapshots=True, live=None), cache))
            if i < len(xs) - 1:
                cache.rollback(pos + rollback + i % 2)
        return outs, cache

    ref, ref_cache = run(False, xs)
    one = delta_kernel.ONE_KERNEL
    for form in (True, False):
        delta_kernel.ONE_KERNEL = form
        name = "one kernel" if form else "two kernels"
        out, cache = run(True, xs)
        err = max((a.float() - b.float()).abs().max().item() for a, b in zip(out, ref))
        scale = max(b.float().abs().max().item() for b in ref)
        check(f"delta-step ({name}): outputs equal the torch form's (one fp16 step at the largest)", err <= scale / 512,
              f"(max diff {err:.2e}, scale {scale:.2e})")
        serr = max((cache.state(n) - ref_cache.state(n)).abs().max().item() for n in range(cache.base, cache.length + 1))
        check(f"delta-step ({name}): the state at every length of the last step, in the ring", serr < 2e-3,
              f"(max diff {serr:.2e})")
        check(f"delta-step ({name}): the conv window at every length of the last step, in the ring",
              all(torch.equal(cache.conv_window(n), ref_cache.conv_window(n)) for n in range(cache.base, cache.length + 1)))
        alone, _ = run(True, xs[:1] + [xs[1][:1]])
        check(f"delta-step ({name}): a row's bits in a 5-row step equal its bits alone", torch.equal(alone[1][0], out[1][0]))
    delta_kernel.ONE_KERNEL = one
    # each kernel alone on rings that wrap, in fp32, against the layer's conv and gates and the torch recurrence
    from specdec.models.deltanet import recurrent_gated_delta
    nc, ns, start = ks - 1 + 5, 6, 11  # window: positions 8, 9, 10 at rows 0, 1, 2 ... inputs 11..15 at rows 3..7
    with torch.no_grad():
        window = torch.randn(ks - 1, layer.conv_dim).half()
        proj, _, b1, a1 = layer.project(xs[1])
        mixed, full = layer.conv(window, proj)
        want = layer.gates(mixed, b1, a1)
        conv_ring = torch.randn(nc, layer.conv_dim).half()
        rows = [(start - (ks - 1) + i) % nc for i in range(ks - 1 + 5)]
        conv_ring[rows[:ks - 1]] = window
        states = torch.randn(ns, hv, dk, dv)
        args = (layer.conv_weight_fp32(), b1, a1, layer.A_log, layer.dt_bias, hk, hv, dk, dv)
        ring2, states2 = conv_ring.clone(), states.clone()
        got = delta_kernel.conv_gates(proj, conv_ring, start, *args)
        r = hv // hk
        rep = (got[0].repeat_interleave(r, dim=1), got[1].repeat_interleave(r, dim=1), *got[2:])
        gerr = max((a - b).abs().max().item() / max(b.abs().max().item(), 1e-6) for a, b in zip(rep, want))
        check("delta-step: conv_gates' q, k, v, g, beta equal the layer's conv and gates", gerr < 1e-5,
              f"(max relative diff {gerr:.2e})")
        check("delta-step: conv_gates' inputs written at their positions, the window untouched",
              torch.equal(conv_ring[rows], full))
        q, k, v, g, beta = (x.float() for x in got[:5])
        o_rec = delta_kernel.recurrent_into_cache(q, k, v, g, beta, states, start, None)
        ref_o, ref_s = recurrent_gated_delta(rep[0].float(), rep[1].float(), v, g, beta, states2[start % ns])
        srow = [(start + 1 + t) % ns for t in range(5)]
        check("delta-step: recurrent_into_cache's outputs and states (at lengths past the ring's end) equal the "
              "torch recurrence", (o_rec - ref_o).abs().max().item() < 1e-4 and (states[srow] - ref_s).abs().max() < 1e-4)
        # the one kernel, from the same rings: its conv inputs, and its outputs and states as the two kernels'
        states1 = states2.clone()
        o_one = delta_kernel.step(proj, ring2, states1, start, None, *args)
        check("delta-step: the step kernel's inputs written at their positions, the window untouched",
              torch.equal(ring2[rows], full))
        derr = max((o_one - o_rec).abs().max().item(), (states1 - states).abs().max().item())
        check("delta-step: the step kernel's outputs and states equal the two kernels' (to fp32 rounding)", derr < 1e-5,
              f"(max diff {derr:.2e})")
        check("delta-step: the step kernel leaves the live state and the other lengths' rows as they were",
              torch.equal(states1[start % ns], states2[start % ns]))
        # a static step's padding rows (past ``live``): zero outputs, no states; the live rows as unpadded. The start
        # as a static step's 0-d tensor
        for name, fn in (("two kernels", lambda st, live: delta_kernel.recurrent_into_cache(q, k, v, g, beta, st,
                                                                                            torch.tensor(start), live)),
                         ("one kernel", lambda st, live: delta_kernel.step(proj, conv_ring.clone(), st, torch.tensor(start),
                                                                           live, *args))):
            full_states, part_states = states2.clone(), states2.clone()
            o_all, o_two = fn(full_states, None), fn(part_states, torch.tensor(2))
            kept = [start % ns] + srow[:2]
            check(f"delta-step ({name}): the live rows of a padded step as unpadded, its padding rows zero and "
                  "stateless", torch.equal(o_two[:2], o_all[:2]) and not o_two[2:].any()
                  and torch.equal(part_states[kept], full_states[kept]) and torch.equal(part_states[srow[2:]],
                                                                                       states2[srow[2:]]))


def experts() -> None:
    """models/expert_kernel.py (one GEMV a (row, expert) pair) against the torch gather form, for SiLU- and
    GELU-tanh-gated experts (Qwen3.5's and Gemma 4's): each pair's output, a row's bits at every row count and
    beside other rows, and a static step's padding rows (past ``live``) zero."""
    from specdec.models import expert_kernel
    from specdec.models.layers import gelu_tanh
    from specdec.models.moe import Experts
    torch.manual_seed(0)
    e, hidden, inter, t, k = 6, 300, 40, 5, 2  # hidden past one BK block and not a multiple of it
    for act in (torch.nn.functional.silu, gelu_tanh):
        name = f"experts ({act.__name__})"
        gelu = act is gelu_tanh
        ex = Experts(e, hidden, inter, act=act).half()
        with torch.no_grad():
            ex.gate_up_proj.copy_(torch.randn_like(ex.gate_up_proj) * 0.1)
            ex.down_proj.copy_(torch.randn_like(ex.down_proj) * 0.1)
            x = torch.randn(t, hidden).half()
            idx = torch.randint(0, e, (t, k))
            got = expert_kernel.pairs(x, idx, ex.gate_up_proj, ex.down_proj, gelu=gelu)
            # the gather form in fp32, rounded where the fp16 torch form rounds
            gu = torch.einsum("tkoh,th->tko", ex.gate_up_proj[idx].float(), x.float())
            gate, up = gu.half().float().chunk(2, dim=-1)
            a = act(gate).half().float()
            hmid = (a * up).half().float()
            want = torch.einsum("tkhi,tki->tkh", ex.down_proj[idx].float(), hmid).half()
            diff = (got.float() - want.float()).abs()
            ulps = (diff / (want.float().abs() * 2 ** -10 + 1e-4)).max().item()  # in fp16 steps of each value
            check(f"{name}: each pair's output equals the gather form's (within one fp16 step)", ulps <= 1.0,
                  f"(max diff {diff.max().item():.2e}, {ulps:.2f} steps)")
            other = expert_kernel.pairs(x, idx, ex.gate_up_proj, ex.down_proj, gelu=not gelu)
            check(f"{name}: the other activation gives other outputs (the flag reaches the kernel)",
                  (other.float() - want.float()).abs().max().item() > 10 * diff.max().item())
            alone = torch.cat([expert_kernel.pairs(x[i:i + 1], idx[i:i + 1], ex.gate_up_proj, ex.down_proj, gelu=gelu)
                               for i in range(t)])
            check(f"{name}: a row's bits alone equal its bits beside the others", torch.equal(alone, got))
            part = expert_kernel.pairs(x, idx, ex.gate_up_proj, ex.down_proj, torch.tensor(2), gelu=gelu)
            check(f"{name}: the live rows as before, the padding rows zero",
                  torch.equal(part[:2], got[:2]) and not part[2:].any())


def moe() -> None:
    """models/expert_kernel.py's whole MoE step (the router's GEMM, routing, the pairs with the shared expert,
    the weighted sum) against its torch form (moe_reference): the output, a row's bits alone and beside
    others, and a static step's padding rows (past ``live``) zero; with and without a shared expert, with the
    combine kernel's pairs loaded one, three or four at a time (P = 3 pairs: a chunk past the last pair). The
    routing alone too: every row written (5 and 21 rows, with and without padding rows)."""
    from specdec.models import expert_kernel
    torch.manual_seed(0)
    e, hidden, inter, t, k = 6, 300, 40, 5, 2  # hidden past one BK block and not a multiple of it
    gate_up = (torch.randn(e, 2 * inter, hidden) * 0.1).half()
    down = (torch.randn(e, hidden, inter) * 0.1).half()
    shared = ((torch.randn(2 * inter, hidden) * 0.1).half(), (torch.randn(hidden, inter) * 0.1).half())
    router = (torch.randn(e + 1, hidden) * 0.1).half()  # the shared gate's row last
    x = torch.randn(t, hidden).half()
    for xr, live in itertools.product((x, torch.randn(21, hidden).half()), (None, torch.tensor(2))):
        # the routing alone, into outputs filled with -7 first: every row written
        logits = (xr.float() @ router.float().T).half().float()
        top, want_idx = torch.topk(torch.softmax(logits[:, :e], -1), k, -1)
        want_w = torch.cat([top / top.sum(-1, keepdim=True), torch.sigmoid(logits[:, e:])], 1).half()
        tr = xr.shape[0]
        out = (torch.full((tr, k), -7, dtype=torch.int32), torch.full((tr, k + 1), -7.0).half())
        idx, w = expert_kernel.routing(xr, router, k, True, live, out=out)
        n = tr if live is None else 2
        ok = (torch.equal(idx[:n].long(), want_idx[:n]) and (w[:n].float() - want_w[:n].float()).abs().max() < 2e-3
              and not idx[n:].any() and not w[n:].any())
        check(f"moe routing ({n} live of {tr} rows): the torch form's experts and weights, padding rows 0", ok)
    for name, sh, rw in (("shared expert", shared, router), ("no shared expert", None, router[:e])):
        for pc in (1, 4):
            tiles = ((16, 128, 4), (8, 32, 4, pc))  # past one BK block of the intermediate too
            label = f"{name}, {pc} pair{'s' if pc > 1 else ''} a load"
            got = expert_kernel.moe(x, rw, k, gate_up, down, sh, tiles=tiles)
            want = expert_kernel.moe_reference(x, rw, k, gate_up, down, sh)
            diff = (got.float() - want.float()).abs()
            ulps = (diff / (want.float().abs() * 2 ** -10 + 1e-3)).max().item()
            check(f"moe ({label}): the output equals the torch form's (within two fp16 steps)", ulps <= 2.0,
                  f"(max diff {diff.max().item():.2e}, {ulps:.2f} steps)")
            alone = torch.cat([expert_kernel.moe(x[i:i + 1], rw, k, gate_up, down, sh, tiles=tiles) for i in range(t)])
            check(f"moe ({label}): a row's bits alone equal its bits beside the others", torch.equal(alone, got))
            part = expert_kernel.moe(x, rw, k, gate_up, down, sh, torch.tensor(2), tiles=tiles)
            check(f"moe ({label}): the live rows as before, the padding rows zero",
                  torch.equal(part[:2], got[:2]) and not part[2:].any())
    # the persistent combine (COMBINE_STREAM): 8 programs a row group over 150 or 75 blocks (each walks several, the
    # last's next block past the hidden size), 5 rows in 4 groups (rows 0 and 4 in one), K = 3 routed pairs in a tile of
    # 4 (a pair masked), K = 2 in one of 2
    saved = expert_kernel.COMBINE_STREAM, expert_kernel.STREAM_TILE
    try:
        for name, sh, rw, bn, kk in (("shared expert", shared, router, 2, 3), ("no shared expert", None, router[:e], 4, 2)):
            expert_kernel.COMBINE_STREAM, expert_kernel.STREAM_TILE = True, (bn, 4)
            label = f"persistent combine, {name}, {bn} channels a block, top {kk}"
            got = expert_kernel.moe(x, rw, kk, gate_up, down, sh)
            want = expert_kernel.moe_reference(x, rw, kk, gate_up, down, sh)
            diff = (got.float() - want.float()).abs()
            ulps = (diff / (want.float().abs() * 2 ** -10 + 1e-3)).max().item()
            check(f"moe ({label}): the output equals the torch form's (within two fp16 steps)", ulps <= 2.0,
                  f"(max diff {diff.max().item():.2e}, {ulps:.2f} steps)")
            alone = torch.cat([expert_kernel.moe(x[i:i + 1], rw, kk, gate_up, down, sh) for i in range(t)])
            check(f"moe ({label}): a row's bits alone equal its bits beside the others", torch.equal(alone, got))
            part = expert_kernel.moe(x, rw, kk, gate_up, down, sh, torch.tensor(2))
            check(f"moe ({label}): the live rows as before, the padding rows zero",
                  torch.equal(part[:2], got[:2]) and not part[2:].any())
    finally:
        expert_kernel.COMBINE_STREAM, expert_kernel.STREAM_TILE = saved
    # Gemma 4's block: the router on its own input, each chosen weight times its expert's scale, GELU-tanh experts
    rx = torch.randn(t, hidden).half()
    scale = (1.0 + 0.3 * torch.randn(e)).half()
    tiles = ((16, 128, 4), (8, 32, 4, 2))
    gemma = dict(router_x=rx, expert_scale=scale, gelu=True)
    got = expert_kernel.moe(x, router[:e], k, gate_up, down, None, tiles=tiles, **gemma)
    want = expert_kernel.moe_reference(x, router[:e], k, gate_up, down, None, **gemma)
    diff = (got.float() - want.float()).abs()
    ulps = (diff / (want.float().abs() * 2 ** -10 + 1e-3)).max().item()
    check("moe (Gemma 4: router input, expert scales, GELU-tanh): the output equals the torch form's (within two fp16 "
          "steps)", ulps <= 2.0, f"(max diff {diff.max().item():.2e}, {ulps:.2f} steps)")
    for label, kw in (("the router's own input", dict(gemma, router_x=None)), ("the expert scales", dict(gemma, expert_scale=None)),
                      ("GELU", dict(gemma, gelu=False))):
        off = expert_kernel.moe(x, router[:e], k, gate_up, down, None, tiles=tiles, **kw)
        check(f"moe (Gemma 4): without {label} the output differs (the option reaches the kernels)",
              (off.float() - want.float()).abs().max().item() > 10 * diff.max().item())
    alone = torch.cat([expert_kernel.moe(x[i:i + 1], router[:e], k, gate_up, down, None, tiles=tiles,
                                         **dict(gemma, router_x=rx[i:i + 1])) for i in range(t)])
    check("moe (Gemma 4): a row's bits alone equal its bits beside the others", torch.equal(alone, got))
    part = expert_kernel.moe(x, router[:e], k, gate_up, down, None, torch.tensor(2), tiles=tiles, **gemma)
    check("moe (Gemma 4): the live rows as before, the padding rows zero", torch.equal(part[:2], got[:2]) and not part[2:].any())
    # the tiles of a shape in SHAPE_TILES (the gemma4-26b-a4b shape's, on this block's sizes): the tiles given, the
    # output as the torch form's; another shape's block keeps the defaults
    saved_tiles = expert_kernel.SHAPE_TILES
    try:
        defaults = (expert_kernel.GATE_UP_TILE, expert_kernel.COMBINE_TILE)
        launched = []  # each launch's (gate/up BN, BK), (combine BN, BK)
        kernels = expert_kernel._gate_up_kernel, expert_kernel._combine_kernel

        class Record:
            def __init__(self, kernel):
                self.kernel = kernel

            def __getitem__(self, grid):
                return lambda *a, **kw: launched.append((kw["BN"], kw["BK"])) or self.kernel[grid](*a, **kw)
        expert_kernel._gate_up_kernel, expert_kernel._combine_kernel = Record(kernels[0]), Record(kernels[1])
        try:
            expert_kernel.SHAPE_TILES = {(hidden, inter): tiles}
            same = torch.equal(expert_kernel.moe(x, router[:e], k, gate_up, down, None, **gemma), got)
            check("moe (Gemma 4): a shape's SHAPE_TILES are its default tiles", same and launched == [(16, 128), (8, 32)],
                  f"({launched})")
            expert_kernel.SHAPE_TILES, launched[:] = {(hidden + 1, inter): tiles}, []
            expert_kernel.moe(x, router[:e], k, gate_up, down, None, **gemma)
            check("moe: a block of another shape keeps the default tiles",
                  launched == [defaults[0][:2], defaults[1][:2]], f"({launched})")
        finally:
            expert_kernel._gate_up_kernel, expert_kernel._combine_kernel = kernels
        by_shape = expert_kernel.moe(x, router[:e], k, gate_up, down, None, tiles=saved_tiles[(2816, 704)], **gemma)
        diff2 = (by_shape.float() - want.float()).abs()
        ulps2 = (diff2 / (want.float().abs() * 2 ** -10 + 1e-3)).max().item()
        check("moe (Gemma 4) on the gemma4-26b-a4b shape's tiles: the output equals the torch form's", ulps2 <= 2.0,
              f"({ulps2:.2f} steps)")
    finally:
        expert_kernel.SHAPE_TILES = saved_tiles
    try:
        expert_kernel.moe(x, router[:e], k, gate_up, down, None, expert_scale=scale[:-1])
        check("moe: expert scales of the wrong length are refused", False)
    except ValueError as err:
        check("moe: expert scales of the wrong length are refused", "scales" in str(err))
    try:
        expert_kernel.moe(x, router[:e], k, gate_up, down, shared)
        check("moe: a router without the shared gate's row is refused", False)
    except ValueError as err:
        check("moe: a router without the shared gate's row is refused", "router" in str(err))


def norm_router() -> None:
    """models/expert_kernel.py's post-mixer add and norm with the router's GEMM (``norm_router``): the sum and the norm
    the bits of fused_ops' norm kernel, the logits the torch form's within fp16 rounding, a row's logits alone equal
    its logits beside the others (7 router rows: the last block half full), the live rows' as before with padding
    rows; :func:`moe` on those logits as the torch form; bad shapes refused. Then a tiny random fp16 Qwen3.5 MoE
    target (three Gated DeltaNet layers and a gated attention, 32 experts top 2 and a shared one) on its fused layers
    with every kernel forced: each layer's MoE step takes its logits from the kernel, its logits equal the torch
    layers' within fp16 tolerance, and speculative output with accepted and rolled-back drafts equals plain decoding,
    padded and row-exact."""
    from specdec.models import delta_kernel, expert_kernel, fused_layer, fused_ops
    torch.manual_seed(0)
    e, hidden, inter, t, k = 6, 300, 40, 5, 2
    x, d = torch.randn(t, hidden).half(), torch.randn(t, hidden).half()
    scale, eps = 1.0 + 0.1 * torch.randn(hidden), 1e-6
    router = (torch.randn(e + 1, hidden) * 0.1).half()  # the shared gate's row last
    s, y, lg = expert_kernel.norm_router(x, d, scale, eps, router)
    ws, wy = fused_ops.rms_norm(x, scale, eps, residual=d)
    check("norm_router: the sum and the norm are the norm kernel's bits", torch.equal(s, ws) and torch.equal(y, wy))
    want = (wy.float() @ router.float().T).half().float()
    ulps = ((lg.float() - want).abs() / (want.abs() * 2 ** -10 + 1e-3)).max().item()
    check("norm_router: the logits the torch form's (within one fp16 step)", lg.shape == (t, e + 1) and ulps <= 1.0,
          f"({ulps:.2f} steps)")
    alone = torch.cat([expert_kernel.norm_router(x[i:i + 1], d[i:i + 1], scale, eps, router)[2] for i in range(t)])
    check("norm_router: a row's logits alone equal its logits beside the others", torch.equal(alone, lg))
    ps, py, pl = expert_kernel.norm_router(x, d, scale, eps, router, torch.tensor(2))
    check("norm_router: with padding rows the sum and norm of every row, the live rows' logits as before",
          torch.equal(ps, s) and torch.equal(py, y) and torch.equal(pl[:2], lg[:2]))
    gate_up = (torch.randn(e, 2 * inter, hidden) * 0.1).half()
    down = (torch.randn(e, hidden, inter) * 0.1).half()
    shared = ((torch.randn(2 * inter, hidden) * 0.1).half(), (torch.randn(hidden, inter) * 0.1).half())
    got = expert_kernel.moe(y, router, k, gate_up, down, shared, logits=lg)
    ref = expert_kernel.moe_reference(y, router, k, gate_up, down, shared)
    diff = (got.float() - ref.float()).abs()
    steps = (diff / (ref.float().abs() * 2 ** -10 + 1e-3)).max().item()
    check("norm_router: moe on its logits the torch form's (within two fp16 steps)", steps <= 2.0, f"({steps:.2f} steps)")
    for label, call in (("a delta of another shape", lambda: expert_kernel.norm_router(x, d[:2], scale, eps, router)),
                        ("logits of another shape", lambda: expert_kernel.moe(y, router, k, gate_up, down, shared,
                                                                                logits=lg[:, :e]))):
        try:
            call()
            check(f"norm_router: {label} refused", False)
        except ValueError as err:
            check(f"norm_router: {label} refused", "expert_kernel" in str(err), f"({err})")
    model, prompt, logits = _tiny_fused_model({
        "model_type": "qwen3_5_moe_text", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "full_attention_interval": 4, "num_experts": 32, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32, "rms_norm_eps": 1e-6, "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}})
    torch_form = logits()
    forced = lambda x: x.dtype == torch.float16 and not torch.is_grad_enabled()  # noqa: E731  (the CPU, forced)
    fused_layer.usable, fused_ops.usable, expert_kernel.usable = forced, forced, lambda x, act: forced(x)
    delta_kernel.step_kernels_available = lambda x, dk, dv: True
    expert_kernel.SHAPE_TILES = FEW_MOE_PROGRAMS
    check("hybrid moe fused: every layer on the fused path", all(layer.fused_path for layer in model.layers))
    calls, run = [], expert_kernel.norm_router
    expert_kernel.norm_router = lambda *a, **kw: calls.append(a[0].shape[0]) or run(*a, **kw)
    expert_kernel.NORM_ROUTER = True  # whatever SPECDEC_NORM_ROUTER says in the environment
    fused = logits()
    check("hybrid moe fused: each layer's MoE step routed on the norm kernel's logits", calls == [9] * 4 + [1] * 4,
          f"({calls})")
    _fused_checks("hybrid moe fused", model, prompt, fused, torch_form, 14)
    on_device = fused_layer.on_device
    fused_layer.on_device = lambda w: True  # as on CUDA: row-exact up to the MoE kernels' rows (32 experts, top 2: 16)
    try:
        check("hybrid moe fused: row-exact up to 16 rows", model.row_exact(16) and not model.row_exact(17))
        _row_exact_generation("hybrid moe fused", model, prompt)
    finally:
        fused_layer.on_device = on_device


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


def rope() -> None:
    """The fused RoPE + KV write against ``layers.apply_rope`` and the caches' writes (fp16: the
    interpreter's bf16 is not the GPU's), for one sequence's static step (a 0-d start) and a batched
    step (slots and positions per row), full and partial rotary."""
    from specdec.cache import BatchKVCache, BatchWrite, KVCache
    from specdec.models.layers import RotaryEmbedding, apply_rope
    from specdec.models.rope_write import rope_write, rope_write_one
    g = torch.Generator().manual_seed(0)
    for h, hkv, d, r in ((6, 2, 16, 16), (4, 2, 32, 16)):
        rot = RotaryEmbedding(d, 10000.0, partial_factor=r / d)
        # one sequence: T rows at start 5 of a 24-position cache
        t = 3
        qkv = torch.randn(t, (h + 2 * hkv) * d, generator=g).half()
        q, k, v = qkv.split([h * d, hkv * d, hkv * d], -1)
        q, k, v = q.view(t, h, d), k.view(t, hkv, d), v.view(t, hkv, d)
        start = torch.tensor(5)
        cos, sin = rot.cos_sin(start + torch.arange(t), torch.float16)
        want_c, got_c = KVCache(hkv, d, 24, torch.float16, "cpu"), KVCache(hkv, d, 24, torch.float16, "cpu")
        want_q = apply_rope(q.transpose(0, 1), cos, sin)
        want_c.update(start, apply_rope(k.transpose(0, 1), cos, sin), v.transpose(0, 1))
        got_q = rope_write_one(q, k, v, cos, sin, got_c, start)
        check(f"rope one sequence h={h} d={d} r={r}: queries", torch.equal(got_q, want_q))
        check(f"rope one sequence h={h} d={d} r={r}: cache", torch.equal(got_c.k, want_c.k) and torch.equal(got_c.v, want_c.v))
        # batched: 2 rows of 2 tokens in slots 3 and 1 at their own positions
        b, t = 2, 2
        qkv = torch.randn(b, t, (h + 2 * hkv) * d, generator=g).half()
        q, k, v = qkv.split([h * d, hkv * d, hkv * d], -1)
        q, k, v = q.view(b, t, h, d), k.view(b, t, hkv, d), v.view(b, t, hkv, d)
        pos = torch.tensor([[7, 8], [2, 3]])
        w = BatchWrite(torch.tensor([3, 1]), pos, 12)
        cos, sin = rot.cos_sin(pos.reshape(-1), torch.float16)
        want_c, got_c = (BatchKVCache(4, hkv, d, 12, torch.float16, "cpu") for _ in range(2))
        c4, s4 = cos.view(b, 1, t, r), sin.view(b, 1, t, r)
        want_q = apply_rope(q.transpose(1, 2), c4, s4)
        want_c.update(w, apply_rope(k.transpose(1, 2), c4, s4), v.transpose(1, 2))
        got_q = rope_write(q, k, v, cos, sin, got_c, w)
        check(f"rope batched h={h} d={d} r={r}: queries", torch.equal(got_q, want_q))
        check(f"rope batched h={h} d={d} r={r}: cache", torch.equal(got_c.k, want_c.k) and torch.equal(got_c.v, want_c.v))


def fused() -> None:
    """models/fused_ops.py: RMSNorm (alone and after a residual add) and silu(gate) * up against the
    torch ops, for 2-d and strided 3-d inputs; a row's bits alone and among other rows; the add's sum
    bitwise the torch add's."""
    from specdec.models import fused_ops
    from specdec.models.layers import RMSNorm
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float16):
        for zc in (False, True):
            norm = RMSNorm(48, 1e-6, zero_centered=zc)
            norm.weight.data = torch.randn(48, generator=g) * 0.1
            x = torch.randn(7, 48, generator=g).to(dtype)
            want = norm(x.float())  # the torch ops in fp32 (a CPU tensor)
            got = fused_ops.rms_norm(x, norm.fp32_scale(), 1e-6)
            err = (got.float() - want).abs().max().item()
            check(f"fused norm {dtype} zero-centred={zc}: equals RMSNorm", err < (1e-5 if dtype == torch.float32 else 2e-2), f"(max diff {err:.1e})")
            check(f"fused norm {dtype}: a row alone has its bits among 7", torch.equal(fused_ops.rms_norm(x[3:4], norm.fp32_scale(), 1e-6), got[3:4]))
            d = torch.randn(7, 48, generator=g).to(dtype)
            s, y = fused_ops.rms_norm(x, norm.fp32_scale(), 1e-6, residual=d)
            check(f"fused add+norm {dtype}: the sum is the torch add's", torch.equal(s, x + d))
            check(f"fused add+norm {dtype}: the norm of the sum", torch.equal(y, fused_ops.rms_norm(x + d, norm.fp32_scale(), 1e-6)))
            # a sandwich-normed layer's post-norm, add and pre-norm in one kernel: the bits of the two kernels
            post = torch.rand(48, generator=g) + 0.5
            d3 = d * 7  # another scale than x's
            s2, y2 = fused_ops.rms_norm(x, norm.fp32_scale(), 1e-6, residual=d3, residual_scale=post, residual_eps=1e-5)
            s1, y1 = fused_ops.rms_norm(x, norm.fp32_scale(), 1e-6, residual=fused_ops.rms_norm(d3, post, 1e-5))
            check(f"fused norm+add+norm {dtype}: the bits of the norm, then the add and norm",
                  torch.equal(s2, s1) and torch.equal(y2, y1) and not torch.equal(s2, x + d3))
            # Gemma 4's MoE layer tail in one kernel: (x + norm(norm_1(f) + norm_2(e))) * scalar, the bits of the
            # norm kernels, the torch add and the torch product in turn
            f, e = torch.randn(7, 48, generator=g).to(dtype) * 3, d3
            w1, w2 = torch.rand(48, generator=g) + 0.5, post
            sc = torch.tensor([0.75], dtype=dtype)
            tail = fused_ops.sandwich_tail(x, f, e, (w1, w2, norm.fp32_scale()), (1e-5, 1e-4, 1e-6), sc)
            u, p = fused_ops.rms_norm(fused_ops.rms_norm(f, w1, 1e-5), norm.fp32_scale(), 1e-6,
                                      residual=fused_ops.rms_norm(e, w2, 1e-4))
            want_t = (x + p) * sc
            check(f"fused sandwich tail {dtype}: the bits of the norms, the add and the scalar", torch.equal(tail, want_t))
            check(f"fused sandwich tail {dtype}: the scalar applied", not torch.equal(tail, x + p))
            check(f"fused sandwich tail {dtype}: a row alone has its bits among 7", torch.equal(
                fused_ops.sandwich_tail(x[2:3], f[2:3], e[2:3], (w1, w2, norm.fp32_scale()), (1e-5, 1e-4, 1e-6), sc),
                tail[2:3]))
            # Gemma 4's dense layer tail in one kernel: x + norm(f), times the scalar or not, the bits of the norm
            # kernel, the torch add and the torch product
            nf = fused_ops.rms_norm(f, w1, 1e-5)
            an = fused_ops.add_norm(x, f, w1, 1e-5, sc)
            check(f"fused add+norm+scalar {dtype}: the bits of the norm, the add and the scalar",
                  torch.equal(an, (x + nf) * sc) and not torch.equal(an, x + nf))
            check(f"fused add+norm {dtype}: the bits of the norm and the add", torch.equal(fused_ops.add_norm(x, f, w1, 1e-5), x + nf))
            check(f"fused add+norm+scalar {dtype}: a row alone has its bits among 7",
                  torch.equal(fused_ops.add_norm(x[2:3], f[2:3], w1, 1e-5, sc), an[2:3]))
        # strided rows: per-head norms of q as a view of a fused projection [T, H*d + more]
        big = torch.randn(5, 4 * 16 + 8, generator=g).to(dtype)
        q = big[:, : 4 * 16].view(5, 4, 16)
        scale = torch.rand(16, generator=g) + 0.5
        got = fused_ops.rms_norm(q, scale, 1e-6)
        check(f"fused norm {dtype}: strided [T, H, d] rows", torch.equal(got, fused_ops.rms_norm(q.contiguous(), scale, 1e-6)))
        gu = torch.randn(6, 2 * 40, generator=g).to(dtype)
        want = (torch.nn.functional.silu(gu[:, :40].float()) * gu[:, 40:].float())
        got = fused_ops.silu_mul(gu)
        err = (got.float() - want).abs().max().item()
        check(f"fused silu*mul {dtype}: equals the torch ops", err < (1e-5 if dtype == torch.float32 else 1e-2), f"(max diff {err:.1e})")
        check(f"fused silu*mul {dtype}: a row alone has its bits", torch.equal(fused_ops.silu_mul(gu[2:3]), got[2:3]))
        want = (torch.nn.functional.gelu(gu[:, :40].float(), approximate="tanh") * gu[:, 40:].float())
        got_g = fused_ops.silu_mul(gu, gelu=True)
        err = (got_g.float() - want).abs().max().item()
        check(f"fused gelu_tanh*mul {dtype}: equals the torch ops (and not SiLU's)", err < (1e-5 if dtype == torch.float32
              else 1e-2) and (got_g.float() - got.float()).abs().max().item() > 0.05, f"(max diff {err:.1e})")
        # gate and up apart, up a strided view (Gemma 4's per-layer input of one layer among three): the bits of the
        # fused form on the two side by side
        ups = torch.randn(6, 3, 40, generator=g).to(dtype)
        got_s = fused_ops.glu_mul(gu[:, :40], ups[:, 1], gelu=True)
        check(f"fused gelu_tanh*mul {dtype}: gate and a strided up apart, the bits of the fused form",
              torch.equal(got_s, fused_ops.silu_mul(torch.cat([gu[:, :40], ups[:, 1]], 1), gelu=True))
              and not torch.equal(got_s, got_g))
        try:
            fused_ops.glu_mul(gu[:, :40], ups[:5, 1])
            check(f"fused glu_mul {dtype}: rows that differ refused", False)
        except ValueError as e:
            check(f"fused glu_mul {dtype}: rows that differ refused", "glu_mul" in str(e))


def fused_layer() -> None:
    """models/fused_layer.py's GEMM (plain, and with the SwiGLU epilogue) against its torch reference,
    with K and N not multiples of the tiles; a row's bits alone and among other rows; [B, T, K] inputs."""
    from specdec.models import fused_layer as fl
    g = torch.Generator().manual_seed(0)
    m, k, n = 37, 200, 72  # K: 4 blocks of 64, the last partial; N: 5 tiles of 16, the last partial
    for dtype in (torch.float16, torch.float32):
        x = torch.randn(m, k, generator=g).to(dtype)
        w = (torch.randn(2 * n, k, generator=g) * k ** -0.5).to(dtype)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        for act in ("", "silu", "gelu"):  # plain; the gated products (SwiGLU; Gemma's GELU-tanh)
            silu, gelu = act == "silu", act == "gelu"
            wt = w if act else w[:n].contiguous()
            # split K (K 200): 128 + 72; 96 + 96 + 8; 64 + 64 + 64 + 8
            for tile in ((16, 64, 2, 2), (32, 128, 4, 3), (16, 64, 2, 2, 2), (32, 32, 4, 3, 3), (16, 64, 2, 2, 4)):
                name = f"fused layer {act + ' ' if act else ''}gemm {dtype} tile {tile}"
                got = fl.linear(x, wt, silu=silu, tile=tile, gelu=gelu)
                want = fl.reference(x, wt, silu=silu, gelu=gelu)
                err = (got.float() - want.float()).abs().max().item()
                check(f"{name}: equals the torch ops", got.shape == want.shape and err < tol, f"(max diff {err:.1e})")
                check(f"{name}: row 20 alone has its bits among {m}",
                      torch.equal(fl.linear(x[20:21], wt, silu=silu, tile=tile, gelu=gelu), got[20:21]))
        xl = torch.linspace(-12, 12, 16 * 40).view(40, 16).to(dtype)  # GELU's tails: tanh saturates, no inf or nan
        eye = torch.cat([torch.eye(16), torch.eye(16)]).to(dtype)  # gate = up = x
        got, want = fl.linear(xl, eye, gelu=True), fl.reference(xl, eye, gelu=True)
        check(f"fused layer gelu {dtype}: gate values over [-12, 12] as the torch ops", bool(torch.isfinite(got).all())
              and (got.float() - want.float()).abs().max().item() <= 1e-3 * want.float().abs().max().item())
        check(f"fused layer {dtype}: split K leaves its tile counters at zero",
              not fl._counters(x.device).any())
        full = fl.linear(x, w, tile=(16, 64, 2, 2, 3))
        saved, fl.COUNTERS = fl.COUNTERS, 9  # 9 tiles of 16 outputs: the 37 rows run as three kernels
        try:
            fl._COUNTER_BUFS.clear()
            check(f"fused layer {dtype}: split K over more tiles than counters (rows in chunks) keeps the bits",
                  torch.equal(fl.linear(x, w, tile=(16, 64, 2, 2, 3)), full))
        finally:
            fl.COUNTERS = saved
            fl._COUNTER_BUFS.clear()
        x3 = x.view(1, m, k)
        check(f"fused layer {dtype}: [B, T, K] input", torch.equal(fl.linear(x3, w), fl.linear(x, w).view(1, m, 2 * n)))
        # int8 rows (a drafter's Int8Rows): against the reference's int8 sums times the scales, and within int8's
        # rounding of the float weight's product; a row's bits alone
        for silu in (False, True):
            q = fl.Int8Rows.of(w if silu else w[:n])
            for tile in ((16, 64, 2, 2), (16, 64, 2, 2, 3)):
                name = f"fused layer int8 {'silu ' if silu else ''}gemm {dtype} tile {tile}"
                got = fl.linear(x, q, silu=silu, tile=tile)
                want = fl.reference(x, q, silu=silu)
                err = (got.float() - want.float()).abs().max().item()
                check(f"{name}: equals the torch ops", got.shape == want.shape and err < tol, f"(max diff {err:.1e})")
                full = fl.reference(x, w if silu else w[:n].contiguous(), silu=silu).float()
                rel = ((got.float() - full).abs().max() / full.abs().max()).item()
                check(f"{name}: within int8's rounding of the float weight's product", rel < 2e-2, f"(relative {rel:.1e})")
                check(f"{name}: row 20 alone has its bits among {m}",
                      torch.equal(fl.linear(x[20:21], q, silu=silu, tile=tile), got[20:21]))
        check(f"fused layer {dtype}: int8 rows dequantize within half a step of the weight",
              ((q.dequantized() - w.float()).abs() <= q.scale[:, None] / 2 + 1e-6).all().item())


def _tiny_fused_model(d: dict):
    """A tiny random fp16 target of config ``d`` (weights N(0, 0.1), seed 0), its projections fused; a 9-token prompt;
    and a function giving its logits for the prompt, then one more token."""
    from specdec.config import parse_config
    from specdec.models.registry import by_hf_model_type
    arch = by_hf_model_type(d["model_type"], "test")
    torch.manual_seed(0)
    model = arch.model_cls(parse_config(arch.config_cls, d, source="test")).half()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    model.fuse_projections()
    model.eval()
    prompt = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(1)).tolist()

    def logits() -> list:
        cache = model.new_cache(32)
        return [model.forward(torch.tensor(ids), cache).logits for ids in (prompt, [5])]
    return model, prompt, logits


def _fused_checks(name: str, model, prompt, fused: list, torch_form: list, n: int) -> None:
    """The fused path's logits within fp16 tolerance of the torch layers'; speculative output with a spoiled oracle's
    drafts (accepted, rolled back) equal to plain decoding's over ``n`` tokens."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _engine_util import SpoiledOracle
    from specdec.engine import SpeculativeGenerator
    err = max((a.float() - b.float()).abs().max().item() for a, b in zip(fused, torch_form))
    scale = max(b.float().abs().max().item() for b in torch_form)
    check(f"{name}: the logits as the torch layers'", err <= scale / 64, f"(max diff {err:.1e}, scale {scale:.1e})")
    plain = SpeculativeGenerator(model, None, 0, cuda_graphs=False).generate(prompt, n)
    check(f"{name}: plain output varied (near-ties a wrong bit could flip)", len(set(plain.token_ids)) >= n // 2,
          f"({len(set(plain.token_ids))} distinct of {n})")
    spec = SpeculativeGenerator(model, SpoiledOracle(prompt + plain.token_ids, 256, spoil=0.25), 4,
                                cuda_graphs=False).generate(prompt, n)
    check(f"{name}: speculative output (drafts accepted, rollbacks) equals plain decoding",
          spec.token_ids == plain.token_ids and sum(spec.stats.accepted) > 0, f"(accepted {spec.stats.accepted})")


def hybrid_fused() -> None:
    """A Qwen3.5 target on its fused layers (``forward_fused``: the fused GEMM, the Gated DeltaNet's step kernels on
    the cache) on the CPU: a tiny random fp16 dense Qwen3.5 (three Gated DeltaNet layers, one gated attention) with
    fused_layer.usable and the step kernels forced, in the interpreter. Its logits (a 9-row step keeping snapshots,
    then a 1-row step) equal the torch layers' within fp16 tolerance, and a speculative generation whose drafts are
    mostly accepted (a spoiled oracle: verify steps of several rows, rollbacks) equals plain decoding."""
    from specdec.models import delta_kernel, fused_layer
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _engine_util import qwen35_text_config
    model, prompt, logits = _tiny_fused_model(qwen35_text_config())
    torch_form = logits()
    fused_layer.usable = lambda x: x.dtype == torch.float16 and not torch.is_grad_enabled()  # the CPU, forced
    delta_kernel.step_kernels_available = lambda x, dk, dv: True
    check("hybrid fused: every layer on the fused path", all(layer.fused_path for layer in model.layers))
    _fused_checks("hybrid fused", model, prompt, logits(), torch_form, 12)
    # the gated attention's static steps on the split kernel (CUDA only otherwise; forced here) with the gate in its
    # output store (layers.GATE_IN_SPLIT): speculative output equals plain decoding
    from specdec.models import split_attention
    split_attention.supported = lambda q, k, mask: q.dim() == 4 and mask is not None and q.dtype == torch.float16
    launch, gated = split_attention._launch, []
    split_attention._launch = lambda *a: gated.append(a[5] is not None) or launch(*a)
    from _engine_util import SpoiledOracle
    from specdec.engine import SpeculativeGenerator
    plain = SpeculativeGenerator(model, None, 0, cuda_graphs=False, batch_invariant=True).generate(prompt, 8)
    check("hybrid fused, gate in the split kernel: the static steps ran it", len(gated) >= 7 and all(gated),
          f"({len(gated)} launches)")
    spec = SpeculativeGenerator(model, SpoiledOracle(prompt + plain.token_ids, 256, spoil=0.25), 4,
                                cuda_graphs=False, batch_invariant=True).generate(prompt, 8)
    check("hybrid fused, gate in the split kernel: speculative output (drafts accepted, rollbacks) equals plain "
          "decoding", spec.token_ids == plain.token_ids and sum(spec.stats.accepted) > 0,
          f"(accepted {spec.stats.accepted})")


def gemma_fused() -> None:
    """A Gemma 3 target on its fused layers (``forward_fused``: the fused GEMMs with the GELU-tanh product, the
    sandwich norms, a sliding window) on the CPU: a tiny random fp16 Gemma 3 (window 6, every third layer global) with
    fused_layer.usable forced, in the interpreter. Its logits (a 9-row step, then a 1-row step past the window) equal
    the torch layers' within fp16 tolerance, and a speculative generation whose drafts are mostly accepted (a spoiled
    oracle: verify steps of several rows, rollbacks) equals plain decoding."""
    from specdec.models import fused_layer
    model, prompt, logits = _tiny_fused_model({
        "model_type": "gemma3_text", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "query_pre_attn_scalar": 24, "sliding_window": 6, "sliding_window_pattern": 3, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512, "rope_theta": 10000.0, "rope_local_base_freq": 100.0,
        "tie_word_embeddings": False})  # tied, its greedy output repeats one token (a weak check)
    torch_form = logits()
    check("gemma fused: every layer eligible, sliding and global", all(layer.fused_path for layer in model.layers)
          and {layer.sliding for layer in model.layers} == {True, False})
    fused_layer.usable = lambda x: x.dtype == torch.float16 and not torch.is_grad_enabled()  # the CPU, forced
    calls = []
    run = fused_layer.linear
    fused_layer.linear = lambda *a, **k: calls.append(k.get("gelu", False)) or run(*a, **k)
    fused = logits()
    check("gemma fused: the fused GEMMs ran, the MLP's with the GELU-tanh product",
          len(calls) == 2 * 4 * 3 and calls.count(True) == 2 * 3, f"({len(calls)} calls)")
    fused_layer.linear = run
    _fused_checks("gemma fused", model, prompt, fused, torch_form, 14)


def _tiny_gemma4():
    """:func:`_tiny_fused_model` of a tiny random fp16 Gemma 4 MoE (a sliding and a full layer, 32 experts top 2, keys
    as values in the full one, window 6), its norms, router scales and layer scalars near 1 as checkpoints have them."""
    s, f = "sliding_attention", "full_attention"
    model, prompt, logits = _tiny_fused_model({
        "model_type": "gemma4_text", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "global_head_dim": 32, "num_global_key_value_heads": 1, "attention_k_eq_v": True, "enable_moe_block": True,
        "num_experts": 32, "top_k_experts": 2, "moe_intermediate_size": 32, "hidden_size_per_layer_input": 0,
        "sliding_window": 6, "layer_types": [s, f], "rms_norm_eps": 1e-6, "max_position_embeddings": 512,
        "final_logit_softcapping": 30.0, "tie_word_embeddings": False,
        "rope_parameters": {f: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
                            s: {"rope_type": "default", "rope_theta": 1e4}}})
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _gemma_util import randomise_gemma4
    randomise_gemma4(model)
    return model, prompt, logits


def gemma4_moe() -> None:
    """A Gemma 4 MoE target's routed experts on :func:`expert_kernel.moe` (its router's own input, the per-expert
    scales, GELU-tanh experts) and its norms and GELU * up on ``fused_ops``' kernels on the CPU: a tiny random fp16 Gemma 4 (a sliding and a full layer, 32 experts top 2,
    keys as values in the full one, window 6) with the expert kernels forced, in the interpreter. Its logits (a 9-row step, then a 1-row step)
    equal the torch forms' within fp16 tolerance, and a speculative generation whose drafts are mostly accepted (a
    spoiled oracle: verify steps of several rows, rollbacks) equals plain decoding."""
    from specdec.models import expert_kernel
    expert_kernel.SHAPE_TILES = FEW_MOE_PROGRAMS
    model, prompt, logits = _tiny_gemma4()
    torch_form = logits()
    usable, calls = expert_kernel.usable, []
    expert_kernel.usable = lambda x, act: x.dtype == torch.float16 and not torch.is_grad_enabled()  # the CPU, forced
    from specdec.models import fused_ops  # the norms (the router's input among them) and GELU * up as on CUDA
    fused_ops.usable = lambda x: x.dtype == torch.float16 and not torch.is_grad_enabled()
    run = expert_kernel.moe
    expert_kernel.moe = lambda *a, **k: calls.append(k) or run(*a, **k)
    fused = logits()
    check("gemma4 moe: every layer's experts on the MoE kernels, with the router's input, scales and GELU",
          len(calls) == 2 * 2 and all(k["gelu"] and k["router_x"] is not None and k["expert_scale"] is not None
                                      for k in calls), f"({len(calls)} calls)")
    _fused_checks("gemma4 moe", model, prompt, fused, torch_form, 14)
    expert_kernel.usable, expert_kernel.moe = usable, run
    # the attention's static steps (padded to 16 rows, as on CUDA without row exactness): the fused q/k/v GEMM, then
    # the q/k norms, RoPE, the v norm and the cache write in one kernel (forced on the CPU), against the torch layers
    from specdec.engine import SpeculativeGenerator
    from specdec.models import rope_write
    from specdec.models.gemma4 import Gemma4Attention
    eager = SpeculativeGenerator(model, None, 0, cuda_graphs=False, batch_invariant=False).generate(prompt, 14)
    Gemma4Attention.fast_path = lambda self, x, start: self._fused is not None and isinstance(start, torch.Tensor)
    rope_write.supported = lambda *a: True
    nrw, kernel_calls = rope_write.norm_rope_write, []
    rope_write.norm_rope_write = lambda *a, **k: kernel_calls.append(k["v_norm"]) or nrw(*a, **k)
    plain = SpeculativeGenerator(model, None, 0, cuda_graphs=False, batch_invariant=True).generate(prompt, 14)
    check("gemma4 attention: static steps ran the norm + RoPE + v norm + write kernel",
          len(kernel_calls) >= 2 * 13 and all(kernel_calls), f"({len(kernel_calls)} calls)")
    _kernel_generation("gemma4 attention", model, prompt, eager, plain)


def _kernel_generation(name: str, model, prompt, eager, static) -> None:
    """Static steps on a forced kernel (``static``, a plain generation) decode what the eager steps decode (``eager``),
    and speculative output on it with a spoiled oracle's drafts (accepted, rolled back) equals that plain decoding."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _engine_util import SpoiledOracle
    from specdec.engine import SpeculativeGenerator
    check(f"{name}: static steps on the kernel decode what the eager steps decode",
          static.token_ids == eager.token_ids, f"({static.token_ids} / {eager.token_ids})")
    spec = SpeculativeGenerator(model, SpoiledOracle(prompt + static.token_ids, 256, spoil=0.25), 4, cuda_graphs=False,
                                batch_invariant=True).generate(prompt, 14)
    check(f"{name}: speculative output on the kernel (drafts accepted, rollbacks) equals plain decoding",
          spec.token_ids == static.token_ids and sum(spec.stats.accepted) > 0, f"(accepted {spec.stats.accepted})")


def gemma4_fused() -> None:
    """A Gemma 4 MoE target on its fused layers (``Gemma4DecoderLayer.forward_fused``: q/k(/v), o_proj and the GELU-tanh
    MLP on the fused GEMM, the experts on the MoE kernels, the layer scalar on the whole stream) on the CPU: the tiny
    random fp16 Gemma 4 of ``gemma4-moe`` with fused_layer, the expert kernels and the norms forced, in the interpreter.
    Its logits equal the torch layers' within fp16 tolerance; a capture of a layer's output is that layer's output;
    speculative output with accepted and rolled-back drafts equals plain decoding, also with the model taken as row-exact
    (its weights taken as on CUDA: unpadded steps, the LM head on the fused GEMM)."""
    from specdec.models import expert_kernel, fused_layer, fused_ops
    expert_kernel.SHAPE_TILES = FEW_MOE_PROGRAMS
    model, prompt, logits = _tiny_gemma4()
    torch_form = logits()
    ids = torch.tensor(prompt)
    torch_cap = model.forward(ids, model.new_cache(32), capture=(0,)).captured
    check("gemma4 fused: every layer eligible, sliding and full", all(layer.fused_path for layer in model.layers)
          and {layer.sliding for layer in model.layers} == {True, False})
    forced = lambda x: x.dtype == torch.float16 and not torch.is_grad_enabled()  # noqa: E731  (the CPU, forced)
    fused_layer.usable, fused_ops.usable, expert_kernel.usable = forced, forced, lambda x, act: forced(x)
    calls, run, tails, tail = [], fused_layer.linear, [], fused_ops.sandwich_tail
    fused_layer.linear = lambda *a, **k: calls.append(k.get("gelu", False)) or run(*a, **k)
    fused_ops.sandwich_tail = lambda *a, **k: tails.append(1) or tail(*a, **k)
    fused = logits()
    fused_ops.sandwich_tail = tail
    check("gemma4 fused: each layer's tail in one kernel", len(tails) == 2 * 2, f"({len(tails)} calls)")
    # a layer a forward: q/k, o_proj, gate/up with GELU-tanh, down_proj, the router's GEMM (expert_kernel.routing)
    check("gemma4 fused: the fused GEMMs ran, the MLP's with the GELU-tanh product",
          len(calls) == 2 * 5 * 2 and calls.count(True) == 2 * 2, f"({len(calls)} calls)")
    n = len(calls)
    cap = model.forward(ids, model.new_cache(32), capture=(0,)).captured
    check("gemma4 fused: a capturing forward on the fused path too", len(calls) == n + 2 * 5)
    fused_layer.linear = run
    err = (cap.float() - torch_cap.float()).abs().max().item()
    check("gemma4 fused: a capture is the layer's output", err <= torch_cap.float().abs().max().item() / 64,
          f"(max diff {err:.1e})")
    _fused_checks("gemma4 fused", model, prompt, fused, torch_form, 14)
    check("gemma4 fused: not row-exact with its weights on the CPU", not model.row_exact(4))
    on_device = fused_layer.on_device
    fused_layer.on_device = lambda w: True  # as on CUDA: the model row-exact up to 16 rows (32 experts, top 2)
    try:
        check("gemma4 fused: row-exact up to its MoE kernels' 16 rows", model.row_exact(16) and not model.row_exact(17))
        _row_exact_generation("gemma4 fused", model, prompt)
    finally:
        fused_layer.on_device = on_device


def _row_exact_generation(name: str, model, prompt) -> None:
    """:func:`_row_exact_generation_k` with k = 4 drafts a step."""
    _row_exact_generation_k(name, model, prompt, 4)


def _row_exact_generation_k(name: str, model, prompt, k: int) -> None:
    """A row-exact model (its weights taken as on CUDA by the caller): plain decoding on 1-row steps, verify steps of
    k + 1 rows unpadded, and speculative output with a spoiled oracle's drafts equal to plain decoding's."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _engine_util import SpoiledOracle
    from specdec.engine import SpeculativeGenerator
    one = SpeculativeGenerator(model, None, 0, cuda_graphs=False, batch_invariant=True)
    plain = one.generate(prompt, 14)
    gen = SpeculativeGenerator(model, SpoiledOracle(prompt + plain.token_ids, 256, spoil=0.25), k, cuda_graphs=False,
                               batch_invariant=True)
    spec = gen.generate(prompt, 14)
    check(f"{name}, row-exact: 1-row plain steps, {k + 1}-row verify steps; speculative output equals plain decoding",
          one.row_exact and one.pad_to is None and gen.row_exact and gen.pad_to == k + 1
          and spec.token_ids == plain.token_ids and sum(spec.stats.accepted) > 0, f"(accepted {spec.stats.accepted})")


def gemma4_small_fused() -> None:
    """A small Gemma 4 (E2B/E4B's kind: the last layers reuse earlier layers' keys and values, a per-layer input into
    every layer, the shared layers' MLP twice as wide, no experts) on its fused layers on the CPU: a tiny random fp16
    one (a sliding and a full layer with their own keys and values, then one of each sharing them) with fused_layer and
    the norms forced, in the interpreter. Every layer is eligible; the fused GEMM runs the per-layer inputs' projection
    (one a forward), q alone in a shared layer, and each layer's per-layer gate and projection; the logits equal the
    torch layers' within fp16 tolerance; speculative output equals plain decoding, also row-exact (its weights taken as
    on CUDA: 1-row plain steps, unpadded verify steps)."""
    from specdec.models import fused_layer, fused_ops, gemma4
    s, f = "sliding_attention", "full_attention"
    model, prompt, logits = _tiny_fused_model({
        "model_type": "gemma4_text", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16,
        "global_head_dim": 32, "attention_k_eq_v": False, "enable_moe_block": False,
        "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 256, "num_kv_shared_layers": 2,
        "use_double_wide_mlp": True, "sliding_window": 6, "layer_types": [s, f, s, f], "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512, "final_logit_softcapping": 30.0, "tie_word_embeddings": False,
        "rope_parameters": {f: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
                            s: {"rope_type": "default", "rope_theta": 1e4}}})
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _gemma_util import randomise_gemma4
    randomise_gemma4(model)
    torch_form = logits()
    check("gemma4 small fused: on by default (SPECDEC_GEMMA4_SMALL_FUSED)", gemma4.SMALL_FUSED)
    gemma4.SMALL_FUSED = False
    check("gemma4 small fused: switched off, the KV-shared layers and those with a per-layer input off the fused path",
          not any(layer.fused_path for layer in model.layers))
    gemma4.SMALL_FUSED = True
    check("gemma4 small fused: every layer eligible, two of them KV-shared with double-wide MLPs",
          all(layer.fused_path for layer in model.layers)
          and [layer.self_attn.shared for layer in model.layers] == [False, False, True, True]
          and model.layers[3].mlp.down_proj.weight.shape[1] == 2 * model.layers[1].mlp.down_proj.weight.shape[1])
    forced = lambda x: x.dtype == torch.float16 and not torch.is_grad_enabled()  # noqa: E731  (the CPU, forced)
    fused_layer.usable, fused_ops.usable = forced, forced
    weights, run, tails, add_norm, glu, glu_mul = [], fused_layer.linear, [], fused_ops.add_norm, [], fused_ops.glu_mul
    fused_layer.linear = lambda x, w, **k: weights.append(w.data_ptr()) or run(x, w, **k)
    fused_ops.add_norm = lambda *a, **k: tails.append(len(a) > 4) or add_norm(*a, **k)
    fused_ops.glu_mul = lambda *a, **k: glu.append(k["gelu"]) or glu_mul(*a, **k)
    fused = logits()
    fused_layer.linear = run
    # a layer's tail: x + norm(f), then gelu(gate) * its per-layer input, then (x + norm(projection)) * scalar
    check("gemma4 small fused: each layer's tail in three kernels (fused_ops.DENSE_TAIL)",
          tails == 2 * 4 * [False, True] and glu == 2 * 4 * [True], f"({len(tails)} add_norm, {len(glu)} glu_mul)")
    fused_ops.DENSE_TAIL = False
    fused_ops.add_norm, fused_ops.glu_mul = add_norm, glu_mul
    off = logits()
    fused_ops.DENSE_TAIL = True
    err = max((a.float() - b.float()).abs().max().item() for a, b in zip(fused, off))
    check("gemma4 small fused: the logits with the tail kernels as without (their GELU the fused GEMM's, not torch's)",
          err <= max(b.float().abs().max().item() for b in off) / 64, f"(max diff {err:.1e})")
    named = [model.per_layer_model_projection.weight] + [w for layer in model.layers[2:] for w in (
        layer.self_attn.q_proj.weight, layer.per_layer_input_gate.weight, layer.per_layer_projection.weight)]
    # a forward: the per-layer inputs' projection, then per layer q/k/v (q alone where shared), o_proj, gate/up,
    # down_proj, the per-layer gate and projection
    check("gemma4 small fused: the fused GEMMs ran, the per-layer inputs' and the shared layers' q among them",
          len(weights) == 2 * (1 + 4 * 6) and all(weights.count(w.data_ptr()) == 2 for w in named),
          f"({len(weights)} calls)")
    _fused_checks("gemma4 small fused", model, prompt, fused, torch_form, 14)
    on_device = fused_layer.on_device
    fused_layer.on_device = lambda w: True  # as on CUDA
    try:
        check("gemma4 small fused: row-exact (no experts: at any row count the fused layers take)", model.row_exact(16))
        _row_exact_generation("gemma4 small fused", model, prompt)
    finally:
        fused_layer.on_device = on_device
    from specdec.engine import SpeculativeGenerator
    # the static steps' attention kernel (forced on the CPU): a KV-shared layer's q norm and RoPE alone (no keys,
    # values or cache write), the others' q/k norms, RoPE, v norm and write; against the eager steps
    from specdec.models import rope_write
    from specdec.models.gemma4 import Gemma4Attention
    eager = SpeculativeGenerator(model, None, 0, cuda_graphs=False, batch_invariant=False).generate(prompt, 14)
    Gemma4Attention.fast_path = lambda self, x, start: isinstance(start, torch.Tensor)
    rope_write.supported = rope_write.supported_q = lambda *a: True
    nrw, kernel_calls = rope_write.norm_rope_write, []
    rope_write.norm_rope_write = lambda q, k, *a, **kw: kernel_calls.append(k is None) or nrw(q, k, *a, **kw)
    static = SpeculativeGenerator(model, None, 0, cuda_graphs=False, batch_invariant=True).generate(prompt, 14)
    check("gemma4 small fused: static steps ran the attention kernel, queries alone in the KV-shared layers",
          len(kernel_calls) >= 4 * 13 and kernel_calls.count(True) == kernel_calls.count(False),
          f"({kernel_calls.count(True)} of {len(kernel_calls)} calls queries alone)")
    _kernel_generation("gemma4 small fused", model, prompt, eager, static)
    # a dense layer without a per-layer input (Gemma 4 31B's kind): its tail one kernel, the bits of the three
    for layer in model.layers:
        layer.per_layer = False
    fused_ops.DENSE_TAIL = False
    off = logits()
    fused_ops.DENSE_TAIL, tails[:] = True, []
    fused_ops.add_norm = lambda *a, **k: tails.append(len(a) > 4) or add_norm(*a, **k)
    on = logits()
    fused_ops.add_norm = add_norm
    check("gemma4 fused, no per-layer input: each layer's tail in one kernel, the bits of the torch ops",
          tails == 2 * 4 * [True] and all(torch.equal(a, b) for a, b in zip(on, off)), f"({len(tails)} calls)")


def _tiny_llama():
    """A random fp16 Llama of 2 layers (64 wide, 4 / 2 heads), seed 0."""
    from specdec.models.llama import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(model_type="llama", vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return model.half().eval()


def dflash_fast() -> None:
    """drafters/dflash_fast.py (the DFlash drafter's static steps on the fused kernels) against the eager
    drafter, fp16 (the interpreter's bf16 is not the GPU's): the q/k norm + RoPE + write kernel against
    RMSNorm and ``apply_rope``; then a random drafter of the tiny shape drafting along a greedy
    generation with its static steps on the fast path (its context buffers grown on the way), each
    block's logits against the eager ``block_logits`` of the same state, and the generation equal to
    plain decoding."""
    from specdec.drafters import dflash_fast as df
    from specdec.drafters import draft_vocab as dv
    from specdec.drafters.dflash import DFlashDrafter
    from specdec.models import fused_layer as fl
    from specdec.engine import SpeculativeGenerator
    from specdec.models.layers import RMSNorm, RotaryEmbedding, apply_rope, unit_rms_norm
    from specdec.models.rope_write import norm_rope_write
    from specdec.sampling import SamplingParams
    from specdec.shapes import build_shape
    from specdec.train.dflash_batch import new_dflash_config, new_dflash_model
    g = torch.Generator().manual_seed(0)
    for h, hkv, d, r in ((4, 2, 16, 16), (6, 2, 32, 16)):
        t, cap = 5, 24
        qn, kn = RMSNorm(d, 1e-6), RMSNorm(d, 1e-6)
        qn.weight.data, kn.weight.data = torch.rand(d, generator=g) + 0.5, torch.rand(d, generator=g) + 0.5
        q = (torch.randn(t, h, d, generator=g) * 3).half()
        k, v = (torch.randn(t, hkv, d, generator=g) * 3).half(), torch.randn(t, hkv, d, generator=g).half()
        rot = RotaryEmbedding(d, 10000.0, partial_factor=r / d)
        cos, sin = rot.cos_sin(torch.arange(cap), torch.float16)
        start = torch.tensor(7)
        ck, cv = torch.zeros(hkv, cap, d).half(), torch.zeros(hkv, cap, d).half()
        got_q = norm_rope_write(q, k, v, qn.fp32_scale(), kn.fp32_scale(), 1e-6, cos, sin, ck, cv, start)
        c7, s7 = cos[7:7 + t], sin[7:7 + t]
        want_q = apply_rope(qn(q.float()).half().transpose(0, 1), c7, s7)
        want_k = apply_rope(kn(k.float()).half().transpose(0, 1), c7, s7)
        err = max((got_q.float() - want_q.float()).abs().max().item(), (ck[:, 7:7 + t].float() - want_k.float()).abs().max().item())
        check(f"norm+rope+write h={h} d={d} r={r}: queries and keys equal the eager ops", err < 2e-2, f"(max diff {err:.1e})")
        check(f"norm+rope+write h={h} d={d} r={r}: values at their positions, nothing else written",
              torch.equal(cv[:, 7:7 + t], v.transpose(0, 1)) and not ck[:, :7].any() and not ck[:, 7 + t:].any())
        # a target's static step (layers.NORM_ROPE): cos / sin given a row for each of the step's rows
        ck3, cv3 = torch.zeros_like(ck), torch.zeros_like(cv)
        got_q3 = norm_rope_write(q, k, v, qn.fp32_scale(), kn.fp32_scale(), 1e-6, c7.contiguous(), s7.contiguous(),
                                 ck3, cv3, start, row_tables=True)
        check(f"norm+rope+write h={h} d={d} r={r}: tables by row, the bits of tables by position",
              torch.equal(got_q3, got_q) and torch.equal(ck3, ck) and torch.equal(cv3, cv))
        ck4, cv4 = torch.zeros_like(ck), torch.zeros_like(cv)  # Gemma 4's v_norm: the values normed as stored
        got_q4 = norm_rope_write(q, k, v, qn.fp32_scale(), kn.fp32_scale(), 1e-6, c7.contiguous(), s7.contiguous(),
                                 ck4, cv4, start, row_tables=True, v_norm=True)
        want_v = unit_rms_norm(v.float(), 1e-6).half().transpose(0, 1)
        verr = (cv4[:, 7:7 + t].float() - want_v.float()).abs().max().item()
        check(f"norm+rope+write h={h} d={d} r={r}: v_norm: the values unit-RMS-normed, queries and keys as before",
              verr < 2e-3 and torch.equal(got_q4, got_q3) and torch.equal(ck4, ck3) and not cv4[:, :7].any(),
              f"(max diff {verr:.1e})")
        ck2 = torch.zeros_like(ck)
        check(f"norm+rope+write h={h} d={d}: keys alone (no queries) the same",
              norm_rope_write(None, k, v, None, kn.fp32_scale(), 1e-6, cos, sin, ck2, cv, start) is None and torch.equal(ck2, ck))
    # a drafter along a generation: the fast static steps on the CPU (usable() wants CUDA: forced here);
    # 2 layers and blocks of 8, for the interpreter's time. With int8 weights (use_int8_weights), each block
    # against an eager copy of the drafter on the int8 rows' values, over the same context buffers
    model = build_shape("tiny", torch.device("cpu"), torch.float16)
    cfg = new_dflash_config(model, 2, 8, mask_token_id=model.config.vocab_size - 1)
    df.usable = lambda m, x: df.eligible(m)
    prompt = torch.randint(0, 500, (12,), generator=g).tolist()
    plain = SpeculativeGenerator(model, None, 0, cuda_graphs=False).generate(prompt, 16)
    for int8 in (False, True):
        name = "dflash fast int8" if int8 else "dflash fast"
        drafter = DFlashDrafter(new_dflash_model(model, cfg, init="random").half().eval(), model)
        eager = drafter
        if int8:  # with a draft vocabulary (every other token id), its head rows read as int8 too
            drafter.use_int8_weights()
            vocab_ids = range(0, model.config.vocab_size, 2)
            drafter.use_draft_vocab(vocab_ids)
            eager = DFlashDrafter(fl.int8_values_(copy.deepcopy(drafter.model)), model)
            eager.use_draft_vocab(vocab_ids)
            eager.vocab.rows = drafter.vocab.rows_int8.dequantized(drafter.vocab.rows.dtype)
            # the vocabulary's GEMM on the CPU (usable() wants CUDA: forced for it alone)
            dv.fused_layer = types.SimpleNamespace(usable=lambda x: x.dtype == torch.float16 and not torch.is_grad_enabled(),
                                                   linear=fl.linear, Int8Rows=fl.Int8Rows)
        drafter.static_steps = drafter.static_flush = True
        drafter.min_capacity = 16  # the prompt's 32 positions, then grown along the way
        check(f"{name}: the tiny drafter is eligible", df.eligible(drafter.model))
        diffs, blocks = [], []
        propose = drafter.propose

        def checked(last, k, params, gen):
            drafter.catch_up()
            if eager is not drafter:  # the same context (the int8 context write's), the eager block on the int8 values
                eager.kv, eager.length, eager._written, eager._part = drafter.kv, drafter.length, drafter._written, drafter._part
            want = eager.block_logits(last)  # the eager block over the same context
            out = propose(last, k, params, gen)  # the greedy static block
            st = drafter._static_block(SamplingParams(temperature=1.0), logits=True)  # its logits (the same fast path, the same writes)
            got = st(last, drafter.length)
            blocks.append(st.fast is not None and drafter._static.fast is not None and st.fast.int8 == int8)
            fin = torch.isfinite(want)  # (a draft vocabulary's logits are -inf off it: the same tokens in both)
            diffs.append((got[fin] - want[fin]).abs().max().item() / max(1.0, want[fin].abs().max().item())
                         if torch.equal(fin, torch.isfinite(got)) else float("inf"))
            return out
        drafter.propose = checked
        gen = SpeculativeGenerator(model, drafter, 7, cuda_graphs=False)
        res = gen.generate(prompt, 16)
        check(f"{name}: every block on the fast path", bool(blocks) and all(blocks), f"({len(blocks)} blocks)")
        check(f"{name}: the context buffers grew past the prompt's 32 positions", drafter.kv[0].k.shape[1] > 32)
        check(f"{name}: each block's logits equal the eager block's", max(diffs) < 2e-3, f"(max relative diff {max(diffs):.1e})")
        check(f"{name}: the generation equals plain decoding", res.token_ids == plain.token_ids)
        dv.fused_layer = fl


def mtp_fast() -> None:
    """drafters/mtp.py's FastLayer (a Llama-family MTP head on the fused GEMMs) against the eager head,
    fp16: a random head of a tiny Llama drafting k = 3 along a greedy generation, its static proposals on
    the fast path and, in step, the same proposals eagerly: the logits within fp16 tolerance; and the
    generation equal to plain decoding."""
    from specdec.drafters import mtp
    from specdec.drafters.mtp_dir import new_mtp_block
    from specdec.engine import SpeculativeGenerator
    from specdec.models import fused_layer
    model = _tiny_llama()
    fused_layer.usable = lambda x: x.dtype == torch.float16 and not torch.is_grad_enabled()  # the CPU, forced
    mtp.FAST = True
    fast = mtp.MTPDrafter(new_mtp_block(model, generator=torch.Generator().manual_seed(1)).half().eval(), model)
    fast.static_steps = True
    check("mtp fast: the tiny Llama head is eligible", mtp.FastLayer.eligible(fast.block.layers[0]))
    eager = fast.spawn()  # the same weights, its own cache
    eager.static_steps = True
    eager.fast_layer = lambda: None
    diffs, used = [], []
    propose, observe, begin = fast.propose, fast.observe, fast.begin

    def both_begin(ids, out):
        begin(ids, out)
        eager.begin(ids, out)

    def both_observe(tokens, out):
        observe(tokens, out)
        eager.observe(tokens, out)

    def both_propose(last, k, params, gen):
        got = propose(last, k, params, gen)
        eager.propose(last, k, params, gen)
        used.append(fast._fast_layer is not None)
        diffs.append((fast.last_logits - eager.last_logits).abs().max().item() / max(1.0, eager.last_logits.abs().max().item()))
        return got
    fast.begin, fast.observe, fast.propose = both_begin, both_observe, both_propose
    prompt = torch.randint(0, 90, (10,), generator=torch.Generator().manual_seed(2)).tolist()
    res = SpeculativeGenerator(model, fast, 3, cuda_graphs=False).generate(prompt, 24)
    plain = SpeculativeGenerator(model, None, 0, cuda_graphs=False).generate(prompt, 24)
    check("mtp fast: every proposal on the fast path", bool(used) and all(used), f"({len(used)} proposals)")
    check("mtp fast: each proposal's logits equal the eager head's", max(diffs) < 2e-2, f"(max relative diff {max(diffs):.1e})")
    check("mtp fast: the generation equals plain decoding", res.token_ids == plain.token_ids)


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
    const = {"R": 64, "HALF": 32, "D": 128, "USE_GDC": False}  # a partial rotary: rotated and copied lanes
    sig = {n: ptrs.get(n, "constexpr" if n in const else "i32") for n in fn.arg_names}
    ptx = triton.compile(ASTSource(fn, sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                         options=dict(rw.COMPILE_OPTIONS)).asm["ptx"]
    check("rope-ptx: the product is rounded (mul.rn.bf16)", "mul.rn.bf16" in ptx)
    check("rope-ptx: then the sum (add.rn.bf16)", "add.rn.bf16" in ptx)
    check("rope-ptx: no FMA", "fma" not in ptx)


def pdl_ptx() -> None:
    """models/pdl.py's promise, in the PTX compiled for an H100/H200 (sm_90) with USE_GDC on: every
    global load and store of the fused layer's GEMM, the fused norm, RoPE + the cache write, the q/k norm +
    RoPE + write kernel, the three MoE kernels and the three Gated DeltaNet step kernels comes
    after ``griddepcontrol.wait`` (so a kernel launched early reads nothing before the one before it has
    finished), and ``launch_dependents`` comes first; the MoE add-norm-router kernel loads its router rows (weights)
    before the wait, its rows and every store after it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from specdec.models import delta_kernel, expert_kernel, fused_layer, fused_ops, rope_write
    gemm_ptrs = {"x": "*bf16", "w": "*bf16", "y": "*bf16", "ws": "*fp32", "cnt": "*i32", "sc": "*fp32"}
    gemm_const = {"SILU": True, "BM": 16, "BN": 32, "BK": 64, "PER_LINE": 64, "LINES": 16, "FENCE": True, "SCALED": False,
                  "GELU": False}
    cases = {"gemm": (fused_layer._kernel, gemm_ptrs, {**gemm_const, "SPLIT": 1}),
             "gemm-split": (fused_layer._kernel, gemm_ptrs, {**gemm_const, "SPLIT": 3}),
             "gemm-gelu": (fused_layer._kernel, gemm_ptrs, {**gemm_const, "SPLIT": 2, "GELU": True}),
             "gemm-int8": (fused_layer._kernel, {**gemm_ptrs, "w": "*i8"},
                           {**gemm_const, "SPLIT": 3, "SCALED": True}),
             "norm": (fused_ops._norm_kernel, {"x": "*bf16", "res": "*bf16", "w": "*fp32", "y": "*bf16", "s": "*bf16",
                                               "eps": "fp32", "wr": "*fp32", "eps_r": "fp32"},
                      {"HAS_RES": True, "BLOCK": 1024, "RES_NORM": False}),
             "norm-prenormed": (fused_ops._norm_kernel, {"x": "*bf16", "res": "*bf16", "w": "*fp32", "y": "*bf16",
                                                         "s": "*bf16", "eps": "fp32", "wr": "*fp32", "eps_r": "fp32"},
                                {"HAS_RES": True, "BLOCK": 1024, "RES_NORM": True}),
             "sandwich-tail": (fused_ops._tail_kernel, {"x": "*bf16", "f": "*bf16", "e": "*bf16", "w1": "*fp32",
                                                        "w2": "*fp32", "w": "*fp32", "sc": "*bf16", "y": "*bf16",
                                                        "eps1": "fp32", "eps2": "fp32", "eps": "fp32"},
                               {"BLOCK": 4096}),
             "add-norm": (fused_ops._add_norm_kernel, {"x": "*bf16", "v": "*bf16", "w": "*fp32", "sc": "*bf16", "y": "*bf16",
                                                       "eps": "fp32"}, {"BLOCK": 2048, "SCALAR": True}),
             "glu-mul": (fused_ops._silu_mul_kernel, {"g": "*bf16", "u": "*bf16", "y": "*bf16"}, {"BLOCK": 1024, "GELU": True}),
             "rope": (rope_write._rope_write_kernel, {n: "*bf16" for n in ("q", "k", "v", "cos", "sin", "q_out", "ck", "cv")}
                      | {"slots": "*i64", "pos": "*i64"}, {"R": 64, "HALF": 32, "D": 64}),
             "norm-rope": (rope_write._norm_rope_kernel, {n: "*bf16" for n in ("q", "k", "v", "cos", "sin", "q_out", "ck", "cv")}
                           | {"qw": "*fp32", "kw": "*fp32", "start": "*i64", "eps": "fp32"},
                           {"R": 64, "HALF": 32, "D": 64, "HAS_Q": True}),
             "norm-rope-rows": (rope_write._norm_rope_kernel, {n: "*bf16" for n in ("q", "k", "v", "cos", "sin", "q_out", "ck", "cv")}
                                | {"qw": "*fp32", "kw": "*fp32", "start": "*i64", "eps": "fp32"},
                                {"R": 64, "HALF": 32, "D": 256, "HAS_Q": True, "ROW_TABLES": True}),
             "norm-rope-vnorm": (rope_write._norm_rope_kernel, {n: "*bf16" for n in ("q", "k", "v", "cos", "sin", "q_out", "ck", "cv")}
                                 | {"qw": "*fp32", "kw": "*fp32", "start": "*i64", "eps": "fp32"},
                                 {"R": 512, "HALF": 256, "D": 512, "HAS_Q": True, "ROW_TABLES": True, "V_NORM": True}),
             "moe-route": (expert_kernel._route_kernel, {"logits": "*bf16", "idx": "*i32", "wts": "*bf16", "live": "*i64",
                                                         "pes": "*bf16"},
                           {"LIVE": True, "SHARED": True, "K": 8, "KB": 16, "BE": 256, "SCALED": False}),
             "moe-route-scaled": (expert_kernel._route_kernel, {"logits": "*bf16", "idx": "*i32", "wts": "*bf16",
                                                                "live": "*i64", "pes": "*bf16"},
                                  {"LIVE": True, "SHARED": False, "K": 8, "KB": 8, "BE": 128, "SCALED": True}),
             "moe-gate-up": (expert_kernel._gate_up_kernel, {n: "*bf16" for n in ("x", "w", "sw", "h")}
                             | {"idx": "*i32", "live": "*i64"}, {"LIVE": True, "BN": 4, "BK": 512, "PER_LINE": 64, "LINES": 32,
                                                                "GELU": False}),
             "moe-gate-up-gelu": (expert_kernel._gate_up_kernel, {n: "*bf16" for n in ("x", "w", "sw", "h")}
                                  | {"idx": "*i32", "live": "*i64"}, {"LIVE": True, "BN": 4, "BK": 512, "PER_LINE": 64,
                                                                     "LINES": 32, "GELU": True}),
             "moe-combine": (expert_kernel._combine_kernel, {n: "*bf16" for n in ("hin", "wts", "w", "sw", "y")}
                             | {"idx": "*i32", "live": "*i64"}, {"K": 8, "P": 9, "LIVE": True, "BN": 4, "BK": 512, "PC": 4,
                                                                "PER_LINE": 64, "LINES": 8}),
             "moe-combine-stream": (expert_kernel._combine_stream_kernel, {n: "*bf16" for n in ("hin", "wts", "w", "sw", "y")}
                                    | {"idx": "*i32", "live": "*i64"}, {"K": 8, "SHARED": True, "LIVE": True, "BN": 2,
                                                                       "BI": 512, "KP": 8}),
             "delta-conv": (delta_kernel._conv_gates_kernel, {n: "*bf16" for n in ("proj", "conv", "bo", "ao", "a_log", "dt_bias")}
                            | {n: "*fp32" for n in ("w", "q", "k", "v", "g", "beta")} | {"start": "*i64", "scale": "fp32"},
                            {"DK": 128, "DV": 128, "KS": 4, "BLOCK": 128, "RB": 16, "START_PTR": True}),
             "delta-recurrent": (delta_kernel._recurrent_cache_kernel, {n: "*fp32" for n in ("q", "k", "v", "g", "beta", "s0",
                                                                                            "states", "out")}
                                 | {"start": "*i64", "live": "*i64"}, {"CACHE": True, "LIVE": True, "DK": 128, "DV": 128,
                                                                      "BV": 32, "START_PTR": True}),
             "delta-step": (delta_kernel._step_kernel, {n: "*bf16" for n in ("proj", "conv", "bo", "ao", "a_log", "dt_bias")}
                            | {n: "*fp32" for n in ("w", "states", "out")} | {"start": "*i64", "live": "*i64", "scale": "fp32"},
                            {"LIVE": True, "DK": 128, "DV": 128, "BV": 32, "KS": 4, "START_PTR": True, "EARLY": True}),
             "norm-router": (expert_kernel._norm_router_kernel, {n: "*bf16" for n in ("x", "res", "s", "y", "rw", "logits")}
                             | {"w": "*fp32", "live": "*i64", "eps": "fp32"}, {"LIVE": True, "RB": 2, "BLOCK": 2048}),
             "delta-norm": (delta_kernel._gated_norm_kernel, {"o": "*fp32", "z": "*bf16", "w": "*fp32", "y": "*bf16",
                                                              "eps": "fp32"}, {"DV": 128})}
    # the one-kernel DeltaNet step's row count unspecialised: Triton's build for T == 1 gave row 0 other bits than the
    # general build on an H100 (scripts/check_delta_rows.py), and speculative output differed from plain decoding
    check("pdl-ptx delta-step: its kernel takes T (the row count) unspecialised",
          [p.name for p in delta_kernel._step_kernel.params if p.do_not_specialize] == ["start", "T"])
    for name, (fn, ptrs, const) in cases.items():
        const = {**const, "USE_GDC": True}
        sig = {n: ptrs.get(n, "constexpr" if n in const else "i32") for n in fn.arg_names}
        ptx = triton.compile(ASTSource(fn, sig, constexprs=const), target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        body = ptx[ptx.index(".entry"):]
        wait = body.find("griddepcontrol.wait")
        first_mem = min(i for i in (body.find("ld.global"), body.find("st.global"), body.find("cp.async")) if i >= 0)
        if name == "delta-step":  # the start and the live state loaded before the wait (only an earlier forward wrote
            # them), everything else after it
            check("pdl-ptx delta-step: launch_dependents, the start's and the state's loads, the wait, then the rows' "
                  "loads and every store", 0 <= body.find("griddepcontrol.launch_dependents") < body.find("ld.global") < wait
                  < body.find("ld.global", wait) and body.find("st.global") > wait
                  and body.count("ld.global", 0, wait) >= 2)
            continue
        if name != "norm-router":
            check(f"pdl-ptx {name}: launch_dependents, then wait, then the first global access",
                  0 <= body.find("griddepcontrol.launch_dependents") < wait < first_mem)
        if name == "norm-router":  # the router rows loaded before the wait (weights), the step's rows after it
            check("pdl-ptx norm-router: launch_dependents, the router rows' loads, the wait, then the rows' loads and "
                  "every store", 0 <= body.find("griddepcontrol.launch_dependents") < body.find("ld.global") < wait
                  < body.find("ld.global", wait) < body.find("st.global") and body.find("st.global") > wait)
            continue
        if name == "gemm-split":  # a program's partials fenced at GPU scope before it counts in, the count atomic
            fence, atom = body.find("fence.acq_rel.gpu"), body.find("atom.global")
            check("pdl-ptx gemm-split: the partials' stores, a GPU-scope fence, then the tile's atomic count",
                  0 <= body.find("st.global") < fence < atom)
        if name in ("gemm", "gemm-split", "gemm-gelu", "gemm-int8", "moe-gate-up", "moe-combine"):  # weights that never depend on the kernel before
            # (the GEMM's, the shared expert's) prefetched before the wait
            check(f"pdl-ptx {name}: the weight rows prefetched into L2 before the wait",
                  0 <= body.find("prefetch.global.L2") < wait)


if __name__ == "__main__":
    {"split": split, "split-gated": split_gated, "delta": delta, "delta-step": delta_step, "experts": experts, "moe": moe, "norm-router": norm_router, "linear": linear, "rope": rope, "fused": fused, "fused-layer": fused_layer,
     "dflash-fast": dflash_fast, "mtp-fast": mtp_fast, "hybrid-fused": hybrid_fused, "gemma-fused": gemma_fused, "gemma4-moe": gemma4_moe, "gemma4-fused": gemma4_fused, "gemma4-small-fused": gemma4_small_fused, "rope-ptx": rope_ptx, "pdl-ptx": pdl_ptx}[sys.argv[1]]()
