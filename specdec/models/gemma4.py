"""Gemma 4 text targets, dense and MoE (``gemma4_text``, and the language model of ``gemma4``; GGUF
architecture ``gemma4``, read by :mod:`.gemma4_gguf`).

A decoder layer, in transformers' names:

- attention, sandwich-normed: ``x + post_attention_layernorm(attn(input_layernorm(x)))``. Queries
  and keys are RMS-normed per head (``q_norm``, ``k_norm``), values too without a weight
  (``v_norm``); the score scale is 1 (the norms set it). Sliding layers see the last
  ``sliding_window`` positions; full layers may use another head size and KV-head count, and
  with ``attention_k_eq_v`` have no ``v_proj``: the values are the raw ``k_proj`` output.
  Each layer type has its own RoPE (see :mod:`.gemma4_config`).
- feed-forward: ``x + post_feedforward_layernorm(f)`` with ``f = mlp(pre_feedforward_layernorm(x))``,
  a GELU-tanh GLU; with ``enable_moe_block`` every layer also runs routed experts on the same
  ``x`` and ``f = post_feedforward_layernorm_1(mlp(...)) + post_feedforward_layernorm_2(experts(
  pre_feedforward_layernorm_2(x)))``. The router RMS-normalises ``x`` (no weight), scales it by
  ``router.scale / sqrt(hidden)``, takes an fp32 softmax over ``router.proj``, keeps the top k
  renormalised and multiplies each by ``router.per_expert_scale``.
- per-layer embeddings (``hidden_size_per_layer_input`` > 0): every layer adds
  ``post_per_layer_input_norm(per_layer_projection(gelu(per_layer_input_gate(x)) * p_i))``, where
  ``p_i`` is layer ``i``'s slice of ``(norm(per_layer_model_projection(e) / sqrt(hidden)) +
  embed_tokens_per_layer(ids) * sqrt(P)) / sqrt(2)`` for the scaled token embeddings ``e``.
- the layer's output is multiplied by its ``layer_scalar`` (a checkpoint buffer).

Norms scale by ``w`` (not ``1 + w`` as in Gemma 3), statistics in fp32. Embeddings are scaled by
``sqrt(hidden_size)`` rounded to the weight dtype; logits are soft-capped by
``final_logit_softcapping``. The last ``num_kv_shared_layers`` layers compute no keys or values:
they attend over the cache of the last earlier layer of their type (:class:`SharedKV`), so only
that cache rolls back. Every cache is full-length and sliding layers mask by window, by position,
in eager and static steps alike. A CUDA static step's MoE block runs :func:`~.expert_kernel.moe` (the
router's GEMM, the routing with the per-expert scales, one GEMV a (row, expert) pair with GELU-tanh, the
weighted sum; a static step's padding rows skipped); elsewhere :class:`~.moe.Experts` (static forms for
steps of at most 16 rows), so the per-position invariance of the static steps holds as for Gemma 3 and
Qwen3.5 MoE.

On CUDA every layer runs :meth:`Gemma4DecoderLayer.forward_fused` (a small model's, KV-shared or with a per-layer
input, only with ``SMALL_FUSED``, on by default: see there): its dense GEMMs on ``fused_layer.linear`` (a
KV-shared layer's q alone; the per-layer input's gate and projection, the per-layer inputs' projection of the
embeddings and the LM head too), the MoE block on the expert kernels, the full layers' 512-wide heads on the split
attention. A row's bits are then its own at any row count up to 16 where the model has experts, up to
``fused_layer.WIDE_ROWS`` where not (:meth:`Gemma4ForCausalLM.row_exact`), so the steps need no padding to stay exact.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from .. import env
from ..cache import KVCache, SequenceCache
from ..cpu_linear import Linear, linear, plain
from . import expert_kernel, fused_layer, fused_ops, layers, rope_write
from .base import StepContext, WindowedCausalLM
from .gemma4_config import Gemma4Config
from .gemma4_gguf import gguf_config, gguf_names, gguf_tensor_config
from .layers import (Embedding, GeluTanhGLU, RMSNorm, apply_rope, attend, derived_weight, fuse_linears, gelu_tanh,
                     rope_tables, static_cos_sin, unit_rms_norm)
from .moe import Experts
from .registry import Architecture, register

# Gemma 4's small models (E2B, E4B: KV-shared layers, per-layer inputs) on the fused layers, row-exact: a KV-shared
# layer's q on the fused GEMM and its q norm and RoPE in the attention kernel's queries-alone form, the per-layer
# projections on the fused GEMM. On by default since the session of 2026-12-07 (fourteenth): on an H100 (gemma4-e2b
# shape, context 512, scripts/ab_flags.py, one process) plain decoding's step took 4.172 ms padded on cuBLAS, 4.533 ms
# on this path's 1-row steps with the fused GEMM's default tile, 3.025 ms with the 1,536-output projections on split-K
# tilings (fused_layer.TILES) and 2.956 with all the shape's tilings; its output equal to plain decoding's with
# accepted drafts (device_check). SPECDEC_GEMMA4_SMALL_FUSED=0: those models on cuBLAS with padded steps
SMALL_FUSED = env.switch("SPECDEC_GEMMA4_SMALL_FUSED")


class Gemma4Rotary(nn.Module):
    """RoPE over the whole head in rotate-half layout: pair ``i`` (channels ``i`` and ``i + d/2``)
    turns at ``base ** (-2i / d) / factor`` for the first ``fraction * d/2`` pairs; the others keep
    frequency 0 (transformers' ``proportional``; ``default`` is fraction 1, factor 1)."""

    def __init__(self, head_dim: int, base: float, fraction: float = 1.0, factor: float = 1.0):
        super().__init__()
        self.head_dim, self.base, self.fraction, self.factor = head_dim, base, fraction, factor
        self._inv: dict[torch.device, torch.Tensor] = {}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        inv = self._inv.get(device)
        if inv is None:
            d = self.head_dim
            n = int(self.fraction * d // 2)
            inv = 1.0 / (self.base ** (torch.arange(0, 2 * n, 2, dtype=torch.float32) / d))
            inv = torch.cat([inv, torch.zeros(d // 2 - n)]) / self.factor
            inv = self._inv[device] = inv.to(device)
        return inv

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T]`` positions -> cos, sin ``[T, head_dim]`` (``layers.rope_tables``: the sin's sign folded)."""
        return rope_tables(positions.float()[:, None] * self.inv_freq(positions.device)[None, :], dtype)


class SharedKV(KVCache):
    """The cache of a KV-shared layer: the producing layer's buffers, read, never written."""

    def __init__(self, source: KVCache):  # no buffers of its own
        self.k, self.v = source.k, source.v

    def read(self, start, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions ``0..start+t`` (a static step, ``start`` a tensor: all)."""
        if isinstance(start, torch.Tensor):
            return self.k, self.v
        return self.k[:, :start + t], self.v[:, :start + t]

    def update(self, start, k, v):
        raise AssertionError("a KV-shared layer never writes keys and values")

    def nbytes(self) -> int:
        return 0


@dataclass(frozen=True)
class Gemma4StepContext(StepContext):
    """A :class:`StepContext` (full layers' RoPE and mask) plus the sliding layers' RoPE and window
    mask, and the per-layer embeddings ``[T, L, P]`` (added by :meth:`Gemma4ForCausalLM.token_context`)."""

    local_cos: torch.Tensor | None = None
    local_sin: torch.Tensor | None = None
    local_mask: torch.Tensor | None = None
    per_layer: torch.Tensor | None = None


class Gemma4Attention(nn.Module):
    """GQA attention with q/k/v norms, score scale 1, optional k=v and optional shared KV."""

    def __init__(self, c: Gemma4Config, layer_type: str, shared: bool):
        super().__init__()
        self.head_dim, self.n_kv = c.attention_dims[layer_type]
        self.n_heads, self.eps, self.shared = c.num_attention_heads, c.rms_norm_eps, shared
        h, d, bias = c.hidden_size, self.head_dim, c.attention_bias
        self.q_proj = Linear(h, self.n_heads * d, bias=bias)
        self.q_norm = RMSNorm(d, c.rms_norm_eps)
        if not shared:
            self.k_proj = Linear(h, self.n_kv * d, bias=bias)
            k_eq_v = c.attention_k_eq_v and layer_type == "full_attention"
            self.v_proj = None if k_eq_v else Linear(h, self.n_kv * d, bias=bias)
            self.k_norm = RMSNorm(d, c.rms_norm_eps)
        self.o_proj = Linear(self.n_heads * d, h, bias=bias)
        self._fused: tuple | None = None  # (weight, bias, sizes): q/k(/v) as one GEMM once fuse() ran

    def fuse(self) -> None:
        """q, k (and v) as one GEMM (:func:`~.layers.fuse_linears`); a KV-shared layer has only q. Call after
        loading."""
        if self._fused is None and not self.shared:
            self._fused = fuse_linears(*(p for p in (self.q_proj, self.k_proj, self.v_proj) if p is not None))

    def fast_path(self, x: torch.Tensor, start) -> bool:
        """Whether this step takes :meth:`forward`'s static CUDA path: the fused projection (a KV-shared layer: q), then
        the q/k norms, RoPE, the v norm and the cache write (a KV-shared layer: the q norm and RoPE) in one kernel
        (``rope_write.norm_rope_write``; ``layers.NORM_ROPE`` and ``layers.FUSED_ROPE_WRITE``), no gradients."""
        if self.shared:
            w = self.q_proj.weight if SMALL_FUSED else None
        else:
            w = None if self._fused is None else self._fused[0]
        return (w is not None and layers.NORM_ROPE and layers.FUSED_ROPE_WRITE and x.is_cuda and x.dim() == 2
                and isinstance(start, torch.Tensor) and not torch.compiler.is_compiling()
                and not (torch.is_grad_enabled() and w.requires_grad))

    def forward(self, x: torch.Tensor, cos, sin, cache: KVCache, start, mask, fused: bool = False) -> torch.Tensor:
        """``fused``: every GEMM on ``fused_layer.linear`` (:meth:`Gemma4DecoderLayer.forward_fused`; q/k(/v) fused)."""
        t = x.shape[0]
        q = k = v = None
        fast = self.fast_path(x, start)
        if self.shared:  # q alone (on the fused GEMM in a fused forward), over the keys and values of the layer shared
            q = fused_layer.linear(x, self.q_proj.weight) if fused else self.q_proj(x)
            q = q.view(t, self.n_heads, self.head_dim)
            rows = cos.reshape(-1, cos.shape[-1])
            if fast and rope_write.supported_q(q, rows):  # its norm and RoPE in one kernel
                q = rope_write.norm_rope_write(q, None, None, self.q_norm.fp32_scale(), None, self.eps, rows,
                                               sin.reshape(rows.shape), None, None, start, row_tables=True)
                return self._out(attend(q, *cache.read(start, t), mask, 1.0), fused)
        if self._fused is not None and (fused or fast):
            w, b, sizes = self._fused
            parts = (fused_layer.linear(x, w) if fused else linear(x, w, b)).split(sizes, dim=-1)
            q = parts[0].view(t, self.n_heads, self.head_dim)
            k = parts[1].view(t, self.n_kv, self.head_dim)
            v = k if self.v_proj is None else parts[2].view(t, self.n_kv, self.head_dim)
            rows = cos.reshape(-1, cos.shape[-1])
            if fast and rope_write.supported(q, k, rows, cache, start):
                q = rope_write.norm_rope_write(q, k, v, self.q_norm.fp32_scale(), self.k_norm.fp32_scale(), self.eps,
                                               rows, sin.reshape(rows.shape), cache.k, cache.v, start, row_tables=True,
                                               v_norm=True)
                return self._out(attend(q, cache.k, cache.v, mask, 1.0), fused)
        if q is None:
            q = self.q_proj(x).view(t, self.n_heads, self.head_dim)
            k = self.k_proj(x).view(t, self.n_kv, self.head_dim)
            v = k if self.v_proj is None else self.v_proj(x).view(t, self.n_kv, self.head_dim)
        q = apply_rope(self.q_norm(q).transpose(0, 1), cos, sin)
        if self.shared:
            k_all, v_all = cache.read(start, t)
        else:
            k = apply_rope(self.k_norm(k).transpose(0, 1), cos, sin)
            v = unit_rms_norm(v, self.eps).transpose(0, 1)
            k_all, v_all = cache.update(start, k, v)
        return self._out(attend(q, k_all, v_all, mask, 1.0), fused)  # attend: [H, T, d]

    def _out(self, o: torch.Tensor, fused: bool) -> torch.Tensor:
        """The attention's output ``[H, T, d]`` through ``o_proj``."""
        o = o.transpose(0, 1).reshape(o.shape[1], -1)
        return fused_layer.linear(o, self.o_proj.weight) if fused else self.o_proj(o)


class Gemma4Router(nn.Module):
    """Top-k expert choice; see the module docstring. Parameters: ``proj``, ``scale``, ``per_expert_scale``."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, eps: float):
        super().__init__()
        self.top_k, self.eps, self.root = top_k, eps, hidden ** -0.5
        self.proj = Linear(hidden, num_experts, bias=False)
        self.scale = nn.Parameter(torch.empty(hidden))
        self.per_expert_scale = nn.Parameter(torch.empty(num_experts))

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        """The router's GEMM input: ``x`` RMS-normalised, times ``scale`` and ``1/sqrt(hidden)``; on CUDA without
        gradients one kernel (``fused_ops.rms_norm``, the two scales as one fp32 weight: other roundings than the
        torch ops', every CUDA forward alike), else the torch ops."""
        if fused_ops.usable(x) and not (torch.is_grad_enabled() and (x.requires_grad or self.scale.requires_grad)):
            w = derived_weight(self, "_input_scale", self.scale, lambda s: s.float() * self.root)
            return fused_ops.rms_norm(x, w, self.eps)
        return unit_rms_norm(x, self.eps) * self.scale * self.root

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, H]`` -> (expert ids ``[T, k]``, weights ``[T, k]`` in ``x``'s dtype)."""
        probs = torch.softmax(self.proj(self.inputs(x)).float(), dim=-1)
        top, idx = torch.topk(probs, self.top_k, dim=-1)
        w = top / top.sum(-1, keepdim=True) * self.per_expert_scale[idx]
        return idx, w.to(x.dtype)


class Gemma4DecoderLayer(nn.Module):
    """One decoder layer, transformers' parameter names (see the module docstring)."""

    _eligible = False  # fused_layer's GEMMs on CUDA (set by CausalLM.fuse_projections, as fused_path)

    @property
    def fused_path(self) -> bool:
        """Whether this layer runs :meth:`forward_fused` (``fused_layer.runs``): eligible, and a small model's layer
        (KV-shared or with a per-layer input) only with ``SMALL_FUSED`` (read at every step: a switch of its own)."""
        return self._eligible and (SMALL_FUSED or not (self.self_attn.shared or self.per_layer))

    @fused_path.setter
    def fused_path(self, value: bool) -> None:
        self._eligible = value

    def __init__(self, c: Gemma4Config, i: int):
        super().__init__()
        self.config = c
        self.index = i
        self.sliding = c.layer_types[i] == "sliding_attention"
        shared = c.kv_source[i] is not None
        h = c.hidden_size
        norm = partial(RMSNorm, h, c.rms_norm_eps)
        self.input_layernorm = norm()
        self.self_attn = Gemma4Attention(c, c.layer_types[i], shared)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = GeluTanhGLU(h, c.intermediate_size * (2 if c.use_double_wide_mlp and shared else 1))
        self.post_feedforward_layernorm = norm()
        self.register_buffer("layer_scalar", torch.empty(1))
        self.router = None
        if c.enable_moe_block:
            self.router = Gemma4Router(h, c.num_experts, c.top_k_experts, c.rms_norm_eps)
            self.experts = Experts(c.num_experts, h, c.moe_intermediate_size, act=gelu_tanh)
            self.pre_feedforward_layernorm_2 = norm()
            self.post_feedforward_layernorm_1 = norm()
            self.post_feedforward_layernorm_2 = norm()
        self.per_layer = bool(c.hidden_size_per_layer_input)
        if self.per_layer:
            self.per_layer_input_gate = Linear(h, c.hidden_size_per_layer_input, bias=False)
            self.per_layer_projection = Linear(c.hidden_size_per_layer_input, h, bias=False)
            self.post_per_layer_input_norm = norm()

    def _positions(self, ctx: Gemma4StepContext) -> tuple:
        """This layer's RoPE tables and mask: the local ones (window) for a sliding layer, else the full ones."""
        if self.sliding:
            return ctx.local_cos, ctx.local_sin, ctx.local_mask
        return ctx.cos, ctx.sin, ctx.mask

    def forward(self, x: torch.Tensor, ctx: Gemma4StepContext, cache: KVCache) -> torch.Tensor:
        cos, sin, mask = self._positions(ctx)
        a = self.self_attn(self.input_layernorm(x), cos, sin, cache, ctx.start, mask)
        x, h = self.pre_feedforward_layernorm.add(x, a, self.post_attention_layernorm)  # CUDA: one kernel
        x = x + self._ffn(self.mlp(h), x, ctx)
        if self.per_layer:
            x = self._add_per_layer(x, ctx)
        return x * self.layer_scalar

    def _add_per_layer(self, x: torch.Tensor, ctx: Gemma4StepContext, fused: bool = False) -> torch.Tensor:
        """``x`` plus this layer's per-layer input term: ``norm(projection(gelu_tanh(gate(x)) * p_i))``; ``fused``: the
        gate and projection on ``fused_layer.linear``."""
        def lin(m, t):
            return fused_layer.linear(t, m.weight) if fused else m(t)
        g = gelu_tanh(lin(self.per_layer_input_gate, x)) * ctx.per_layer[:, self.index]
        return x + self.post_per_layer_input_norm(lin(self.per_layer_projection, g))

    def _ffn(self, f: torch.Tensor, x: torch.Tensor, ctx: Gemma4StepContext) -> torch.Tensor:
        """``post_feedforward_layernorm`` of the dense MLP's output ``f``, with the routed experts' (of the residual
        stream ``x``) where the layer has them: ``post_1(f) + post_2(experts)``, normed, the sum and its norm in one
        kernel on CUDA (``RMSNorm.add``; the same bits as the three ops)."""
        if self.router is None:
            return self.post_feedforward_layernorm(f)
        return self.post_feedforward_layernorm.add(self.post_feedforward_layernorm_1(f), self._moe(x, ctx.live),
                                                   self.post_feedforward_layernorm_2)[1]

    def fused_eligible(self) -> bool:
        """Whether :meth:`forward_fused` can run this layer (``fused_layer.eligible``'s question): q/k(/v) (a KV-shared
        layer: q) and gate/up fused without biases, contiguous output weights, the MoE block on the expert kernels
        (``SPECDEC_FUSED_MOE``, no expert parallelism, a contiguous router), the per-layer input's two projections
        (the small models') plain linears with contiguous weights, wider than ``fused_layer.MAX_HIDDEN`` only with
        ``fused_layer.WIDE``. A small model's layer takes the path only with ``SMALL_FUSED`` (:attr:`fused_path`)."""
        a, r = self.self_attn, self.router
        moe = r is None or (expert_kernel.FUSED_MOE and expert_kernel.ENABLED and self.experts.rows is None
                            and plain(r.proj) and r.proj.weight.is_contiguous())
        ready = fused_layer.linear_ready
        attn = (ready(a.q_proj) and ready(a.o_proj)) if a.shared else fused_layer.attention_fusable(a)
        per = not self.per_layer or (ready(self.per_layer_input_gate) and ready(self.per_layer_projection))
        return (attn and per and moe and fused_layer.mlp_fusable(self.mlp)
                and (self.config.hidden_size <= fused_layer.MAX_HIDDEN or fused_layer.WIDE))

    def forward_fused(self, x: torch.Tensor, delta: torch.Tensor | None, ctx: Gemma4StepContext, cache: KVCache
                      ) -> tuple[torch.Tensor, None]:
        """:meth:`forward` on ``fused_layer``'s GEMMs (CUDA, no gradients; routed by ``base.run_layers`` where
        ``fused_layer.runs``): ``(x, delta)`` whose sum is its input -> ``(output, None)`` (the layer scalar multiplies
        the whole residual stream, so no add is left to the next layer). A MoE layer's tail (the post-feed-forward
        norms, their sum, the residual add, the scalar) is one kernel (``fused_ops.sandwich_tail``), a dense layer's
        one too, or three with a per-layer input (``fused_ops.DENSE_TAIL``). A row's bits depend on its own inputs
        only."""
        if delta is not None:
            x = x + delta
        cos, sin, mask = self._positions(ctx)
        a = self.self_attn(self.input_layernorm(x), cos, sin, cache, ctx.start, mask, fused=True)
        x, h = self.pre_feedforward_layernorm.add(x, a, self.post_attention_layernorm)
        mlp = self.mlp
        f = fused_layer.linear(fused_layer.linear(h, mlp._fused[0], gelu=True), mlp.down_proj.weight)
        kernels = fused_ops.usable(x) and x.is_contiguous()  # (the tails' kernels)
        if self.router is not None and not self.per_layer and fused_ops.SANDWICH_TAIL and kernels:
            norms = (self.post_feedforward_layernorm_1, self.post_feedforward_layernorm_2, self.post_feedforward_layernorm)
            return fused_ops.sandwich_tail(x, f, self._moe(x, ctx.live), tuple(n.fp32_scale() for n in norms),
                                           tuple(n.eps for n in norms), self.layer_scalar), None
        if self.router is None and fused_ops.DENSE_TAIL and kernels:
            post = self.post_feedforward_layernorm  # the dense tail: 1 kernel (3 with a per-layer input) for 3 (7)
            if not self.per_layer:
                return fused_ops.add_norm(x, f, post.fp32_scale(), post.eps, self.layer_scalar), None
            x = fused_ops.add_norm(x, f, post.fp32_scale(), post.eps)
            g = fused_ops.glu_mul(fused_layer.linear(x, self.per_layer_input_gate.weight), ctx.per_layer[:, self.index],
                                  gelu=True)
            norm = self.post_per_layer_input_norm
            return fused_ops.add_norm(x, fused_layer.linear(g, self.per_layer_projection.weight), norm.fp32_scale(),
                                      norm.eps, self.layer_scalar), None
        x = x + self._ffn(f, x, ctx)
        if self.per_layer:
            x = self._add_per_layer(x, ctx, fused=True)
        return x * self.layer_scalar, None

    def _moe(self, x: torch.Tensor, live: torch.Tensor | None) -> torch.Tensor:
        """The routed experts' output for the residual stream ``x``; ``live``: a static step's real rows (padding rows
        skipped). A CUDA static step within the expert kernels' limits runs :func:`~.expert_kernel.moe` (the router's
        GEMM, the routing with the per-expert scales, the GELU-tanh pairs and their weighted sum in four kernels:
        ``SPECDEC_FUSED_MOE``); else the router in torch ops and :class:`~.moe.Experts`."""
        r, ex = self.router, self.experts
        xe = self.pre_feedforward_layernorm_2(x)
        if ex.block_kernels_run(x, r.top_k, live) and r.proj.weight.is_contiguous():
            return expert_kernel.moe(xe, r.proj.weight, r.top_k, ex.gate_up_proj, ex.down_proj, None, live,
                                     router_x=r.inputs(x), expert_scale=r.per_expert_scale, gelu=True)
        idx, w = r(x)
        return ex(xe, idx, w, live)


class Gemma4ForCausalLM(WindowedCausalLM):
    """The Gemma 4 text target."""

    def __init__(self, config: Gemma4Config):
        super().__init__(config)
        c = config
        rotary = {t: Gemma4Rotary(c.attention_dims[t][0], *c.rope[t]) for t in c.rope}
        self.rotary = rotary["full_attention"]  # the last layer is always full attention
        self.local_rotary = rotary.get("sliding_attention")
        self.window = c.sliding_window if self.local_rotary is not None else 0
        self.final_logit_softcap = c.final_logit_softcapping
        self.layers = nn.ModuleList(Gemma4DecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.per_layer_dim = c.hidden_size_per_layer_input
        if self.per_layer_dim:
            n = c.num_hidden_layers * self.per_layer_dim
            self.embed_tokens_per_layer = Embedding(c.vocab_size_per_layer_input, n)
            self.per_layer_model_projection = Linear(c.hidden_size, n, bias=False)
            self.per_layer_projection_norm = RMSNorm(self.per_layer_dim, c.rms_norm_eps)

    def fuse_projections(self) -> None:
        for layer in self.layers:  # first: the layers' fused path (set by CausalLM's) asks for the fused attention
            layer.self_attn.fuse()
        super().fuse_projections()  # the dense MLPs' gate/up

    def row_exact(self, rows: int = 1) -> bool:
        """:meth:`CausalLM.row_exact`, and every MoE block's steps within the expert kernels' rows
        (``Experts.block_rows``)."""
        return (super().row_exact(rows) and all(rows <= layer.experts.block_rows(layer.router.top_k)
                                                for layer in self.layers if layer.router is not None))

    def make_layer_cache(self, i, max_len, dtype, device):
        c = self.config
        if c.kv_source[i] is not None:
            return None  # filled in by new_cache: the producing layer's buffers
        head_dim, n_kv = c.attention_dims[c.layer_types[i]]
        return KVCache(n_kv, head_dim, max_len, dtype, device)

    def new_cache(self, max_len: int | None = None, spare: int = 0) -> SequenceCache:
        cache = super().new_cache(max_len, spare)
        for i, src in enumerate(self.config.kv_source):
            if src is not None:
                cache.layers[i] = SharedKV(cache.layers[src])
        return cache

    @staticmethod
    def _scale(x: torch.Tensor, value: float) -> torch.Tensor:
        # transformers multiplies by the scale rounded to the weight dtype (bf16: sqrt(3072) -> 55.5)
        return x * float(torch.tensor(value, dtype=x.dtype))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self._scale(self.embed_tokens(ids), self.config.hidden_size ** 0.5)

    def token_context(self, ids: torch.Tensor, x: torch.Tensor, ctx: StepContext) -> StepContext:
        if not self.per_layer_dim:
            return ctx
        shape = (ids.shape[0], self.config.num_hidden_layers, self.per_layer_dim)
        tokens = self._scale(self.embed_tokens_per_layer(ids), self.per_layer_dim ** 0.5).view(shape)
        w = self.per_layer_model_projection.weight
        # on the fused GEMM where the layers run theirs (a row's bits its own in row-exact steps)
        fused = (fused_layer.usable(x) and fused_layer.runs(self.layers[0], ctx.length) and x.is_contiguous()
                 and fused_layer.linear_ready(self.per_layer_model_projection))
        proj = fused_layer.linear(x, w) if fused else self.per_layer_model_projection(x)
        proj = proj * self.config.hidden_size ** -0.5
        proj = self.per_layer_projection_norm(proj.view(shape))
        return dataclasses.replace(ctx, per_layer=(proj + tokens) * 2 ** -0.5)

    def _local(self, ctx: StepContext, pos: torch.Tensor, local_mask, limit: int | None = None) -> Gemma4StepContext:
        cos = sin = None
        if self.local_rotary is not None:
            cos, sin = (self.local_rotary.cos_sin(pos, self.dtype) if limit is None
                        else static_cos_sin(self.local_rotary, pos, self.dtype, limit))
        return Gemma4StepContext(ctx.start, ctx.length, ctx.cos, ctx.sin, ctx.mask, ctx.snapshots, ctx.live, cos, sin, local_mask)



register(Architecture(
    name="gemma4", hf_model_types=("gemma4_text", "gemma4"), gguf_archs=("gemma4",), config_cls=Gemma4Config,
    model_cls=Gemma4ForCausalLM, gguf_config=gguf_config, gguf_names=gguf_names,
    gguf_tensor_config=gguf_tensor_config, gguf_rope_freqs_in_config=True, gguf_ignore=("rope_freqs.weight",),
    # a gemma4 (multimodal) checkpoint: model.language_model.* is the target, the rest is left out
    hf_ignore_prefixes=("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio."),
    # DFlash: the drafter embeds with the raw table times its own input_embedding_scale (not this
    # family's sqrt(hidden)) and soft-caps with its own final_logit_softcapping (see drafters/dflash.py)
    drafters=("ngram", "dflash"),
))
