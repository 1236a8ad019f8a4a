"""The target-model contract and the forward loop every architecture shares.

``forward(ids, cache, capture=...)`` runs ``T`` new tokens at the cache's next positions,
appends to the cache and returns logits, the final (post-norm) hidden states, and the outputs
of the requested decoder layers (DFlash's context features). Architectures supply the layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from .. import env
from ..cache import BatchCache, BatchKVCache, BatchWrite, NoCache, SequenceCache
from ..errors import ConfigError
from ..config import ModelConfig
from ..cpu_linear import Linear, linear
from ..parallel.tp import Shard, VocabParallelEmbedding, gather_vocab, vocab_parallel_head
from . import fused_layer, layers
from .layers import Embedding, RMSNorm, RotaryEmbedding, causal_mask, sliding_causal_mask

# Each layer's last residual add folded into the next layer's input norm (``RMSNorm.add``: one kernel
# on CUDA for the add and the norm), for layers with ``forward_folded`` (Llama/Qwen3, Qwen3.5): one kernel less a
# layer. The same sums, bit for bit (the add rounds alike); on the CPU the same ops, so the same bits
# everywhere; on CUDA the input norm then comes from the add-and-norm kernel, which can differ from the
# plain norm kernel in the last bit (every path alike, so speculative output still equals plain). Measured
# on the H200 (qwen3-8b shape, 2026-12-03): the 16-row step 5.608 -> 5.520 ms in one process (scripts/ab_flags.py,
# 6 rounds), plain decoding 169.5 -> 172.7 tok/s in four processes; device_check (random Qwen3, oracle drafts
# accepted) 0 outputs differing. On by default; SPECDEC_FOLD_RESIDUAL=0 turns it off.
FOLD_RESIDUAL = env.switch("SPECDEC_FOLD_RESIDUAL")
# Steps whose every kernel gives a row the same bits at any row count: a Llama-family model on the fused
# layers (models/fused_layer.py's 16-row GEMM tiles, fused_ops' per-row norms, the per-row RoPE write, the
# split attention) with its LM head on the same GEMM (:meth:`CausalLM.raw_logits`). ``generate`` then runs
# decode and verify steps unpadded (a 1-row plain step, k+1 rows a verify) and still computes every
# committed position's logits bit for bit alike (:meth:`CausalLM.row_exact`). Measured on the H200 (real
# SmolLM2-135M-Instruct, GSM8K first 80, -n 128, one run): plain 920 -> 1,000 tok/s, n-gram 1,296 -> 1,414, MTP
# k=3 1,566 -> 1,666, DFlash 2,399 -> 2,424; device_check on the real weights with every shipped drafter and
# on random Llama: 0 outputs differing. Batched steps (forward_batch) keep cuBLAS's head. SPECDEC_ROW_EXACT=0
# turns it off.
ROW_EXACT = env.switch("SPECDEC_ROW_EXACT")


@dataclass(frozen=True)
class StepContext:
    """Per-forward metadata handed to every layer (never a module global)."""

    start: int  # position of the first new token
    length: int  # number of new tokens T
    cos: torch.Tensor  # [T, rotary_dim]
    sin: torch.Tensor
    mask: torch.Tensor | None  # [T, start+T] bool, None when T == 1
    # Recurrent (linear-attention) caches keep the state after every position, so the forward can
    # be rolled back (decode and verify steps). A prefill needs none and runs the chunked form.
    snapshots: bool = True
    # A static step's real rows (a 0-d int64 device tensor; the rows after them pad the step), set by
    # its runner before each replay; None: every row is real. Kernels may skip padding rows' work
    # (the Gated DeltaNet's states, routed experts), their outputs then zero.
    live: torch.Tensor | None = None


@dataclass
class ForwardOut:
    logits: torch.Tensor | None  # [T, V] fp32 (or [1, V] with logits="last")
    hidden: torch.Tensor  # [T, H] final hidden state after the final norm
    # [T, len(capture) * H]: decoder-layer outputs in capture order; the last layer's entry is taken
    # after the final norm, as HF's hidden_states[L] is (what DFlash drafters are trained on)
    captured: torch.Tensor | None


class CausalLM(nn.Module):
    """Base class of target models. Subclasses build ``embed_tokens``, ``layers``, ``norm``,
    ``lm_head`` (or tie it), ``rotary`` and implement :meth:`make_layer_cache`.

    ``shard`` (families with ``tensor_parallel = True``): the model is one rank's part, its
    embedding and LM head hold a block of vocabulary rows, and :meth:`head` gathers every
    rank's logits (see :mod:`specdec.parallel.tp`); the layers take the shard too."""

    config: ModelConfig
    embed_scale: float = 1.0
    final_logit_softcap: float | None = None
    tensor_parallel = False  # whether the family's layers can be split across ranks

    def __init__(self, config: ModelConfig, shard: Shard | None = None):
        super().__init__()
        self.config = config
        self.shard = shard
        v, h = config.vocab_size, config.hidden_size
        self.embed_tokens = Embedding(v, h) if shard is None else VocabParallelEmbedding(v, h, shard)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, self.zero_centered_norms())
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.partial_rotary_factor, config.rope_scaling)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(h, v, bias=False) if shard is None else vocab_parallel_head(h, v, shard)
        self.layers = nn.ModuleList()

    # --- per-architecture hooks -------------------------------------------------
    @classmethod
    def zero_centered_norms(cls) -> bool:
        return False

    def make_layer_cache(self, i: int, max_len: int, dtype: torch.dtype, device):
        raise NotImplementedError

    def token_context(self, ids: torch.Tensor, x: torch.Tensor, ctx: StepContext) -> StepContext:
        """The context the layers see, given the step's ids and embeddings ``x [T, H]``: a family
        with per-token inputs to every layer (Gemma 4's per-layer embeddings) adds them here."""
        return ctx

    # Families whose layers run batched steps (``[B, T, H]`` with a :class:`BatchWrite` as the
    # start). Others raise a ConfigError from :meth:`forward_batch`.
    batched = False

    def make_batch_layer_cache(self, i: int, slots: int, max_len: int, spare: int):
        """Layer ``i``'s cache for batched steps (default: keys and values of the KV heads the
        layer holds: a rank's share under tensor parallelism)."""
        return BatchKVCache(slots, self.layers[i].self_attn.n_kv, self.config.head_dim, max_len, self.dtype,
                            self.device)

    # --- the contract -------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def max_context(self) -> int:
        return int(self.config.max_position_embeddings)

    def new_cache(self, max_len: int | None = None, spare: int = 0) -> SequenceCache:
        """A cache for ``max_len`` positions (at most the model's context), plus ``spare`` rows that
        only padding rows of fixed-size steps ever occupy (they are rolled back, never committed)."""
        max_len = min(max_len or self.max_context, self.max_context) + spare
        return SequenceCache([self.make_layer_cache(i, max_len, self.dtype, self.device) for i in range(len(self.layers))], max_len)

    def fuse_projections(self) -> None:
        """q/k/v, gate/up, a Gated DeltaNet's four in-projections and a MoE block's router with its shared
        expert's gate each as one GEMM (:func:`~specdec.models.layers.fuse_linears`): called once the weights
        are loaded and placed."""
        from .deltanet import GatedDeltaNet
        from .layers import Attention, SwiGLU
        from .moe import SparseMoeBlock

        for m in self.modules():
            if isinstance(m, (Attention, SwiGLU, GatedDeltaNet, SparseMoeBlock)):
                m.fuse()
        for layer in self.layers:  # layers with a fused path (Llama-family, Qwen3.5): every layer or none, by config
            if hasattr(layer, "fused_path"):
                layer.fused_path = fused_layer.eligible(layer)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        return x * self.embed_scale if self.embed_scale != 1.0 else x

    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def raw_logits(self, h: torch.Tensor, exact: bool = True) -> torch.Tensor:
        """``h [T, H]`` through the LM head, before any soft cap: fp32 ``[T, V]`` (on a rank:
        every rank's vocabulary rows gathered). On the fused GEMM for a :meth:`row_exact` model, unless
        ``exact`` is off (a drafter's logits: only the target's rows must keep their bits)."""
        w = self.head_weight()
        if exact and self.row_exact() and fused_layer.usable(h) and w.is_contiguous():
            return fused_layer.linear(h, w).float()
        logits = linear(h, w).float()
        return logits if self.shard is None else gather_vocab(logits, self.shard, self.config.vocab_size)

    def row_exact(self, rows: int = 1) -> bool:
        """Whether every kernel of this model's CUDA steps of up to ``rows`` rows a sequence gives a row the same bits
        at any such row count (see ROW_EXACT): with ``ROW_EXACT``, every layer on the fused kernels (on CUDA in
        bf16/fp16) in steps of up to ``rows`` rows (``fused_layer.runs``: a layer past MAX_HIDDEN takes them up to
        WIDE_ROWS only), one process. Their norms, q/k norm + RoPE writes and split attention (a sliding layer's window
        is its mask, by position) give a row its bits at any row count. A family whose layers have no fused path
        (``fused_path``) never is; a family with more to ask adds it (Qwen3.5's MoE blocks)."""
        return ROW_EXACT and fused_layer.model_runs(self, rows)

    def cpu_row_exact(self) -> bool:
        """Whether this model's eager CPU steps, run within :func:`specdec.cpu_exact.exact`, give a row the same bits
        at any row count (every op row by row but the linears and attention, which that context makes so)."""
        return False

    def head(self, h: torch.Tensor, exact: bool = True) -> torch.Tensor:
        """Final-normed hidden ``[T, H]`` -> fp32 logits ``[T, V]`` (``exact``: see :meth:`raw_logits`)."""
        return self.soft_cap(self.raw_logits(h, exact))

    def soft_cap(self, logits: torch.Tensor) -> torch.Tensor:
        """The final logit soft cap (Gemma's ``c * tanh(x / c)``), where the model has one."""
        if self.final_logit_softcap:
            c = self.final_logit_softcap
            logits = torch.tanh(logits / c) * c
        return logits

    def step_context(self, start: int, t: int, snapshots: bool = True) -> StepContext:
        pos = torch.arange(start, start + t, device=self.device)
        cos, sin = self.rotary.cos_sin(pos, self.dtype)
        return StepContext(start, t, cos, sin, causal_mask(start, t, self.device), snapshots)

    def static_context(self, start: torch.Tensor, t: int, max_len: int) -> StepContext:
        """Context for a CUDA-graph step: ``start`` is a 0-d device tensor, shapes depend on ``t`` only,
        and attention runs over the whole preallocated cache with a mask by position."""
        pos = start + self._arange(t)
        cos, sin = layers.static_cos_sin(self.rotary, pos, self.dtype, max_len + t)
        mask = self._arange(max_len)[None, :] <= pos[:, None]
        return StepContext(start, t, cos, sin, mask)

    def _arange(self, n: int) -> torch.Tensor:
        """``arange(n)`` on the device; with layers.ROPE_TABLE on CUDA kept per ``n`` (made outside captures and
        compiles; never replaced: captured steps read it by address)."""
        if not layers.keeps_tables(self.device):
            return torch.arange(n, device=self.device)
        kept = self.__dict__.setdefault("_aranges", {})
        a = kept.get(n)
        if a is None:
            a = torch.arange(n, device=self.device)
            if not layers.capturing(self.device):
                kept[n] = a
        return a

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: SequenceCache, capture: Sequence[int] = (), logits: str = "all",
                snapshots: bool = True) -> ForwardOut:
        """Run ``ids [T]`` at positions ``cache.length ..``; ``logits`` is "all", "last" or "none".
        ``snapshots=False`` (a prefill) keeps no per-position recurrent states: no rollback into it."""
        ids = ids.to(self.device).reshape(-1)
        t = ids.shape[0]
        start = cache.reserve(t)
        return self.run_layers(ids, self.step_context(start, t, snapshots), cache, capture, logits)

    def run_layers(self, ids: torch.Tensor, ctx: StepContext, cache: SequenceCache, capture: Sequence[int] = (),
                   logits: str = "all") -> ForwardOut:
        """The forward proper, for a prepared context (eager or static)."""
        x = self.embed(ids)
        ctx = self.token_context(ids, x, ctx)
        caps = {}
        want = set(capture)
        last = len(self.layers) - 1
        delta = None  # with FOLD_RESIDUAL or fused layers: the last layer's output is x + delta
        fused = fused_layer.usable(x)  # the layers' fused kernels (a model runs them in every such forward)
        for i, layer in enumerate(self.layers):
            if fused and fused_layer.runs(layer, ctx.length):
                x, delta = layer.forward_fused(x, delta, ctx, cache.layers[i])
                if i in want and i != last:
                    caps[i] = x if delta is None else x + delta  # (Gemma 4's layers leave no add)
                continue
            if FOLD_RESIDUAL and hasattr(layer, "forward_folded"):
                x, delta = layer.forward_folded(x, delta, ctx, cache.layers[i])
                if i in want and i != last:
                    caps[i] = x + delta
                continue
            if delta is not None:
                x, delta = x + delta, None
            x = layer(x, ctx, cache.layers[i])
            if i in want:
                caps[i] = x
        h = self.norm.add(x, delta)[1]
        if len(self.layers) - 1 in want:
            caps[len(self.layers) - 1] = h  # HF's hidden_states[L] is after the final norm
        out_logits = None
        if logits == "all":
            out_logits = self.head(h)
        elif logits == "last":
            out_logits = self.head(h[-1:])
        captured = torch.cat([caps[i] for i in capture], dim=-1) if capture else None
        return ForwardOut(out_logits, h, captured)

    # --- batched steps (many sequences; training data and the server) --------------------
    def check_batched(self) -> None:
        """Refuse batched steps where they are not supported (one-line ConfigError)."""
        if not self.batched:
            raise ConfigError(f"batched forwards are not supported for {self.config.model_type} targets yet")

    def new_batch_cache(self, slots: int, max_len: int, spare: int = 0) -> BatchCache:
        """Caches for ``slots`` sequences of ``max_len`` positions (at most the model's context),
        plus ``spare`` rows that only padding rows of a step ever occupy (never committed).
        Linear-attention layers keep per-row states for steps of up to ``max(spare, 1)`` rows."""
        self.check_batched()
        max_len = min(max_len, self.max_context) + spare
        return BatchCache([self.make_batch_layer_cache(i, slots, max_len, spare) for i in range(len(self.layers))],
                          slots, max_len)

    @torch.inference_mode()
    def forward_batch(self, ids: torch.Tensor, cache: BatchCache | None, starts: torch.Tensor, slots=None,
                      span: int | None = None, capture: Sequence[int] = (), last: torch.Tensor | None = None,
                      logits: str | None = None, commit: torch.Tensor | None = None) -> ForwardOut:
        """Run ``ids [b, T]``: row ``r`` at positions ``starts[r] ..`` of cache slot ``slots[r]``
        (``slots``: a ``range`` or a long tensor; default ``range(b)``). ``span``: attention
        reads positions ``0 .. span-1`` (at least ``max(starts) + T``, known to the caller without
        a device sync). ``cache=None``: whole sequences from position 0, no cache (features).
        Rows shorter than ``T`` are right-padded: padding writes past the row's length, which the
        next step overwrites. Returns hidden ``[b, T, H]``, captured ``[b, T, n*H]``, and logits
        ``[b, V]`` of the position ``last[r]`` of each row (None without ``last``); with
        ``logits="all"`` (verify steps) fp32 logits ``[b, T, V]`` of every position instead.

        Linear-attention (recurrent) layers cannot be overwritten later: ``commit [b]`` (a prefill)
        commits each row's state after its first ``commit[r]`` positions; without it (a verify
        step, at most ``max(spare, 1)`` rows) the caller then keeps each slot's accepted rows with
        :meth:`BatchCache.commit`, and the padding is never committed."""
        if logits not in (None, "all"):
            raise ValueError(f"forward_batch: logits must be None or 'all', got {logits!r}")
        if logits == "all" and last is not None:
            raise ValueError("forward_batch: give either last or logits='all', not both")
        out = self._forward_batch(ids, cache, starts, slots, span, capture, last, commit)
        if logits == "all":
            out.logits = self.head(out.hidden, exact=False)  # many slots' rows: cuBLAS (ROW_EXACT is one sequence's)
        return out

    def _forward_batch(self, ids, cache, starts, slots, span, capture, last, commit=None) -> ForwardOut:
        self.check_batched()
        ids = ids.to(self.device)
        b, t = ids.shape
        pos = starts.to(self.device)[:, None] + torch.arange(t, device=self.device)[None, :]
        cos, sin = self.rotary.cos_sin(pos.reshape(-1), self.dtype)
        cos, sin = cos.view(b, 1, t, -1), sin.view(b, 1, t, -1)
        if cache is None:
            keys = pos
            layers = [NoCache()] * len(self.layers)
            write = None
        else:
            span = int(span if span is not None else cache.max_len)
            keys = torch.arange(span, device=self.device)[None, :].expand(b, -1)
            layers = cache.layers
            write = BatchWrite(range(b) if slots is None else slots, pos, span,
                               None if commit is None else commit.to(self.device))
        mask = (keys[:, None, :] <= pos[:, :, None])[:, None]  # [b, 1, T, S]
        ctx = StepContext(write, t, cos, sin, mask)
        out = self.run_layers(ids, ctx, _Layers(layers), capture, logits="none")
        if last is not None:
            h_last = out.hidden[torch.arange(b, device=self.device), last.to(self.device)]
            out.logits = self.head(h_last, exact=False)
        return out

    def forward_batch_train(self, ids: torch.Tensor, capture: Sequence[int] = ()) -> ForwardOut:
        """Whole sequences ``ids [b, L]`` from position 0, no cache, no grad (training features)."""
        with torch.no_grad():
            starts = torch.zeros(ids.shape[0], dtype=torch.long, device=self.device)
            return self._forward_batch(ids, None, starts, None, None, capture, None)


class WindowedCausalLM(CausalLM):
    """A target with sliding-window layers beside global ones (Gemma 3, Gemma 4): the step contexts
    add the window to the causal mask by position, in eager and static steps alike, and hand it
    with the step's positions to :meth:`_local` (the family's local-layer RoPE and context type)."""

    window: int | None = None

    def _local(self, ctx: StepContext, pos: torch.Tensor, local_mask, limit: int | None = None) -> StepContext:
        """The family's context with its local layers' RoPE at ``pos`` and ``local_mask``; ``limit`` (a static step's
        positions bound): their cos/sin by ``layers.static_cos_sin``, else computed."""
        raise NotImplementedError

    def step_context(self, start: int, t: int, snapshots: bool = True) -> StepContext:
        ctx = super().step_context(start, t, snapshots)
        pos = torch.arange(start, start + t, device=self.device)
        mask = sliding_causal_mask(start, t, self.window, self.device) if self.window else ctx.mask
        return self._local(ctx, pos, mask)

    def static_context(self, start: torch.Tensor, t: int, max_len: int) -> StepContext:
        ctx = super().static_context(start, t, max_len)
        pos = start + self._arange(t)
        mask = ctx.mask
        if self.window:  # the window, by position, over the whole cache
            mask = mask & (self._arange(max_len)[None, :] > pos[:, None] - self.window)
        return self._local(ctx, pos, mask, max_len + t)


class _Layers:
    """Duck-typed stand-in for a SequenceCache in :meth:`CausalLM.run_layers`."""

    def __init__(self, layers):
        self.layers = layers
