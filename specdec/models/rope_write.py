"""RoPE and the KV-cache write of a batched step in one kernel (issue 10: fewer, larger kernels).

In a batched step an attention layer's rotary embedding and cache write are ~15 small kernels:
per rotated tensor a negation, a concatenation, two products and a sum (``layers.apply_rope``),
then the index writes of keys and values (``cache.BatchKVCache.update``) with their layout copies.
On the H200 a SmolLM2 step ran ~1,090 kernels (~36 a layer, BENCHMARKS.md, session 3), most of
1-3 us. Here one Triton program per (row, head) rotates a query head into a fresh ``[B, T, H, d]``
tensor, or rotates a key head and writes it with its value head at the row's slot and position.

Bits: the rotation rounds where the eager ops round (each product to the model dtype, then their
sum), so the outputs equal the eager ones bitwise and a step's logits do not change. That needs the
compiler's floating-point contraction off (``COMPILE_OPTIONS``): with it on (Triton's default) the
H200 run of 2026-12-01 differed from the eager ops in q and k, and the kernel's PTX shows why: the
product and the sum became one ``fma.rn.bf16x2``, the product never rounded. With it off the PTX is
``mul.rn.bf16x2`` then ``add.rn.bf16x2`` (tests/test_triton_interpret.py compiles the kernel for sm_90
on the CPU and checks that). CUDA, bf16 or fp16 only. Off until measured on the GPU again:
``SPECDEC_FUSED_ROPE=1`` turns it on (``layers.FUSED_ROPE_WRITE``); ``scripts/check_rope_write.py``
compares it with the eager ops and times it.
"""

from __future__ import annotations

import torch

from ..cache import BatchKVCache, BatchWrite, KVCache
from . import pdl

try:  # Triton ships with CUDA builds of torch; CPU-only installs have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def _takes(q: torch.Tensor, cos: torch.Tensor) -> bool:
    """The kernels' own conditions: Triton, CUDA, bf16/fp16 heads of a power-of-two size with contiguous features,
    tables of that dtype, contiguous, an even rotary width within the head."""
    d, r = q.shape[-1], cos.shape[-1]
    return (triton is not None and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and cos.dtype == q.dtype
            and d & (d - 1) == 0 and r % 2 == 0 and r <= d and q.stride(-1) == 1 and cos.is_contiguous())


def supported_q(q: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether :func:`norm_rope_write` takes queries alone (``q [T, H, d]``, a static step's tables a row a row)."""
    return q.dim() == 3 and _takes(q, cos)


def supported(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, cache, w) -> bool:
    """Whether :func:`rope_write` takes these (else the eager ops run): a batched step (``q [B, T, H,
    d]``, a :class:`BatchKVCache` and a :class:`BatchWrite`) or one sequence's static step (``q [T, H,
    d]``, a :class:`KVCache` and the step's start as a 0-d device tensor)."""
    if q.dim() == 4:
        layout = isinstance(cache, BatchKVCache) and isinstance(w, BatchWrite)
    else:
        layout = (q.dim() == 3 and type(cache) is KVCache and isinstance(w, torch.Tensor) and w.dim() == 0
                  and w.dtype == torch.int64 and cache.k.shape[-1] == cache.v.shape[-1] == q.shape[-1])
    return layout and _takes(q, cos) and k.stride(-1) == 1


# launch options: one warp a (row, head); no contraction of a product and a sum into an FMA
COMPILE_OPTIONS = {"num_warps": 1, "enable_fp_fusion": False}

if triton is not None:
    @triton.jit(do_not_specialize=["T", "H", "pos_step"])
    def _rope_write_kernel(q, k, v, cos, sin, q_out, ck, cv, slots, pos, T, H, pos_step,
                           sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sob, sot, soh, scs, sch, scp, spb, spt,
                           R: tl.constexpr, HALF: tl.constexpr, D: tl.constexpr, USE_GDC: tl.constexpr):
        if USE_GDC:  # models/pdl.py
            pdl.begin()
        # a row's position: pos[b, t] (batched), or the step's start + t (one sequence: pos_step 1,
        # pos the 0-d start, its strides 0)
        row, head = tl.program_id(0), tl.program_id(1)
        b, t = row // T, row % T
        i = tl.arange(0, D)
        rot = i < R
        partner = tl.where(i < HALF, i + HALF, i - HALF)
        kh = tl.maximum(head - H, 0)
        slot = tl.load(slots + b)
        p = tl.load(pos + b * spb + t * spt) + t * pos_step
        if head < H:
            src = q + b * sqb + t * sqt + head * sqh
            dst = q_out + b * sob + t * sot + head * soh
        else:
            src = k + b * skb + t * skt + kh * skh
            dst = ck + slot * scs + kh * sch + p * scp
        x = tl.load(src + i)
        xp = tl.load(src + partner, mask=rot, other=0.0)
        c = tl.load(cos + row * R + i, mask=rot, other=0.0).to(tl.float32)
        s = tl.load(sin + row * R + i, mask=rot, other=0.0).to(tl.float32)
        a = (x.to(tl.float32) * c).to(x.dtype)  # xr * cos, rounded as the eager product is
        bb = (xp.to(tl.float32) * s).to(x.dtype)  # [x2, x1] * sin, its first half negated (cos_sin)
        tl.store(dst + i, tl.where(rot, (a.to(tl.float32) + bb.to(tl.float32)).to(x.dtype), x))
        if head >= H:
            val = tl.load(v + b * svb + t * svt + kh * svh + i)
            tl.store(cv + slot * scs + kh * sch + p * scp + i, val)


def rope_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               cache: BatchKVCache, w: BatchWrite) -> torch.Tensor:
    """``q [B, T, H, d]``, ``k``/``v [B, T, Hkv, d]`` (before RoPE; any strides, ``d`` contiguous),
    ``cos``/``sin`` rows ``[B * T, r]`` in the model dtype -> the rotated queries ``[B, H, T, d]``
    (a view of a ``[B, T, H, d]`` tensor); the rotated keys and the values are written at each row's
    slot (``w.index``) and positions (``w.pos``), as ``layers.apply_rope`` and
    :meth:`BatchKVCache.update` would."""
    b, t, h, d = q.shape
    hkv, r = k.shape[2], cos.shape[-1]
    q_out = torch.empty(b, t, h, d, dtype=q.dtype, device=q.device)
    ck, cv = cache.k, cache.v
    pos = w.pos
    _rope_write_kernel[(b * t, h + hkv)](
        q, k, v, cos, sin, q_out, ck, cv, w.index, pos, t, h, 0,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), q_out.stride(0), q_out.stride(1), q_out.stride(2),
        ck.stride(0), ck.stride(1), ck.stride(2), pos.stride(0), pos.stride(1),
        R=r, HALF=r // 2, D=d, **COMPILE_OPTIONS, **pdl.options(q))
    return q_out.transpose(1, 2)


def rope_write_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   cache: KVCache, start: torch.Tensor) -> torch.Tensor:
    """One sequence's static step: ``q [T, H, d]``, ``k``/``v [T, Hkv, d]`` (before RoPE), ``cos``/``sin
    [T, r]``, ``start`` the step's first position (a 0-d int64 device tensor) -> the rotated queries
    ``[H, T, d]``; the rotated keys and the values are written at positions ``start ..`` of ``cache``,
    as ``layers.apply_rope`` and :meth:`KVCache.update` would."""
    t, h, d = q.shape
    hkv, r = k.shape[1], cos.shape[-1]
    q_out = torch.empty(1, t, h, d, dtype=q.dtype, device=q.device)
    ck, cv = cache.k, cache.v  # [Hkv, L, d]: one slot (stride 0, the slot index never read as such)
    _rope_write_kernel[(t, h + hkv)](
        q, k, v, cos, sin, q_out, ck, cv, start, start, t, h, 1,
        0, q.stride(0), q.stride(1), 0, k.stride(0), k.stride(1),
        0, v.stride(0), v.stride(1), q_out.stride(0), q_out.stride(1), q_out.stride(2),
        0, ck.stride(0), ck.stride(1), 0, 0,
        R=r, HALF=r // 2, D=d, **COMPILE_OPTIONS, **pdl.options(q))
    return q_out[0].transpose(0, 1)


# A DFlash drafter's step (drafters/dflash_fast.py): each head RMS-normed (Qwen3's q_norm / k_norm),
# rotated at its position (a row of the cos / sin tables by position, so no per-step tables), queries
# written out, keys and values stored in the drafter's context buffers. One kernel where the eager ops
# take ~17 (two norms of three kernels each, two rotations of five, the key/value writes).
if triton is not None:
    @triton.jit(do_not_specialize=["T", "H", "Hkv", "eps"])
    def _norm_rope_kernel(q, k, v, qw, kw, cos, sin, q_out, ck, cv, start, T, H, Hkv, eps,
                          sqt, sqh, skt, skh, svt, svh, sot, soh, sch, scp,
                          R: tl.constexpr, HALF: tl.constexpr, D: tl.constexpr, HAS_Q: tl.constexpr,
                          USE_GDC: tl.constexpr, ROW_TABLES: tl.constexpr = False, V_NORM: tl.constexpr = False):
        if USE_GDC:  # models/pdl.py
            pdl.begin()
        t, head = tl.program_id(0), tl.program_id(1)
        nq = H if HAS_Q else 0
        is_q = head < nq
        kh = tl.maximum(head - nq, 0)
        i = tl.arange(0, D)
        rot = i < R
        partner = tl.where(i < HALF, i + HALF, i - HALF)
        p = tl.load(start) + t
        if is_q:
            src = q + t * sqt + head * sqh
            w = qw
        else:
            src = k + t * skt + kh * skh
            w = kw
        x = tl.load(src + i)
        f = x.to(tl.float32)
        inv = 1.0 / tl.sqrt_rn(tl.sum(f * f, 0) / D + eps)
        xn = (f * inv * tl.load(w + i)).to(x.dtype)  # the RMSNorm, rounded to the model dtype
        fp = tl.load(src + partner, mask=rot, other=0.0).to(tl.float32)
        xpn = (fp * inv * tl.load(w + partner, mask=rot, other=0.0)).to(x.dtype)  # the normed partner
        if ROW_TABLES:  # the tables' row: the step's row, or the position
            tr = t.to(tl.int64)
        else:
            tr = p
        c = tl.load(cos + tr * R + i, mask=rot, other=0.0).to(tl.float32)
        s = tl.load(sin + tr * R + i, mask=rot, other=0.0).to(tl.float32)
        a = (xn.to(tl.float32) * c).to(x.dtype)
        b = (xpn.to(tl.float32) * s).to(x.dtype)
        y = tl.where(rot, (a.to(tl.float32) + b.to(tl.float32)).to(x.dtype), xn)
        if is_q:
            tl.store(q_out + t * sot + head * soh + i, y)
        else:
            tl.store(ck + kh * sch + p * scp + i, y)
            vv = tl.load(v + t * svt + kh * svh + i)
            if V_NORM:  # Gemma 4's v_norm: RMS-normalised, no weight, rounded to the model dtype
                vf = vv.to(tl.float32)
                vv = (vf * (1.0 / tl.sqrt_rn(tl.sum(vf * vf, 0) / D + eps))).to(vv.dtype)
            tl.store(cv + kh * sch + p * scp + i, vv)


def norm_rope_write(q: torch.Tensor | None, k: torch.Tensor | None, v: torch.Tensor | None, q_scale: torch.Tensor | None,
                    k_scale: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                    ck: torch.Tensor | None, cv: torch.Tensor | None, start: torch.Tensor, row_tables: bool = False,
                    v_norm: bool = False) -> torch.Tensor | None:
    """``q [T, H, d]`` (or None), ``k``/``v [T, Hkv, d]`` (``d`` contiguous), the fp32 norm scales
    ``[d]``, ``cos``/``sin`` tables ``[P, r]`` by position (model dtype), the context buffers ``ck``/``cv
    [Hkv, L, d]`` (contiguous) and ``start`` (a 0-d int64 device tensor): row ``t`` sits at position
    ``start + t``. Keys are normed, rotated and stored with the values at their positions; the normed,
    rotated queries come back as ``[H, T, d]`` (a view of a ``[T, H, d]`` tensor). What the eager
    ``RMSNorm`` then ``apply_rope`` compute, up to the norm's summation order. ``row_tables``: ``cos``/``sin``
    are ``[T, r]``, a row for each of the step's rows (a target's static step, ``layers.NORM_ROPE``), not
    tables by position. A target's :class:`KVCache` ``k``/``v`` are such buffers. ``v_norm``: the values
    RMS-normalised (no weight, ``eps``) before they are stored (Gemma 4's ``v_norm``). ``k``, ``v``, ``k_scale``,
    ``ck`` and ``cv`` all None: the queries alone (a Gemma 4 KV-shared layer's, whose keys and values are another
    layer's)."""
    q_only = k is None
    if q_only:  # stand-ins for the keys' and the buffers' pointers and strides: no program reads or writes them
        if q is None or any(a is not None for a in (v, k_scale, ck, cv)):
            raise ValueError("norm_rope_write: queries alone take no values, key scale or buffers")
        k = v = ck = cv = q[:, :0]
        k_scale = q_scale
    t, hkv, d = k.shape
    h = 0 if q is None else q.shape[1]
    r = cos.shape[-1]
    if d & (d - 1) or r % 2 or r > d or not (ck.is_contiguous() and cv.is_contiguous() and cos.is_contiguous()
                                             and sin.is_contiguous()) or (ck.shape[-1] != d and not q_only):
        raise ValueError(f"norm_rope_write: heads of {d}, rotary {r}, buffers {tuple(ck.shape)}")
    q_out = torch.empty(t, max(h, 1), d, dtype=k.dtype, device=k.device)
    qq = k if q is None else q
    _norm_rope_kernel[(t, h + hkv)](
        qq, k, v, k_scale if q_scale is None else q_scale, k_scale, cos, sin, q_out, ck, cv, start, t, h, hkv, eps,
        qq.stride(0), qq.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1), ck.stride(0), ck.stride(1),
        R=r, HALF=r // 2, D=d, HAS_Q=q is not None, ROW_TABLES=row_tables, V_NORM=v_norm, **COMPILE_OPTIONS,
        **pdl.options(k))
    return None if q is None else q_out.transpose(0, 1)
