"""Gated DeltaNet, the linear-attention token mixer of Qwen3.5 / Qwen3.6 (and Qwen3-Next).

Per value head, with an fp32 state ``S`` of shape ``[dk, dv]``::

    S_t = exp(g_t) * S_{t-1}
    u_t = beta_t * (v_t - S_t^T k_t)          # the delta rule: write only what S mispredicts
    S_t = S_t + k_t u_t^T
    o_t = S_t^T q_t

with ``q, k`` L2-normalised (``q`` also scaled by ``1/sqrt(dk)``), ``beta = sigmoid(b)`` and
``g = -exp(A_log) * softplus(a + dt_bias)``. Two exact forms of the same recurrence:
:func:`recurrent_gated_delta` steps through positions (decode and verification: its per-position
arithmetic does not depend on the position's row in the step, which keeps speculative output
bit-identical to plain decoding) and returns the state after every position, which the cache keeps
for rollback; :func:`chunked_gated_delta` processes chunks of positions with a few matmuls (prefill).

The projections feed a depthwise causal conv (+SiLU) over ``[q | k | v]`` whose window is
carried across forwards by :class:`~specdec.cache.LinearAttnCache`.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from .. import env
from ..cache import BatchLinearCache, LinearAttnCache
from .. import cpu_linear
from ..cpu_linear import Linear
from ..errors import ConfigError
from ..parallel.tp import Blocks, Shard, Slice, row_parallel
from . import delta_kernel
from .layers import derived_weight, fuse_linears


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (the FLA / transformers convention)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrent_gated_delta(q, k, v, g, beta, state):
    """Step through positions. Position-major inputs: ``q, k [T, H, dk]``, ``v [T, H, dv]``,
    ``g, beta [T, H]``, ``state [H, dk, dv]``, all fp32 -> (out ``[T, H, dv]``, states after each
    position ``[T, H, dk, dv]``).

    Position ``t`` is computed from the state before it and its own (contiguous) row only, by the
    same ops on the same shapes whatever ``T`` is and wherever ``t`` sits in the step: this is the
    form that keeps a position's numerics independent of its row (per-position invariance).
    """
    outs, states = [], []
    s = state
    for t in range(q.shape[0]):
        kt, qt = k[t], q[t]  # [H, dk]
        s = s * g[t].exp()[:, None, None]
        pred = torch.bmm(kt[:, None, :], s)[:, 0]  # S^T k: [H, dv]
        u = beta[t][:, None] * (v[t] - pred)
        s = torch.baddbmm(s, kt[:, :, None], u[:, None, :])  # S + k u^T
        outs.append(torch.bmm(qt[:, None, :], s)[:, 0])
        states.append(s)
    return torch.stack(outs), torch.stack(states)


# On CUDA, run the recurrent form as one fused Triton kernel (delta_kernel.py) when available.
use_fused_kernel = True


def recurrent_step_form(q, k, v, g, beta, state):
    """The recurrent form for a decode/verify step: the fused kernel on CUDA, else the torch loop."""
    if use_fused_kernel and delta_kernel.available(k):
        return delta_kernel.recurrent_gated_delta_fused(q, k, v, g, beta, state)
    return recurrent_gated_delta(q, k, v, g, beta, state)


# On CUDA, decode and verify steps (forwards that keep snapshots) run the mixer as three fused kernels
# (delta_kernel.conv_gates, recurrent_into_cache, gated_norm) instead of ~60 torch ops. SPECDEC_DELTA_FUSED=0
# gives the torch form back.
FUSED_STEP = env.switch("SPECDEC_DELTA_FUSED")

# The four in-projections (qkv, z, b, a) read the same input: once fused (GatedDeltaNet.fuse, at load),
# one GEMM computes them. SPECDEC_DELTA_PROJ=0 runs the four GEMMs on the same (view) weights.
FUSED_PROJ = env.switch("SPECDEC_DELTA_PROJ")


# Longest stretch handed to one chunked pass: bounds its [H, T/C, C, C] temporaries.
SEGMENT_TOKENS = 4096


def chunked_gated_delta(q, k, v, g, beta, state, chunk_size: int = 64, all_states: bool = False):
    """The same recurrence, ``chunk_size`` positions at a time.

    Inside a chunk, with ``G`` the cumulative sum of ``g`` and ``D[t, j] = exp(G_t - G_j)``
    (``j <= t``), the delta-rule values solve a unit lower-triangular system::

        (I + A) U = beta*V - beta*exp(G) * (K S0),   A[t, j] = beta_t D[t, j] (k_t . k_j), j < t
        O   = exp(G) * (Q S0) + (D o (Q K^T)) U
        S_t = exp(G_t) S0 + sum_{j<=t} D[t, j] k_j u_j^T

    Shapes as :func:`recurrent_gated_delta`, fp32. Returns (out ``[H, T, dv]``, states): the
    state after every position ``[T, H, dk, dv]`` when ``all_states``, else ``[1, H, dk, dv]``.
    """
    h, t, dk = k.shape
    seg = max(SEGMENT_TOKENS // chunk_size, 1) * chunk_size
    if t > seg:
        outs, states = [], []
        for lo in range(0, t, seg):
            sl = slice(lo, lo + seg)
            o, st = chunked_gated_delta(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], state, chunk_size, all_states)
            outs.append(o)
            states.append(st)
            state = st[-1]
        return torch.cat(outs, dim=1), (torch.cat(states) if all_states else states[-1])
    dv = v.shape[-1]
    c = min(chunk_size, t)
    pad = (-t) % c
    if pad:
        # beta = 0 and g = 0 make padded positions leave the state untouched
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (t + pad) // c
    q, k, v = q.view(h, n, c, dk), k.view(h, n, c, dk), v.view(h, n, c, dv)
    g, beta = g.view(h, n, c), beta.view(h, n, c)

    G = g.cumsum(-1)  # [h, n, c]
    incl = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~incl, float("-inf")).exp()  # D, zero above the diagonal
    a = (k @ k.transpose(-1, -2)) * decay * beta[..., :, None]
    # solve_triangular(unitriangular) reads only the strictly lower part of `a`: that is A
    w_v = torch.linalg.solve_triangular(a, v * beta[..., None], upper=False, unitriangular=True)
    w_k = torch.linalg.solve_triangular(a, k * (beta * G.exp())[..., None], upper=False, unitriangular=True)
    qk = (q @ k.transpose(-1, -2)) * decay
    q_dec = q * G.exp()[..., None]
    g_last = G[..., -1]  # [h, n]
    k_dec = k * (g_last[..., None] - G).exp()[..., None]

    out = q.new_empty(h, n, c, dv)
    states = []
    s = state
    for i in range(n):
        u = w_v[:, i] - w_k[:, i] @ s  # [h, c, dv]
        out[:, i] = q_dec[:, i] @ s + qk[:, i] @ u
        if all_states:
            inner = torch.einsum("htj,hjk,hjv->thkv", decay[:, i], k[:, i], u)
            states.append(G[:, i].exp().t()[:, :, None, None] * s[None] + inner)
        s = g_last[:, i].exp()[:, None, None] * s + k_dec[:, i].transpose(-1, -2) @ u
    out = out.view(h, n * c, dv)[:, :t]
    if all_states:
        return out, torch.cat(states, dim=0)[:t]
    return out, s[None]


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's ``dv`` channels with a plain ``w`` (not ``1 + w``), gated by ``silu(z)``."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight
        return (y.float() * F.silu(z.float())).to(x.dtype)


def split_linear_heads(n_k: int, n_v: int, k_dim: int, v_dim: int, shard: Shard) -> dict[str, Slice | Blocks]:
    """A rank's part of a Gated DeltaNet (tensor parallelism): a block of ``n_k / world`` key heads
    with the value heads they serve (consecutive in HF's grouped order, so a group stays whole).
    Parameter name -> the slice of its checkpoint tensor; everything per value head is local."""
    if n_k % shard.world:
        raise ConfigError(f"linear_num_key_heads={n_k} is not divisible by the {shard.world} tensor-parallel ranks")
    k0, k1 = shard.rank * n_k // shard.world, (shard.rank + 1) * n_k // shard.world
    per_k = n_v // n_k
    v0, v1 = k0 * per_k, k1 * per_k
    kd = n_k * k_dim
    # rows of this rank's q, k and v among [q (Hk*dk) | k (Hk*dk) | v (Hv*dv)]: three blocks
    qkv = Blocks(0, ((k0 * k_dim, k1 * k_dim), (kd + k0 * k_dim, kd + k1 * k_dim),
                     (2 * kd + v0 * v_dim, 2 * kd + v1 * v_dim)), 2 * kd + n_v * v_dim)
    heads = Slice(0, v0, v1, n_v, v1 - v0)
    rows = heads.scaled(v_dim)
    return {"in_proj_qkv.weight": qkv, "conv1d.weight": qkv, "in_proj_z.weight": rows, "in_proj_b.weight": heads,
            "in_proj_a.weight": heads, "dt_bias": heads, "A_log": heads, "out_proj.weight": rows.along(1)}


class GatedDeltaNet(nn.Module):
    """The linear-attention mixer with transformers' parameter names (``linear_attn.*``).

    ``in_proj_qkv`` emits ``[q (Hk*dk) | k (Hk*dk) | v (Hv*dv)]``; each key head serves
    ``Hv / Hk`` consecutive value heads. ``conv1d.weight`` is ``[C, 1, kernel]``.
    ``shard`` (tensor parallelism): the module holds this rank's key heads and their value heads
    (:func:`split_linear_heads`), so do its conv and recurrent caches; ``out_proj`` all-reduces.
    """

    # Positions per chunk of the chunked form (prefill: forwards that keep no snapshots).
    chunk_size = 64

    def __init__(self, hidden: int, n_k_heads: int, n_v_heads: int, k_dim: int, v_dim: int, kernel: int, eps: float,
                 shard: Shard | None = None):
        super().__init__()
        if shard is not None:
            self.tp_slices = split_linear_heads(n_k_heads, n_v_heads, k_dim, v_dim, shard)
            n_k_heads, n_v_heads = n_k_heads // shard.world, n_v_heads // shard.world
        self.hk, self.hv, self.dk, self.dv, self.kernel = n_k_heads, n_v_heads, k_dim, v_dim, kernel
        self.conv_dim = 2 * n_k_heads * k_dim + n_v_heads * v_dim
        self.in_proj_qkv = Linear(hidden, self.conv_dim, bias=False)
        self.in_proj_z = Linear(hidden, n_v_heads * v_dim, bias=False)
        self.in_proj_b = Linear(hidden, n_v_heads, bias=False)
        self.in_proj_a = Linear(hidden, n_v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(n_v_heads))
        self.A_log = nn.Parameter(torch.empty(n_v_heads))
        self.norm = GatedRMSNorm(v_dim, eps)
        self.out_proj = row_parallel(n_v_heads * v_dim, hidden, False, shard)
        self._fused: tuple | None = None  # (weight, None, sizes) once fuse() ran

    def fuse(self) -> None:
        """The four in-projections as one weight (:func:`~specdec.models.layers.fuse_linears`); call
        after loading."""
        if self._fused is None:
            self._fused = fuse_linears(self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)

    def project(self, x: torch.Tensor, linear=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [..., hidden]`` -> ``in_proj_qkv, in_proj_z, in_proj_b, in_proj_a`` of it: one GEMM once
        fused (column slices of its output), else four. ``linear(x, w)``: the GEMM (the fused layers' kernel,
        ``fused_layer.linear``: the fused weight always); None: ``cpu_linear.linear``."""
        if linear is not None:
            w, _, sizes = self._fused
            return linear(x, w).split(sizes, dim=-1)
        if self._fused is not None and FUSED_PROJ:
            w, _, sizes = self._fused
            return cpu_linear.linear(x, w).split(sizes, dim=-1)
        return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)

    def make_cache(self, dtype: torch.dtype, device, snapshot_tokens: int = 32) -> LinearAttnCache:
        return LinearAttnCache(self.conv_dim, self.kernel, self.hv, self.dk, self.dv, dtype, device, snapshot_tokens)

    def make_batch_cache(self, slots: int, rows: int, dtype: torch.dtype, device) -> BatchLinearCache:
        """Caches of ``slots`` sequences, keeping per-row states for steps of up to ``rows`` rows."""
        return BatchLinearCache(slots, self.conv_dim, self.kernel, self.hv, self.dk, self.dv, rows, dtype, device)

    def conv(self, window: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Depthwise causal conv + SiLU. ``window [K-1, C]``, ``x [T, C]`` -> (out ``[T, C]``,
        conv inputs ``[K-1+T, C]``, which the cache keeps for rollback); batched, ``[b, ...]``.

        Written as an explicit sum over the kernel taps in fp32 (not ``F.conv1d``, whose algorithm
        and vector tails depend on ``T``), so every output row is computed the same way wherever it
        sits in the step."""
        full = torch.cat([window.to(x.dtype), x], dim=-2)
        taps = full.float().unfold(-2, self.kernel, 1)  # [..., T, C, K]: row t holds inputs t .. t+K-1
        out = (taps * self.conv1d.weight[:, 0].float()).sum(-1)
        return F.silu(out).to(x.dtype), full

    def gates(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor):
        """Conv outputs ``mixed [..., C]`` and the ``in_proj_b, in_proj_a`` outputs ``[..., Hv]`` -> fp32
        ``q, k [..., Hv, dk]`` (normalised, key heads repeated per value head), ``v [..., Hv, dv]``,
        ``g, beta [..., Hv]``."""
        lead = mixed.shape[:-1]
        kd = self.hk * self.dk
        q = mixed[..., :kd].reshape(*lead, self.hk, self.dk).float()
        k = mixed[..., kd:2 * kd].reshape(*lead, self.hk, self.dk).float()
        v = mixed[..., 2 * kd:].reshape(*lead, self.hv, self.dv).float()
        q = l2norm(q) * self.dk ** -0.5
        k = l2norm(k)
        if self.hv != self.hk:
            r = self.hv // self.hk
            q, k = q.repeat_interleave(r, dim=-2), k.repeat_interleave(r, dim=-2)
        beta = torch.sigmoid(b.float())
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        return q, k, v, g, beta

    def finish(self, o: torch.Tensor, z: torch.Tensor, linear=None) -> torch.Tensor:
        """Recurrence output ``o [..., Hv, dv]`` (fp32) and the gate ``z [..., Hv * dv]`` (``in_proj_z``'s
        output) -> gated norm -> ``out_proj``: ``[..., hidden]`` (``linear``: see :meth:`project`)."""
        lead = z.shape[:-1]
        z = z.unflatten(-1, (self.hv, self.dv))
        return self._out(self.norm(o.to(z.dtype), z).reshape(*lead, -1), linear)

    def _out(self, y: torch.Tensor, linear=None) -> torch.Tensor:
        return self.out_proj(y) if linear is None else linear(y, self.out_proj.weight)

    def forward(self, x: torch.Tensor, ctx, cache: LinearAttnCache, linear=None) -> torch.Tensor:
        """``ctx.start``: an int (eager), or a 0-d device tensor in a static (CUDA-graph) step, where
        the live state is selected on the device and the caller does the Python bookkeeping.
        ``x [b, T, hidden]``: a batched step (:meth:`forward_batch`).

        Forwards that keep per-position snapshots (decode and verify steps, which may be rolled
        back) and 1-token forwards use the recurrent form, whose per-position arithmetic does not
        depend on the row: a position verified at row 3 gets the bits it gets at row 0 in plain
        decoding. Longer forwards without snapshots (prefill) use the chunked form. ``linear``: the in- and
        out-projections' GEMM (see :meth:`project`)."""
        if x.dim() == 3:
            return self.forward_batch(x, ctx, cache, linear)
        t = x.shape[0]
        start = ctx.start
        static = isinstance(start, torch.Tensor)
        keep = ctx.snapshots and cache.keeps_snapshots(t)
        if keep:
            cache.reserve_rows(t)
        proj, z, b, a = self.project(x, linear)
        if keep and FUSED_STEP and delta_kernel.step_kernels_available(x, self.dk, self.dv):
            o = self.step_fused(proj, z, b, a, cache, start, ctx.live, linear)
            if not static:
                cache.commit(start, t, keep)
            return o
        window, state0 = cache.conv_window(start), cache.state(start)
        mixed, full = self.conv(window, proj)
        q, k, v, g, beta = self.gates(mixed, b, a)
        if keep or t == 1:
            o, states = recurrent_step_form(q.contiguous(), k.contiguous(), v.contiguous(), g, beta, state0)
        else:
            hm = (y.transpose(0, 1).contiguous() for y in (q, k, v, g, beta))  # head-major
            o, states = chunked_gated_delta(*hm, state0, self.chunk_size, all_states=False)
            o = o.transpose(0, 1)
        cache.write(start, full, states if keep else states[-1:], keep)
        if not static:
            cache.commit(start, t, keep)
        return self.finish(o, z, linear)

    def step_fused(self, proj: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, cache: LinearAttnCache,
                   start, live: torch.Tensor | None = None, linear=None) -> torch.Tensor:
        """A snapshot step (decode, verify) on :mod:`delta_kernel`'s step kernels, from the step's
        in-projections (:meth:`project`) at position ``start`` (an int, or a static step's 0-d device tensor): the
        same values as the torch form up to rounding, written into ``cache``'s rings as :meth:`LinearAttnCache.write`
        would (the conv inputs, the state after each position). ``live``: a static step's real rows
        (``StepContext.live``; the rest pad it), None: all."""
        args = (self.conv_weight_fp32(), b, a, self.A_log, self.dt_bias, self.hk, self.hv, self.dk, self.dv)
        if delta_kernel.ONE_KERNEL:
            o = delta_kernel.step(proj, cache.conv, cache.states, start, live, *args)
        else:
            q, k, v, g, beta = delta_kernel.conv_gates(proj, cache.conv, start, *args)
            o = delta_kernel.recurrent_into_cache(q, k, v, g, beta, cache.states, start, live)
        return self._out(delta_kernel.gated_norm(o, z, self.norm.weight, self.norm.eps), linear)

    def conv_weight_fp32(self) -> torch.Tensor:
        """``conv1d.weight`` as ``[C, K]`` fp32, remade when the weight changes (``layers.derived_weight``)."""
        return derived_weight(self, "_conv_w", self.conv1d.weight, lambda w: w[:, 0].float().contiguous())

    def forward_batch(self, x: torch.Tensor, ctx, cache, linear=None) -> torch.Tensor:
        """Rows ``x [b, T, hidden]``, row ``r`` continuing its slot's sequence (``ctx.start``, a
        :class:`~specdec.cache.BatchWrite`, with a :class:`BatchLinearCache`), or whole sequences
        from position 0 without a cache (``ctx.start`` None: training features).

        A verify step (no ``commit``) runs the recurrent form, every slot's heads side by side as
        ``b * Hv`` heads, and stages the state after every row for :meth:`BatchLinearCache.commit`.
        A prefill (``commit``: each row's real length) runs the chunked form with the padding
        positions made inert (``g = 0``, ``beta = 0`` leave the state unchanged), so the final state
        is each row's state after its last real position, which is committed."""
        b, t, _ = x.shape
        w = ctx.start
        if w is None:
            window = x.new_zeros(b, self.kernel - 1, self.conv_dim)
            state0 = x.new_zeros(b, self.hv, self.dk, self.dv, dtype=torch.float32)
        else:
            window, state0 = cache.read(w)
        proj, z, bo, ao = self.project(x, linear)
        mixed, full = self.conv(window, proj)
        q, k, v, g, beta = self.gates(mixed, bo, ao)  # [b, T, Hv, ...]
        heads = b * self.hv
        if w is not None and w.commit is None:
            pm = [y.transpose(0, 1).reshape(t, heads, *y.shape[3:]).contiguous() for y in (q, k, v, g, beta)]
            o, states = recurrent_step_form(*pm, state0.reshape(heads, self.dk, self.dv))  # position-major
            o = o.view(t, b, self.hv, self.dv).transpose(0, 1)
            cache.stage(w, full, states.view(t, b, self.hv, self.dk, self.dv).transpose(0, 1), state0)
            return self.finish(o, z, linear)
        if w is not None:
            real = (torch.arange(t, device=x.device)[None, :] < w.commit[:, None])[..., None]  # [b, T, 1]
            g, beta = g * real, beta * real
        hm = [y.transpose(1, 2).reshape(heads, t, *y.shape[3:]).contiguous() for y in (q, k, v, g, beta)]
        o, s = chunked_gated_delta(*hm, state0.reshape(heads, self.dk, self.dv), self.chunk_size)
        if w is not None:
            cache.store(w, full, s[-1].view(b, self.hv, self.dk, self.dv))
        return self.finish(o.view(b, self.hv, t, self.dv).transpose(1, 2), z, linear)
