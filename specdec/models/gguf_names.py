"""llama.cpp's GGUF conventions shared by the architectures: tensor names and metadata keys."""

from __future__ import annotations

import math

from ..errors import CheckpointError

# llama.cpp block tensor suffix -> HF suffix inside a decoder layer (dense attention + FFN)
DENSE_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.bias": "mlp.down_proj.bias",
}


def dense_block_names(i: int, prefix: str) -> dict[str, str]:
    return {f"blk.{i}.{k}": f"{prefix}.{v}" for k, v in DENSE_BLOCK.items()}


def meta_getters(meta: dict, arch: str):
    """``need(key, kind)`` (error naming a missing ``{arch}.key``) and ``opt(key, default, kind)``
    readers. ``kind`` is checked: ``number`` (finite int or float), ``count`` (an integer >= 1),
    ``numbers`` (a list of numbers), ``list``, ``str`` or ``any``, so a corrupt value fails here
    naming its key instead of inside the arithmetic that uses it."""

    def need(key: str, kind: str = "number"):
        full = f"{arch}.{key}"
        if full not in meta:
            raise CheckpointError(f"GGUF metadata field '{full}' is missing")
        return _checked(full, meta[full], kind)

    def opt(key: str, default=None, kind: str = "number"):
        full = f"{arch}.{key}"
        return default if meta.get(full) is None else _checked(full, meta[full], kind)

    return need, opt


def is_number(v) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


_KINDS = {
    "number": (is_number, "a finite number"),
    "count": (lambda v: is_number(v) and v >= 1 and v == int(v), "an integer >= 1"),
    "numbers": (lambda v: isinstance(v, list) and all(is_number(x) for x in v), "an array of numbers"),
    "list": (lambda v: isinstance(v, list), "an array"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "any": (lambda v: True, "anything"),
}


def _checked(key: str, value, kind: str):
    ok, what = _KINDS[kind]
    if not ok(value):
        raise CheckpointError(f"GGUF metadata field '{key}' must be {what}, got {str(repr(value))[:80]}")
    return int(value) if kind == "count" else value


def gguf_meta(meta: dict, arch: str) -> dict:
    """Translate the common ``{arch}.*`` GGUF metadata keys to an HF-style config dict."""
    need, opt = meta_getters(meta, arch)

    heads = need("attention.head_count", "count")
    hidden = int(need("embedding_length"))
    head_dim = opt("attention.key_length") or opt("rope.dimension_count") or hidden // heads
    tokens = meta.get("tokenizer.ggml.tokens", [])
    vocab = opt("vocab_size") or (len(tokens) if isinstance(tokens, list) else 0)
    d = {
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(opt("feed_forward_length", 0) or 0),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(opt("attention.head_count_kv", heads)),
        "head_dim": int(head_dim),
        "rms_norm_eps": float(opt("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(opt("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(opt("context_length", 4096)),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    kind = opt("rope.scaling.type", kind="str")
    if kind and kind != "none":
        d["rope_scaling"] = {"rope_type": kind, "factor": float(opt("rope.scaling.factor", 1.0))}
    return d
