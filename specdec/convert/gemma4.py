"""Gemma 4 checkpoints (``gemma4_text``, or the language model of a ``gemma4`` checkpoint), dense
and MoE, as llama.cpp's ``gemma4`` GGUF.

The inverse of :mod:`specdec.models.gemma4_gguf` (whose docstring lists llama.cpp's conventions
and the sources they were read from). What the converter does beyond renaming:

- norms are written as they are (Gemma 4 scales by ``w``: no ``+1``);
- ``rope_freqs.weight``: the full layers' frequency divisors, the proportional factor for the
  rotated pairs (1 in every released checkpoint, as llama.cpp writes) and 1e30 for the others;
- ``router.scale`` -> ``ffn_gate_inp.scale``, ``router.per_expert_scale`` ->
  ``ffn_down_exps.scale``; stacked experts stay stacked (``ffn_gate_up_exps``, ``ffn_down_exps``);
- per-layer arrays where layers differ: ``head_count_kv`` (full layers' own KV heads) and
  ``feed_forward_length`` (double-wide MLPs of the KV-shared layers);
- the vision and audio towers of a ``gemma4`` checkpoint are left out; a tied ``lm_head`` too.

Refused, as llama.cpp's ``gemma4`` cannot express them: attention biases, a sliding-layer RoPE
other than the default, and per-layer embeddings over a vocabulary of another size.
"""

from __future__ import annotations

import re

import gguf
import torch

from ..errors import CheckpointError, ConfigError
from ..weights.source import TensorSource
from .plan import Plan

K = gguf.Keys
S, F = "sliding_attention", "full_attention"
_SKIP = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")
_RENAME = {  # HF suffix -> llama.cpp suffix, where gguf-py's map has no entry
    "router.scale": "ffn_gate_inp.scale",
    "router.per_expert_scale": "ffn_down_exps.scale",
    "layer_scalar": "layer_output_scale.weight",
    "experts.gate_up_proj": "ffn_gate_up_exps.weight",
    "experts.down_proj": "ffn_down_exps.weight",
}


def _metadata(plan: Plan, c) -> None:
    mt, n, types = c.model_type, c.num_hidden_layers, c.layer_types
    if c.attention_bias:
        raise ConfigError(f"{mt} config: attention_bias=true cannot be converted (llama.cpp's gemma4 has no "
                          "attention biases)")
    if c.hidden_size_per_layer_input and c.vocab_size_per_layer_input != c.vocab_size:
        raise ConfigError(f"{mt} config: vocab_size_per_layer_input={c.vocab_size_per_layer_input} differs from "
                          f"vocab_size={c.vocab_size}; llama.cpp's gemma4 reads one per-layer row per token")
    if S in c.rope and c.rope[S][1:] != (1.0, 1.0):
        raise ConfigError(f"{mt} config: the sliding_attention RoPE must be rope_type 'default' to be converted "
                          "(llama.cpp's gemma4 scales only the full layers' RoPE, by rope_freqs)")
    dims = c.attention_dims
    full_dim, full_kv = dims[F]
    swa_dim, swa_kv = dims.get(S, dims[F])
    plan.u32(K.LLM.BLOCK_COUNT, n)
    plan.u32(K.LLM.CONTEXT_LENGTH, c.max_position_embeddings)
    plan.u32(K.LLM.EMBEDDING_LENGTH, c.hidden_size)
    plan.u32(K.LLM.VOCAB_SIZE, c.vocab_size)
    ff = [c.intermediate_size * (2 if c.use_double_wide_mlp and src is not None else 1) for src in c.kv_source]
    if len(set(ff)) == 1:
        plan.u32(K.LLM.FEED_FORWARD_LENGTH, ff[0])
    else:
        plan.array(K.LLM.FEED_FORWARD_LENGTH, ff)
    plan.u32(K.Attention.HEAD_COUNT, c.num_attention_heads)
    kv = [dims[t][1] for t in types]
    if len(set(kv)) == 1:
        plan.u32(K.Attention.HEAD_COUNT_KV, kv[0])
    else:
        plan.array(K.Attention.HEAD_COUNT_KV, kv)
    plan.f32(K.Attention.LAYERNORM_RMS_EPS, c.rms_norm_eps)
    plan.u32(K.Attention.KEY_LENGTH, full_dim)
    plan.u32(K.Attention.VALUE_LENGTH, full_dim)
    plan.u32(K.Attention.KEY_LENGTH_SWA, swa_dim)
    plan.u32(K.Attention.VALUE_LENGTH_SWA, swa_dim)
    plan.u32(K.Rope.DIMENSION_COUNT, full_dim)  # proportional RoPE: see rope_freqs
    plan.u32(K.Rope.DIMENSION_COUNT_SWA, swa_dim)
    plan.f32(K.Rope.FREQ_BASE, c.rope[F][0])
    plan.f32(K.Rope.FREQ_BASE_SWA, c.rope.get(S, c.rope[F])[0])
    plan.u32(K.Attention.SLIDING_WINDOW, c.sliding_window)
    plan.array(K.Attention.SLIDING_WINDOW_PATTERN, [t == S for t in types])
    plan.u32(K.Attention.SHARED_KV_LAYERS, c.num_kv_shared_layers)
    plan.u32(K.LLM.EMBD_LENGTH_PER_LAYER_INP, c.hidden_size_per_layer_input or 0)
    if c.final_logit_softcapping:
        plan.f32(K.LLM.FINAL_LOGIT_SOFTCAPPING, c.final_logit_softcapping)
    if c.enable_moe_block:
        plan.u32(K.LLM.EXPERT_COUNT, c.num_experts)
        plan.u32(K.LLM.EXPERT_USED_COUNT, c.top_k_experts)
        plan.u32(K.LLM.EXPERT_FEED_FORWARD_LENGTH, c.moe_intermediate_size)


def rope_freqs(c) -> torch.Tensor:
    """The full layers' RoPE frequency divisors, one per rotate-half pair."""
    full_dim = c.attention_dims[F][0]
    _, frac, factor = c.rope[F]
    rotated = int(frac * full_dim // 2)  # as the model counts them
    return torch.tensor([factor] * rotated + [1e30] * (full_dim // 2 - rotated), dtype=torch.float32)


def plan_gemma4(cfg, source: TensorSource) -> Plan:
    """The GGUF plan of a Gemma 4 checkpoint (``source``: its HF tensors)."""
    c = cfg
    arch_enum = gguf.MODEL_ARCH.GEMMA4
    plan = Plan(gguf.MODEL_ARCH_NAMES[arch_enum])
    _metadata(plan, c)
    tmap = gguf.get_tensor_name_map(arch_enum, c.num_hidden_layers)
    freqs = rope_freqs(c)
    plan.add("rope_freqs.weight", tuple(freqs.shape), lambda: freqs)
    for name, info in source.infos().items():
        if name.startswith(_SKIP):
            continue
        hf = re.sub(r"^model\.language_model\.", "model.", name)
        if hf == "lm_head.weight" and c.tie_word_embeddings:
            continue  # llama.cpp reads the embedding as the output projection
        m = re.match(r"model\.layers\.(\d+)\.(.+)$", hf)
        if m and m.group(2) in _RENAME:
            gname = f"blk.{m.group(1)}.{_RENAME[m.group(2)]}"
        else:
            gname = tmap.get_name(hf, try_suffixes=(".weight", ".bias"))
        if gname is None:
            raise CheckpointError(f"{info.file}: tensor '{name}' has no llama.cpp name for {plan.arch}")
        plan.add(gname, info.shape, _reader(source, name))
    return plan


def _reader(source: TensorSource, name: str):
    return lambda: source.get(name, torch.float32)
