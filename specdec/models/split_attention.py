"""Span-invariant attention for the serving loop's static steps on CUDA: split over fixed key
ranges, combined in order (issue 10: attention cost follows the live context).

A static step attends over a span bucket (256, 512, ... positions) with every key past a row's own
positions masked. The memory-efficient SDPA kernel the steps used gave a row the same bits at any
span, but it walks the keys of a (sequence, head) in one program: on the H200 a SmolLM2 step's 30
calls took 17 us each at span 256, and a 1-slot step cost 2.81 ms at span 256 against 9.49 ms at 4096
(BENCHMARKS.md, session 3).

Here the keys are cut into splits of :func:`split_keys` positions at fixed absolute offsets (for heads of 128, longer
splits past the first 1,024 and 4,096 positions: :func:`schedule`), one program per
(sequence, KV head, query tile, split): it walks its split in blocks of keys (:func:`_tile`) with the
online softmax (fp32), skipping a block where no query sees a key, and writes its partial max, sum
and output. A second kernel combines a row's splits: their maximum first, then their sums rescaled
to it, ``COMBINE`` splits at a time (chunks at fixed multiples, a fixed-shape sum per chunk, chunks
added in order), one program per 16 rows and 32 features of a KV head, so the reads spread over the
SMs. A block holding no key a row sees leaves that row's state bitwise unchanged (its scores are
-inf: the rescale is exp(0) = 1 and the added terms are exact zeros); in the combine such a split
weighs exactly 0 and a chunk of them leaves the row's sums as they are. A split no row of the tile
sees writes its max only, and the combine reads only the splits some row sees (the scratch traffic
follows the live context, not the cache). So a row's bits depend on the keys it sees only: not on the
span, on the other rows of the tile (query positions, the heads of its group), on the slot count or
on the step width. Each KV head's query group is folded into the tile's rows (GQA without copies),
and the output is written in ``[B, T, H, d]`` order, so the step's transpose before ``o_proj`` is free; a gated
attention's ``sigmoid(gate)`` is applied in that store (``gate``, Qwen3.5), with the torch product's roundings.

:func:`split_attention_reference` is the same algorithm in torch ops (the CPU equivalent that
``scripts/check_split_attention.py`` compares the kernel with on the GPU, and that the CPU tests
compare with SDPA).
"""

from __future__ import annotations

import math
import os

import torch

from .. import env
from ..errors import ConfigError
from . import pdl

try:  # Triton ships with CUDA builds of torch; CPU-only installs have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def _split_keys_env() -> int | None:
    """``SPECDEC_SPLIT_KEYS`` (64, 128, 256, 512 or 1,024; unset: :func:`split_keys`' choice by head size)."""
    raw = os.environ.get("SPECDEC_SPLIT_KEYS")
    if raw is None:
        return None
    if raw.strip() not in ("64", "128", "256", "512", "1024"):
        raise ConfigError(f"SPECDEC_SPLIT_KEYS={raw!r}: want 64, 128, 256, 512 or 1024 (keys per split of the "
                          "split attention)")
    return int(raw)


_SPLIT_ENV = _split_keys_env()


def split_keys(d: int) -> int:
    """Keys per split (walked by one program, at fixed absolute offsets) of :func:`schedule`'s first tier for heads of
    ``d`` features: 128 for d = 128 (256 until the session of 2026-12-06 (fifth); see FAR), 64 for d = 256 and 512,
    256 otherwise; ``SPECDEC_SPLIT_KEYS`` sets one value for every head size (raised to the tile's block of keys,
    :func:`_tile`, where that is larger: 128 up to d = 128, 64 for d = 256). A span of one split
    needs no combine kernel (DIRECT, and graphs.SHORT_SPAN's steps within the first split). Every attention
    of a model takes the same value, so plain and speculative decoding stay equal at any of them (their bits
    differ from one value to another). Measured on the H200: for d = 128, with the qwen3-8b shape's steps unpadded
    1-row steps (fused_layer.WIDE, session of 2026-12-04 (third), scripts/ab_flags.py, ms): 128 / 256 / 512 keys
    4.98 / 5.21-5.26 / 5.34-5.52 at context 512, 5.42 / 5.38 / 5.46 at 4,096, 7.47-7.65 / 6.54-6.67 / 6.26-6.39 at
    16,000: 256 was within 5 % of the fastest at each (512 had made the padded 16-row steps 4-9 % faster at
    contexts 128-16k, session of 2026-12-03 (sixth)). SmolLM2 (d = 64): 512 keys 2 % slower on MT-Bench's two
    turns. For d = 256 (Qwen3.5, Gemma) a decode step's grid is a few programs a layer (2 KV heads x the splits):
    64-key splits made the qwen3.5-9b shape's plain step 5.624 -> 5.502 ms at context 512 (128 keys: 5.533;
    scripts/ab_flags.py, session of 2026-12-04)."""
    if _SPLIT_ENV:  # never fewer keys than one inner block of the head size's tile
        return max(_SPLIT_ENV, _tile(d)[1])
    return {128: 128, 256: 64, 512: 64}.get(d, 256)


def _far_env() -> tuple[int, int] | None:
    """``SPECDEC_SPLIT_FAR=NEAR,FAR`` (FAR-key splits past the first NEAR positions), ``0`` (one split size)."""
    raw = os.environ.get("SPECDEC_SPLIT_FAR")
    if raw is None:
        return None
    if raw.strip() == "0":
        return (0, 0)
    try:
        near, far = (int(v) for v in raw.split(","))
    except ValueError:
        near = far = -1
    if near <= 0 or far not in (256, 512, 1024, 2048) or near % far:
        raise ConfigError(f"SPECDEC_SPLIT_FAR={raw!r}: want NEAR,FAR (FAR-key splits past the first NEAR positions of "
                          "the split attention: FAR 256, 512, 1024 or 2048, NEAR a multiple of it) or 0 (one split size)")
    return near, far


_FAR_ENV = _far_env()
# head size -> (E1, S2, E2, S3) of schedule(): split_keys(d)-key splits over the first E1 positions, S2-key ones up to
# E2, S3-key ones past it. Heads of 128 since the session of 2026-12-06 (fifth): 128-key splits over the first 1,024
# positions, 256-key ones to 4,096, 512-key ones past it. The far splits (session of 2026-12-06 (fourth)): on an H100
# (sweep_split_attention.py --long, us a layer of qwen3-8b's heads, 16-row tiles) a 1-row step's attention at 16k live
# keys 37.25 -> 34.15 and a 16-row step's 85.56 -> 76.30 against 256-key splits throughout; 512-key splits past 2,048
# positions were as fast at 16k and slower at 4k (18.93 against 15.00: too few programs), 1,024-key ones past 4,096
# slower for one row at 16k (42.26). The 128-key first tier (H100, scripts/ab_flags.py, qwen3-8b shape, ms, 1-row /
# padded step against the 256-key first splits of before, one process): 6.251 / 6.564 -> 6.131 / 6.510 at context 512,
# 6.329 / 7.094 -> 6.404 / 7.083 at 4,000, 7.054 / 8.859 -> 7.121 / 8.924 at 16,000 (past 16 splits the combine walks
# a second chunk). 128-key splits all the way to 4,096 had given 6.018 / 6.389, 6.247 / 7.436 and 7.111 / 9.003: the
# padded steps paid for the partials past ~1k.
FAR = {128: (1024, 256, 4096, 512)}


def schedule(d: int) -> tuple[int, int, int, int, int]:
    """``(S1, E1, S2, E2, S3)`` for heads of ``d`` features: splits of S1 = :func:`split_keys` keys over the first E1
    positions, of S2 keys up to E2, of S3 keys past it, each at fixed absolute offsets (so a row's bits still depend on
    the keys it sees only). Short contexts keep many small splits (programs enough to fill the GPU); long ones walk
    fewer, longer splits, whose loads pipeline. One split size: ``(S, 0, S, 0, S)``. ``SPECDEC_SPLIT_FAR=NEAR,FAR`` sets
    two tiers for every head size: S1 to NEAR, FAR past it. Sizes never shrink from tier to tier; each tier's end is
    a whole number of its splits past the one before."""
    s1 = split_keys(d)
    if _FAR_ENV is not None:
        near, far = _FAR_ENV
        e1, s2, e2, s3 = near, far, near, far
    else:
        e1, s2, e2, s3 = FAR.get(d, (0, s1, 0, s1))
    s2 = max(s2, s1)
    s3 = max(s3, s2)
    e1 -= e1 % s1
    e2 = max(e2 - (e2 - e1) % s2, e1)
    return s1, e1, s2, e2, s3


def n_splits(s: int, s1: int, e1: int, s2: int, e2: int, s3: int) -> int:
    """The splits of a span of ``s`` positions under the schedule ``(s1, e1, s2, e2, s3)`` (:func:`schedule`)."""
    if s <= e1:
        return -(-s // s1)
    if s <= e2:
        return e1 // s1 + -(-(s - e1) // s2)
    return e1 // s1 + (e2 - e1) // s2 + -(-(s - e2) // s3)


def split_bounds(s: int, d: int) -> list[tuple[int, int]]:
    """Each split's ``(first, last + 1)`` positions of a span of ``s`` for heads of ``d`` features (schedule())."""
    s1, e1, s2, e2, s3 = schedule(d)
    starts = [(c, s1) for c in range(0, min(s, e1), s1)] + [(c, s2) for c in range(e1, min(s, e2), s2)]
    starts += [(c, s3) for c in range(e2, s, s3)]
    return [(c, min(c + n, s)) for c, n in starts]


COMBINE = 16  # splits the combine sums at once (chunks at fixed multiples)
# (rows, features) of a combine program: one fixed cut. Each row and feature sums its own splits, but on the GPU the
# order of tl.sum's tree over a chunk follows the block's shape: a (4, 8) cut for steps of at most 4 rows and (16, 32)
# for wider ones gave 1-row and verify steps other bits (H200, 2026-12-04: bench --shape qwen3-8b's oracle and
# device_check's random Qwen3 differed from plain; Triton's interpreter, summing in numpy, saw nothing). One (4, 8)
# cut for every step since 2026-12-04 (fourth) (H200, scripts/ab_flags.py, qwen3-8b shape, ms, against (16, 32): 1-row
# step 4.97 -> 4.78 at context 512, 6.37 -> 6.07 at 16,000; the padded 16-row step 7.27 -> 7.30 at 16,000; qwen3.5-9b's
# padded step 5.29 -> 5.31; device_check with it: 0 outputs differing). SPECDEC_COMBINE_CUT sets another.
def _combine_cut_env() -> tuple[int, int]:
    raw = os.environ.get("SPECDEC_COMBINE_CUT", "4,8")
    cuts = ("1,8", "2,8", "4,8", "4,16", "8,16", "8,32", "16,16", "16,32")
    if raw.replace(" ", "") not in cuts:
        raise ConfigError(f"SPECDEC_COMBINE_CUT={raw!r}: want rows,features of a combine program, one of {', '.join(cuts)}")
    return tuple(int(v) for v in raw.split(","))


COMBINE_CUT = _combine_cut_env()
# A span of one split (at most split_keys(d) keys): the split kernel divides and writes the output itself, with
# no combine launch. The same bits: the combine of one split adds it, weighed exp(0) = 1, to zeros and
# divides as the split kernel then does (the interpreter test appends dead keys to a one-split span and
# compares). On the H200 a SmolLM2 16-row step over a 244-position cache went 1.33 -> 1.19 ms, and
# 1.16 -> 1.04 with fused_layer (scripts/ab_flags.py; BENCHMARKS.md). SPECDEC_SPLIT_DIRECT=0 turns it off.
DIRECT = env.switch("SPECDEC_SPLIT_DIRECT")
# The split kernel's walk over a split without a branch a block (see _split_kernel), so Triton pipelines its loads:
# on the H200 a SmolLM2-shape 1-row step at context 512 1.014 -> 0.912 ms (scripts/ab_flags.py --variants defaults
# defaults-pipeline, session of 2026-12-04 (third)). SPECDEC_SPLIT_PIPELINE=0: a branch a block, as before.
PIPELINE = env.switch("SPECDEC_SPLIT_PIPELINE")
# Tried and removed: past one split, the tile's last split program combining it after an acquire-release
# ticket (no combine launch). On the H200 it made the 16-row step slower: SmolLM2 at context 300 1.05 ->
# 1.20 ms, qwen3-8b at 1000 5.35 -> 8.23 ms (scripts/ab_flags.py, BENCHMARKS.md). Its code is at bb0405a.
# Tried and removed (session of 2026-12-06 (fourth)): a gated attention's o * sigmoid(gate) in the final store, for
# the one-sequence and batched steps alike (no torch kernels between the attention and o_proj). On an H100
# (scripts/ab_flags.py, qwen3.5-35b-a3b at 512, 2 rounds) the 1-row step took 3.659 ms against 3.634 without it (the
# padded one 3.902 / 3.901); device_check: 0 outputs differing. Its code and tests are at 7cb7b8e.


def supported(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether :func:`split_attention` takes these inputs (else the caller uses SDPA)."""
    d = q.shape[-1]
    return (triton is not None and q.is_cuda and q.dim() == 4 and mask is not None and mask.dim() == 4
            and mask.dtype == torch.bool
            and q.dtype in (torch.bfloat16, torch.float16) and k.dtype == q.dtype and 16 <= d <= 512
            and d & (d - 1) == 0 and q.stride(-1) == 1 and k.stride(-1) == 1 and mask.shape[1] == 1)


# 16-row query tiles for heads of at most 64 channels (SmolLM2's): on the H200 a SmolLM2 16-row step's
# attention over a 244-position cache took 4.64 us against 9.25 with 64-row tiles
# (scripts/sweep_split_attention.py --decode), the whole step 0.996 -> 0.832 ms at one split and 1.207 ->
# 1.054 at two (scripts/ab_flags.py; BENCHMARKS.md). For heads of 128 (Qwen3's) since the session of
# 2026-12-06 (fourth), walked two stages deep (_stages): on an H100 (sweep_split_attention.py --long, us a layer, 30
# layers' own keys in a graph, qwen3-8b's heads, with schedule()'s far splits) a 1-row step's attention at 512 / 4k /
# 16k live keys 13.18 / 17.40 / 53.60 -> 9.77 / 15.00 / 34.15, a 16-row step's 18.18 / 24.88 / 75.35 -> 14.94 / 27.73
# / 76.30 (64-row tiles cost a 1-row step's 4 query rows a 64-row tile's registers and exps; without the second stage
# the 16-row step at 16k took 120 us). A fixed choice per head size, like the rest of the tile.
# SPECDEC_SPLIT_SMALL_TILES=0 gives the 64-row tiles (and Triton's pipeline depth) back.
SMALL_TILES = env.switch("SPECDEC_SPLIT_SMALL_TILES")


def _tile(d: int) -> tuple[int, int, int]:
    """(query rows per tile, keys per inner block, warps) for head size ``d``: fixed per model, never
    per shape. Up to d = 128: 128-key blocks and 4 warps, the fastest of the sweeps on the H200 and the H100 at every
    context and step width measured (scripts/sweep_split_attention.py, BENCHMARKS.md), in 16-row query
    tiles (SMALL_TILES), else 64; heads of 256 (Qwen3.5's, Gemma's) keep the blocks they were checked with; Gemma 4's
    heads of 512 take 16-row tiles of 32-key blocks (its 1-row step's 8 query rows of a KV head fill half a tile)."""
    if d <= 128 and SMALL_TILES:
        return 16, 128, 4
    if d > 256:  # Gemma 4's 512-wide full-attention heads: a 16 x 512 fp32 state and 32-key blocks in 8 warps' registers
        return 16, 32, 8
    return (64, 128, 4) if d <= 128 else (32, 64, 8)


def _stages(d: int) -> int | None:
    """The split kernel's software-pipeline depth (Triton's ``num_stages``) for head size ``d``: 2 for the 16-row tiles
    of heads of 128 (SMALL_TILES), else Triton's default (None). No bit depends on it."""
    if d > 256:  # two 32 x 512 key and value blocks a stage: two stages fit the shared memory
        return 2
    return 2 if d == 128 and SMALL_TILES else None


if triton is not None:
    @triton.jit
    def _store_out(out, o, b, heads, t, d, live, sob, soh, sot, gate, sgb, sgh, sgt, GATED: tl.constexpr):
        # a tile's output rows (fp32) rounded to o's dtype and stored; GATED: times sigmoid(gate) first, as
        # Attention.gathered's torch ops round it (the sigmoid rounded, then the product)
        dt = o.dtype.element_ty
        res = out.to(dt)
        if GATED:
            gv = tl.load(gate + b * sgb + heads[:, None] * sgh + t[:, None] * sgt + d[None, :], mask=live[:, None],
                         other=0.0).to(tl.float32)
            res = (res.to(tl.float32) * tl.sigmoid(gv).to(dt).to(tl.float32)).to(dt)
        tl.store(o + b * sob + heads[:, None] * soh + t[:, None] * sot + d[None, :], res, mask=live[:, None])

    @triton.jit(do_not_specialize=["T", "S", "Hkv", "rows"])
    def _split_kernel(q, k, v, mask, m_out, l_out, a_out, T, S, Hkv, rows, scale,
                      sqb, sqh, sqt, skb, skh, sks, svb, svh, svs, smb, smt, sms, o, sob, soh, sot,
                      gate, sgb, sgh, sgt,
                      G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, S1: tl.constexpr, E1: tl.constexpr,
                      S2: tl.constexpr, E2: tl.constexpr, S3: tl.constexpr, D: tl.constexpr, DIRECT: tl.constexpr,
                      USE_GDC: tl.constexpr, PIPELINE: tl.constexpr, GATED: tl.constexpr = False):
        if USE_GDC:  # models/pdl.py
            pdl.begin()
        pid_bh, pid_m, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        b, kh = pid_bh // Hkv, pid_bh % Hkv
        # the split's keys (schedule()): S1 keys a split over the first E1 positions, S2 keys up to E2, S3 keys past it
        n1 = E1 // S1
        n2 = n1 + (E2 - E1) // S2
        start = tl.where(pid_s < n1, pid_s * S1, tl.where(pid_s < n2, E1 + (pid_s - n1) * S2, E2 + (pid_s - n2) * S3))
        size = tl.where(pid_s < n1, S1, tl.where(pid_s < n2, S2, S3))
        r = pid_m * BM + tl.arange(0, BM)
        live = r < rows
        g, t = r // T, r % T
        d = tl.arange(0, D)
        qt = tl.load(q + b * sqb + (kh * G + g)[:, None] * sqh + t[:, None] * sqt + d[None, :],
                     mask=live[:, None], other=0.0)
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, D], tl.float32)
        # the split's blocks up to the last one some row of the tile sees (a first pass over the mask's bytes,
        # unrolled): the walk below has a trip count and no branch, so Triton pipelines its loads (PIPELINE), and
        # its cost follows the live context. A block no row sees leaves every row's state bitwise as it is (its
        # scores are -inf: the rescale is exp(0) = 1, or 0 times a state still 0, and the added terms are zeros).
        n_blk = 0
        if PIPELINE:
            for jb in tl.static_range(S3 // BN):  # S3 the largest: a shorter split's blocks past its size are masked
                s = start + jb * BN + tl.arange(0, BN)
                seen = tl.load(mask + b * smb + t[:, None] * smt + s[None, :] * sms,
                               mask=live[:, None] & ((s < S) & (jb * BN < size))[None, :], other=0) != 0
                n_blk = tl.where(tl.max(tl.max(seen.to(tl.int32), 1), 0) > 0, jb + 1, n_blk)
        else:
            n_blk = size // BN
        for j in range(0, n_blk * BN, BN):
            s = start + j + tl.arange(0, BN)
            inside = s < S
            seen = tl.load(mask + b * smb + t[:, None] * smt + s[None, :] * sms,
                           mask=live[:, None] & inside[None, :], other=0) != 0
            if PIPELINE or tl.max(tl.max(seen.to(tl.int32), 1), 0) > 0:
                kt = tl.load(k + b * skb + kh * skh + s[:, None] * sks + d[None, :], mask=inside[:, None], other=0.0)
                sc = tl.where(seen, tl.dot(qt, tl.trans(kt)) * scale, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(sc, 1))
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp(m_i - m_use)
                p = tl.exp(sc - m_use[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                vt = tl.load(v + b * svb + kh * svh + s[:, None] * svs + d[None, :], mask=inside[:, None], other=0.0)
                acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
                m_i = m_new
        if DIRECT:  # the only split: what the combine would write (its sums of one split are these)
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            _store_out(out, o, b, kh * G + g, t, d, live, sob, soh, sot, gate, sgb, sgh, sgt, GATED)
            return
        n_m, n_s = tl.num_programs(1), tl.num_programs(2)
        base = ((pid_bh * n_m + pid_m) * n_s + pid_s) * BM
        i = tl.arange(0, BM)
        tl.store(m_out + base + i, m_i, mask=live)  # a tile's padding rows are never read
        # a split no row sees (past the live context) writes its max (-inf) only: the combine reads no more
        # of it, so the scratch traffic follows the live context, not the cache
        sees = live & (m_i > float("-inf"))
        tl.store(l_out + base + i, l_i, mask=sees)
        tl.store(a_out + (base + i)[:, None] * D + d[None, :], acc, mask=sees[:, None])

    @triton.jit(do_not_specialize=["T", "Hkv", "rows", "n_s", "n_m"])
    def _combine_kernel(m_out, l_out, a_out, o, T, Hkv, rows, n_s, n_m, sob, soh, sot, gate, sgb, sgh, sgt,
                        G: tl.constexpr, BM: tl.constexpr, D: tl.constexpr, RB: tl.constexpr,
                        DB: tl.constexpr, CB: tl.constexpr, USE_GDC: tl.constexpr, GATED: tl.constexpr = False):
        if USE_GDC:  # models/pdl.py
            pdl.begin()
        # one program per (sequence, KV head, RB rows, DB features): every row's and feature's
        # arithmetic is its own, so the cut changes no bit; it spreads the reads over the SMs
        pid_bh, pid_r, pid_d = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        b, kh = pid_bh // Hkv, pid_bh % Hkv
        r = pid_r * RB + tl.arange(0, RB)
        live = r < rows
        row0 = (pid_bh * n_m + r // BM) * n_s * BM + r % BM  # the row's split-0 entry in the scratch
        d = pid_d * DB + tl.arange(0, DB)
        # the splits any of these rows sees: [lo, hi] (the others leave every row's state as it is)
        # and each row's max over all its splits (pass 1: maxima are exact in any order)
        lo, hi = n_s + 0, n_s * 0 - 1  # int32 tensors (loop-carried)
        mx = tl.full([RB], float("-inf"), tl.float32)
        for c0 in range(0, n_s, CB):
            c = c0 + tl.arange(0, CB)
            m_c = tl.load(m_out + row0[None, :] + c[:, None] * BM, mask=(c < n_s)[:, None] & live[None, :],
                          other=float("-inf"))
            seen = tl.max((m_c > float("-inf")).to(tl.int32), 1) > 0
            lo = tl.minimum(lo, tl.min(tl.where(seen, c, n_s), 0))
            hi = tl.maximum(hi, tl.max(tl.where(seen, c, -1), 0))
            mx = tl.maximum(mx, tl.max(m_c, 0))
        # pass 2: the splits' sums rescaled to that max, CB splits at a time (chunks at fixed multiples
        # of CB; a fixed-shape sum over a chunk, the chunks added in order). A split a row sees no key
        # of weighs exactly 0 and a chunk it sees nothing of leaves its sums as they are.
        m_use = tl.where(mx == float("-inf"), 0.0, mx)
        l = tl.zeros([RB], tl.float32)
        acc = tl.zeros([RB, DB], tl.float32)
        for c0 in range(lo - lo % CB, hi + 1, CB):
            c = c0 + tl.arange(0, CB)
            at = row0[None, :] + c[:, None] * BM  # [CB, RB]
            m_c = tl.load(m_out + at, mask=(c < n_s)[:, None] & live[None, :], other=float("-inf"))
            sees = m_c > float("-inf")
            w = tl.where(sees, tl.exp(m_c - m_use[None, :]), 0.0)
            l_c = tl.load(l_out + at, mask=sees, other=0.0)
            a_c = tl.load(a_out + at[:, :, None] * D + d[None, None, :], mask=sees[:, :, None], other=0.0)
            any_c = tl.max(sees.to(tl.int32), 0) > 0
            l = tl.where(any_c, l + tl.sum(l_c * w, 0), l)
            acc = tl.where(any_c[:, None], acc + tl.sum(a_c * w[:, :, None], 0), acc)
        g, t = r // T, r % T
        out = acc / tl.where(l > 0, l, 1.0)[:, None]
        _store_out(out, o, b, kh * G + g, t, d, live, sob, soh, sot, gate, sgb, sgh, sgt, GATED)


def split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                    gate: torch.Tensor | None = None) -> torch.Tensor:
    """``q [B, H, T, d]``, ``k``/``v [B, Hkv, S, d]`` (head ``h`` reads KV head ``h // (H / Hkv)``),
    ``mask [B, 1, T, S]`` (True: seen) -> ``[B, H, T, d]`` (a view of a ``[B, T, H, d]`` tensor).
    ``gate`` ``[B, T, H, d]`` (any strides but a contiguous last dimension): the output times ``sigmoid(gate)``
    (Qwen3.5's gated attention), rounded as ``o * torch.sigmoid(gate)`` rounds it, in the kernel that writes it.
    CUDA, bf16/fp16, ``d`` a power of two in 16..512 (:func:`supported`). Under torch.compile the
    kernels run as one opaque custom op (``specdec::split_attention``), the same launches."""
    if gate is not None and (gate.shape != (q.shape[0], q.shape[2], q.shape[1], q.shape[3]) or gate.stride(-1) != 1
                             or gate.dtype != q.dtype):
        raise ValueError(f"split_attention: gate {tuple(gate.shape)} {gate.dtype} for q {tuple(q.shape)} {q.dtype}: "
                         "want [B, T, H, d] in q's dtype, its last dimension contiguous")
    run = split_attention_op if torch.compiler.is_compiling() else _launch
    return run(q, k, v, mask, scale, gate).transpose(1, 2)


@torch.library.custom_op("specdec::split_attention", mutates_args=())
def split_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                       gate: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`split_attention` as a custom op for torch.compile: ``[B, T, H, d]``, contiguous."""
    # the compiled graph may hand over other layouts than the eager step; the kernels take any
    # strides but a contiguous last dimension
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    return _launch(q, k, v, mask, scale, gate)


@split_attention_op.register_fake
def _(q, k, v, mask, scale, gate=None):
    b, h, t, d = q.shape
    return q.new_empty(b, t, h, d)


def _launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
            gate: torch.Tensor | None = None) -> torch.Tensor:
    """The two kernels: ``[B, T, H, d]`` (contiguous) from :func:`split_attention`'s inputs."""
    b, h, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    g = h // hkv
    bm, bn, warps = _tile(d)
    rows = g * t
    sched = schedule(d)
    n_m, n_s = -(-rows // bm), n_splits(s, *sched)
    direct = DIRECT and n_s == 1
    # the partial states (a direct launch writes none: one-element stand-ins)
    m_out = torch.empty(1 if direct else b * hkv * n_m * n_s * bm, dtype=torch.float32, device=q.device)
    l_out = torch.empty_like(m_out)
    a_out = torch.empty(m_out.numel(), d, dtype=torch.float32, device=q.device)
    out = torch.empty(b, t, h, d, dtype=q.dtype, device=q.device)
    o = out.transpose(1, 2)
    gated = gate is not None
    # the gate's strides as (B, H, T) like o's; a stand-in pointer without it (never read)
    gp, gs = (gate, (gate.stride(0), gate.stride(2), gate.stride(1))) if gated else (out, (0, 0, 0))
    mask = mask.view(torch.uint8)  # a boolean mask (supported()), read as bytes
    _split_kernel[(b * hkv, n_m, n_s)](
        q, k, v, mask, m_out, l_out, a_out, t, s, hkv, rows, scale,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), mask.stride(0), mask.stride(2), mask.stride(3),
        o, o.stride(0), o.stride(1), o.stride(2), gp, *gs,
        G=g, BM=bm, BN=bn, S1=sched[0], E1=sched[1], S2=sched[2], E2=sched[3], S3=sched[4], D=d, DIRECT=direct,
        PIPELINE=PIPELINE, GATED=gated, num_warps=warps,
        **({} if _stages(d) is None else {"num_stages": _stages(d)}), **pdl.options(q))
    if direct:
        return out
    rb, db = COMBINE_CUT[0], min(d, COMBINE_CUT[1])
    _combine_kernel[(b * hkv, -(-rows // rb), d // db)](
        m_out, l_out, a_out, o, t, hkv, rows, n_s, n_m, o.stride(0), o.stride(1), o.stride(2), gp, *gs,
        G=g, BM=bm, D=d, RB=rb, DB=db, CB=COMBINE, GATED=gated, num_warps=4, **pdl.options(q))
    return out


def split_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                              scale: float, gate: torch.Tensor | None = None, split: int | None = None,
                              block: int | None = None, chunk: int = COMBINE) -> torch.Tensor:
    """:func:`split_attention`'s algorithm in torch ops, fp32 throughout (any device and dtype; ``gate`` as there):
    blocks of ``block`` keys (default: the kernel's for the head size) at fixed offsets with the
    online softmax, a block no query of the sequence sees skipped, the partial states of each
    split (``split`` keys each; default: :func:`schedule`'s splits) combined as the kernel does (the maximum, then the rescaled
    sums ``chunk`` splits at a time, chunks in order)."""
    b, h, t, d = q.shape
    block = block or _tile(d)[1]
    hkv, s = k.shape[1], k.shape[2]
    bounds = [(c, min(c + split, s)) for c in range(0, s, split)] if split else split_bounds(s, d)
    g = h // hkv
    qf = q.float().reshape(b, hkv, g * t, d)
    seen = mask[:, 0].bool().unsqueeze(1).expand(b, g, t, s).reshape(b, 1, g * t, s).expand(b, hkv, g * t, s)
    parts = []
    for c0, c1 in bounds:
        m = torch.full((b, hkv, g * t), -math.inf, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros(b, hkv, g * t, d, device=q.device)
        for j in range(c0, c1, block):
            sl = slice(j, min(j + block, c1))
            if not seen[..., sl].any():
                continue
            sc = torch.where(seen[..., sl], qf @ k[:, :, sl].float().transpose(-1, -2) * scale, -math.inf)
            m_new = torch.maximum(m, sc.amax(-1))
            m_use = torch.where(m_new == -math.inf, 0.0, m_new)
            alpha = torch.exp(m - m_use)
            p = torch.exp(sc - m_use[..., None])
            l = l * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + p.to(v.dtype).float() @ v[:, :, sl].float()
            m = m_new
        parts.append((m, l, acc))
    # the combine: each row's max over its splits, then the splits' sums rescaled to it, ``chunk``
    # splits at a time (chunks at fixed multiples; a split past the span weighs 0)
    m_all = torch.stack([p[0] for p in parts])  # [n_s, b, hkv, rows]
    mx = m_all.amax(0)
    m_use = torch.where(mx == -math.inf, 0.0, mx)
    l = torch.zeros_like(mx)
    acc = torch.zeros(b, hkv, g * t, d, device=q.device)
    for c0 in range(0, len(parts), chunk):
        idx = range(c0, c0 + chunk)
        m_c = torch.stack([parts[c][0] if c < len(parts) else torch.full_like(mx, -math.inf) for c in idx])
        sees = m_c > -math.inf
        if not sees.any():
            continue
        w = torch.where(sees, torch.exp(m_c - m_use), 0.0)
        l_c = torch.stack([parts[c][1] if c < len(parts) else torch.zeros_like(mx) for c in idx])
        a_c = torch.stack([parts[c][2] if c < len(parts) else torch.zeros_like(acc) for c in idx])
        l_c, a_c = torch.where(sees, l_c, 0.0), torch.where(sees[..., None], a_c, 0.0)
        any_c = sees.any(0)
        l = torch.where(any_c, l + (l_c * w).sum(0), l)
        acc = torch.where(any_c[..., None], acc + (a_c * w[..., None]).sum(0), acc)
    out = (acc / torch.where(l > 0, l, 1.0)[..., None]).reshape(b, h, t, d).to(q.dtype)
    return out if gate is None else out * torch.sigmoid(gate.transpose(1, 2))
