"""Llama-family (Llama 3, SmolLM2) and Qwen3 dense targets.

Qwen3 is Llama plus a per-head RMSNorm on queries and keys, so both share one decoder layer.
GGUF files of the ``llama`` architecture store q/k rows permuted for llama.cpp's interleaved
RoPE; :func:`unpermute_qk` undoes it. ``qwen3`` GGUFs are not permuted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..cache import KVCache
from ..config import ModelConfig
from ..errors import ConfigError
from ..parallel.tp import Shard
from . import fused_layer
from .base import CausalLM, StepContext
from .gguf_names import dense_block_names, gguf_meta
from .layers import Attention, RMSNorm, SwiGLU
from .registry import Architecture, register


@dataclass
class LlamaConfig(ModelConfig):
    def __post_init__(self) -> None:
        super().__post_init__()
        # options that would change the math but that this module does not implement
        if self.hidden_act not in ("silu", "swish"):
            raise ConfigError(f"hidden_act '{self.hidden_act}' is not supported for {self.model_type} (supported: silu)")
        if self.raw.get("use_sliding_window"):
            raise ConfigError(f"use_sliding_window=true is not supported for {self.model_type}")


@dataclass
class Qwen3Config(LlamaConfig):
    pass


class DenseDecoderLayer(nn.Module):
    """Attention + SwiGLU with HF names; ``layer(x [T, H], ctx, cache)`` with a :class:`KVCache`
    from :meth:`make_cache` (the target's own layers, and the MTP head of a Llama-family target).
    With a ``shard``: this rank's heads and intermediate block (tensor parallelism)."""

    fused_path = False  # fused_layer's kernels on CUDA (set by CausalLM.fuse_projections)

    def __init__(self, c: ModelConfig, qk_norm: bool, shard: Shard | None = None):
        super().__init__()
        self.config = c
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                   bias=c.attention_bias, qk_norm_eps=c.rms_norm_eps if qk_norm else None, shard=shard)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size, c.mlp_bias, shard=shard)

    def make_cache(self, max_len: int, dtype: torch.dtype, device) -> KVCache:
        # the KV heads this module holds (a rank's share under tensor parallelism)
        return KVCache(self.self_attn.n_kv, self.config.head_dim, max_len, dtype, device)

    def forward(self, x: torch.Tensor, ctx: StepContext, cache: KVCache) -> torch.Tensor:
        x, h = self.post_attention_layernorm.add(x, self.self_attn(self.input_layernorm(x), ctx.cos, ctx.sin, cache,
                                                                    ctx.start, ctx.mask))
        return x + self.mlp(h)

    def forward_fused(self, x: torch.Tensor, delta: torch.Tensor | None, ctx: StepContext, cache: KVCache,
                      weights: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward_folded`'s contract with :mod:`~specdec.models.fused_layer`'s GEMMs (CUDA, no
        gradients; layers for which ``fused_layer.eligible``). ``weights``: ``(qkv, qkv sizes, gate_up)``
        concatenated elsewhere (an MTP head's copies), else the layer's own fused projections."""
        a, mlp = self.self_attn, self.mlp
        qkv, sizes, gate_up = weights or (a._fused[0], a._fused[2], mlp._fused[0])
        x, h = self.input_layernorm.add(x, delta)
        heads = a._shape_heads(*fused_layer.linear(h, qkv).split(sizes, dim=-1), norm=False)
        o = a.attend_heads(heads, ctx.cos, ctx.sin, cache, ctx.start, ctx.mask, normed=False)
        x, h = self.post_attention_layernorm.add(x, fused_layer.linear(o, a.o_proj.weight))
        return x, fused_layer.linear(fused_layer.linear(h, gate_up, silu=True), mlp.down_proj.weight)

    def forward_folded(self, x: torch.Tensor, delta: torch.Tensor | None, ctx: StepContext, cache: KVCache
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer with the residual adds moved: it takes ``(x, delta)``, whose sum is its input
        (``delta`` None: ``x`` alone), and returns ``(x', delta')`` whose sum is :meth:`forward`'s output,
        bit for bit (see ``base.FOLD_RESIDUAL``)."""
        x, h = self.input_layernorm.add(x, delta)
        x, h = self.post_attention_layernorm.add(x, self.self_attn(h, ctx.cos, ctx.sin, cache, ctx.start, ctx.mask))
        return x, self.mlp(h)


class LlamaForCausalLM(CausalLM):
    qk_norm = False
    batched = True
    tensor_parallel = True

    def __init__(self, config: ModelConfig, shard: Shard | None = None):
        super().__init__(config, shard)
        self.layers = nn.ModuleList(DenseDecoderLayer(config, self.qk_norm, shard)
                                    for _ in range(config.num_hidden_layers))

    def make_layer_cache(self, i, max_len, dtype, device):
        return self.layers[i].make_cache(max_len, dtype, device)

    def cpu_row_exact(self) -> bool:
        """Norms, RoPE, SwiGLU and the embedding work row by row (tests/test_invariance.py checks the bits); one
        process (a tensor-parallel rank's all-reduce is not covered)."""
        return self.shard is None


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Invert llama.cpp's ``permute`` of q/k projection rows (per head: interleaved -> halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_config(meta: dict, arch: str) -> dict:
    g = gguf_meta(meta, arch)
    return g


def _llama_gguf_transform(config: ModelConfig):
    def fix(name: str, t: torch.Tensor) -> torch.Tensor:
        # per head, so it applies alike to a rank's block of heads (tensor parallelism); llama.cpp's
        # converter permutes the q/k biases with their rows
        if name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                          "self_attn.q_proj.bias", "self_attn.k_proj.bias")):
            return unpermute_qk(t, t.shape[0] // config.head_dim)
        return t
    return fix


def _gguf_biases(d: dict, src) -> None:
    """llama.cpp records attention and MLP biases by their tensors only (no metadata key)."""
    names = src.infos()
    d["attention_bias"] = "blk.0.attn_q.bias" in names
    d["mlp_bias"] = "blk.0.ffn_up.bias" in names


def _dense_gguf_names(config: ModelConfig) -> dict[str, str]:
    names = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight", "output.weight": "lm_head.weight"}
    for i in range(config.num_hidden_layers):
        names.update(dense_block_names(i, f"layers.{i}"))
    return names


register(Architecture(
    name="llama", hf_model_types=("llama",), gguf_archs=("llama",), config_cls=LlamaConfig,
    model_cls=LlamaForCausalLM, gguf_config=lambda m: _gguf_config(m, "llama"), gguf_names=_dense_gguf_names,
    gguf_transform=_llama_gguf_transform, gguf_ignore=("rope_freqs.weight",), gguf_tensor_config=_gguf_biases,
    drafters=("ngram", "dflash", "mtp:PATH"),
))
register(Architecture(
    name="qwen3", hf_model_types=("qwen3",), gguf_archs=("qwen3",), config_cls=Qwen3Config,
    model_cls=Qwen3ForCausalLM, gguf_config=lambda m: _gguf_config(m, "qwen3"), gguf_names=_dense_gguf_names,
    gguf_tensor_config=_gguf_biases,
    drafters=("ngram", "dflash", "mtp:PATH"),
))
