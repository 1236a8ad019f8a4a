"""Named model shapes for ``specdec bench --shape``: published configs built with random weights.

A shape is a ``config.json`` dict; :func:`build_shape` makes the specdec target of that
architecture straight in device memory (built on the meta device, then allocated once in the
run dtype: no fp32 copy, no disk, no download) with small random weights. The step costs of a
random model equal a trained one's (same shapes, same kernels); its outputs are noise, which is
why ``bench_shape`` measures speculative decoding with an oracle drafter.
"""

from __future__ import annotations

import torch

from .config import parse_config
from .errors import ConfigError
from .models.registry import by_hf_model_type

# Qwen3-8B, from the published config.json (Qwen/Qwen3-8B).
QWEN3_8B = {
    "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": False,
}
# SmolLM2-135M, from the published config.json (HuggingFaceTB/SmolLM2-135M): Llama, tied embeddings.
SMOLLM2_135M = {
    "model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0, "max_position_embeddings": 8192, "tie_word_embeddings": True,
}
_QWEN35_ROPE = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                "mrope_section": [11, 11, 10], "mrope_interleaved": True}
# Qwen3.5-9B: the published config.json was not available here. These are transformers'
# Qwen3_5TextConfig defaults (5.x, documented against Qwen/Qwen3.5-27B), which give ~9e9
# parameters: hidden 4096, 32 layers (every 4th full attention), 16 heads / 4 KV of head_dim 256,
# DeltaNet 16 key / 32 value heads of 128, intermediate 12288, vocab 248320. RoPE theta 1e7 and
# partial rotary 0.25 as in specdec's Qwen3.5 tests. Replace with the published numbers when known.
QWEN35_9B = {
    "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "full_attention_interval": 4,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "tie_word_embeddings": False,
    "rope_parameters": _QWEN35_ROPE, "mtp_num_hidden_layers": 1,
}
# Qwen3.5-35B-A3B: transformers' Qwen3_5MoeTextConfig defaults (5.x), which its docstring names as
# Qwen/Qwen3.5-35B-A3B's: hidden 2048, 40 layers (every 4th full attention), 16 heads / 2 KV of
# head_dim 256, 256 experts top-8 of 512 plus a shared expert of 512, vocab 248320.
QWEN35_35B_A3B = {
    "model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 2048,
    "num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "full_attention_interval": 4,
    "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
    "tie_word_embeddings": False, "rope_parameters": _QWEN35_ROPE, "mtp_num_hidden_layers": 1,
}
# Gemma 4 26B-A4B (google/gemma-4-26B-A4B-it's text_config, as derived checkpoints publish it):
# every layer has a dense GELU MLP (2112) beside 128 experts (top 8, 704 wide); five sliding-window
# (1024) layers of 8 KV heads x 256 per full layer of 2 KV heads x 512 with keys reused as values;
# tied, scaled embeddings; final logits soft-capped at 30. The target of the reference DFlash drafter.
GEMMA4_26B_A4B = {
    "model_type": "gemma4_text", "vocab_size": 262144, "hidden_size": 2816, "intermediate_size": 2112,
    "num_hidden_layers": 30, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
    "global_head_dim": 512, "num_global_key_value_heads": 2, "attention_k_eq_v": True,
    "enable_moe_block": True, "num_experts": 128, "top_k_experts": 8, "moe_intermediate_size": 704,
    "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0, "sliding_window": 1024,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 5,
    "rope_parameters": {"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                           "rope_theta": 1000000.0},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
    "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
    "tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh",
}
# Gemma 4 E2B (google/gemma-4-E2B-it's text_config): 35 layers of 1536, four sliding-window (512) layers of one KV
# head x 256 per full layer of one KV head x 512 (keys and values their own); the last 20 layers reuse the keys and
# values of the last earlier layer of their type and have a GELU MLP twice as wide (12,288; the others 6,144); every
# layer adds a 256-wide per-layer input (a 262,144 x 35 x 256 table read one row a token, and a projection of the
# embeddings); tied, scaled embeddings; final logits soft-capped at 30.
GEMMA4_E2B = {
    "model_type": "gemma4_text", "vocab_size": 262144, "hidden_size": 1536, "intermediate_size": 6144,
    "num_hidden_layers": 35, "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256,
    "global_head_dim": 512, "attention_k_eq_v": False, "enable_moe_block": False,
    "hidden_size_per_layer_input": 256, "vocab_size_per_layer_input": 262144, "num_kv_shared_layers": 20,
    "use_double_wide_mlp": True, "sliding_window": 512,
    "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 7,
    "rope_parameters": GEMMA4_26B_A4B["rope_parameters"],
    "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 131072,
    "tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh",
}
# Gemma 4 E4B (google/gemma-4-E4B-it; as gemma.cpp's Gemma 4 configs and NVIDIA Megatron Bridge's E4B recipe describe
# it, not checked against the checkpoint's config.json): 42 layers of 2560, five sliding-window (512) layers of two KV
# heads x 256 per full layer of two KV heads x 512; the last 18 layers reuse earlier layers' keys and values; one MLP
# width (10,240); a 256-wide per-layer input; otherwise as E2B.
GEMMA4_E4B = {**GEMMA4_E2B, "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 42,
              "num_key_value_heads": 2, "num_kv_shared_layers": 18, "use_double_wide_mlp": False,
              "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 7}
# Gemma 3 270M (google/gemma-3-270m; the values the packaged gemma-3-270m GGUF's metadata gives, `specdec info`): 18
# layers of 640, 4 heads / 1 KV head of 256, GELU-tanh MLP of 2048, every 6th layer global, the others a 512-position
# window; a tied 262,144-token vocabulary (the head is 60 % of the bytes a step reads).
GEMMA3_270M = {
    "model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 640, "intermediate_size": 2048,
    "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
    "query_pre_attn_scalar": 256, "sliding_window": 512, "sliding_window_pattern": 6, "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
}
# A few-MB Qwen3-style shape for tests (not a published model).
TINY = {
    "model_type": "qwen3", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 4096, "tie_word_embeddings": False,
}

SHAPES = {"qwen3-8b": QWEN3_8B, "qwen3.5-9b": QWEN35_9B, "qwen3.5-35b-a3b": QWEN35_35B_A3B,
          "gemma4-26b-a4b": GEMMA4_26B_A4B, "gemma4-e2b": GEMMA4_E2B, "gemma4-e4b": GEMMA4_E4B, "gemma3-270m": GEMMA3_270M,
          "smollm2-135m": SMOLLM2_135M, "tiny": TINY}


def shape_config(name: str):
    """``(architecture, parsed config)`` of shape ``name``; an unknown name is a ConfigError."""
    if name not in SHAPES:
        raise ConfigError(f"unknown shape '{name}' (known: {', '.join(SHAPES)})")
    d = dict(SHAPES[name])
    arch = by_hf_model_type(d["model_type"], f"shape {name}")
    return arch, parse_config(arch.config_cls, d, source=f"shape {name}")


def meta_model(name: str, shard=None):
    """The target of shape ``name`` on the meta device (no memory): for sizes and parameter counts.
    ``shard``: one tensor-parallel rank's part."""
    arch, cfg = shape_config(name)
    with torch.device("meta"):
        return arch.model_cls(cfg, shard) if shard is not None else arch.model_cls(cfg)


def param_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def free_bytes(device: torch.device) -> int:
    """Memory free for new tensors on ``device``: the GPU's free memory, or the host's available RAM."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def build_shape(name: str, device: torch.device, dtype: torch.dtype, *, seed: int = 0, headroom: float = 0.9,
                free: int | None = None, shard=None):
    """The target of shape ``name`` on ``device`` in ``dtype``, weights ~N(0, 0.02), norms (and
    checkpoint scalar buffers) the identity.

    Refuses (ConfigError, one line) before allocating when the weights exceed ``headroom`` of the
    free memory (``free``: measured when None), so a shape that cannot fit fails at once.
    """
    model = meta_model(name, shard).to(dtype)
    need = param_count(model) * torch.empty((), dtype=dtype).element_size()
    free = free_bytes(device) if free is None else free
    if need > headroom * free:
        raise ConfigError(f"shape {name}: {need / 1e9:.1f} GB of {str(dtype).replace('torch.', '')} weights do not fit "
                          f"in {free / 1e9:.1f} GB free on {device} (use a smaller shape or another device)")
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight") or pname.endswith("norm.bias"):
                # 1 + w norms (Qwen3.5) are the identity at 0; plain norms at 1
                zc = getattr(model.get_submodule(pname.rsplit(".", 1)[0]), "zero_centered", False)
                p.fill_(0.0 if zc or pname.endswith("bias") else 1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
        for b in model.buffers():  # checkpoint scalars (Gemma 4's layer_scalar): the identity
            if b.is_floating_point():
                b.fill_(1.0)
    model.fuse_projections()  # as load_model does
    return model.eval()
