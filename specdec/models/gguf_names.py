"""llama.cpp's GGUF conventions shared by the architectures: tensor names and metadata keys."""

from __future__ import annotations

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
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def dense_block_names(i: int, prefix: str) -> dict[str, str]:
    return {f"blk.{i}.{k}": f"{prefix}.{v}" for k, v in DENSE_BLOCK.items()}


def meta_getters(meta: dict, arch: str):
    """``need(key)`` (error naming a missing ``{arch}.key``) and ``opt(key, default)`` readers."""

    def need(key: str):
        full = f"{arch}.{key}"
        if full not in meta:
            raise CheckpointError(f"GGUF metadata field '{full}' is missing")
        return meta[full]

    def opt(key: str, default=None):
        return meta.get(f"{arch}.{key}", default)

    return need, opt


def gguf_meta(meta: dict, arch: str) -> dict:
    """Translate the common ``{arch}.*`` GGUF metadata keys to an HF-style config dict."""
    need, opt = meta_getters(meta, arch)

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    head_dim = opt("attention.key_length") or opt("rope.dimension_count") or hidden // heads
    vocab = opt("vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
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
    kind = opt("rope.scaling.type")
    if kind and kind != "none":
        d["rope_scaling"] = {"rope_type": kind, "factor": float(opt("rope.scaling.factor", 1.0))}
    return d
