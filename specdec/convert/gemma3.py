"""Gemma 3 checkpoints (``gemma3_text``, or the language model of a ``gemma3`` vision-language
checkpoint) as llama.cpp's ``gemma3`` GGUF.

The inverse of :mod:`specdec.models.gemma3`'s GGUF view. Conventions:

- every ``*norm.weight`` (the sandwich norms, the q/k norms and the final norm) is stored as
  ``1 + w``, as llama.cpp's converter bakes Gemma's zero-centred gain in;
- embeddings are tied: no ``output.weight`` unless the checkpoint has an untied ``lm_head``;
- the vision tower and the projector of a ``gemma3`` checkpoint are left out;
- metadata: llama.cpp's ``gemma3`` keys (sliding window, global RoPE base and linear scaling,
  key/value length, ``final_logit_softcapping`` when set). llama.cpp assumes the rest: every 6th
  layer global, local RoPE base 10000, attention scale ``1/sqrt(head_dim)`` (``hidden/heads``
  for the 62-layer 27B). A checkpoint that differs writes the keys specdec's loader reads for
  them (``attention.sliding_window_pattern`` as one flag per layer, ``rope.freq_base_swa``,
  ``attention.scale``); standard Gemma 3 checkpoints write none of them.
"""

from __future__ import annotations

import re

import gguf
import torch

from ..errors import CheckpointError, ConfigError
from ..weights.source import TensorSource
from .plan import Plan

K = gguf.Keys
_SKIP = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.")
_LLAMA_CPP_LOCAL_BASE = 10000.0


def _hf_name(name: str) -> str:
    """A text-only HF name (``model.*`` / ``lm_head.weight``) for any Gemma 3 checkpoint layout."""
    name = re.sub(r"^model\.language_model\.", "model.", name)  # transformers 5 gemma3
    name = re.sub(r"^language_model\.model\.", "model.", name)  # transformers 4 gemma3
    return re.sub(r"^language_model\.lm_head\.", "lm_head.", name)


def default_layer_types(n: int) -> list[str]:
    """llama.cpp's fixed Gemma 3 pattern: every 6th layer global."""
    return ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)]


def default_attn_scalar(c) -> float:
    """The ``query_pre_attn_scalar`` llama.cpp assumes for a ``gemma3`` file."""
    return c.hidden_size / c.num_attention_heads if c.num_hidden_layers == 62 else c.head_dim


def _metadata(plan: Plan, c) -> None:
    plan.common_metadata(c)
    plan.u32(K.Attention.KEY_LENGTH, c.head_dim)
    plan.u32(K.Attention.VALUE_LENGTH, c.head_dim)
    rope = c.rope_scaling or {}
    kind = rope.get("rope_type", "default")
    if kind == "linear":
        plan.string(K.Rope.SCALING_TYPE, "linear")
        plan.f32(K.Rope.SCALING_FACTOR, rope["factor"])
    elif kind != "default":
        raise ConfigError(f"{c.model_type} config: full_attention rope_type '{kind}' cannot be converted "
                          "(default, linear)")
    if c.local_rope_scaling:
        raise ConfigError(f"{c.model_type} config: sliding_attention rope_type "
                          f"'{c.local_rope_scaling.get('rope_type')}' cannot be converted (llama.cpp's gemma3 "
                          "has no scaling for the sliding layers)")
    if "sliding_attention" in c.layer_types:
        plan.u32(K.Attention.SLIDING_WINDOW, c.sliding_window)
    else:  # the loader needs the key; a window as long as the context never masks
        plan.u32(K.Attention.SLIDING_WINDOW, c.sliding_window or c.max_position_embeddings)
    if c.final_logit_softcapping:
        plan.f32(K.LLM.FINAL_LOGIT_SOFTCAPPING, c.final_logit_softcapping)
    # what llama.cpp assumes, written only where this checkpoint differs (specdec reads these keys)
    if list(c.layer_types) != default_layer_types(c.num_hidden_layers):
        plan.array(K.Attention.SLIDING_WINDOW_PATTERN, [t == "sliding_attention" for t in c.layer_types])
    if float(c.rope_local_base_freq) != _LLAMA_CPP_LOCAL_BASE:
        plan.f32(K.Rope.FREQ_BASE_SWA, c.rope_local_base_freq)
    if float(c.query_pre_attn_scalar) != float(default_attn_scalar(c)):
        plan.f32(K.Attention.SCALE, float(c.query_pre_attn_scalar) ** -0.5)


def plan_gemma3(cfg, source: TensorSource) -> Plan:
    """The GGUF plan of a Gemma 3 checkpoint (``source``: its HF tensors)."""
    c = cfg
    arch_enum = gguf.MODEL_ARCH.GEMMA3
    plan = Plan(gguf.MODEL_ARCH_NAMES[arch_enum])
    _metadata(plan, c)
    tmap = gguf.get_tensor_name_map(arch_enum, c.num_hidden_layers)
    for name, info in source.infos().items():
        if name.startswith(_SKIP):
            continue
        hf = _hf_name(name)
        if hf == "lm_head.weight" and c.tie_word_embeddings:
            continue  # llama.cpp reads the embedding as the output projection
        if hf.endswith("rotary_emb.inv_freq"):
            continue
        gname = tmap.get_name(hf, try_suffixes=(".weight", ".bias"))
        if gname is None:
            raise CheckpointError(f"{info.file}: tensor '{name}' has no llama.cpp name for {plan.arch}")
        plan.add(gname, info.shape, _reader(source, name, shift=hf.endswith("norm.weight")))
    return plan


def _reader(source: TensorSource, name: str, shift: bool):
    def read() -> torch.Tensor:
        t = source.get(name, torch.float32)
        return t + 1.0 if shift else t  # llama.cpp stores Gemma's norm gains as 1 + w
    return read
