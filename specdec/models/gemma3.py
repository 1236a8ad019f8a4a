"""Gemma 3 text targets (``gemma3_text``; GGUF architecture ``gemma3``).

A decoder layer is sandwich-normed: ``x + post_attn_norm(attn(input_norm(x)))``, then
``x + post_ffw_norm(mlp(pre_ffw_norm(x)))``. Every RMSNorm (q/k norms and the final norm
included) scales by ``1 + w`` with fp32 statistics. Attention has per-head q/k norms, GQA and a
score scale of ``query_pre_attn_scalar ** -0.5``. Layers are ``sliding_attention`` (the last
``sliding_window`` positions, RoPE base ``rope_local_base_freq``, unscaled unless
``rope_parameters["sliding_attention"]`` says otherwise) or ``full_attention`` (RoPE base
``rope_theta`` with the configured scaling). Embeddings are scaled by ``sqrt(hidden_size)``
(rounded to the weight dtype, as transformers does), the MLP is GELU-tanh gated, and the final
logits are soft-capped when ``final_logit_softcapping`` is set. The config also carries
``attn_logit_softcapping``, but transformers' and llama.cpp's Gemma 3 never apply it (only
Gemma 2 did); a set value is reported with a warning and not applied either.

Every layer keeps a full-length KV cache; a sliding layer masks by window (in the eager and the
static step alike), so rollback stays free. llama.cpp stores every ``*norm.weight`` with the
``+1`` baked in; :func:`_gguf_transform` takes it out again (as transformers does for GGUF).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn

from ..cache import KVCache
from ..config import SUPPORTED_ROPE_TYPES, ModelConfig
from ..errors import ConfigError
from . import fused_layer
from .base import StepContext, WindowedCausalLM
from .gguf_names import DENSE_BLOCK, gguf_meta, is_number, meta_getters
from .layers import Attention, GeluTanhGLU, RMSNorm, RotaryEmbedding, static_cos_sin
from .registry import Architecture, register

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass
class Gemma3Config(ModelConfig):
    """``Gemma3TextConfig`` (``gemma3_text``); defaults mirror transformers'."""

    head_dim: int = 256
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 131_072
    tie_word_embeddings: bool = True
    hidden_activation: str = "gelu_pytorch_tanh"
    query_pre_attn_scalar: float = 256
    sliding_window: int | None = 4096
    sliding_window_pattern: int = 6
    layer_types: list | None = None
    rope_local_base_freq: float = 10_000.0
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    use_bidirectional_attention: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        mt = self.model_type
        if self.hidden_activation != "gelu_pytorch_tanh":
            raise ConfigError(f"{mt} config: hidden_activation '{self.hidden_activation}' is not supported "
                              "(gelu_pytorch_tanh)")
        if self.use_bidirectional_attention:
            raise ConfigError(f"{mt} config: use_bidirectional_attention=true is not supported (a causal target is needed)")
        if self.attn_logit_softcapping:
            warnings.warn(f"{mt} config: attn_logit_softcapping={self.attn_logit_softcapping} is not applied: Gemma 3 "
                          "attention has no soft-capping (transformers and llama.cpp ignore the field too)", stacklevel=2)
        if self.layer_types is None:
            k = int(self.raw.get("_sliding_window_pattern", self.sliding_window_pattern))
            if k < 1:
                raise ConfigError(f"{mt} config: sliding_window_pattern={k} must be at least 1")
            self.layer_types = ["sliding_attention" if (i + 1) % k else "full_attention"
                                for i in range(self.num_hidden_layers)]
        self.layer_types = list(self.layer_types)
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(f"{mt} config: layer_types has {len(self.layer_types)} entries "
                              f"for num_hidden_layers={self.num_hidden_layers}")
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ConfigError(f"{mt} config: layer_types {bad} not supported ({', '.join(LAYER_TYPES)})")
        if "sliding_attention" in self.layer_types and not (self.sliding_window or 0) > 0:
            raise ConfigError(f"{mt} config: sliding_window must be a positive integer for sliding_attention layers, "
                              f"got {self.sliding_window!r}")
        # transformers 5 keeps the sliding layers' RoPE in rope_parameters["sliding_attention"]
        # (transformers 4: rope_local_base_freq, never scaled); the global one is rope_theta/rope_scaling
        self.local_rope_scaling: dict | None = None
        params = self.raw.get("rope_parameters")
        local = params.get("sliding_attention") if isinstance(params, dict) else None
        if isinstance(local, dict):
            local = dict(local)
            self.rope_local_base_freq = float(local.pop("rope_theta", self.rope_local_base_freq))
            kind = local.get("rope_type", "default")
            if kind not in SUPPORTED_ROPE_TYPES:
                raise ConfigError(f"{mt} config: sliding_attention rope_type '{kind}' is not supported "
                                  f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
            if kind != "default":
                self.local_rope_scaling = local


@dataclass(frozen=True)
class Gemma3StepContext(StepContext):
    """A :class:`StepContext` plus the sliding layers' RoPE tables and window mask."""

    local_cos: torch.Tensor | None = None
    local_sin: torch.Tensor | None = None
    local_mask: torch.Tensor | None = None


def _norm(c: Gemma3Config) -> RMSNorm:
    return RMSNorm(c.hidden_size, c.rms_norm_eps, zero_centered=True)


class Gemma3DecoderLayer(nn.Module):
    """Sandwich-normed attention + GELU-tanh MLP, HF names (``pre_feedforward_layernorm`` ...)."""

    fused_path = False  # fused_layer's GEMMs on CUDA (set by CausalLM.fuse_projections)

    def __init__(self, c: Gemma3Config, sliding: bool):
        super().__init__()
        self.config = c
        self.sliding = sliding
        self.input_layernorm = _norm(c)
        self.self_attn = Attention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                   bias=c.attention_bias, qk_norm_eps=c.rms_norm_eps, zero_centered_qk=True,
                                   scale=float(c.query_pre_attn_scalar) ** -0.5)
        self.post_attention_layernorm = _norm(c)
        self.pre_feedforward_layernorm = _norm(c)
        self.mlp = GeluTanhGLU(c.hidden_size, c.intermediate_size)
        self.post_feedforward_layernorm = _norm(c)

    def _positions(self, ctx: Gemma3StepContext) -> tuple:
        """This layer's RoPE tables and mask: the local ones (window) for a sliding layer, else the global ones."""
        if self.sliding:
            return ctx.local_cos, ctx.local_sin, ctx.local_mask
        return ctx.cos, ctx.sin, ctx.mask

    def forward(self, x: torch.Tensor, ctx: Gemma3StepContext, cache: KVCache) -> torch.Tensor:
        cos, sin, mask = self._positions(ctx)
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, cache, ctx.start, mask))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))

    def fused_eligible(self) -> bool:
        """Whether :meth:`forward_fused` can run this layer (``fused_layer.eligible``'s question): q/k/v and gate/up
        fused without biases, contiguous output weights, one process (Gemma 3 has no tensor parallelism), at most
        ``fused_layer.MAX_HIDDEN`` wide or with ``fused_layer.WIDE``."""
        return (fused_layer.attention_fusable(self.self_attn) and fused_layer.mlp_fusable(self.mlp)
                and (self.config.hidden_size <= fused_layer.MAX_HIDDEN or fused_layer.WIDE))

    def forward_fused(self, x: torch.Tensor, delta: torch.Tensor | None, ctx: Gemma3StepContext, cache: KVCache
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer on ``fused_layer``'s GEMMs (CUDA, no gradients), the residual add folded: it takes ``(x,
        delta)``, whose sum is its input (``delta`` None: ``x`` alone), and returns ``(x', delta')`` whose sum is its
        output, ``delta'`` the post-feed-forward norm's output (the next layer's input norm, or the final one, adds
        it). The q/k norms run in the RoPE kernel where it takes them. A row's bits depend on its own inputs only."""
        cos, sin, mask = self._positions(ctx)
        a, mlp = self.self_attn, self.mlp
        x, h = self.input_layernorm.add(x, delta)
        heads = a._shape_heads(*fused_layer.linear(h, a._fused[0]).split(a._fused[2], dim=-1), norm=False)
        o = a.attend_heads(heads, cos, sin, cache, ctx.start, mask, normed=False)
        x, h = self.pre_feedforward_layernorm.add(x, fused_layer.linear(o, a.o_proj.weight), self.post_attention_layernorm)
        m = fused_layer.linear(fused_layer.linear(h, mlp._fused[0], gelu=True), mlp.down_proj.weight)
        return x, self.post_feedforward_layernorm(m)


class Gemma3ForCausalLM(WindowedCausalLM):
    """The Gemma 3 text target."""

    def __init__(self, config: Gemma3Config):
        super().__init__(config)
        self.local_rotary = RotaryEmbedding(config.head_dim, config.rope_local_base_freq, 1.0, config.local_rope_scaling)
        self.final_logit_softcap = config.final_logit_softcapping
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, t == "sliding_attention") for t in config.layer_types)
        self.window = int(config.sliding_window or 0)

    @classmethod
    def zero_centered_norms(cls) -> bool:
        return True

    def cpu_row_exact(self) -> bool:
        """As the Llama family's: within ``cpu_exact.exact()`` the linears and attention give a row its bits at any row
        count, and the rest works row by row (the sandwich norms, GELU-tanh, the scaled embedding; a sliding layer's
        window is a mask by position). tests/test_invariance.py checks the bits."""
        return True

    def make_layer_cache(self, i, max_len, dtype, device):
        c = self.config
        return KVCache(c.num_key_value_heads, c.head_dim, max_len, dtype, device)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        # transformers multiplies by sqrt(hidden) rounded to the weight dtype (bf16: 25.25 for 640)
        return x * float(torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype))

    def _local(self, ctx: StepContext, pos: torch.Tensor, local_mask, limit: int | None = None) -> Gemma3StepContext:
        cos, sin = (self.local_rotary.cos_sin(pos, self.dtype) if limit is None
                    else static_cos_sin(self.local_rotary, pos, self.dtype, limit))
        return Gemma3StepContext(ctx.start, ctx.length, ctx.cos, ctx.sin, ctx.mask, ctx.snapshots, ctx.live, cos, sin, local_mask)



# --- checkpoints -------------------------------------------------------------------------------

_GGUF_BLOCK = dict(DENSE_BLOCK)
_GGUF_BLOCK.update({
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
})


def _gguf_names(config: Gemma3Config) -> dict[str, str]:
    names = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
             "output.weight": "lm_head.weight"}
    for i in range(config.num_hidden_layers):
        names.update({f"blk.{i}.{k}": f"layers.{i}.{v}" for k, v in _GGUF_BLOCK.items()})
    return names


def _gguf_transform(config: Gemma3Config):
    def fix(name: str, t: torch.Tensor) -> torch.Tensor:
        return t - 1.0 if name.endswith("norm.weight") else t  # llama.cpp stores 1 + w
    return fix


def gguf_config(meta: dict) -> dict:
    """``gemma3.*`` GGUF metadata as a ``gemma3_text`` config dict.

    Keys llama.cpp's converter does not write fall back to the values llama.cpp itself assumes
    for ``gemma3``: every 6th layer global, local RoPE base 10000, attention scale
    ``1/sqrt(head_dim)`` (``1/sqrt(hidden/heads)`` for the 62-layer 27B model).
    """
    d = gguf_meta(meta, "gemma3")
    need, opt = meta_getters(meta, "gemma3")
    n = d["num_hidden_layers"]
    d["sliding_window"] = int(need("attention.sliding_window"))
    pattern = opt("attention.sliding_window_pattern", 6, kind="any")
    if isinstance(pattern, (list, tuple)):  # one flag per layer: true = sliding
        if not all(isinstance(p, (bool, int)) for p in pattern):
            raise ConfigError("GGUF metadata field 'gemma3.attention.sliding_window_pattern' must hold one flag per layer")
        if len(pattern) != n:
            raise ConfigError(f"GGUF metadata field 'gemma3.attention.sliding_window_pattern' has {len(pattern)} "
                              f"entries for {n} layers")
        d["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:
        if not is_number(pattern) or pattern < 0 or pattern != int(pattern):
            raise ConfigError("GGUF metadata field 'gemma3.attention.sliding_window_pattern' must be a layer count "
                              f"or one flag per layer, got {str(pattern)[:40]}")
        p = int(pattern)
        d["layer_types"] = ["sliding_attention" if p == 0 or i % p < p - 1 else "full_attention" for i in range(n)]
    d["rope_local_base_freq"] = float(opt("rope.freq_base_swa", 10000.0))
    scale = opt("attention.scale")
    if scale:
        d["query_pre_attn_scalar"] = 1.0 / float(scale) ** 2
    else:
        d["query_pre_attn_scalar"] = d["hidden_size"] / d["num_attention_heads"] if n == 62 else d["head_dim"]
    if opt("final_logit_softcapping"):
        d["final_logit_softcapping"] = float(opt("final_logit_softcapping"))
    return d


def _hf_names(config: Gemma3Config, checkpoint_names) -> dict[str, str]:
    # text-only checkpoints: model.*; multimodal ones (model_type gemma3): model.language_model.*
    # (transformers 5) or language_model.model.* (transformers 4), whose vision tower is ignored
    out = {}
    for n in checkpoint_names:
        for p in ("model.language_model.", "language_model.model.", "model."):
            if n.startswith(p):
                out[n] = n[len(p):]
                break
        else:
            out[n] = n[len("language_model."):] if n.startswith("language_model.") else n
    return out


register(Architecture(
    name="gemma3", hf_model_types=("gemma3_text", "gemma3"), gguf_archs=("gemma3",), config_cls=Gemma3Config,
    model_cls=Gemma3ForCausalLM, gguf_config=gguf_config, gguf_names=_gguf_names,
    gguf_transform=_gguf_transform, hf_names=_hf_names,
    hf_ignore_prefixes=("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector."),
    # DFlash: the drafter embeds with the raw table times its own input_embedding_scale (not this
    # family's sqrt(hidden)) and soft-caps with its own final_logit_softcapping (see drafters/dflash.py)
    drafters=("ngram", "dflash"),
))
