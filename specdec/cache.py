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

    def update(self, start, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k, v`` ``[n_kv, T, d]`` at ``start`` and return views of positions ``0..start+T``.

        ``start`` may be a 0-d device tensor (CUDA-graph steps): then the write is an index copy
        and the whole buffer is returned, the step's mask hiding positions past ``start+T``.
        """
        if isinstance(start, torch.Tensor):
            pos = start + torch.arange(k.shape[1], device=k.device)
            self.k.index_copy_(1, pos, k)
            self.v.index_copy_(1, pos, v)
            return self.k, self.v
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


class LinearAttnCache:
    """Conv window and recurrent state of one linear-attention (Gated DeltaNet) layer.

    Live state: the conv window (the last ``kernel - 1`` inputs of the causal conv,
    ``[kernel-1, channels]`` in the model dtype) and the recurrent state
    (``[heads, key_dim, value_dim]``, always fp32).

    Rollback: a forward of ``T <= snapshot_tokens`` positions keeps the state after each of
    its positions (``T`` recurrent states plus the ``kernel-1+T`` conv inputs), so
    ``rollback(length)`` to any position inside that forward restores the exact state with no
    recomputation. The snapshot memory is bounded by ``T`` (one verify step), never by the
    context. A longer forward (prefill) keeps only its final state, and rolling back into it
    is an error.
    """

    def __init__(self, conv_channels: int, kernel: int, n_heads: int, key_dim: int, value_dim: int,
                 dtype: torch.dtype, device, snapshot_tokens: int = 32):
        self.kernel = kernel
        self.snapshot_tokens = snapshot_tokens
        self.length = 0
        # conv inputs of the last forward, preceded by the window before it: [kernel-1+T, C];
        # the window after i positions of that forward is rows i .. i+kernel-2.
        self._conv = torch.zeros(kernel - 1, conv_channels, dtype=dtype, device=device)
        self._prev = torch.zeros(n_heads, key_dim, value_dim, dtype=torch.float32, device=device)  # before the last forward
        self._hist: torch.Tensor | None = None  # [T, H, dk, dv]: after each position of the last forward
        self._base = 0  # cache length before the last forward
        self._cur = 0  # positions of the last forward that are live (0 = none)

    # --- read by the layer -------------------------------------------------------
    def conv_window(self) -> torch.Tensor:
        """The live conv window ``[kernel-1, C]``."""
        return self._conv[self._cur:self._cur + self.kernel - 1]

    def state(self) -> torch.Tensor:
        """The live recurrent state ``[H, dk, dv]`` (fp32)."""
        return self._prev if self._cur == 0 else self._hist[self._cur - 1]

    def keeps_snapshots(self, t: int) -> bool:
        """Whether a forward of ``t`` positions must pass the state after each of them to :meth:`commit`."""
        return t <= self.snapshot_tokens

    # --- written by the layer ----------------------------------------------------
    def commit(self, start: int, conv_inputs: torch.Tensor, states: torch.Tensor) -> None:
        """Record a forward of ``T`` positions starting at ``start``.

        ``conv_inputs`` is ``[kernel-1+T, C]``: the window before the forward followed by the
        T new conv inputs. ``states`` is ``[T, H, dk, dv]`` fp32, the state after each position
        (when :meth:`keeps_snapshots`), or ``[1, H, dk, dv]``, the final state only.
        """
        if start != self.length:
            raise RuntimeError(f"linear-attention cache holds {self.length} positions but the forward starts at {start}")
        if states.dtype != torch.float32:
            raise TypeError(f"recurrent state must be float32, got {states.dtype}")
        t = conv_inputs.shape[0] - (self.kernel - 1)
        if self.keeps_snapshots(t):
            if states.shape[0] != t:
                raise ValueError(f"a forward of {t} positions must record {t} states, got {states.shape[0]}")
            live = self.state()
            # a view into several snapshots would keep them all alive: copy the one we need
            multi = self._cur > 0 and self._hist is not None and self._hist.shape[0] > 1
            self._prev = live.clone() if multi else live
            self._hist = states
            self._conv = conv_inputs
            self._cur = t
        else:
            self._prev = states[-1].clone()
            self._hist = None
            self._conv = conv_inputs[t:].clone()  # the last kernel-1 rows: the window after the forward
            self._cur = 0
        self._base = start
        self.length = start + t

    # --- the LayerCache protocol ------------------------------------------------
    def rollback(self, length: int) -> None:
        """Restore the state after ``length`` positions; it must lie inside the last forward."""
        if length == self.length:
            return
        if self._hist is None or not self._base <= length < self.length:
            kept = f"{self._base}..{self.length}" if self._hist is not None else f"only {self.length}"
            raise ValueError(
                f"linear-attention cache cannot roll back to {length}: it holds {self.length} positions and can "
                f"restore {kept} (states are kept per position only for the last forward, and only when it "
                f"had <= {self.snapshot_tokens} tokens)"
            )
        self._cur = length - self._base
        self.length = length

    def nbytes(self) -> int:
        n = self._conv.numel() * self._conv.element_size() + self._prev.numel() * self._prev.element_size()
        if self._hist is not None:
            n += self._hist.numel() * self._hist.element_size()
        return n

    def snapshot_nbytes(self) -> int:
        """Bytes kept only for rollback: the per-position states and conv inputs of the last forward."""
        live = self._prev.numel() * self._prev.element_size()
        live += (self.kernel - 1) * self._conv.shape[1] * self._conv.element_size()
        return self.nbytes() - live
