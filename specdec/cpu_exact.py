"""Bitwise-exact eager steps on the CPU, without padding (``--batch-invariant`` on the CPU).

Speculative output equals plain output bit for bit when a committed position's logits are the same
whether a 1-row decode step or a (k+1)-row verify step computed them. On the CPU (fp32) two kernels
break that in the eager path (``scripts/probe_cpu_row_invariance.py``):

- oneDNN's matmul gives a row the same bits at every row count from 2 on, but a 1-row call (a GEMV)
  rounds otherwise once K > 576. Within :func:`exact`, :func:`specdec.cpu_linear.linear` runs every fp32
  linear on oneDNN (whatever its size) and pads a 1-row call to 2 rows: with packed weights that costs
  nothing measurable (576 x 1,536: 140 -> 117 us).
- The CPU's SDPA changes a row's bits with the row count. :func:`attention` computes each KV head's scores
  and weighted sum as oneDNN matmuls (at least 2 rows: the head's query group, padded where it is one row)
  with an fp32 softmax between them; a row's bits then depend neither on the other rows nor on masked keys
  after its own (checked: 0 of 256 positions differ, 8 contexts of 63..1,000 keys, 1..16 rows).

One smaller thing rounds by the row count too: the CPU softmax over fewer than 16 values (another code path,
a scalar loop by all appearances), so rows get at least :data:`MIN_KEYS` keys, the extra ones masked. Norms, RoPE (its cos/sin keep their bits at any
length: checked), SwiGLU and embeddings work row by row.

Cost (SmolLM2-135M, 2 cores, GSM8K 4 prompts x 96 tokens, 2026-12-05): plain 28.1 -> 19.3 tok/s, MTP 55.5 ->
43.4, DFlash 52.5 -> 43.2, against 16.8 / 35.9 / 39.1 for the 16-row padded steps: the attention's oneDNN calls
(6 a layer, ~48 us each with the live keys as their weight) instead of one SDPA call. The engine takes it for
``batch_invariant`` on the CPU (``SpeculativeGenerator.cpu_exact``); ``SPECDEC_CPU_EXACT=0`` pads instead.
"""

from __future__ import annotations

import torch

from . import cpu_linear


# The CPU's softmax over fewer than 16 values (an AVX-512 vector of fp32) rounds otherwise than over more (another
# code path, a scalar loop by all appearances): a row with 15 live keys changed its bits once masked keys followed
# (seen on the 2-core EPYC). So rows get at least this many, the extra ones masked.
MIN_KEYS = 16
# Key counts are rounded up to a multiple of this many (the extra keys masked): oneDNN builds, and JIT-compiles on
# first sight, a matmul for every key count it meets, and a decode step's key count is a new one at every step.
KEY_BLOCK = 64


def on() -> bool:
    """Whether this thread runs inside :func:`exact`."""
    return cpu_linear.row_invariant_on()


def exact():
    """Within it (this thread), CPU fp32 linears and single-sequence attention take their row-invariant forms."""
    return cpu_linear.row_invariant()


def available() -> bool:
    """Whether oneDNN's linear runs here (the row-invariant forms are built on it)."""
    return cpu_linear.active()


def _extended(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x [Hkv, S, d]`` as ``[Hkv, n, d]``, n >= S: a view of the storage it lies in (a cache's later positions,
    finite: its buffers start zeroed) where that holds them, else a copy padded with zeros."""
    h, s, d = x.shape
    st = x.stride()
    last = x.storage_offset() + (h - 1) * st[0] + (n - 1) * st[1] + (d - 1) * st[2]
    if st[2] == 1 and st[1] == d and st[0] >= n * d and last < x.untyped_storage().nbytes() // x.element_size():
        return x.as_strided((h, n, d), st)
    return torch.cat([x, x.new_zeros(h, n - s, d)], dim=1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """``q [H, T, d]``, ``k [Hkv, S, d]``, ``v [Hkv, S, dv]``, ``mask [T, S]`` (True: seen; None: every key)
    -> ``[H, T, dv]``, each row computed alike at any ``T`` and any number of masked keys after its own."""
    h, t, d = q.shape
    kv, s = k.shape[0], k.shape[1]
    rep = h // kv
    n = -(-max(s, MIN_KEYS) // KEY_BLOCK) * KEY_BLOCK  # see KEY_BLOCK and MIN_KEYS
    k, v = _extended(k, n), _extended(v, n)
    outs = []
    for g in range(kv):
        qg = q[g * rep:(g + 1) * rep].reshape(rep * t, d)
        scores = cpu_linear.row_invariant_linear(qg, k[g], pack=False) * scale  # [rep*t, n]
        if mask is not None:
            scores[:, :s] = scores[:, :s].view(rep, t, s).masked_fill(~mask, float("-inf")).view(rep * t, s)
        scores[:, s:] = float("-inf")
        p = torch.softmax(scores, dim=-1)
        # v[g].t() as it lies (a strided weight): oneDNN takes it with the contiguous copy's bits, 18.6 against 42.8 us
        # alone for 6 rows over 400 keys (the copy included); end to end (SmolLM2, --batch-invariant, 3 alternated
        # runs) plain 18.62 -> 18.73 tok/s, MTP k=3 38.6 -> 40.4: within the runs' spread
        outs.append(cpu_linear.row_invariant_linear(p, v[g].t(), pack=False).view(rep, t, -1))
    return torch.cat(outs) if kv > 1 else outs[0]
