"""Llama-family (Llama 3, SmolLM2) and Qwen3 dense checkpoints as llama.cpp's ``llama`` /
``qwen3`` GGUF.

Names come from the ``gguf`` package's tensor map. Conventions: ``llama`` stores the q/k
projection rows (and biases) permuted per head for ggml's interleaved RoPE (specdec's loader undoes it
with ``unpermute_qk``); ``qwen3`` is not permuted. Tied embeddings write no ``output.weight``.
Llama 3 RoPE scaling becomes the ``rope_freqs`` tensor (frequency divisors per pair of dims).
"""

from __future__ import annotations

import math

import gguf
import torch

from ..config import ModelConfig
from ..errors import CheckpointError, ConfigError
from ..weights.source import TensorSource
from .plan import Plan

K = gguf.Keys
_ARCHS = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen3": gguf.MODEL_ARCH.QWEN3}


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's q/k row order: per head, the rotate-half halves become interleaved pairs."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(rope: dict, rot_dim: int, theta: float) -> torch.Tensor:
    """The divisor of each RoPE frequency under Llama 3 scaling (``rope_freqs.weight``)."""
    freqs = 1.0 / theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim)  # as llama.cpp: fp32
    factor, lo, hi = float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    old = float(rope["original_max_position_embeddings"])
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


def plan_dense(cfg: ModelConfig, source: TensorSource) -> Plan:
    """The GGUF plan of a ``llama`` or ``qwen3`` checkpoint (``source``: its HF tensors)."""
    arch_enum = _ARCHS[cfg.model_type]
    plan = Plan(gguf.MODEL_ARCH_NAMES[arch_enum])
    c = cfg
    plan.common_metadata(c)
    plan.u32(K.Rope.DIMENSION_COUNT, c.head_dim)
    if c.head_dim != c.hidden_size // c.num_attention_heads or c.model_type == "qwen3":
        plan.u32(K.Attention.KEY_LENGTH, c.head_dim)
        plan.u32(K.Attention.VALUE_LENGTH, c.head_dim)
    rope = c.rope_scaling or {}
    kind = rope.get("rope_type", "default")
    if kind == "linear":
        plan.string(K.Rope.SCALING_TYPE, "linear")
        plan.f32(K.Rope.SCALING_FACTOR, rope["factor"])
    elif kind == "llama3":
        if c.model_type != "llama":
            raise ConfigError(f"{c.model_type} config: rope_type 'llama3' is only supported for llama")
        plan.add(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", (c.head_dim // 2,),
                 lambda: llama3_rope_factors(rope, c.head_dim, c.rope_theta))
    elif kind != "default":
        raise ConfigError(f"{c.model_type} config: rope_type '{kind}' cannot be converted (default, linear, llama3)")

    tmap = gguf.get_tensor_name_map(arch_enum, c.num_hidden_layers)
    infos = source.infos()
    for name, info in infos.items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue  # llama.cpp reads the embedding as the output projection
        if name.endswith("rotary_emb.inv_freq"):
            continue  # a buffer some old checkpoints saved; recomputed from the config
        gname = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        if gname is None:
            raise CheckpointError(f"{info.file}: tensor '{name}' has no llama.cpp name for {plan.arch}")
        fix = None
        if plan.arch == "llama" and name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            fix = c.num_attention_heads
        elif plan.arch == "llama" and name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            fix = c.num_key_value_heads
        plan.add(gname, info.shape, _reader(source, name, fix))
    return plan


def _reader(source: TensorSource, name: str, permute_heads: int | None):
    def read() -> torch.Tensor:
        t = source.get(name, torch.float32)
        return permute_qk(t, permute_heads) if permute_heads else t
    return read
