"""Gemma 4 in llama.cpp's GGUF layout (``general.architecture = gemma4``): metadata -> config,
tensor names -> parameters. :mod:`specdec.convert.gemma4` writes the same layout.

Read from llama.cpp (ggml-org/llama.cpp): ``src/models/gemma4.cpp`` (``load_arch_hparams``,
``load_arch_tensors``), ``src/models/gemma4-iswa.cpp`` (the graph), and the ``Gemma4Model`` class
of its HF converter (``convert_hf_to_gguf.py``, a subclass of ``Gemma3Model``); names as
``gguf-py`` (``MODEL_TENSORS[MODEL_ARCH.GEMMA4]``) spells them. The conventions:

- norms are stored as ``w`` (Gemma 4 scales by ``w``; the converter's ``norm_shift`` is 0);
- ``{arch}.attention.key_length`` / ``rope.dimension_count`` are the full layers' head size,
  ``*_swa`` the sliding layers'; ``attention.head_count_kv`` and ``feed_forward_length`` may be
  per-layer arrays (full layers' own KV-head count; double-wide MLPs of KV-shared layers);
- ``attention.sliding_window_pattern``: one flag per layer, true = sliding;
  ``attention.shared_kv_layers``: the last layers that reuse earlier layers' keys and values;
  ``rope.freq_base`` / ``rope.freq_base_swa``: the full / sliding layers' RoPE bases;
- the full layers' proportional RoPE is the tensor ``rope_freqs.weight`` (``head_dim/2``
  frequency divisors): the converter writes 1 for the rotated pairs and 1e30 for the rest;
- ``attention_k_eq_v``: full layers have no ``attn_v`` (llama.cpp uses the keys as values);
- the router is ``ffn_gate_inp.{weight,scale}`` (``router.proj``, ``router.scale``), the
  per-expert scale ``ffn_down_exps.scale``; experts are the fused ``ffn_gate_up_exps``
  (``[E, 2I, H]``, gate rows first) and ``ffn_down_exps``; ``layer_scalar`` is
  ``layer_output_scale.weight``.

Inferred rather than read: a file without ``rope.freq_base_swa`` uses ``rope.freq_base`` for the
sliding layers too (llama.cpp's generic default).
"""

from __future__ import annotations

import torch

from ..errors import CheckpointError, ConfigError
from .gguf_names import gguf_meta, meta_getters

ARCH = "gemma4"
S, F = "sliding_attention", "full_attention"
UNROTATED = 1e20  # rope_freqs divisors at least this large mean "this pair does not rotate" (llama.cpp writes 1e30)

_GLOBAL = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
    "per_layer_token_embd.weight": "embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "per_layer_projection_norm.weight",
}
# llama.cpp block suffix -> HF suffix inside a decoder layer
BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "layer_output_scale.weight": "layer_scalar",
    "inp_gate.weight": "per_layer_input_gate.weight",
    "proj.weight": "per_layer_projection.weight",
    "post_norm.weight": "post_per_layer_input_norm.weight",
    "ffn_gate_inp.weight": "router.proj.weight",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "ffn_gate_up_exps.weight": "experts.gate_up_proj",
    "ffn_down_exps.weight": "experts.down_proj",
    "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
}


def gguf_names(config) -> dict[str, str]:
    names = dict(_GLOBAL)
    for i in range(config.num_hidden_layers):
        names.update({f"blk.{i}.{k}": f"layers.{i}.{v}" for k, v in BLOCK.items()})
    return names


def _per_layer(meta: dict, key: str, n: int):
    """A per-layer array ``{arch}.key`` (or None when the key holds a scalar or is absent)."""
    v = meta.get(f"{ARCH}.{key}")
    if not isinstance(v, list):
        return None
    if len(v) != n or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in v):
        raise CheckpointError(f"GGUF metadata field '{ARCH}.{key}' must hold one positive integer per layer "
                              f"({n}), got {str(v)[:60]}")
    return v


def _by_type(values: list[int], types: list[str], key: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for i, (t, v) in enumerate(zip(types, values)):
        if out.setdefault(t, v) != v:
            raise ConfigError(f"GGUF metadata field '{ARCH}.{key}' gives layer {i} ({t}) {v}, other {t} layers "
                              f"{out[t]} (they must agree within a layer type)")
    return out


def gguf_config(meta: dict) -> dict:
    """``gemma4.*`` GGUF metadata as a ``gemma4_text`` config dict (the full layers' RoPE
    fraction and k=v come from the tensors: :func:`gguf_tensor_config`)."""
    need, opt = meta_getters(meta, ARCH)
    n = int(need("block_count", "count"))
    arrays = {k: _per_layer(meta, k, n) for k in ("feed_forward_length", "attention.head_count_kv")}
    dropped = {f"{ARCH}.{k}" for k, v in arrays.items() if v is not None}  # read per layer type below
    scalar_meta = {k: v for k, v in meta.items() if k not in dropped}
    d = gguf_meta(scalar_meta, ARCH)
    d["model_type"] = "gemma4_text"

    pattern = need("attention.sliding_window_pattern", "any")
    if isinstance(pattern, bool):  # llama.cpp's get_key_or_arr: one value for every layer
        pattern = [pattern] * n
    if not isinstance(pattern, list) or len(pattern) != n or not all(isinstance(p, (bool, int)) for p in pattern):
        raise CheckpointError(f"GGUF metadata field '{ARCH}.attention.sliding_window_pattern' must hold one flag "
                              f"per layer ({n}), got {str(pattern)[:60]}")
    types = d["layer_types"] = [S if p else F for p in pattern]
    d["sliding_window"] = int(need("attention.sliding_window", "count"))

    full_dim = int(need("attention.key_length", "count"))
    swa_dim = int(need("attention.key_length_swa", "count"))
    for key, want in (("attention.value_length", full_dim), ("attention.value_length_swa", swa_dim),
                      ("rope.dimension_count", full_dim), ("rope.dimension_count_swa", swa_dim)):
        got = opt(key, want, kind="count")
        if got != want:
            raise ConfigError(f"GGUF metadata field '{ARCH}.{key}'={got} differs from the head size {want} "
                              "(Gemma 4 rotates whole heads; a partial rotation is not supported)")
    kv = arrays["attention.head_count_kv"]
    kv_by = _by_type(kv, types, "attention.head_count_kv") if kv else {t: d["num_key_value_heads"] for t in types}
    d["head_dim"], d["global_head_dim"] = swa_dim, full_dim
    if S in kv_by:
        d["num_key_value_heads"] = kv_by[S]
    # the full layers' sizes as transformers 5 writes them (per_layer_config), so k=v needs no
    # num_global_key_value_heads
    d["per_layer_config"] = {str(i): {"head_dim": full_dim, "num_key_value_heads": kv_by[F]}
                             for i, t in enumerate(types) if t == F}

    shared = int(opt("attention.shared_kv_layers", 0))
    d["num_kv_shared_layers"] = shared
    ff = arrays["feed_forward_length"]
    if ff:
        base, first_shared = ff[0], n - shared
        d["intermediate_size"] = base
        d["use_double_wide_mlp"] = shared > 0 and ff[first_shared] == 2 * base
        want = [base * (2 if d["use_double_wide_mlp"] and i >= first_shared else 1) for i in range(n)]
        if ff != want:
            raise ConfigError(f"GGUF metadata field '{ARCH}.feed_forward_length' {ff[:8]} is neither one width "
                              "nor double width on the KV-shared layers only")
    elif not d["intermediate_size"]:
        raise CheckpointError(f"GGUF metadata field '{ARCH}.feed_forward_length' is missing")

    per_layer = int(need("embedding_length_per_layer_input"))
    d["hidden_size_per_layer_input"] = per_layer
    d["vocab_size_per_layer_input"] = d["vocab_size"]
    theta = d.pop("rope_theta")
    d["rope_parameters"] = {F: {"rope_type": "default", "rope_theta": theta},
                            S: {"rope_type": "default", "rope_theta": float(opt("rope.freq_base_swa", theta))}}
    if d.pop("rope_scaling", None):
        raise ConfigError(f"GGUF metadata field '{ARCH}.rope.scaling.type' is set; Gemma 4 has no RoPE scaling")
    cap = opt("final_logit_softcapping")
    d["final_logit_softcapping"] = float(cap) if cap else None
    experts = int(opt("expert_count", 0))
    if experts:
        d.update(enable_moe_block=True, num_experts=experts, top_k_experts=int(need("expert_used_count", "count")),
                 moe_intermediate_size=int(need("expert_feed_forward_length", "count")))
    return d


def gguf_tensor_config(d: dict, source) -> None:
    """Fill what llama.cpp says by tensors rather than metadata: ``attention_k_eq_v`` (full layers
    without ``attn_v``) and the full layers' proportional RoPE (``rope_freqs.weight``)."""
    infos = source.infos()
    full = [i for i, t in enumerate(d["layer_types"]) if t == F]
    own_kv = [i for i in full if i < d["num_hidden_layers"] - d["num_kv_shared_layers"]]
    d["attention_k_eq_v"] = bool(own_kv) and all(f"blk.{i}.attn_v.weight" not in infos for i in own_kv)
    if "rope_freqs.weight" not in infos:
        raise CheckpointError(f"{source.path}: tensor 'rope_freqs.weight' is missing (the RoPE frequency divisors "
                              "of Gemma 4's full-attention layers)")
    half = d["global_head_dim"] // 2
    if tuple(infos["rope_freqs.weight"].shape) != (half,):
        raise CheckpointError(f"{source.path}: tensor 'rope_freqs.weight' has shape "
                              f"{list(infos['rope_freqs.weight'].shape)}, expected [{half}]")
    ff = source.get("rope_freqs.weight", torch.float32)
    rotated = int((ff < UNROTATED).sum())
    factors = ff[:rotated]
    if rotated == 0 or bool((ff[rotated:] < UNROTATED).any()) or not bool((factors == factors[0]).all()):
        raise ConfigError(f"{source.path}: tensor 'rope_freqs.weight' is not a proportional RoPE (one divisor for a "
                          "leading run of pairs, >= 1e20 for the rest), the only kind Gemma 4 uses")
    frac, factor = rotated / half, float(factors[0])
    if int(frac * d["global_head_dim"] // 2) != rotated:  # as Gemma4Rotary counts the rotated pairs
        raise ConfigError(f"{source.path}: tensor 'rope_freqs.weight': {rotated} rotated pairs of {half} is not "
                          "expressible as a partial_rotary_factor")
    theta = d["rope_parameters"][F]["rope_theta"]
    if rotated < half or factor != 1.0:
        d["rope_parameters"][F] = {"rope_type": "proportional", "partial_rotary_factor": frac, "factor": factor,
                                   "rope_theta": theta}
