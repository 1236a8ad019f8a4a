"""Sampling parameters and the target distribution they define.

Speculative sampling is lossless with respect to *this* distribution: temperature, then top-k,
then top-p (nucleus), then softmax, all in fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import env
from .errors import RequestError

# Sampling's cumulative sums (the inverse-CDF draws of acceptance and of the drafters' static steps, top-p) in
# blocks (_blocked_cumsum) instead of CUDA's serial per-row scan, which costs 60 us a 49,152-token row on the
# H100 (profile_engine.py -t 1, 2026-12-06: 0.12 ms of the 0.897 ms sampled plain step against 0.774 greedy).
# Another rounding, so other tokens for a seed. On by default since measured (H100, 2026-12-06 (third),
# scripts/ab_sampled.py --shape smollm2-135m, T=1, 30 prompts, its +scan variants): the plain sampled step 0.880 ->
# 0.838 ms, MTP k=3 +10 %, DFlash +7 % tok/s, and 0 outputs differing between its eager and captured acceptance
# (SPECDEC_BLOCKED_SCAN=0: the serial scan).
BLOCKED_SCAN = env.switch("SPECDEC_BLOCKED_SCAN")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None

    def __post_init__(self) -> None:
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise RequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise RequestError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:  # also refuses nan
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**64):
            raise RequestError(f"seed must be an integer in 0..2**64-1, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def filter_key(self) -> tuple:
        """(temperature, top-k, top-p): what the filtered distribution depends on (steps built per params key on it)."""
        return (self.temperature, self.top_k, self.top_p)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def probs_from_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """``[..., V]`` logits -> fp32 probabilities of the filtered, tempered distribution."""
    x = logits.float() / max(p.temperature, 1e-6)
    if p.top_k and p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        srt, idx = torch.sort(x, dim=-1, descending=True)
        sp = torch.softmax(srt, dim=-1)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop = (row_cumsum(sp) - sp) >= p.top_p
        srt = srt.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(-1, idx, srt)
    return torch.softmax(x, dim=-1)


def probs_from_logits_rows(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """:func:`probs_from_logits` for ``logits [b, ..., V]`` whose row ``i`` samples with
    ``params[i]``: one call for each distinct (temperature, top-k, top-p), not one per row."""
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault(p.filter_key, []).append(i)
    if len(groups) == 1:
        return probs_from_logits(logits, params[0])
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for rows in groups.values():
        idx = torch.tensor(rows, device=logits.device)
        out[idx] = probs_from_logits(logits[idx], params[rows[0]])
    return out


def sample_inverse_cdf(q: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One draw per row of ``q [B, V]`` (probabilities) from uniforms ``u [B]`` in [0, 1): the first
    token whose cumulative probability exceeds ``u`` times the row's total, so never a token of
    probability 0. No host sync and no generator: CUDA graphs can hold it (the uniforms are drawn
    outside). Where ``u * total`` rounds up to the total, or a rounding of the sums would pick a token
    of probability 0 (the blocked scan's block boundaries: :func:`_blocked_cumsum`), the row's
    likeliest token."""
    cdf = row_cumsum(q)
    tok = torch.searchsorted(cdf, u.view(-1, 1) * cdf[:, -1:], right=True).view(-1)
    fits = tok < q.shape[-1]
    fits &= q.gather(1, tok.clamp_max(q.shape[-1] - 1)[:, None])[:, 0] > 0
    return torch.where(fits, tok, q.argmax(-1))


def row_cumsum(x: torch.Tensor) -> torch.Tensor:
    """``x.cumsum(-1)`` whose rows do not depend on how many rows ``x`` has. CUDA scans a lone row
    (CUB's whole-array scan) in another order than each row of many (one kernel per row), and a
    draw from a flat distribution turns on the last bit of the sums; so a lone row is scanned as
    one of two. Batch invariance and the captured acceptance's equality with the eager one (whose
    shapes differ) rest on it; the CPU scans every row alike, in order. With BLOCKED_SCAN, in
    blocks (:func:`_blocked_cumsum`)."""
    if BLOCKED_SCAN:
        return _blocked_cumsum(x)
    return _scan(x)


def _scan(x: torch.Tensor) -> torch.Tensor:
    if _lone_row_scanned_apart(x):
        two = x.reshape(1, -1).expand(2, -1).contiguous()
        return two.cumsum(-1)[:1].view(x.shape)
    return x.cumsum(-1)


def _blocked_cumsum(x: torch.Tensor) -> torch.Tensor:
    """The row scan in two levels: each block of ``b`` (the largest power of two dividing the row, at
    most 256) scanned alone, then the blocks' totals, added back. CUDA's per-row scan walks a row
    serially in 32-element steps (60 us a 49,152-token row on the H100, one kernel per sampled token:
    half of what sampling adds to a SmolLM2 step); blocks run in parallel. Still independent of the
    row count (every level scans many rows, or a lone row as one of two), and the last element is
    the row's total. Within a block the sums never decrease; across a block boundary they may by a
    rounding (a block's offset is the scan of the totals, not its predecessor's last sum), which
    :func:`sample_inverse_cdf` guards. Another rounding than the serial scan: other tokens for a seed."""
    v = x.shape[-1]
    b = min(v & -v, 256, v // 2)  # the largest power of two dividing v (at least two blocks)
    if b < 2:
        return _scan(x)
    blocks = x.reshape(-1, b).cumsum(-1)  # many short rows
    totals = blocks[:, -1].reshape(-1, v // b)
    offsets = torch.nn.functional.pad(_scan(totals)[:, :-1], (1, 0))  # each block's exclusive prefix
    return (blocks.view(-1, v // b, b) + offsets[..., None]).reshape(x.shape)


def _lone_row_scanned_apart(x: torch.Tensor) -> bool:
    return x.is_cuda and x.numel() == x.shape[-1]


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
    return g


def sample_one(logits: torch.Tensor, params: SamplingParams, gen) -> int:
    """One token from ``logits [V]``: the argmax when greedy, else a draw from the filtered distribution."""
    if params.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(probs_from_logits(logits, params), 1, generator=gen))
