"""Per-sequence caches with exact rollback.

A :class:`SequenceCache` holds one entry per target layer: a :class:`KVCache` for attention
layers (preallocated, indexed by position; rollback is free because entries past the committed
length are simply overwritten later) or a recurrent cache for linear-attention layers, which
keeps the state after every position of the last forward so rollback restores it exactly.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from .errors import ContextOverflowError
from .hostcopy import device_ints


class LayerCache(Protocol):
    def rollback(self, length: int) -> None:
        """Return to the state after ``length`` positions (within the last forward)."""
        ...

    def nbytes(self) -> int:
        ...

    def reset(self) -> None:
        """Forget the sequence (a new one starts at position 0), keeping the buffers."""
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

    def reset(self) -> None:
        pass  # a new sequence overwrites positions from 0

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

    @torch.inference_mode()
    def reset(self) -> None:
        """Empty the cache for a new sequence, keeping every buffer (captured graphs stay valid)."""
        for c in self.layers:
            if c is not None:
                c.reset()
        self.length = 0


class LinearAttnCache:
    """Conv window and recurrent state of one linear-attention (Gated DeltaNet) layer, in two rings
    keyed by position.

    Static buffers (never reallocated once a step length has been seen, so CUDA graphs can
    capture the steps that use them):

    - ``conv [kernel-1+R, C]`` (model dtype): the conv input of position ``p`` at row ``p mod
      (kernel-1+R)``; the window at length ``L`` is positions ``L-kernel+1 .. L-1`` (a position
      before 0 reads a row never written since :meth:`reset`: zeros);
    - ``states [R+1, H, dk, dv]`` (fp32): the state after ``L`` positions at row ``L mod (R+1)``.

    A forward of ``T <= R`` positions at ``S`` (one that keeps snapshots: a decode or verify step) reads
    the rows of length ``S`` and writes those of lengths ``S+1 .. S+T`` (positions ``S .. S+T-1``),
    never a row it reads. Rolling back to any length in ``S .. S+T`` is then the length alone: exact, no
    copy, no device write; the kernels find the live rows from the step's start (a static step's start
    tensor). ``R`` grows to the longest snapshot forward seen (at most ``snapshot_tokens``; one verify
    step), so the snapshot memory is bounded by the draft length, never by the context. A longer forward
    (prefill) keeps only its final state and window, and rolling back into it is an error.
    """

    def __init__(self, conv_channels: int, kernel: int, n_heads: int, key_dim: int, value_dim: int,
                 dtype: torch.dtype, device, snapshot_tokens: int = 32):
        self.kernel, self.snapshot_tokens = kernel, snapshot_tokens
        self.conv = torch.zeros(kernel - 1, conv_channels, dtype=dtype, device=device)
        self.states = torch.zeros(1, n_heads, key_dim, value_dim, dtype=torch.float32, device=device)
        self._steps = torch.arange(kernel + snapshot_tokens, device=device)  # row offsets (index_copy_'s indices)
        self.base = 0  # cache length before the last forward
        self.length = 0
        self.rollbackable = False  # the last forward kept per-position states
        self.version = 0  # bumped when the buffers are reallocated (captured graphs then go stale)

    @property
    def rows(self) -> int:
        return self.states.shape[0] - 1

    def _rows(self, first, n: int, ring: int) -> torch.Tensor:
        """Ring rows of ``n`` consecutive positions (or lengths) from ``first`` (an int, or a 0-d device tensor in a
        static step: graph-safe), as a device index."""
        return (self._steps[:n] + first) % ring

    # --- read by the layer -------------------------------------------------------
    def conv_window(self, length=None) -> torch.Tensor:
        """A copy of the conv window ``[kernel-1, C]`` at ``length`` (default: the cache's; a 0-d device tensor in a
        static step)."""
        length = self.length if length is None else length
        return self.conv.index_select(0, self._rows(length - (self.kernel - 1), self.kernel - 1, self.conv.shape[0]))

    def state(self, length=None) -> torch.Tensor:
        """The recurrent state ``[H, dk, dv]`` (fp32) after ``length`` positions (default: the cache's; a 0-d device
        tensor in a static step: a copy)."""
        length = self.length if length is None else length
        if isinstance(length, torch.Tensor):
            return self.states.index_select(0, (length % self.states.shape[0]).reshape(1))[0]
        return self.states[length % self.states.shape[0]]

    def keeps_snapshots(self, t: int) -> bool:
        """Whether a forward of ``t`` positions keeps the state after each of them."""
        return t <= self.snapshot_tokens

    def reserve_rows(self, t: int) -> None:
        """Grow the rings for snapshot forwards of ``t`` positions (before any graph capture), every row a rollback
        may still read moved to its place in the larger rings."""
        if t <= self.rows:
            return
        k1 = self.kernel - 1
        first = self.base if self.rollbackable else self.length  # the lengths a rollback may still restore
        if self._steps.shape[0] < k1 + t:
            self._steps = torch.arange(k1 + t, device=self._steps.device)
        conv = self.conv.new_zeros(k1 + t, self.conv.shape[1])
        states = self.states.new_zeros(t + 1, *self.states.shape[1:])
        lengths = torch.arange(first, self.length + 1, device=states.device)
        states[lengths % (t + 1)] = self.states[lengths % self.states.shape[0]]
        pos = torch.arange(max(first - k1, 0), self.length, device=states.device)  # their windows' positions
        conv[pos % (k1 + t)] = self.conv[pos % self.conv.shape[0]]
        self.conv, self.states = conv, states
        self.version += 1

    # --- written by the layer ----------------------------------------------------
    def write(self, start, conv_inputs: torch.Tensor, states: torch.Tensor, snapshots: bool) -> None:
        """Store a forward's results in place (graph-safe). ``start``: its first position (an int, or a 0-d device
        tensor in a static step). ``conv_inputs [kernel-1+T, C]``: the window before the forward, then its T inputs.
        ``states``: ``[T, H, dk, dv]`` after each position (``snapshots``) or ``[1, ...]``, the final state."""
        k1 = self.kernel - 1
        t = conv_inputs.shape[0] - k1
        if states.dtype != torch.float32:
            raise TypeError(f"recurrent state must be float32, got {states.dtype}")
        if snapshots:
            if states.shape[0] != t:
                raise RuntimeError(f"a snapshot forward of {t} positions wrote {states.shape[0]} states")
            if t > self.rows:
                raise RuntimeError(f"linear-attention cache has {self.rows} snapshot rows, a forward wrote {t}; "
                                   "call reserve_rows first")
            self.states.index_copy_(0, self._rows(start + 1, t, self.states.shape[0]), states)
            self.conv.index_copy_(0, self._rows(start, t, self.conv.shape[0]), conv_inputs[k1:])
        else:  # the final state and the window that ends there (past a window's worth of inputs, only theirs)
            self.states.index_copy_(0, self._rows(start + t, 1, self.states.shape[0]), states[-1:])
            n = min(t, k1)
            self.conv.index_copy_(0, self._rows(start + t - n, n, self.conv.shape[0]), conv_inputs[k1 + t - n:])

    def commit(self, start: int, t: int, snapshots: bool) -> None:
        """Python bookkeeping for a forward of ``t`` positions at ``start`` (after :meth:`write`)."""
        if start != self.length:
            raise RuntimeError(f"linear-attention cache holds {self.length} positions but the forward starts at {start}")
        self.base, self.length, self.rollbackable = start, start + t, snapshots

    # --- the LayerCache protocol ------------------------------------------------
    def rollback(self, length: int) -> None:
        """Restore the state after ``length`` positions; it must lie inside the last forward."""
        if length == self.length:
            return
        if not self.rollbackable or not self.base <= length < self.length:
            kept = f"{self.base}..{self.length}" if self.rollbackable else f"only {self.length}"
            raise ValueError(
                f"linear-attention cache cannot roll back to {length}: it holds {self.length} positions and can "
                f"restore {kept} (states are kept per position only for the last forward, and only when it "
                f"had <= {self.snapshot_tokens} tokens)"
            )
        self.length = length

    def reset(self) -> None:
        """Back to the empty sequence (zero state and window), in the same buffers."""
        self.conv.zero_()
        self.states.zero_()
        self.base = self.length = 0
        self.rollbackable = False

    def nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.states.numel() * self.states.element_size()

    def snapshot_nbytes(self) -> int:
        """Bytes kept only for rollback: per-position states and conv inputs of a verify step."""
        live = self.states[0].numel() * self.states.element_size()
        live += (self.kernel - 1) * self.conv.shape[1] * self.conv.element_size()
        return self.nbytes() - live


class BatchWrite:
    """Where a batched step writes: row ``r`` of the step lives in cache slot ``slots[r]`` and
    writes positions ``pos[r]`` (``[b, T]``); attention reads positions ``0 .. span-1``.
    ``slots`` is a ``range`` (a contiguous block of slots: views, no gather) or a long tensor.
    ``commit`` (``[b]`` long, or None): a prefill, whose linear-attention states are committed
    after each row's first ``commit[r]`` positions (its padding dropped); without it the step
    keeps the states after every row position until :meth:`BatchCache.commit` picks one."""

    def __init__(self, slots, pos: torch.Tensor, span: int, commit: torch.Tensor | None = None):
        self.slots, self.pos, self.span, self.commit = slots, pos, span, commit
        if isinstance(slots, range):
            self.rows = slice(slots.start, slots.stop)
            self.index = torch.arange(slots.start, slots.stop, device=pos.device)
        else:
            self.rows, self.index = slots, slots


class BatchKVCache:
    """Keys and values of one attention layer for many sequences: ``[slots, n_kv, max_len, d]``."""

    def __init__(self, slots: int, n_kv_heads: int, head_dim: int, max_len: int, dtype: torch.dtype, device):
        self.k = torch.zeros(slots, n_kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    def update(self, w: BatchWrite, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k, v [b, n_kv, T, d]`` at each row's positions; return ``[b, n_kv, span, d]``."""
        rows = w.index[:, None]
        self.k[rows, :, w.pos] = k.transpose(1, 2)
        self.v[rows, :, w.pos] = v.transpose(1, 2)
        return self.read(w)

    def read(self, w: BatchWrite) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values a step's attention reads: ``[b, n_kv, span, d]`` views."""
        return self.k[w.rows, :, : w.span], self.v[w.rows, :, : w.span]

    def commit(self, slots: torch.Tensor, n: torch.Tensor) -> None:
        pass  # entries past a slot's length are never read and get overwritten

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


class BatchLinearCache:
    """Conv windows and recurrent states of one linear-attention (Gated DeltaNet) layer for many
    sequences. A slot's recurrent state cannot be overwritten later like a KV entry, so a verify
    step keeps its per-row results aside and the owner commits the accepted rows explicitly:

    - ``conv [S, K-1, C]`` (model dtype), ``state [S, H, dk, dv]`` (fp32): each slot's committed
      window and state;
    - ``step_conv [S, K-1+R, C]``: the last step's conv inputs per slot (the window before it,
      then its rows), so the window after ``n`` rows is ``step_conv[s, n : n+K-1]``;
    - ``step_states [S, R+1, H, dk, dv]``: the state before the last step, then after each row.

    A step of up to ``R`` rows writes only the ``step_*`` buffers (:meth:`stage`: graph-safe, and
    padding or idle rows never touch a committed state); :meth:`commit` then keeps ``n`` rows of
    it for chosen slots. A prefill (``BatchWrite.commit``) writes the committed state after each
    row's real positions directly (:meth:`store`): there is no rollback into a prefill. A row that
    starts at position 0 reads a zero window and state: a new sequence needs no reset.
    """

    def __init__(self, slots: int, conv_channels: int, kernel: int, n_heads: int, key_dim: int, value_dim: int,
                 rows: int, dtype: torch.dtype, device):
        self.kernel = kernel
        self.conv = torch.zeros(slots, kernel - 1, conv_channels, dtype=dtype, device=device)
        self.state = torch.zeros(slots, n_heads, key_dim, value_dim, dtype=torch.float32, device=device)
        self.step_conv = torch.zeros(slots, kernel - 1 + rows, conv_channels, dtype=dtype, device=device)
        self.step_states = torch.zeros(slots, rows + 1, n_heads, key_dim, value_dim, dtype=torch.float32, device=device)

    @property
    def rows(self) -> int:
        return self.step_states.shape[1] - 1

    def read(self, w: BatchWrite) -> tuple[torch.Tensor, torch.Tensor]:
        """The committed window ``[b, K-1, C]`` and state ``[b, H, dk, dv]`` of each row's slot
        (zeros for a row starting at position 0)."""
        fresh = w.pos[:, 0] == 0
        window = self.conv[w.rows].masked_fill(fresh[:, None, None], 0)
        return window, self.state[w.rows].masked_fill(fresh[:, None, None, None], 0)

    def stage(self, w: BatchWrite, conv_inputs: torch.Tensor, states: torch.Tensor, state0: torch.Tensor) -> None:
        """Keep a step's ``conv_inputs [b, K-1+T, C]``, states after each row ``[b, T, H, dk, dv]``
        and states before it ``[b, H, dk, dv]`` until :meth:`commit`."""
        t = states.shape[1]
        if t > self.rows:
            raise RuntimeError(f"a batched step of {t} rows exceeds the {self.rows} rows of per-row linear-attention "
                               "states (build the cache with spare >= the step width, or pass commit for a prefill)")
        if states.dtype != torch.float32:
            raise TypeError(f"recurrent state must be float32, got {states.dtype}")
        self.step_conv[w.rows, : self.kernel - 1 + t] = conv_inputs
        self.step_states[w.rows, 0] = state0
        self.step_states[w.rows, 1: t + 1] = states

    def store(self, w: BatchWrite, conv_inputs: torch.Tensor, state: torch.Tensor) -> None:
        """Commit a prefill: ``state [b, H, dk, dv]`` after each row's ``w.commit[r]`` positions,
        and the window that ends there, from ``conv_inputs [b, K-1+T, C]``."""
        idx = w.commit[:, None] + torch.arange(self.kernel - 1, device=state.device)  # [b, K-1]
        self.conv[w.rows] = conv_inputs.gather(1, idx[..., None].expand(-1, -1, conv_inputs.shape[-1]))
        self.state[w.rows] = state

    def commit(self, slots: torch.Tensor, n: torch.Tensor) -> None:
        """Slot ``slots[i]`` keeps the first ``n[i]`` rows of its last step (0 .. rows)."""
        self.state[slots] = self.step_states[slots, n]
        idx = n[:, None] + torch.arange(self.kernel - 1, device=n.device)
        self.conv[slots] = self.step_conv[slots[:, None], idx]

    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in (self.conv, self.state, self.step_conv, self.step_states))


class NoCache:
    """A layer "cache" for whole-sequence forwards (training features): keys are the step's own."""

    def update(self, w, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v


class BatchCache:
    """The caches of ``slots`` sequences of at most ``max_len`` positions; a sequence's length is
    kept by its owner (the batched engine). Rolling a slot back is free for KV layers; after a
    verify step the owner calls :meth:`commit` with each slot's accepted rows, which
    linear-attention layers need (:class:`BatchLinearCache`)."""

    def __init__(self, layers: list, slots: int, max_len: int):
        self.layers, self.slots, self.max_len = layers, slots, max_len
        self.device = next((c.state.device for c in layers if isinstance(c, BatchLinearCache)), None)

    def commit(self, slots: Sequence[int], n: Sequence[int]) -> None:
        """After a step without ``BatchWrite.commit``: slot ``slots[i]`` keeps ``n[i]`` of its rows
        (the rest is rolled back). Host lists in; a no-op for attention-only caches."""
        if self.device is None or not slots:
            return
        s, k = device_ints(list(slots), self.device), device_ints(list(n), self.device)
        for c in self.layers:
            c.commit(s, k)

    def nbytes(self) -> int:
        return sum(c.nbytes() for c in self.layers)
