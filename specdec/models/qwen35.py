"""Qwen3.5 / Qwen3.6 hybrid targets: Gated DeltaNet and gated full attention, dense or MoE.

A decoder layer is a linear-attention layer (:class:`~specdec.models.deltanet.GatedDeltaNet`,
``linear_attn.*``) or a full-attention layer (``self_attn.*``: ``q_proj`` emits the query and a
sigmoid output gate per head, zero-centred per-head q/k norms, partial RoPE, GQA), followed by a
SwiGLU (``qwen3_5``) or a sparse MoE with a gated shared expert (``qwen3_5_moe``). Every RMSNorm
of the main stack scales by ``1 + w`` with fp32 statistics; only the DeltaNet output norm uses
plain ``w``. Interleaved mRoPE (``mrope_section``) equals plain RoPE for text, where the three
position rows coincide.

For the MTP drafter: :class:`FullAttentionDecoderLayer` (its own KV cache) and
:class:`~specdec.models.moe.SparseMoeBlock` are importable from here, and
:func:`checkpoint_view` presents HF or GGUF checkpoints (``mtp.*`` included) in HF names and
conventions. Checkpoint conversions live in :mod:`specdec.models.qwen35_ckpt`.

Tensor parallelism (dense ``qwen3_5``; ``shard``): attention heads, DeltaNet key heads with their
value heads, and the SwiGLU block are split (:class:`~specdec.models.layers.Attention`,
:class:`~specdec.models.deltanet.GatedDeltaNet`); the MTP block stays whole on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .. import env
from ..cache import KVCache, LinearAttnCache
from ..config import ModelConfig
from ..cpu_linear import plain
from ..errors import ConfigError
from ..parallel.tp import Shard
from . import fused_layer
from .base import CausalLM, StepContext
from .deltanet import GatedDeltaNet
from .layers import Attention, RMSNorm, SwiGLU
from .moe import SparseMoeBlock
from .qwen35_ckpt import HF_HIDDEN_PREFIXES, gguf_config, gguf_view, hf_view
from .registry import Architecture, register

__all__ = ["Qwen35Config", "Qwen35MoeConfig", "FullAttentionDecoderLayer", "LinearAttentionDecoderLayer",
           "SparseMoeBlock", "Qwen35ForCausalLM", "Qwen35MoeForCausalLM", "checkpoint_view"]

LAYER_TYPES = ("linear_attention", "full_attention")
# A target's layers on fused_layer's GEMM (q/k/v + gate, o_proj, the DeltaNet's in- and out-projections, gate/up +
# SwiGLU, down_proj; a MoE block on its own kernels) in the forwards fused_layer.runs picks: with its LM head there too,
# the target is row-exact and plain decoding runs 1-row steps instead of 16-row padded ones. SPECDEC_FUSED_HYBRID=0:
# cuBLAS, padded steps.
HYBRID_FUSED = env.switch("SPECDEC_FUSED_HYBRID")


@dataclass
class Qwen35Config(ModelConfig):
    """``Qwen3_5TextConfig`` (``qwen3_5_text``); defaults mirror transformers'."""

    # Redeclared with defaults: MoE configs carry no intermediate_size. Checked in __post_init__.
    intermediate_size: int = 0
    num_hidden_layers: int = 0
    num_attention_heads: int = 0
    head_dim: int = 256
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 32768
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    layer_types: list | None = None
    full_attention_interval: int = 4
    mtp_num_hidden_layers: int = 0

    def __post_init__(self) -> None:
        sizes = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                 "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                 "linear_num_value_heads", "full_attention_interval")
        for f in sizes + self._required():
            if not int(getattr(self, f) or 0) > 0:
                raise ConfigError(f"{self.model_type} config: field '{f}' is missing or not positive")
        super().__post_init__()
        if self.hidden_act != "silu":
            raise ConfigError(f"{self.model_type} config: hidden_act '{self.hidden_act}' is not supported (silu)")
        if self.layer_types is None:
            k = int(self.full_attention_interval)
            self.layer_types = ["full_attention" if (i + 1) % k == 0 else "linear_attention" for i in range(self.num_hidden_layers)]
        self.layer_types = list(self.layer_types)
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(f"{self.model_type} config: layer_types has {len(self.layer_types)} entries "
                              f"for num_hidden_layers={self.num_hidden_layers}")
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ConfigError(f"{self.model_type} config: layer_types {bad} not supported ({', '.join(LAYER_TYPES)})")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(f"{self.model_type} config: linear_num_value_heads={self.linear_num_value_heads} is not "
                              f"a multiple of linear_num_key_heads={self.linear_num_key_heads}")

    def _required(self) -> tuple[str, ...]:
        return ("intermediate_size",)


@dataclass
class Qwen35MoeConfig(Qwen35Config):
    """``Qwen3_5MoeTextConfig`` (``qwen3_5_moe_text``)."""

    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512

    def _required(self) -> tuple[str, ...]:
        return ("num_experts", "num_experts_per_tok", "moe_intermediate_size")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(f"{self.model_type} config: num_experts_per_tok={self.num_experts_per_tok} exceeds "
                              f"num_experts={self.num_experts}")


def _norm(c: Qwen35Config) -> RMSNorm:
    return RMSNorm(c.hidden_size, c.rms_norm_eps, zero_centered=True)


def _mlp(c: Qwen35Config, moe: bool, shard: Shard | None = None) -> nn.Module:
    """The FFN of a layer; with a ``shard``, experts split across ranks (expert parallel, see
    :mod:`specdec.models.moe`), a dense SwiGLU column/row-parallel."""
    if moe:
        return SparseMoeBlock(c.hidden_size, c.moe_intermediate_size, c.shared_expert_intermediate_size,
                              c.num_experts, c.num_experts_per_tok, shard=shard)
    return SwiGLU(c.hidden_size, c.intermediate_size, shard=shard)




class _HybridLayer(nn.Module):
    """A Qwen3.5 decoder layer: input norm, the token mixer (:meth:`_mix`: full attention or a Gated DeltaNet),
    the residual add and post-mixer norm, the FFN. Subclasses build ``input_layernorm``,
    ``post_attention_layernorm`` and ``mlp`` and say how they mix (:meth:`_mix`, and with the fused layers'
    GEMM, :meth:`_mix_fused`)."""

    fused_path = False  # fused_layer's GEMM on CUDA (set by CausalLM.fuse_projections)

    def _mix(self, h: torch.Tensor, ctx: StepContext, cache) -> torch.Tensor:
        raise NotImplementedError

    def _mix_fused(self, h: torch.Tensor, ctx: StepContext, cache) -> torch.Tensor:
        raise NotImplementedError

    def _mixer_eligible(self) -> bool:
        raise NotImplementedError

    def fused_eligible(self) -> bool:
        """Whether :meth:`forward_fused` can run this layer (``fused_layer.eligible``'s question for a hybrid layer):
        a SwiGLU FFN with fused gate/up and no biases, or a MoE block the MoE kernels take (``fused_rows``), one
        process, the mixer's projections fused and contiguous without biases, wider than ``fused_layer.MAX_HIDDEN``
        only with ``fused_layer.WIDE``."""
        mlp = self.mlp
        ffn = (mlp.fused_rows() > 0 if isinstance(mlp, SparseMoeBlock) else
               type(mlp) is SwiGLU and fused_layer.mlp_fusable(mlp))
        return (HYBRID_FUSED and ffn and (self.config.hidden_size <= fused_layer.MAX_HIDDEN or fused_layer.WIDE)
                and self._mixer_eligible())

    def forward_fused(self, x: torch.Tensor, delta: torch.Tensor | None, ctx: StepContext, cache
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward_folded` with every GEMM on ``fused_layer.linear`` (a row's bits its own at any row count;
        routed by ``base.run_layers`` where ``fused_layer.runs``)."""
        x, h = self.input_layernorm.add(x, delta)
        mix, mlp = self._mix_fused(h, ctx, cache), self.mlp
        if isinstance(mlp, SparseMoeBlock):  # the router's GEMM and the MoE kernels (within mlp.fused_rows)
            return self._add_ffn(x, mix, ctx)
        x, h = self.post_attention_layernorm.add(x, mix)
        return x, fused_layer.linear(fused_layer.linear(h, mlp._fused[0], silu=True), mlp.down_proj.weight)

    def _add_ffn(self, x: torch.Tensor, mix: torch.Tensor, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + mix, FFN(post_attention_layernorm(x + mix)))``; routed experts also get the step's real rows
        (``ctx.live``: padding rows skipped), and on the MoE kernels the norm's kernel computes the router's logits
        (:meth:`SparseMoeBlock.add_forward`)."""
        if isinstance(self.mlp, SparseMoeBlock):
            return self.mlp.add_forward(x, mix, self.post_attention_layernorm, ctx.live)
        x, h = self.post_attention_layernorm.add(x, mix)
        return x, self.mlp(h)

    def forward(self, x: torch.Tensor, ctx: StepContext, cache) -> torch.Tensor:
        x, f = self._add_ffn(x, self._mix(self.input_layernorm(x), ctx, cache), ctx)
        return x + f

    def forward_folded(self, x: torch.Tensor, delta: torch.Tensor | None, ctx: StepContext, cache
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` with its last residual add left to the next layer's input norm (``base.FOLD_RESIDUAL``;
        one kernel a layer less on CUDA): it takes ``(x, delta)``, whose sum is its input (``delta`` None: ``x``
        alone), and returns ``(x', delta')``, whose sum is :meth:`forward`'s output, the add rounded alike."""
        x, h = self.input_layernorm.add(x, delta)
        return self._add_ffn(x, self._mix(h, ctx, cache), ctx)


class FullAttentionDecoderLayer(_HybridLayer):
    """Gated full attention + FFN with HF names ``input_layernorm``, ``self_attn.*``,
    ``post_attention_layernorm``, ``mlp.*`` (SwiGLU, or :class:`SparseMoeBlock` when ``moe``).

    Called as ``layer(x [T, H], ctx, cache)`` with a :class:`KVCache` from :meth:`make_cache`.
    With a ``shard``: this rank's heads and FFN block (tensor parallelism).
    """

    def __init__(self, c: Qwen35Config, moe: bool, shard: Shard | None = None):
        super().__init__()
        self.config = c
        self.input_layernorm = _norm(c)
        self.self_attn = Attention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                   bias=c.attention_bias, qk_norm_eps=c.rms_norm_eps, zero_centered_qk=True, gated=True,
                                   shard=shard)
        self.post_attention_layernorm = _norm(c)
        self.mlp = _mlp(c, moe, shard)

    def make_cache(self, max_len: int, dtype: torch.dtype, device) -> KVCache:
        # the KV heads this module holds (a rank's share under tensor parallelism)
        return KVCache(self.self_attn.n_kv, self.config.head_dim, max_len, dtype, device)

    def _mix(self, h: torch.Tensor, ctx: StepContext, cache: KVCache) -> torch.Tensor:
        return self.self_attn(h, ctx.cos, ctx.sin, cache, ctx.start, ctx.mask)

    def _mix_fused(self, h: torch.Tensor, ctx: StepContext, cache: KVCache) -> torch.Tensor:
        a = self.self_attn
        heads = a.split_qkv(fused_layer.linear(h, a._fused[0]), norm=False)
        return fused_layer.linear(a.attend_heads(heads, ctx.cos, ctx.sin, cache, ctx.start, ctx.mask, normed=False),
                                  a.o_proj.weight)

    def _mixer_eligible(self) -> bool:
        return fused_layer.attention_fusable(self.self_attn)


class LinearAttentionDecoderLayer(_HybridLayer):
    """Gated DeltaNet (``linear_attn.*``) + FFN, with a :class:`LinearAttnCache` (of this rank's
    heads, with a ``shard``)."""

    def __init__(self, c: Qwen35Config, moe: bool, shard: Shard | None = None):
        super().__init__()
        self.config = c
        self.input_layernorm = _norm(c)
        self.linear_attn = GatedDeltaNet(c.hidden_size, c.linear_num_key_heads, c.linear_num_value_heads,
                                         c.linear_key_head_dim, c.linear_value_head_dim, c.linear_conv_kernel_dim,
                                         c.rms_norm_eps, shard=shard)
        self.post_attention_layernorm = _norm(c)
        self.mlp = _mlp(c, moe, shard)

    def make_cache(self, max_len: int, dtype: torch.dtype, device, snapshot_tokens: int = 32) -> LinearAttnCache:
        return self.linear_attn.make_cache(dtype, device, snapshot_tokens)

    def _mix(self, h: torch.Tensor, ctx: StepContext, cache: LinearAttnCache) -> torch.Tensor:
        return self.linear_attn(h, ctx, cache)

    def _mix_fused(self, h: torch.Tensor, ctx: StepContext, cache: LinearAttnCache) -> torch.Tensor:
        return self.linear_attn(h, ctx, cache, linear=fused_layer.linear)

    def _mixer_eligible(self) -> bool:
        d = self.linear_attn
        return (d._fused is not None and d._fused[0].is_contiguous() and plain(d.out_proj)
                and d.out_proj.bias is None and d.out_proj.weight.is_contiguous())


class Qwen35ForCausalLM(CausalLM):
    """The dense hybrid target (``qwen3_5``); with a ``shard``, one tensor-parallel rank's part."""

    moe = False
    tensor_parallel = True
    batched = True  # full-attention layers batch as usual; DeltaNet layers: BatchLinearCache
    # Linear-attention caches keep per-position states for forwards up to this many tokens
    # (verification), so rollback restores them exactly; see LinearAttnCache.
    snapshot_tokens = 32

    def __init__(self, config: Qwen35Config, shard: Shard | None = None):
        super().__init__(config, shard)
        self.layers = nn.ModuleList(
            FullAttentionDecoderLayer(config, self.moe, shard) if t == "full_attention"
            else LinearAttentionDecoderLayer(config, self.moe, shard)
            for t in config.layer_types
        )

    @classmethod
    def zero_centered_norms(cls) -> bool:
        return True

    def row_exact(self, rows: int = 1) -> bool:
        """:meth:`CausalLM.row_exact`, and a MoE block's steps within its kernels' rows (``SparseMoeBlock.fused_rows``);
        the Gated DeltaNet's step kernels already give a row its bits at any row count."""
        return (super().row_exact(rows)
                and all(rows <= layer.mlp.fused_rows() for layer in self.layers if isinstance(layer.mlp, SparseMoeBlock)))

    def make_layer_cache(self, i: int, max_len: int, dtype: torch.dtype, device):
        layer = self.layers[i]
        if isinstance(layer, LinearAttentionDecoderLayer):
            return layer.make_cache(max_len, dtype, device, self.snapshot_tokens)
        return layer.make_cache(max_len, dtype, device)

    def make_batch_layer_cache(self, i: int, slots: int, max_len: int, spare: int):
        layer = self.layers[i]
        if isinstance(layer, LinearAttentionDecoderLayer):  # per-row states for verify steps of <= spare rows
            return layer.linear_attn.make_batch_cache(slots, max(spare, 1), self.dtype, self.device)
        return super().make_batch_layer_cache(i, slots, max_len, spare)


class Qwen35MoeForCausalLM(Qwen35ForCausalLM):
    """The MoE hybrid target (``qwen3_5_moe``)."""

    moe = True
    tensor_parallel = True  # experts split across ranks (expert parallel), see moe.py


def checkpoint_view(config: Qwen35Config, source, fmt: str, mtp: bool = False):
    """``source`` (HF or GGUF) under HF names and conventions; ``mtp`` includes the ``mtp.*``
    tensors (the MTP drafter's view: ``mtp.fc.weight``, ``mtp.layers.0.mlp.experts.gate_up_proj`` ...).

    HF names keep their ``model.`` / ``model.language_model.`` prefix; GGUF names come out as
    parameter names without one.
    """
    if fmt == "gguf":
        return gguf_view(config, source, mtp=mtp)
    if mtp:
        from .moe import stacked_experts_view
        return stacked_experts_view(source)
    return hf_view(source)


def _param_names(model_cls):
    def names(config) -> dict[str, str]:
        with torch.device("meta"):
            model = model_cls(config)
        return {n: n for n in model.state_dict()}
    return names


for _name, _types, _gguf, _cfg, _cls in (
    ("qwen3_5", ("qwen3_5", "qwen3_5_text"), "qwen35", Qwen35Config, Qwen35ForCausalLM),
    ("qwen3_5_moe", ("qwen3_5_moe", "qwen3_5_moe_text"), "qwen35moe", Qwen35MoeConfig, Qwen35MoeForCausalLM),
):
    register(Architecture(
        name=_name, hf_model_types=_types, gguf_archs=(_gguf,), config_cls=_cfg, model_cls=_cls,
        gguf_config=gguf_config, gguf_names=_param_names(_cls),
        hf_ignore_prefixes=HF_HIDDEN_PREFIXES,
        target_view=lambda config, source, fmt: checkpoint_view(config, source, fmt),
        drafters=("ngram", "dflash", "mtp", "mtp:PATH"),
    ))
