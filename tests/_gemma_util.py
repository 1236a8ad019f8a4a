"""Helpers for the Gemma 3 tests: tiny random HF ``gemma3_text`` models and GGUF files written
from them the way llama.cpp's converter writes Gemma 3 (its tensor names, ``1 + w`` norms, a
SentencePiece vocabulary), independently of specdec's loader; and :func:`randomise_gemma4` for Gemma 4's.
"""

from __future__ import annotations

import numpy as np
import torch

import gguf

VOCAB = 320
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]  # ids 0..3, as in Gemma
PIECES = ["▁", "▁the", "▁a", "th", "he", "in", "er", "an", "on", "▁t", "▁s", "re", "at", "en", "es", "or"]

_BLOCK = {  # HF decoder-layer suffix -> llama.cpp gemma3 block suffix
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def randomise_gemma4(model):
    """A Gemma 4 model (transformers' or specdec's) with its norm weights, router scales and per-expert scales near 1
    and its layer scalars in [0.5, 1.5) (as checkpoints have them; a random init leaves them 1 or empty), so that a
    mis-mapped one shows; in place, in eval mode."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "router.scale", "per_expert_scale")):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand_like(b))
    return model.eval()


def tiny_config(kind: str = "base", layers: int = 4):
    """A ``Gemma3TextConfig``: ``base`` (window 8, mixed layers, query_pre_attn_scalar != head_dim),
    ``capped`` (attention and final soft-capping, linear RoPE scaling on global layers), or
    ``llama_cpp`` (what a GGUF can express: default 6-layer pattern, scalar = head_dim)."""
    from transformers import Gemma3TextConfig

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, max_position_embeddings=512,
                  sliding_window=8, bos_token_id=2, eos_token_id=1, pad_token_id=0, initializer_range=0.1,
                  attn_implementation="eager")
    local = {"rope_type": "default", "rope_theta": 10000.0}
    if kind == "base":
        return Gemma3TextConfig(**common, num_hidden_layers=layers, query_pre_attn_scalar=24,
                                layer_types=(["sliding_attention"] * 2 + ["full_attention", "sliding_attention"])[:layers],
                                rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                 "sliding_attention": dict(local)})
    if kind == "capped":
        return Gemma3TextConfig(**common, num_hidden_layers=layers, query_pre_attn_scalar=32,
                                attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                                layer_types=(["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"])[:layers],
                                rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                                                 "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0}})
    if kind == "llama_cpp":  # linear RoPE scaling on global layers, as Gemma 3 4B+ has
        return Gemma3TextConfig(**common, num_hidden_layers=6, query_pre_attn_scalar=32,
                                rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                                 "sliding_attention": dict(local)})
    raise ValueError(kind)


def tiny_model(kind: str = "base", seed: int = 0, tied: bool = True):
    """A random fp32 ``Gemma3ForCausalLM``; norm weights (stored as ``w`` in ``1 + w``) randomised. ``tied`` False: its
    own LM head (tied, a random Gemma's scaled embedding outweighs its layers and greedy output repeats a few
    tokens: too few near-ties for an exactness check)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(kind)
    cfg.tie_word_embeddings = tied
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.3 * torch.randn_like(p))
    return model.eval()


def spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """A Gemma-like SentencePiece vocabulary of VOCAB tokens: specials, <0xNN> bytes, scored pieces,
    a user-defined "\\n\\n" and a control <start_of_turn>, padded with unused tokens."""
    tokens = SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + PIECES + ["\n\n", "<start_of_turn>"]
    scores = [-1000.0] * 4 + [0.0] * 256 + [-float(i) for i in range(len(PIECES))] + [-1000.0, -1000.0]
    types = [3, 3, 3, 2] + [6] * 256 + [1] * len(PIECES) + [4, 3]
    n = VOCAB - len(tokens)
    return tokens + [f"<unused{i}>" for i in range(n)], scores + [-1000.0] * n, types + [5] * n


def write_gguf(model, path: str) -> None:
    """``model`` as llama.cpp's converter writes a Gemma 3: F32 tensors, every ``*norm.weight``
    stored as ``1 + w``, no ``output.weight`` (tied), a SentencePiece vocabulary."""
    cfg = model.config
    w = gguf.GGUFWriter(path, "gemma3")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    rope = cfg.rope_parameters["full_attention"]
    w.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    w.add_sliding_window(cfg.sliding_window)
    w.add_file_type(0)
    tokens, scores, types = spm_vocab()
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)
    w.add_chat_template("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
                        "{{ m['content'] }}\n\n{% endfor %}")
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        a = t.detach().float().numpy()
        if name.endswith("norm.weight"):
            a = a + 1.0
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        else:
            parts = name.split(".")  # model.layers.{i}.<suffix>
            gname = f"blk.{parts[2]}.{_BLOCK['.'.join(parts[3:])]}"
        w.add_tensor(gname, np.ascontiguousarray(a.astype(np.float32)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
