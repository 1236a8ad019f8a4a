"""Tiny random Qwen3.5 checkpoints for the tests: HF (via transformers) and GGUF (llama.cpp's layout).

The GGUF writer follows llama.cpp's ``convert_hf_to_gguf.py`` (``Qwen3_5TextModel`` /
``Qwen3_5MoeTextModel``): names from the ``gguf`` package's tensor map, norms stored as
``1 + w`` (except ``linear_attn.norm``), ``A_log`` stored as ``-exp(A_log)``, ``dt_bias`` as
``ssm_dt.bias``, conv kernels squeezed to ``[C, K]``, value heads reordered from grouped to tiled
order, experts stacked, MTP tensors moved to ``blk.{n_layer}``. It is written independently of
specdec's loader so the two check each other.
"""

from __future__ import annotations

import json
import os
import re

import gguf
import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

VOCAB = 256

TEXT = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
    linear_num_value_heads=4, max_position_embeddings=512, rms_norm_eps=1e-6,
    # full attention at layer 2 only: also what full_attention_interval=3 gives for 4 layers
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True},
)
DENSE = dict(TEXT, intermediate_size=128)
MOE = dict(TEXT, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2)


# Tensor parallelism (2 ranks): two key heads per rank, each serving two value heads, so a rank's
# value heads are not one run of llama.cpp's tiled order, and its grouped order differs from the tiled one.
TP_HEADS = dict(linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8, linear_value_head_dim=8)
TP_DENSE = dict(DENSE, **TP_HEADS)
TP_MOE = dict(MOE, **TP_HEADS)  # 8 experts: 4 a rank (expert parallel), the shared expert split


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """transformers initialises zero-centred norms to 0 and dt_bias to 1: make them random so a
    wrong convention cannot pass unnoticed."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "dt_bias" in name or "A_log" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)


def hf_model(kind: str, seed: int = 0, **over):
    """A tiny random transformers ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM`` (fp32, eval); ``over``: config
    fields changed."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    torch.manual_seed(seed)
    if kind == "dense":
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**DENSE, **over))
    else:
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**MOE | over))
    _perturb(model, seed)
    return model.eval()


def hf_vl_model(seed: int = 0):
    """A tiny vision-language ``Qwen3_5ForConditionalGeneration`` (text config nested, tensors under
    ``model.language_model.*`` and ``model.visual.*``)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    cfg = Qwen3_5Config(
        text_config=DENSE,
        vision_config=dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=64,
                           patch_size=2, temporal_patch_size=1, num_position_embeddings=16),
        image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253)
    model = Qwen3_5ForConditionalGeneration(cfg)
    _perturb(model, seed)
    return model.eval()


def read_tensors(path: str) -> dict[str, torch.Tensor]:
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def write_tensors(path: str, tensors: dict[str, torch.Tensor]) -> None:
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))


def add_mtp_tensors(path: str, layer_prefix: str, seed: int = 1) -> dict[str, torch.Tensor]:
    """Add an MTP block like real Qwen3.5 checkpoints carry (``mtp.fc``, ``mtp.pre_fc_norm_*``,
    ``mtp.norm``, ``mtp.layers.0.*`` shaped like the full-attention layer ``layer_prefix``)."""
    t = read_tensors(path)
    g = torch.Generator().manual_seed(seed)
    h = DENSE["hidden_size"]
    mtp = {"mtp.fc.weight": torch.randn(h, 2 * h, generator=g) * 0.05}
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{n}.weight"] = torch.randn(h, generator=g) * 0.1
    for name, v in t.items():
        if name.startswith(layer_prefix):
            mtp["mtp.layers.0." + name[len(layer_prefix):]] = v + torch.randn(v.shape, generator=g) * 0.01
    t.update(mtp)
    write_tensors(path, t)
    return mtp


def fuse_experts(path: str) -> None:
    """Rewrite per-expert MoE tensors in transformers' in-memory fused layout
    (``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``)."""
    t = read_tensors(path)
    out, fam = {}, {}
    for name, v in t.items():
        m = re.match(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", name)
        if m:
            fam.setdefault(m[1], {})[(int(m[2]), m[3])] = v
        else:
            out[name] = v
    for prefix, d in fam.items():
        n = max(e for e, _ in d) + 1
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([d[(e, "gate_proj")], d[(e, "up_proj")]]) for e in range(n)])
        out[f"{prefix}.down_proj"] = torch.stack([d[(e, "down_proj")] for e in range(n)])
    write_tensors(path, out)


# --- GGUF, the llama.cpp way ---------------------------------------------------------------

def _reorder_v_heads(t: torch.Tensor, dim: int, n_k: int, per_k: int, head: int) -> torch.Tensor:
    """convert_hf_to_gguf's grouped -> tiled value-head order."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], n_k, per_k, head, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).contiguous().reshape(shape)


def _convert_tensor(name: str, t: torch.Tensor, c: dict) -> tuple[str, torch.Tensor]:
    n_k, n_v = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    if n_k != n_v and "linear_attn." in name:
        per_k = n_v // n_k
        if ".in_proj_qkv." in name:
            t = torch.cat([t[:2 * n_k * dk], _reorder_v_heads(t[2 * n_k * dk:], 0, n_k, per_k, dv)])
        elif ".in_proj_z." in name:
            t = _reorder_v_heads(t, 0, n_k, per_k, dv)
        elif ".in_proj_b." in name or ".in_proj_a." in name:
            t = _reorder_v_heads(t, 0, n_k, per_k, 1)
        elif ".A_log" in name or ".dt_bias" in name:
            t = _reorder_v_heads(t[:, None], 0, n_k, per_k, 1)[:, 0]
        elif ".conv1d" in name:
            t = t.squeeze()
            t = torch.cat([t[:2 * n_k * dk], _reorder_v_heads(t[2 * n_k * dk:], 0, n_k, per_k, dv)])
        elif ".out_proj." in name:
            t = _reorder_v_heads(t, 1, n_k, per_k, dv)
    if name.endswith(".A_log"):
        t = -torch.exp(t)
    elif name.endswith(".dt_bias"):
        name = name[: -len(".dt_bias")] + ".dt_proj.bias"
    elif "conv1d" in name:
        t = t.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        t = t + 1
    return name, t


def write_gguf(hf_dir: str, out: str, *, recurrent_layers: bool = False, fuse_gate_up: bool = False,
               fuse_qkv: bool = False, shexp_gate_1d: bool = False, drop: str | None = None) -> None:
    """Write the HF checkpoint in ``hf_dir`` (``mtp.*`` included) as llama.cpp's converter would
    (``drop``: leave out the tensor of that llama.cpp name)."""
    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    c = cfg.get("text_config", cfg)
    moe = "num_experts" in c
    arch_enum = gguf.MODEL_ARCH.QWEN35MOE if moe else gguf.MODEL_ARCH.QWEN35
    arch = gguf.MODEL_ARCH_NAMES[arch_enum]
    n = c["num_hidden_layers"]
    tensors = read_tensors(hf_dir)
    n_mtp = 1 if any(k.startswith("mtp.") for k in tensors) else 0
    tmap = gguf.get_tensor_name_map(arch_enum, n + n_mtp)
    nextn_names = {"eh_proj": gguf.MODEL_TENSOR.NEXTN_EH_PROJ, "enorm": gguf.MODEL_TENSOR.NEXTN_ENORM,
                   "hnorm": gguf.MODEL_TENSOR.NEXTN_HNORM, "shared_head.norm": gguf.MODEL_TENSOR.NEXTN_SHARED_HEAD_NORM}

    out_t: dict[str, np.ndarray] = {}
    experts: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        if name.startswith("model.visual."):
            continue
        name = name.replace("model.language_model.", "model.", 1)
        if name.startswith("mtp."):
            parts = name.split(".", 3)
            if parts[1] == "layers":
                name = f"model.layers.{n + int(parts[2])}.{parts[3]}"
            else:
                short = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm",
                         "norm": "shared_head.norm"}[parts[1]]
                name = f"model.layers.{n}.{short}.{parts[2]}"
        name, t = _convert_tensor(name, t.float(), c)
        m = re.match(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight$", name)
        if m:
            experts.setdefault(int(m[1]), {})[f"{m[3]}.{m[2]}"] = t
            continue
        gname = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        if gname is None:
            m = re.match(r"^model\.layers\.(\d+)\.(eh_proj|enorm|hnorm|shared_head\.norm)\.weight$", name)
            assert m, f"no llama.cpp name for {name}"
            gname = gguf.TENSOR_NAMES[nextn_names[m[2]]].format(bid=int(m[1])) + ".weight"
        if gname.endswith("ffn_gate_inp_shexp.weight") and shexp_gate_1d:
            t = t.reshape(-1)
        out_t[gname] = t.numpy()
    for bid, d in experts.items():
        e = c["num_experts"]
        stack = {p: torch.stack([d[f"{p}.{i}"] for i in range(e)]) for p in ("gate_proj", "up_proj", "down_proj")}
        if fuse_gate_up:
            out_t[f"blk.{bid}.ffn_gate_up_exps.weight"] = torch.cat([stack["gate_proj"], stack["up_proj"]], dim=1).numpy()
        else:
            out_t[f"blk.{bid}.ffn_gate_exps.weight"] = stack["gate_proj"].numpy()
            out_t[f"blk.{bid}.ffn_up_exps.weight"] = stack["up_proj"].numpy()
        out_t[f"blk.{bid}.ffn_down_exps.weight"] = stack["down_proj"].numpy()
    if fuse_qkv:
        for bid in range(n + n_mtp):
            q = f"blk.{bid}.attn_q.weight"
            if q in out_t:
                out_t[f"blk.{bid}.attn_qkv.weight"] = np.concatenate(
                    [out_t.pop(q), out_t.pop(f"blk.{bid}.attn_k.weight"), out_t.pop(f"blk.{bid}.attn_v.weight")])

    w = gguf.GGUFWriter(out, arch)
    rope = c["rope_parameters"]
    w.add_block_count(n + n_mtp)
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    if not moe:
        w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_rope_dimension_sections(list(rope["mrope_section"]) + [0])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_vocab_size(c["vocab_size"])
    if moe:
        w.add_expert_count(c["num_experts"])
        w.add_expert_used_count(c["num_experts_per_tok"])
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
    w.add_ssm_conv_kernel(c["linear_conv_kernel_dim"])
    w.add_ssm_state_size(c["linear_key_head_dim"])
    w.add_ssm_group_count(c["linear_num_key_heads"])
    w.add_ssm_time_step_rank(c["linear_num_value_heads"])
    w.add_ssm_inner_size(c["linear_value_head_dim"] * c["linear_num_value_heads"])
    if recurrent_layers:
        flags = [t == "linear_attention" for t in c["layer_types"]] + [False] * n_mtp
        w.add_array(f"{arch}.attention.recurrent_layers", flags)
    else:
        w.add_full_attention_interval(3)  # the tiny configs put full attention at layer 2 of 4
    w.add_rope_dimension_count(int(c["head_dim"] * rope["partial_rotary_factor"]))
    if n_mtp:
        w.add_nextn_predict_layers(n_mtp)
    out_t.pop(drop, None)
    for name, arr in out_t.items():
        w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def hf_greedy(model, ids: torch.Tensor, n: int) -> list[int]:
    """Greedy continuation by transformers' ``generate`` (its own hybrid cache)."""
    with torch.no_grad():
        out = model.generate(ids[None], max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                             eos_token_id=None, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


def our_greedy(model, ids: torch.Tensor, n: int) -> list[int]:
    """Greedy continuation by a specdec target: prefill, then one token per forward."""
    cache = model.new_cache(len(ids) + n + 1)
    tok = int(model(ids, cache, logits="last").logits[-1].argmax())
    out = [tok]
    for _ in range(n - 1):
        tok = int(model(torch.tensor([tok]), cache, logits="last").logits[-1].argmax())
        out.append(tok)
    return out


def build_tp_dense(path, seed: int, **over) -> str:
    """A tiny random Qwen3.5 dense checkpoint for 2 ranks (:data:`TP_DENSE`, transformers) with an MTP block."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from _mtp_util import set_config  # _mtp_util imports this module

    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**dict(TP_DENSE, **over)))
    _perturb(model, seed)
    model.eval().save_pretrained(str(path))
    add_mtp_tensors(str(path), "model.layers.2.", seed=seed + 1)
    set_config(str(path), mtp_num_hidden_layers=1)
    return str(path)


def build_tp_moe(path, seed: int) -> str:
    """A tiny random Qwen3.5 MoE checkpoint for 2 ranks (:data:`TP_MOE`, transformers), no MTP block."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**TP_MOE))
    _perturb(model, seed)
    model.eval().save_pretrained(str(path))
    return str(path)
