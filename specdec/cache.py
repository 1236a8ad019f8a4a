"""Per-sequence caches with exact rollback.

A :class:`SequenceCache` holds one entry per target layer: a :class:`KVCache` for attention
layers (preallocated, indexed by position; rollback is free because entries past the committed
length are simply overwritten later) or a recurrent cache for linear-attention layers, which
keeps the state after every position of the last forward so rollback restores it exactly.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .errors import ContextOverflowError


class LayerCache(Protocol):
    def rollback(self, length: int) -> None:
        """Return to the state after ``length`` positions (within the last forward)."""
        ...

    def nbytes(self) -> int:
        ...


class KVCache:
    """Keys and values of one attention layer: ``[n_kv_heads, max_len, head_dim]`` each."""

    def __init__(self, n_kv_heads: int, head_dim: int, max_len: int, dtype: torch.dtype, device, v_head_dim: int | None = None):
        self.k = torch.zeros(n_kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(n_kv_heads, max_len, v_head_dim or head_dim, dtype=dtype, device=device)

    def update(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k, v`` ``[n_kv, T, d]`` at ``start`` and return views of positions ``0..start+T``."""
        end = start + k.shape[1]
        self.k[:, start:end] = k
        self.v[:, start:end] = v
        return self.k[:, :end], self.v[:, :end]

    def rollback(self, length: int) -> None:
        pass  # stale entries past `length` are never read and get overwritten

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


class SequenceCache:
    """All caches of one sequence, plus its length (the positions written so far)."""

    def __init__(self, layers: list, max_len: int):
        self.layers = layers
        self.max_len = max_len
        self.length = 0

    def reserve(self, n: int) -> int:
        """Claim ``n`` more positions; return the first one. Raise if the cache is full."""
        if self.length + n > self.max_len:
            raise ContextOverflowError(
                f"sequence needs {self.length + n} positions but the cache holds {self.max_len} "
                f"(the model's context or --max-context limit)"
            )
        start = self.length
        self.length += n
        return start

    def rollback(self, length: int) -> None:
        """Drop every position from ``length`` on, in every layer's cache."""
        if not 0 <= length <= self.length:
            raise ValueError(f"rollback to {length} outside 0..{self.length}")
        for c in self.layers:
            if c is not None:
                c.rollback(length)
        self.length = length

    def nbytes(self) -> int:
        return sum(c.nbytes() for c in self.layers if c is not None)
