"""A DFlash drafter's static steps on CUDA in the target's own kernels (issue 9: the drafter's share of
a speculative step).

On the H200 (random weights, SmolLM2's shape, context 300, ``scripts/profile_shape_step.py --drafter
dflash``) the drafter's proposal took 0.506 ms in 159 kernels and its context write of 16 rows 0.202 ms
in 62: ~0.7 ms a step beside a 16-row verify of ~0.95 ms, in kernels of 2-3 us each. Here they run:

- the block (:func:`block_hidden`), per layer: the input norm (with the residual add from the second
  layer on), the q/k/v GEMM, q_norm + k_norm + RoPE + the block's keys and values written into the
  context buffers at their positions (:func:`~specdec.models.rope_write.norm_rope_write`), the split
  attention over the buffers (every key before the block's end: bidirectional inside the block), o_proj,
  the residual add and norm, gate/up with ``silu(gate) * up``, down_proj (``models/fused_layer.py``'s
  GEMM and ``models/fused_ops.py``' norms, as the target's fused layers): 9 kernels a layer;
- the context write (:func:`write_context`): ``fc``, ``hidden_norm``, one GEMM for every layer's keys
  and values, and per layer the k_norm + RoPE + write kernel.

The math is the eager drafter's (``dflash_model``), its bits are not: the GEMMs and norms sum in other
orders. Drafts never change a greedy output (the target's verify keeps its own tokens), and a sampled
proposal returns the probabilities it drew from, so acceptance stays exact whatever the drafter's bits
(tests compare this path with the eager one in fp16 within tolerance, in Triton's interpreter). The
block's keys and values land in the context buffers at ``start .. start + B - 1``, where the next
context write overwrites them; the caller keeps ``start + B`` within the buffers.

Which drafters take it: :func:`eligible` (full-attention, non-causal layers, the sizes the target's
kernels serve). Measured on the H200 (BENCHMARKS.md, session of 2026-12-03 (third)): the proposal 0.54 ->
0.25 ms (55 kernels), the context write 0.27 -> 0.12 ms (11 kernels); the shipped SmolLM2 drafter end to end
on GSM8K (first 80, T=0) 1.98x -> 2.33x and 1.88x -> 2.40x plain decoding in two alternated rounds,
HumanEval 1.35x -> 1.70x, the same tau and outputs equal to plain. Drafters wider than ``fused_layer.MAX_HIDDEN``
take it since the session of 2026-12-06 (fourth), on the target's wide kernels (``fused_layer.WIDE``): on an H100
(``specdec bench --shape``, random 5-layer drafters, 32,768-token draft vocabulary) the qwen3-8b shape's proposal
1.488 -> 1.110 ms (0.177x a decode step) and qwen3.5-9b's 1.482 -> 1.116; ``scripts/check_dflash_fast.py``: each fast
block's logits within 1.9e-2 (relative) of the eager block's, outputs equal to plain. On by default;
``SPECDEC_DFLASH_FAST=0`` gives the eager ops back.

With ``int8`` (:class:`FastWeights`; ``--draft-int8``, ``DFlashDrafter.use_int8_weights``) every GEMM weight here is
``fused_layer.Int8Rows``: on an H100 the qwen3-8b shape's proposal over a 32,768-token draft vocabulary (its head rows
int8 too) 1.08 -> 0.82 ms, 0.137x a decode step; the shipped SmolLM2 drafter, latency-bound, end to end the same
(BENCHMARKS.md, session of 2026-12-06 (ninth)).
"""

from __future__ import annotations


import torch

from .. import env
from ..models import fused_layer, fused_ops, rope_write, split_attention

ENABLED = env.switch("SPECDEC_DFLASH_FAST")


def eligible(model) -> bool:
    """Whether a :class:`~.dflash_model.DFlashDraftModel` has what the fast steps compute: full
    attention layers, bidirectional in the block, no window; heads of a power-of-two size (the split
    kernel's), an even rotary part; a hidden size the fused GEMMs serve: up to ``fused_layer.MAX_HIDDEN``, or wider
    with ``fused_layer.WIDE`` (the target's 4096-wide layers' kernels) where a block's rows are at most
    ``fused_layer.WIDE_ROWS`` (the fast steps run a block or a block's committed rows, never a prompt)."""
    c = model.config
    r = model.rotary.rotary_dim
    d = c.head_dim
    width = c.hidden_size <= fused_layer.MAX_HIDDEN or (fused_layer.WIDE and c.block_size <= fused_layer.WIDE_ROWS)
    return (all(w is None for w in c.windows) and not any(c.causal) and d & (d - 1) == 0 and 16 <= d <= 256
            and r % 2 == 0 and 0 < r <= d and width
            and type(model.layers[0].mlp).act is fused_layer._silu_act())


def usable(model, x: torch.Tensor) -> bool:
    """Whether a step with input ``x`` takes the fast path: on, the drafter eligible, and the target's
    kernels usable for ``x`` (CUDA, bf16/fp16, no gradient, not compiling)."""
    return ENABLED and eligible(model) and fused_layer.usable(x) and fused_ops.usable(x)


class FastWeights:
    """The drafter's weights laid out for the fused GEMMs (copies, made once: q/k/v rows concatenated
    per layer, gate/up likewise, and every layer's k/v rows in one matrix for the context write). With
    ``int8`` every one of them as ``fused_layer.Int8Rows`` (a copy each: half the bytes a step reads)."""

    def __init__(self, model, int8: bool = False):
        c = model.config
        cat = torch.cat
        form = fused_layer.Int8Rows.of if int8 else (lambda t: t.contiguous())
        self.int8 = int8
        self.qkv = [form(cat([ly.self_attn.q_proj.weight, ly.self_attn.k_proj.weight, ly.self_attn.v_proj.weight]))
                    for ly in model.layers]
        self.o = [form(ly.self_attn.o_proj.weight) for ly in model.layers]
        self.gate_up = [form(cat([ly.mlp.gate_proj.weight, ly.mlp.up_proj.weight])) for ly in model.layers]
        self.down = [form(ly.mlp.down_proj.weight) for ly in model.layers]
        self.fc = form(model.fc.weight)
        self.kv = form(cat([cat([ly.self_attn.k_proj.weight, ly.self_attn.v_proj.weight]) for ly in model.layers]))
        self.nq, self.nkv, self.d = c.num_attention_heads, c.num_key_value_heads, c.head_dim

    def nbytes(self) -> int:
        """The copies' bytes (bf16: o, down and fc are the model's own tensors)."""
        if self.int8:
            return sum(t.nbytes() for t in (*self.qkv, *self.o, *self.gate_up, *self.down, self.fc, self.kv))
        return sum(t.numel() * t.element_size() for t in (*self.qkv, *self.gate_up, self.kv))


def tables(model, positions: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's cos / sin ``[positions, r]`` by position (``like``'s dtype and device): the rows the
    eager steps compute for those positions."""
    return model.rotary.cos_sin(torch.arange(positions, device=like.device), like.dtype)


def block_hidden(model, w: FastWeights, x: torch.Tensor, start: torch.Tensor, buffers, slots: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:meth:`DFlashDraftModel.block_hidden_static` on the fused kernels: block embeddings ``x [B, H]``
    at positions ``start ..`` (``start`` a 0-d device tensor), context ``buffers[i] = (K, V) [n_kv,
    cap, d]`` valid before ``start`` -> final-normed ``[B, H]``. Writes the block's keys and values at
    ``start .. start + B - 1`` of every layer's buffers; ``slots`` is ``arange(cap)`` on the device,
    ``cos``/``sin`` :func:`tables` of at least ``cap`` positions."""
    b = x.shape[0]
    nq, nkv, d = w.nq, w.nkv, w.d
    # every query sees every key before the block's end: the context and the whole block
    mask = (slots < start + b)[None, None, None, :].expand(1, 1, b, -1)
    res = x
    delta = None
    for i, layer in enumerate(model.layers):
        a, ln = layer.self_attn, layer.input_layernorm
        if delta is None:
            h = fused_ops.rms_norm(x, ln.fp32_scale(), ln.eps)
        else:
            res, h = fused_ops.rms_norm(delta, ln.fp32_scale(), ln.eps, residual=res)
        qkv = fused_layer.linear(h, w.qkv[i])
        q = qkv[:, : nq * d].view(b, nq, d)
        k = qkv[:, nq * d: (nq + nkv) * d].view(b, nkv, d)
        v = qkv[:, (nq + nkv) * d:].view(b, nkv, d)
        kb, vb = buffers[i]
        q = rope_write.norm_rope_write(q, k, v, a.q_norm.fp32_scale(), a.k_norm.fp32_scale(), a.q_norm.eps,
                                       cos, sin, kb, vb, start)
        o = split_attention.split_attention(q[None], kb[None], vb[None], mask, a.scale)[0]  # [H, B, d] of [B, H, d]
        o = fused_layer.linear(o.transpose(0, 1).reshape(b, nq * d), w.o[i])
        pn = layer.post_attention_layernorm
        res, h = fused_ops.rms_norm(o, pn.fp32_scale(), pn.eps, residual=res)
        delta = fused_layer.linear(fused_layer.linear(h, w.gate_up[i], silu=True), w.down[i])
    n = model.norm
    return fused_ops.rms_norm(delta, n.fp32_scale(), n.eps, residual=res)[1]


def write_context(model, w: FastWeights, feats: torch.Tensor, start: torch.Tensor, buffers, cos: torch.Tensor,
                  sin: torch.Tensor) -> None:
    """:meth:`DFlashDraftModel.context_kv` and the buffer writes on the fused kernels: captured target
    features ``[T, n_ids * H]`` at positions ``start ..`` -> every layer's keys (k_norm, RoPE) and
    values stored in ``buffers``."""
    t = feats.shape[0]
    hn = model.hidden_norm
    ctx = fused_ops.rms_norm(fused_layer.linear(feats.to(model.fc.weight.dtype), w.fc), hn.fp32_scale(), hn.eps)
    kv = fused_layer.linear(ctx, w.kv)  # [T, layers * 2 * n_kv * d]: a layer's keys, then its values
    width = w.nkv * w.d
    for i, layer in enumerate(model.layers):
        k = kv[:, 2 * i * width: (2 * i + 1) * width].view(t, w.nkv, w.d)
        v = kv[:, (2 * i + 1) * width: (2 * i + 2) * width].view(t, w.nkv, w.d)
        kn = layer.self_attn.k_norm
        rope_write.norm_rope_write(None, k, v, None, kn.fp32_scale(), kn.eps, cos, sin, *buffers[i], start)
