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


def on() -> bool:
    """Whether this thread runs inside :func:`exact`."""
    return cpu_linear.row_invariant_on()


def exact():
    """Within it (this thread), CPU fp32 linears and single-sequence attention take their row-invariant forms."""
    return cpu_linear.row_invariant()


def available() -> bool:
    """Whether oneDNN's linear runs here (the row-invariant forms are built on it)."""
    return cpu_linear.active()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """``q [H, T, d]``, ``k [Hkv, S, d]``, ``v [Hkv, S, dv]``, ``mask [T, S]`` (True: seen; None: every key)
    -> ``[H, T, dv]``, each row computed alike at any ``T`` and any number of masked keys after its own."""
    h, t, d = q.shape
    kv, s = k.shape[0], k.shape[1]
    rep = h // kv
    outs = []
    for g in range(kv):
        qg = q[g * rep:(g + 1) * rep].reshape(rep * t, d)
        scores = cpu_linear.row_invariant_linear(qg, k[g], pack=False) * scale  # [rep*t, s]
        if mask is not None:
            scores = scores.view(rep, t, s).masked_fill(~mask, float("-inf")).view(rep * t, s)
        if s < MIN_KEYS:  # see MIN_KEYS
            scores = torch.cat([scores, scores.new_full((rep * t, MIN_KEYS - s), float("-inf"))], dim=1)
        p = torch.softmax(scores, dim=-1)[:, :s]
        # v[g].t() as it lies (a strided weight): oneDNN takes it with the contiguous copy's bits, 18.6 against 42.8 us
        # alone for 6 rows over 400 keys (the copy included); end to end (SmolLM2, --batch-invariant, 3 alternated
        # runs) plain 18.62 -> 18.73 tok/s, MTP k=3 38.6 -> 40.4: within the runs' spread
        outs.append(cpu_linear.row_invariant_linear(p, v[g].t(), pack=False).view(rep, t, -1))
    return torch.cat(outs) if kv > 1 else outs[0]
