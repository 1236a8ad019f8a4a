"""Building blocks shared by the target architectures.

Tensors inside a model are ``[T, ...]`` (one sequence, no batch dimension); attention works on
``[heads, T, head_dim]``. Norm statistics and softmax run in fp32 whatever the weight dtype.
"""

from __future__ import annotations

import contextlib
import math
import threading

import torch
import torch.nn.functional as F
from torch import nn

from .. import cpu_exact, env
from ..flags import switched_on
from ..cache import KVCache
from ..cpu_linear import Linear, linear
from ..errors import ConfigError
from ..parallel.tp import Shard, even_split, row_parallel, split_heads
from . import fused_ops, rope_write, split_attention


def derived_weight(owner: nn.Module, name: str, w: torch.Tensor | tuple, make) -> torch.Tensor:
    """``make(w.detach())``, kept on ``owner`` under ``name`` and remade whenever ``w`` changes: another
    tensor, storage or version (in-place writes through ``.data`` bypass the version: assign a new tensor).
    ``w`` may be a tuple of tensors (``make`` then gets them detached, in order; any one's change remakes it).
    An inference tensor keeps no version counter: nothing is cached then."""
    ws = w if isinstance(w, tuple) else (w,)
    args = tuple(t.detach() for t in ws)
    try:
        key = tuple((id(t), t.data_ptr(), t._version) for t in ws)
    except RuntimeError:
        return make(*args)
    kept = owner.__dict__.get(name)
    if kept is None or kept[0] != key:
        kept = owner.__dict__[name] = (key, make(*args))
    return kept[1]


# Table lookups on CUDA (the token embeddings, :func:`static_cos_sin`'s RoPE tables) by indexing, not index_select
# (F.embedding's kernel): for a few ids its CUDA kernel (``indexSelectSmallIndex``) walks them one after another in every
# block. On an H100 a 16-row step's three lookups (the tokens, RoPE's cos and sin) took ~13 us each against ~2.5 for
# one row (qwen3-8b shape, ``profile_shape_step.py --timeline``, session of 2026-12-07 (fifteenth)); indexing gathers
# every row at once, the same values. False: index_select (scripts/ab_flags.py ``defaults+index-select``).
INDEX_LOOKUPS = True


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.embedding(ids, weight)``; on CUDA without a gradient to the table, by indexing (INDEX_LOOKUPS): the same
    rows."""
    if INDEX_LOOKUPS and ids.is_cuda and not (weight.requires_grad and torch.is_grad_enabled()):
        return weight[ids]
    return F.embedding(ids, weight)


class Embedding(nn.Embedding):
    """``nn.Embedding`` whose lookup is :func:`embedding` (no padding index, no max norm)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return embedding(ids, self.weight)


class RMSNorm(nn.Module):
    """RMSNorm with fp32 statistics. ``zero_centered`` scales by ``1 + w`` (Qwen3.5, Gemma).

    Without gradients (decoding) the fp32 scale is computed once per version of the weight, and
    the scaled product is rounded straight into ``x``'s dtype by the multiplication (``out=``): the
    bits of ``(y * w).to(x.dtype)`` in 3 kernels instead of 5 (6 zero-centered), and a model calls
    it twice a layer."""

    def __init__(self, dim: int, eps: float, zero_centered: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.zero_centered = zero_centered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        training = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
        if not training and fused_ops.usable(x):  # CUDA: one kernel (models/fused_ops.py)
            return fused_ops.rms_norm(x, self.fp32_scale(), self.eps)
        y = _rms(x.float(), self.eps)
        if training or torch.compiler.is_compiling():  # differentiable; torch.compile fuses it all anyway
            w = self.weight.float()
            return (y * (1.0 + w if self.zero_centered else w)).to(x.dtype)
        return torch.mul(y, self.fp32_scale(), out=torch.empty_like(x))

    def add(self, x: torch.Tensor, delta: torch.Tensor | None, delta_norm: "RMSNorm | None" = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + delta, self(x + delta))``: a residual add and the norm after it (one kernel on CUDA);
        ``delta`` None: ``(x, self(x))`` (a folded layer's input with no add left over). ``delta_norm``: ``delta``
        normed by it first (a sandwich-normed layer's post-norm; one kernel for the three on CUDA with
        ``fused_ops.PRENORM_ADD``, the same bits)."""
        if delta is None:
            return x, self(x)
        training = torch.is_grad_enabled() and (x.requires_grad or delta.requires_grad or self.weight.requires_grad)
        if not training and fused_ops.usable(x) and delta.shape == x.shape and delta.dtype == x.dtype:
            if delta_norm is None:
                return fused_ops.rms_norm(x, self.fp32_scale(), self.eps, residual=delta)
            if fused_ops.PRENORM_ADD:
                return fused_ops.rms_norm(x, self.fp32_scale(), self.eps, residual=delta,
                                          residual_scale=delta_norm.fp32_scale(), residual_eps=delta_norm.eps)
        if delta_norm is not None:
            return self.add(x, delta_norm(delta))
        s = x + delta
        return s, self(s)

    def fp32_scale(self) -> torch.Tensor:
        """``w`` (or ``1 + w``) in fp32, remade whenever the weight changes: another tensor, storage
        or version (in-place writes through ``.data`` bypass the version: assign a new tensor)."""
        return derived_weight(self, "_scale", self.weight,
                              lambda w: 1.0 + w.float() if self.zero_centered else w.float())


if hasattr(F, "rms_norm"):
    def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), eps=eps)  # one fused op where the backend has it
else:  # pragma: no cover - torch < 2.4
    def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def unit_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalise the last dimension with fp32 statistics and no weight (Gemma 4's ``v_norm``)."""
    return _rms(x.float(), eps).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """RoPE in the rotate-half (NeoX / HF) layout on the first ``rotary_dim`` channels.

    Supports plain RoPE, llama3 and linear scaling, and per-frequency divisors read from a
    checkpoint (llama.cpp's ``rope_freqs``). Interleaved mRoPE reduces to plain RoPE for text,
    where every position row is the same.
    """

    def __init__(self, head_dim: int, theta: float, partial_factor: float = 1.0, scaling: dict | None = None):
        super().__init__()
        self.rotary_dim = int(head_dim * partial_factor)
        self.theta = theta
        self.scaling = dict(scaling or {})
        self.freq_factors: torch.Tensor | None = None  # set by a loader that found rope_freqs
        self._inv: dict[torch.device, torch.Tensor] = {}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        inv = self._inv.get(device)
        if inv is None:
            d = self.rotary_dim
            inv = 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
            kind = self.scaling.get("rope_type", "default")
            if kind == "llama3":
                inv = _llama3_inv_freq(inv, self.scaling)
            elif kind == "linear":
                inv = inv / float(self.scaling["factor"])
            elif kind not in ("default", None):
                raise ConfigError(f"rope_type '{kind}' is not supported (supported: default, linear, llama3)")
            if self.freq_factors is not None:
                inv = inv / self.freq_factors.float().cpu()
            inv = inv.to(device)
            self._inv[device] = inv
        return inv

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T]`` positions -> cos, sin ``[T, rotary_dim]`` (:func:`rope_tables`)."""
        return rope_tables(positions.float()[:, None] * self.inv_freq(positions.device)[None, :], dtype)


def keeps_tables(device: torch.device) -> bool:
    """Whether static steps on ``device`` take kept tables (:func:`static_cos_sin`, ``CausalLM._arange``): ROPE_TABLE
    on CUDA (or TABLE_OFF_CUDA, for tests), outside torch.compile."""
    return ROPE_TABLE and (device.type == "cuda" or TABLE_OFF_CUDA) and not torch.compiler.is_compiling()


def capturing(device: torch.device) -> bool:
    """Whether a CUDA graph capture is under way on ``device``'s current stream (a tensor made now holds nothing until
    the graph replays, so none is kept)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def static_cos_sin(rotary: nn.Module, positions: torch.Tensor, dtype: torch.dtype, limit: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotary.cos_sin(positions, dtype)`` for a static step's ``positions`` (below ``limit``; a larger one, a padding
    row's, reads row ``limit - 1``): with ROPE_TABLE on CUDA, two lookups in a table of ``rotary.cos_sin`` over ``0 .. n-1``
    kept on the rotary per device and dtype, instead of ~9 elementwise kernels. Every value is computed elementwise,
    so the table holds the bits ``cos_sin`` gives each position (tested). A table is never freed (captured steps read
    it by address): a larger one is made beside it, outside captures and compiles only (there the values are
    computed)."""
    if not keeps_tables(positions.device):
        return rotary.cos_sin(positions, dtype)
    tables = rotary.__dict__.setdefault("_rope_tables", {}).setdefault((positions.device, dtype), [])
    if not tables or tables[-1][0].shape[0] < limit:
        if capturing(positions.device):  # a table made now would hold nothing until a replay
            return rotary.cos_sin(positions, dtype)
        n = max(limit, 2 * tables[-1][0].shape[0] if tables else 1024)
        tables.append(rotary.cos_sin(torch.arange(n, device=positions.device), dtype))
    cos, sin = tables[-1]
    idx = positions.clamp(max=limit - 1)
    if INDEX_LOOKUPS:
        return cos[idx], sin[idx]
    return cos.index_select(0, idx), sin.index_select(0, idx)


def rope_tables(freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Angles ``[T, r/2]`` -> cos, sin ``[T, r]`` in ``dtype`` for the rotate-half layout, the sin with
    the rotation's sign folded into its first half (``-sin, sin``): what :func:`apply_rope` takes."""
    s = freqs.sin()
    return torch.cat([freqs, freqs], dim=-1).cos().to(dtype), torch.cat([-s, s], dim=-1).to(dtype)


def _llama3_inv_freq(inv: torch.Tensor, s: dict) -> torch.Tensor:
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_ctx = float(s.get("original_max_position_embeddings", 8192))
    low_wl, high_wl = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wl, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wl) & (wavelen <= low_wl)
    return torch.where(is_mid, mid, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [heads, T, d]``; rotate the first ``cos.shape[-1]`` channels (rotate-half layout), ``sin``
    as :meth:`RotaryEmbedding.cos_sin` gives it (first half negated): ``x * cos + [x2, x1] * sin``
    has the bits of ``x * cos + [-x2, x1] * sin`` (a product's sign is exact), one kernel fewer."""
    r = cos.shape[-1]
    xr, xp = x[..., :r], x[..., r:]
    swapped = torch.cat([xr[..., r // 2:], xr[..., : r // 2]], dim=-1)
    out = xr * cos + swapped * sin
    return torch.cat([out, xp], dim=-1) if xp.shape[-1] else out


def causal_mask(start: int, t: int, device) -> torch.Tensor | None:
    """Boolean ``[t, start + t]`` mask: query i (at position start+i) sees keys 0..start+i."""
    if t == 1:
        return None
    q = torch.arange(start, start + t, device=device)[:, None]
    k = torch.arange(start + t, device=device)[None, :]
    return k <= q


def sliding_causal_mask(start: int, t: int, window: int, device) -> torch.Tensor | None:
    """Boolean ``[t, start + t]`` mask of a sliding-window layer: query i (at position p = start+i)
    sees keys p-window+1 .. p, the ``window`` latest positions (HF's ``kv > q - window``)."""
    if start + t <= window:
        return causal_mask(start, t, device)
    q = torch.arange(start, start + t, device=device)[:, None]
    k = torch.arange(start + t, device=device)[None, :]
    return (k <= q) & (k > q - window)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
           gate: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled dot-product attention with GQA: q ``[H, T, d]``, k/v ``[Hkv, S, d]`` -> ``[H, T, dv]``;
    batched, q ``[B, H, T, d]``, k/v ``[B, Hkv, S, d]``, mask ``[B, 1, T, S]`` -> ``[B, H, T, dv]``.
    ``gate`` (``[T, H, d]``, batched ``[B, T, H, d]``): the output times ``sigmoid(gate)`` (gated attention,
    :meth:`Attention.gathered`'s product): inside the split kernel where it runs (:data:`GATE_IN_SPLIT`), else in
    torch ops, the same roundings."""
    in_split = gate if GATE_IN_SPLIT else None
    cpu_rows = q.dim() == 3 and not q.is_cuda and q.dtype == torch.float32 and cpu_exact.on()  # _attend's first path
    o = None if cpu_rows else _split_step(q, k, v, mask, scale, in_split)
    if o is None:
        o = _attend(q, k, v, mask, scale)
    elif in_split is not None:
        return o  # gated in the kernel
    return o if gate is None else o * torch.sigmoid(gate.transpose(-3, -2))


def _split_step(q, k, v, mask, scale: float, gate: torch.Tensor | None) -> torch.Tensor | None:
    """The split kernel where a static step takes it (see :func:`live_context_attention`,
    :func:`span_invariant_attention`), ``gate`` applied in it; None where it does not run."""
    if mask is None or not SPLIT_ATTENTION:
        return None
    if q.dim() == 3:
        return _attend_live(q, k, v, mask, scale, gate) if getattr(_LIVE_CONTEXT, "on", False) else None
    if (getattr(_SPAN_INVARIANT, "on", False) and q.shape[-1] <= SPLIT_BATCHED_MAX_D
            and split_attention.supported(q, k, mask)):
        return split_attention.split_attention(q, k, v, mask, scale, gate)
    return None


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """:func:`attend` on its paths other than the split kernel, ungated."""
    if q.dim() == 3 and not q.is_cuda and q.dtype == torch.float32 and cpu_exact.on():
        return cpu_exact.attention(q, k, v, mask, scale)  # a row's bits at any row count (cpu_exact.py)
    if mask is not None and mask.shape[-1] != k.shape[-2]:
        raise RuntimeError(f"attention over {k.shape[-2]} keys with a mask of {mask.shape[-1]}: a step over part of "
                           "the cache needs the split kernel (graphs.SHORT_SPAN)")
    single = q.dim() == 3
    if single:
        q, k, v = q[None], k[None], v[None]
    if not single and q.shape[0] > 1 and not q.is_cuda and getattr(_ROW_BY_ROW, "on", False):
        return torch.cat([_attend(q[i:i + 1], k[i:i + 1], v[i:i + 1], None if mask is None else mask[i:i + 1], scale)
                          for i in range(q.shape[0])])
    groups = q.shape[1] // k.shape[1]
    if not single and getattr(_SPAN_INVARIANT, "on", False):
        return _attend_span_invariant(q, k, v, mask, scale, groups)
    if not single and groups > 1 and FOLD_GQA_BATCHED:
        return _attend_folded(q, k, v, mask, scale, groups)
    if q.is_cuda and not torch.compiler.is_compiling():
        o = _sdpa_cuda(q, k, v, mask, scale, groups)
    else:
        if groups > 1 and not _SDPA_GQA:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        if groups > 1 and _SDPA_GQA:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return o[0] if single else o


# Eager CUDA attention (prefills, a drafter's catch-up over a prompt) leaves SDPA's cuDNN kernel out.
# torch 2.11 picks it for a masked call on the H200, and it builds a plan for every new sequence length:
# ~43 ms a new length (scripts/probe_sdpa_first_call.py), i.e. on every prompt of a prefill, again in
# an MTP drafter's catch-up at its own length (issue 9: MTP k=3 cost ~110 ms a prompt more than k=4,
# which found the plans built), and on every request of the server. The flash and memory-efficient
# kernels have no per-length setup (0.3-1 ms for the first call of a length there). A masked call
# with GQA expands the keys and values first: with a mask and ``enable_gqa`` SDPA would fall back to
# its math kernel, whose score matrix grows with the square of the prompt.
def sdpa_backends():
    """The SDPA kernels eager CUDA attention may use (a context manager): all but cuDNN's."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _sdpa_cuda(q, k, v, mask, scale: float, groups: int) -> torch.Tensor:
    gqa = groups > 1 and mask is None and _SDPA_GQA  # unmasked: SDPA's own GQA; masked: expanded K/V
    if groups > 1 and not gqa:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    with sdpa_backends():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, **({"enable_gqa": True} if gqa else {}))


# Batched steps (many sequences, few rows each): fold each KV head's query group into its rows,
# so that attention reads every key/value once, with no GQA expansion and any SDPA kernel that
# takes a mask. Off until measured on the GPU (scripts/profile_batch.py compares both).
FOLD_GQA_BATCHED = False


def _attend_folded(q, k, v, mask, scale: float, groups: int) -> torch.Tensor:
    """``q [B, H, T, d]`` with ``H = Hkv * groups`` (head ``h`` reads KV head ``h // groups``) as
    ``[B, Hkv, groups*T, d]``; the mask ``[B, 1, T, S]`` repeated per group row."""
    b, h, t, d = q.shape
    kv = k.shape[1]
    qf = q.reshape(b, kv, groups * t, d)
    m = None
    if mask is not None:
        m = mask.unsqueeze(2).expand(mask.shape[0], 1, groups, t, mask.shape[-1]).reshape(mask.shape[0], 1, groups * t, -1)
    o = F.scaled_dot_product_attention(qf, k, v, attn_mask=m, scale=scale)
    return o.reshape(b, h, t, o.shape[-1])


# Batched static steps whose span follows the live context (the serving loop's span buckets) need a
# row's attention bits not to change with how many masked keys follow its live ones. SDPA's default
# CUDA kernel at [1, 32, 1, 128] and its math kernel change them as the span grows; the memory-efficient
# kernel did not, in every shape measured on the H200 (BENCHMARKS.md, scripts/micro_kernels.py attn).
# So such steps fold each KV head's query group into its rows (no GQA, which that kernel lacks) and,
# on CUDA, take the memory-efficient kernel. The CPU's kernels change bits with the span: the loop
# uses span buckets on CUDA only.
_SPAN_INVARIANT = threading.local()


def span_invariant_attention():
    """Within it (this thread), batched attention takes the span-invariant form above."""
    return switched_on(_SPAN_INVARIANT)


# The CPU's SDPA splits its work across threads by shape, and at T = 1 or 3 (other sizes too, it
# may be) a batch element's bits then depend on its index: with 2 threads, half of a batch's
# elements differ from the same inputs at element 0. The serving loop's static steps (a row's bits
# must not depend on its slot) therefore attend one sequence at a time on the CPU. CUDA kernels
# gave every element the same bits (scripts/check_step_determinism.py on the H200).
_ROW_BY_ROW = threading.local()


def attention_row_by_row():
    """Within it (this thread), batched CPU attention runs one batch element per call."""
    return switched_on(_ROW_BY_ROW)


@contextlib.contextmanager
def static_step_attention(span_invariant: bool, on_cuda: bool):
    """The attention of a batched static step whose rows must not depend on their slot: the
    span-invariant form with ``span_invariant``, and one slot per call off CUDA."""
    with contextlib.ExitStack() as stack:
        if span_invariant:
            stack.enter_context(span_invariant_attention())
        if not on_cuda:
            stack.enter_context(attention_row_by_row())
        yield


# On CUDA the span-invariant form is models/split_attention.py's kernel (fixed key splits combined in
# order: its cost follows the keys a row sees, not the span); SPECDEC_SPAN_ATTENTION=sdpa selects the
# memory-efficient SDPA kernel instead (what the static steps used before it, for comparison)
SPLIT_ATTENTION = env.choice("SPECDEC_SPAN_ATTENTION") == "split"
# Gated attention's sigmoid gate (Qwen3.5's full-attention layers) in the split kernel's output store (the direct
# launch's or the combine's) where a static step runs it, not two torch kernels after it (whose launches also kept
# o_proj's GEMM from starting under PDL before its input was written); the same roundings as the torch ops, the bits
# of tl.sigmoid. SPECDEC_GATE_IN_SPLIT=0: the torch ops.
GATE_IN_SPLIT = env.switch("SPECDEC_GATE_IN_SPLIT")
# RoPE and the KV-cache write of CUDA static steps in one kernel (models/rope_write.py): bitwise the
# eager ops' results (scripts/check_rope_write.py on the H200); SPECDEC_FUSED_ROPE=0 turns it off
FUSED_ROPE_WRITE = env.switch("SPECDEC_FUSED_ROPE")
# ... with the q/k norms in the same kernel (rope_write.norm_rope_write: two norm kernels a layer fewer in a q/k-normed
# target's one-sequence static steps, Qwen3 and Qwen3.5). On by default since measured (H100, 2026-12-06 (third),
# scripts/ab_flags.py, one process, 1-row step at context 512): qwen3-8b 6.204 -> 6.127 ms, qwen3.5-35b-a3b 3.689 ->
# 3.665; SPECDEC_NORM_ROPE=0 off
NORM_ROPE = env.switch("SPECDEC_NORM_ROPE")
# A CUDA static step's RoPE cos/sin (CausalLM.static_context) as two lookups in a table kept per device and dtype
# (static_cos_sin), not ~9 elementwise kernels a step, and its aranges kept too: the same bits (H100, 2026-12-06
# (sixth): 0 of 4 x 3,444 step positions differ from cos_sin's over 4 rotaries; device_check 0 outputs differing). The
# 1-row step -0.015 to -0.018 ms in four of five one-process comparisons (ab_flags: smollm2-135m shape 0.897 -> 0.882,
# qwen3-8b 6.136 -> 6.120, qwen3.5-35b-a3b 3.669 -> 3.651; a 2-round qwen3-8b run +0.038), an MTP k=3 propose 0.470 ->
# 0.445 ms; the real SmolLM2 on GSM8K (40 prompts, alternated twice): MTP 1,737 -> 1,791 tok/s, plain 1,244 -> 1,250.
# SPECDEC_ROPE_TABLE=0 off. Off CUDA the values are computed (a CPU's vector loop and its scalar tail may round sin
# and cos apart); TABLE_OFF_CUDA lets tests run the table there. (First built on 2026-12-03: no faster on the H200's
# padded 16-row steps, removed at 4cdfa31.)
ROPE_TABLE = env.switch("SPECDEC_ROPE_TABLE")
TABLE_OFF_CUDA = False


# A single sequence's static steps (models/graphs.py: generate, bench) attend over the whole
# preallocated cache, masked by position; within live_context_attention() they take the split kernel
# on CUDA, whose cost follows the keys a row sees (the live context), not the cache's size, and whose
# rows do not depend on the step's width. Inputs it does not take keep :func:`attend`'s other paths.
_LIVE_CONTEXT = threading.local()


def live_context_attention():
    """Within it (this thread), CUDA attention with a boolean mask takes the split kernel where it applies."""
    return switched_on(_LIVE_CONTEXT)


# A drafter's static steps of one sequence (the MTP propose, the DFlash block) attend over their whole
# preallocated context with a mask, by SDPA's memory-efficient kernel, whose cost follows that size:
# on the H200 (6d45f6d, SmolLM2, GSM8K) 113 us a call for the MTP block, 56 us for each DFlash layer.
# They are captured within live_context_attention() (the split kernel, the cost of the keys seen):
# on the H200 (af71968, SmolLM2) a DFlash propose 0.86 -> 0.58 ms, an MTP propose 0.80 -> 0.65 ms,
# GSM8K end to end +4..9 % for DFlash and +1..13 % for MTP (BENCHMARKS.md). Drafts only: the target
# verifies, the output cannot change (the drafts' bf16 rounding can: DFlash tau 3.232 -> 3.211).
# SPECDEC_DRAFTER_SPLIT=0 gives the memory-efficient SDPA back.
DRAFTER_SPLIT = env.switch("SPECDEC_DRAFTER_SPLIT")


def drafter_static_attention():
    """The attention of a drafter's static step of one sequence (see DRAFTER_SPLIT)."""
    return live_context_attention() if DRAFTER_SPLIT else contextlib.nullcontext()


def _attend_live(q, k, v, mask, scale: float, gate: torch.Tensor | None = None) -> torch.Tensor | None:
    """:func:`attend` of one sequence (``[H, T, d]``, a ``[T, S]`` mask) by the split kernel as a
    batch of one, or None where the kernel does not take the inputs (batched steps choose theirs
    by :func:`span_invariant_attention`)."""
    if q.dim() != 3 or mask.dim() != 2 or mask.shape[-1] > k.shape[-2]:
        return None
    span = mask.shape[-1]  # a step over the first positions only (graphs.SHORT_SPAN): the keys past it unseen
    q, k, v, mask = q[None], k[None, :, :span], v[None, :, :span], mask.view(1, 1, *mask.shape)
    if not split_attention.supported(q, k, mask):
        return None
    return split_attention.split_attention(q, k, v, mask, scale, None if gate is None else gate[None])[0]


# Batched steps (the serving loop's) take the split kernel for heads of at most this size; Gemma 4's 512-wide heads keep
# the memory-efficient SDPA there. On an H100 (scripts/check_split_attention.py --only gemma4-full, us a layer, 16
# heads on 2 KV heads) the split kernel's 16-row tiles took 32 sequences x 16 rows at 1,024 / 4,096 keys 775 / 3,300
# against SDPA's 225 / 786 (each tile re-reads its keys), where one sequence's step (the split kernel's, generate()'s)
# took 10.3 / 16.9 against 91.7 / 345.4. By head size only, so plain and speculative serving run the same kernel.
SPLIT_BATCHED_MAX_D = 256


def _attend_span_invariant(q, k, v, mask, scale: float, groups: int) -> torch.Tensor:
    # (the split kernel, where it applies, ran before: _split_step)
    def run():
        if groups > 1:
            return _attend_folded(q, k, v, mask, scale, groups)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    if not q.is_cuda:
        return run()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        return run()


def _sdpa_has_gqa() -> bool:
    import inspect
    try:
        return "enable_gqa" in inspect.signature(F.scaled_dot_product_attention).parameters
    except (TypeError, ValueError):  # builtins without a signature: try it
        try:
            z = torch.zeros(1, 2, 1, 4)
            F.scaled_dot_product_attention(z, z[:, :1], z[:, :1], enable_gqa=True)
            return True
        except TypeError:
            return False


_SDPA_GQA = _sdpa_has_gqa()


class Attention(nn.Module):
    """Multi-head attention with GQA, optional per-head q/k norm and optional output gate.

    ``gated``: ``q_proj`` emits, per head, the query followed by a gate of the same width;
    the attention output is multiplied by ``sigmoid(gate)`` before ``o_proj`` (Qwen3.5).
    ``scale`` replaces the usual ``head_dim ** -0.5`` (Gemma's ``query_pre_attn_scalar ** -0.5``).
    ``shard`` (tensor parallelism): the module holds this rank's heads only (with their gates and
    per-head norms, which are local), ``n_heads`` and ``n_kv`` become the local counts, and
    ``o_proj`` all-reduces (see :mod:`specdec.parallel.tp`).
    """

    def __init__(self, hidden: int, n_heads: int, n_kv: int, head_dim: int, *, bias: bool = False,
                 qk_norm_eps: float | None = None, zero_centered_qk: bool = False, gated: bool = False,
                 scale: float | None = None, shard: Shard | None = None):
        super().__init__()
        if shard is not None:
            split = split_heads(n_heads, n_kv, head_dim, shard)
            n_heads, n_kv = split.heads, split.kv_heads
            # gated: each head's 2*d rows of q_proj (query, then gate) go with it
            qkv = {"q_proj": split.q.scaled(2) if gated else split.q, "k_proj": split.kv, "v_proj": split.kv}
            self.tp_slices = {f"{m}.weight": s for m, s in qkv.items()}
            if bias:
                self.tp_slices.update({f"{m}.bias": s for m, s in qkv.items()})
            self.tp_slices["o_proj.weight"] = split.q.along(1)  # its bias is added once, after the all-reduce
        self.n_heads, self.n_kv, self.head_dim, self.gated = n_heads, n_kv, head_dim, gated
        self.q_proj = Linear(hidden, n_heads * head_dim * (2 if gated else 1), bias=bias)
        self.k_proj = Linear(hidden, n_kv * head_dim, bias=bias)
        self.v_proj = Linear(hidden, n_kv * head_dim, bias=bias)
        self.o_proj = row_parallel(n_heads * head_dim, hidden, bias, shard)
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps, zero_centered_qk)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps, zero_centered_qk)
        else:
            self.q_norm = self.k_norm = None
        self.scale = head_dim ** -0.5 if scale is None else scale
        self._fused: tuple | None = None  # (weight, bias, sizes) once fuse() ran

    def fuse(self) -> None:
        """Compute q, k and v with one GEMM (see :func:`fuse_linears`); call after loading."""
        if self._fused is None:
            self._fused = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``x [T, hidden]`` -> q ``[H, T, d]``, k, v ``[Hkv, T, d]``, gate ``[T, H*d]`` or None.
        Batched, ``x [B, T, hidden]`` -> ``[B, H, T, d]`` ... (cos/sin ``[B, 1, T, r]``)."""
        return self._rotate(*self._heads(x), cos, sin)

    @staticmethod
    def _rotate(q, k, v, gate, cos, sin):
        """:meth:`_heads`' outputs -> :meth:`project`'s (heads before positions, RoPE applied)."""
        q, k, v = q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, gate

    def _heads(self, x: torch.Tensor):
        """q ``[..., T, H, d]``, k, v ``[..., T, Hkv, d]`` before RoPE (q/k-normed), and the gate."""
        if self._fused is not None:
            w, b, sizes = self._fused
            return self.split_qkv(linear(x, w, b))
        return self._shape_heads(self.q_proj(x), self.k_proj(x), self.v_proj(x))

    def split_qkv(self, qkv: torch.Tensor, norm: bool = True):
        """The fused projection's output ``[..., T, sizes]`` -> :meth:`_heads`' outputs (``norm`` False: q and k
        not yet q/k-normed, for :meth:`attend_heads` with ``normed=False``)."""
        return self._shape_heads(*qkv.split(self._fused[2], dim=-1), norm=norm)

    def _shape_heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, norm: bool = True):
        """q ``[..., T, H, d]``, k, v ``[..., T, Hkv, d]``, the gate ``[..., T, H, d]`` (a view) or None; q and k
        q/k-normed unless ``norm`` is False."""
        lead = q.shape[:-1]
        gate = None
        if self.gated:
            q = q.view(*lead, self.n_heads, 2 * self.head_dim)
            q, gate = q[..., : self.head_dim], q[..., self.head_dim :]
        q = q.reshape(*lead, self.n_heads, self.head_dim)
        k = k.view(*lead, self.n_kv, self.head_dim)
        v = v.view(*lead, self.n_kv, self.head_dim)
        if self.q_norm is not None and norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v, gate

    def output(self, o: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """``o [H, T, d]`` -> ``[T, hidden]`` (batched: ``[B, H, T, d]`` -> ``[B, T, hidden]``)."""
        return self.o_proj(self.gathered(o, gate))

    @staticmethod
    def gathered(o: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """``o [H, T, d]`` -> ``[T, H*d]`` (batched ``[B, H, T, d]`` -> ``[B, T, H*d]``), times ``sigmoid(gate)`` if
        gated (``gate [T, H, d]``, batched ``[B, T, H, d]``, any strides: a view of the projection, never copied)."""
        o = o.transpose(-3, -2)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return o.reshape(*o.shape[:-2], -1)

    def forward(self, x: torch.Tensor, cos, sin, cache: KVCache, start: int, mask: torch.Tensor | None) -> torch.Tensor:
        return self.o_proj(self.attend_heads(self._heads(x), cos, sin, cache, start, mask))

    def attend_heads(self, heads, cos, sin, cache: KVCache, start, mask: torch.Tensor | None,
                     normed: bool = True) -> torch.Tensor:
        """:meth:`_heads`' outputs -> the attention output before ``o_proj``, ``[..., T, H*d]`` (gated). ``normed``
        False: q and k are not yet q/k-normed (``split_qkv(..., norm=False)``); one sequence's CUDA steps then norm
        them in the RoPE kernel (``NORM_ROPE``), other paths first."""
        normed = normed or self.q_norm is None
        in_rope = not normed and (  # the q/k norms in the RoPE kernel (NORM_ROPE), else first
            NORM_ROPE and FUSED_ROPE_WRITE and heads[0].dim() == 3 and heads[0].is_cuda
            and not torch.compiler.is_compiling() and self.q_norm.eps == self.k_norm.eps
            and rope_write.supported(heads[0], heads[1], cos.reshape(-1, cos.shape[-1]), cache, start))
        if not normed and not in_rope:
            q, k, v, gate = heads
            heads = self.q_norm(q), self.k_norm(k), v, gate
        if FUSED_ROPE_WRITE and heads[0].is_cuda and not torch.compiler.is_compiling():
            # a static step on CUDA (batched, or one sequence's): RoPE and the cache write in one kernel
            # (compiled, inductor fuses the eager ops itself)
            q, k, v, gate = heads
            rows = cos.reshape(-1, cos.shape[-1])
            if rope_write.supported(q, k, rows, cache, start):
                if q.dim() == 4:
                    q = rope_write.rope_write(q, k, v, rows, sin.reshape(rows.shape), cache, start)
                    k_all, v_all = cache.read(start)
                elif in_rope:  # the q/k norms too (NORM_ROPE)
                    q = rope_write.norm_rope_write(q, k, v, self.q_norm.fp32_scale(), self.k_norm.fp32_scale(),
                                                   self.q_norm.eps, rows, sin.reshape(rows.shape), cache.k, cache.v,
                                                   start, row_tables=True)
                    k_all, v_all = cache.k, cache.v
                else:
                    q = rope_write.rope_write_one(q, k, v, cos, sin, cache, start)
                    k_all, v_all = cache.k, cache.v
                return self.gathered(attend(q, k_all, v_all, mask, self.scale, gate), None)
        q, k, v, gate = self._rotate(*heads, cos, sin)
        k_all, v_all = cache.update(start, k, v)
        return self.gathered(attend(q, k_all, v_all, mask, self.scale, gate), None)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``; with a ``shard``, a block of the intermediate features
    (``down_proj`` all-reduces)."""

    def __init__(self, hidden: int, inter: int, bias: bool = False, shard: Shard | None = None):
        super().__init__()
        if shard is not None:
            rows = even_split(inter, shard, "intermediate_size")
            inter = rows.size
            self.tp_slices = {"gate_proj.weight": rows, "up_proj.weight": rows, "down_proj.weight": rows.along(1)}
            if bias:
                self.tp_slices.update({"gate_proj.bias": rows, "up_proj.bias": rows})
        self.gate_proj = Linear(hidden, inter, bias=bias)
        self.up_proj = Linear(hidden, inter, bias=bias)
        self.down_proj = row_parallel(inter, hidden, bias, shard)
        self._fused: tuple | None = None  # (weight, bias, sizes) once fuse() ran

    def fuse(self) -> None:
        """Compute gate and up with one GEMM (see :func:`fuse_linears`); call after loading."""
        if self._fused is None:
            self._fused = fuse_linears(self.gate_proj, self.up_proj)

    @staticmethod
    def act(x: torch.Tensor) -> torch.Tensor:
        return F.silu(x)

    def inner(self, x: torch.Tensor) -> torch.Tensor:
        """``act(gate(x)) * up(x)``: the input of ``down_proj`` (a rank's block of it, sharded)."""
        if self._fused is not None:
            w, b, sizes = self._fused
            gate_up = linear(x, w, b)
            act = type(self).act
            if ((act is SwiGLU.act or act is gelu_tanh) and not (torch.is_grad_enabled() and gate_up.requires_grad)
                    and fused_ops.usable(gate_up)):  # CUDA: the activation and product in one kernel
                return fused_ops.silu_mul(gate_up, gelu=act is gelu_tanh)
            gate, up = gate_up.split(sizes, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.act(gate) * up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.inner(x))


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh form (``gelu_pytorch_tanh``), Gemma's activation; the expert kernels know it by identity."""
    return F.gelu(x, approximate="tanh")


class GeluTanhGLU(SwiGLU):
    """``down(gelu_tanh(gate(x)) * up(x))`` (Gemma's ``gelu_pytorch_tanh`` MLP), same parameter names."""

    act = staticmethod(gelu_tanh)


def fuse_linears(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
    """One weight (and bias) for linears that read the same input: their rows concatenated, and each
    linear's parameters made views of it, so the memory is not doubled and the named parameters
    (state dicts, drafters that copy a layer) stay as they were. One GEMM then replaces several
    smaller ones: fewer kernels per decode step, each reading more bytes at once. Call after the
    weights are loaded and placed (moving the module later would break the views)."""
    sizes = [lin.out_features for lin in linears]
    with torch.no_grad():
        w = torch.cat([lin.weight for lin in linears])
        has_bias = linears[0].bias is not None
        b = torch.cat([lin.bias for lin in linears]) if has_bias else None
        for i, lin in enumerate(linears):
            grad = lin.weight.requires_grad
            lin.weight = nn.Parameter(w.split(sizes)[i], requires_grad=grad)
            if has_bias:
                lin.bias = nn.Parameter(b.split(sizes)[i], requires_grad=grad)
    return w, b, sizes
