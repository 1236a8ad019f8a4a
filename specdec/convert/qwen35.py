"""Qwen3.5 / Qwen3.6 (dense and MoE) checkpoints as llama.cpp's ``qwen35`` / ``qwen35moe`` GGUF,
the MTP block included.

The inverse of :mod:`specdec.models.qwen35_ckpt`'s GGUF view; every llama.cpp convention is
applied here, on tensors as they are read:

- zero-centred norms are stored as ``1 + w`` (every ``*norm.weight`` except
  ``linear_attn.norm``, which is a plain gain);
- ``A_log`` is stored as ``ssm_a = -exp(A_log)``; ``dt_bias`` as ``ssm_dt.bias``;
- the conv kernel ``[C, 1, K]`` is squeezed to ``[C, K]``;
- with fewer key heads than value heads, value heads go from HF's grouped order
  (``k * per_k + v``) to ggml's tiled order (``v * n_k + k``) in ``in_proj_qkv`` (the v rows),
  ``in_proj_z``, ``in_proj_a/b``, ``A_log``, ``dt_bias``, the conv kernel (v channels) and the
  columns of ``out_proj``;
- experts are stacked (``ffn_{gate,up,down}_exps``), whatever the checkpoint's layout; the
  shared-expert gate is written 1-D;
- the ``mtp.*`` block becomes block ``n_layer`` (``nextn.eh_proj``, ``nextn.enorm``,
  ``nextn.hnorm``, ``nextn.shared_head_norm`` plus the layer's own tensors), with
  ``nextn_predict_layers`` in the metadata; vision tensors are left out.
"""

from __future__ import annotations

import re
from typing import Callable

import gguf
import torch

from ..errors import CheckpointError, ConfigError
from ..models.moe import stacked_experts_view
from ..weights.source import TensorSource
from .plan import Plan

K = gguf.Keys
_NEXTN = {"fc.weight": gguf.MODEL_TENSOR.NEXTN_EH_PROJ, "pre_fc_norm_embedding.weight": gguf.MODEL_TENSOR.NEXTN_ENORM,
          "pre_fc_norm_hidden.weight": gguf.MODEL_TENSOR.NEXTN_HNORM,
          "norm.weight": gguf.MODEL_TENSOR.NEXTN_SHARED_HEAD_NORM,
          "embed_tokens.weight": gguf.MODEL_TENSOR.NEXTN_EMBED_TOKENS,
          "shared_head.head.weight": gguf.MODEL_TENSOR.NEXTN_SHARED_HEAD_HEAD}
_SKIP = ("model.visual.", "visual.", "model.language_model.visual.")


def _tile(t: torch.Tensor, dim: int, n_k: int, per_k: int, head: int) -> torch.Tensor:
    """Value heads along ``dim`` from grouped (``k * per_k + v``) to tiled (``v * n_k + k``) order."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], n_k, per_k, head, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).contiguous().reshape(shape)


def _interval(layer_types: list[str]) -> int:
    """The ``full_attention_interval`` that gives ``layer_types`` (llama.cpp's only way to say it)."""
    first = layer_types.index("full_attention") + 1 if "full_attention" in layer_types else len(layer_types) + 1
    want = ["full_attention" if (i + 1) % first == 0 else "linear_attention" for i in range(len(layer_types))]
    if want != list(layer_types):
        raise ConfigError(f"layer_types {layer_types} is not every-k-th-layer full attention, which is all "
                          "llama.cpp's qwen35 metadata (full_attention_interval) can express")
    return first


def _fixes(c) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Per linear-attention tensor suffix: the value-head reorder (identity when n_k == n_v)."""
    n_k, n_v = c.linear_num_key_heads, c.linear_num_value_heads
    per_k, kd, dv = n_v // n_k, c.linear_num_key_heads * c.linear_key_head_dim, c.linear_value_head_dim

    def rows(head: int, offset: int = 0):
        def fix(t: torch.Tensor) -> torch.Tensor:
            if n_k == n_v:
                return t
            return torch.cat([t[:offset], _tile(t[offset:], 0, n_k, per_k, head)], dim=0)
        return fix

    def cols(t: torch.Tensor) -> torch.Tensor:
        return t if n_k == n_v else _tile(t, 1, n_k, per_k, dv)

    return {"in_proj_qkv.weight": rows(dv, 2 * kd), "in_proj_z.weight": rows(dv), "in_proj_a.weight": rows(1),
            "in_proj_b.weight": rows(1), "A_log": lambda t: -torch.exp(rows(1)(t)), "dt_bias": rows(1),
            "conv1d.weight": lambda t: rows(dv, 2 * kd)(t.reshape(t.shape[0], -1)), "out_proj.weight": cols}


def plan_qwen35(cfg, source: TensorSource) -> Plan:
    """The GGUF plan of a Qwen3.5 / 3.6 checkpoint (``source``: its HF tensors, ``mtp.*`` included)."""
    c = cfg
    moe = hasattr(c, "moe_intermediate_size")
    arch_enum = gguf.MODEL_ARCH.QWEN35MOE if moe else gguf.MODEL_ARCH.QWEN35
    plan = Plan(gguf.MODEL_ARCH_NAMES[arch_enum])
    view = stacked_experts_view(source)
    infos = {n: i for n, i in view.infos().items() if not n.startswith(_SKIP)}
    n = c.num_hidden_layers
    mtp_layers = {int(m[1]) for name in infos if (m := re.match(r"^(?:model\.)?mtp\.layers\.(\d+)\.", name))}
    has_mtp = any(name.startswith(("mtp.", "model.mtp.")) for name in infos)
    if has_mtp and (not mtp_layers or mtp_layers != set(range(len(mtp_layers)))):
        raise CheckpointError(f"{source.path}: the mtp.* tensors hold layers {sorted(mtp_layers)}, expected 0..k-1")
    n_mtp = len(mtp_layers)
    _metadata(plan, c, moe, n_mtp)

    tmap = gguf.get_tensor_name_map(arch_enum, n + n_mtp)
    fixes = _fixes(c)
    for name, info in infos.items():
        hf = re.sub(r"^model\.language_model\.", "model.", name)
        hf = re.sub(r"^model\.mtp\.", "mtp.", hf)
        if hf == "lm_head.weight" and c.tie_word_embeddings:
            continue
        ops: list[Callable[[torch.Tensor], torch.Tensor]] = []
        suffix = hf.rsplit("linear_attn.", 1)[-1] if ".linear_attn." in hf else None
        if suffix in fixes:
            ops.append(fixes[suffix])
        if _is_shifted_norm(hf):
            ops.append(lambda t: t + 1.0)
        shape = tuple(info.shape)
        if suffix == "conv1d.weight":
            shape = (shape[0], shape[-1])
        if hf.startswith("mtp.") and not hf.startswith("mtp.layers."):
            rest = hf[len("mtp."):]
            if rest not in _NEXTN:
                raise CheckpointError(f"{info.file}: tensor '{name}' has no llama.cpp name (MTP block)")
            plan.add(gguf.TENSOR_NAMES[_NEXTN[rest]].format(bid=n) + ".weight", shape, _reader(view, name, ops))
            continue
        if hf.startswith("mtp.layers."):
            k, rest = hf[len("mtp.layers."):].split(".", 1)
            hf = f"model.layers.{n + int(k)}.{rest}"
        if hf.endswith("mlp.experts.gate_up_proj"):
            e, two_i, h = shape
            bid = int(hf.split(".")[2])
            gate, up = _split_reader(view, name)
            plan.add(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.FFN_GATE_EXP].format(bid=bid) + ".weight", (e, two_i // 2, h), gate)
            plan.add(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.FFN_UP_EXP].format(bid=bid) + ".weight", (e, two_i // 2, h), up)
            continue
        if hf.endswith("linear_attn.dt_bias"):
            hf = hf[: -len("dt_bias")] + "dt_proj.bias"
        gname = tmap.get_name(hf, try_suffixes=(".weight", ".bias"))
        if gname is None:
            raise CheckpointError(f"{info.file}: tensor '{name}' has no llama.cpp name for {plan.arch}")
        if gname.endswith("ffn_down_exps"):
            gname += ".weight"  # the stacked name carries no suffix in HF
        if gname.endswith("ffn_gate_inp_shexp.weight"):
            shape = (shape[-1],)
            ops.append(lambda t: t.reshape(-1))
        plan.add(gname, shape, _reader(view, name, ops))
    return plan


def _is_shifted_norm(hf: str) -> bool:
    """Zero-centred RMSNorm gains (stored ``1 + w``): every norm but the DeltaNet output gain."""
    if hf.endswith("linear_attn.norm.weight"):
        return False
    return hf.endswith("norm.weight") or hf in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight")


def _metadata(plan: Plan, c, moe: bool, n_mtp: int) -> None:
    plan.common_metadata(c, blocks=c.num_hidden_layers + n_mtp, ffn=not moe)
    plan.u32(K.Attention.KEY_LENGTH, c.head_dim)
    plan.u32(K.Attention.VALUE_LENGTH, c.head_dim)
    plan.u32(K.Rope.DIMENSION_COUNT, int(c.head_dim * c.partial_rotary_factor))
    rope = c.rope_scaling or {}
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(f"{c.model_type} config: rope_type '{rope.get('rope_type')}' cannot be converted (default only)")
    if rope.get("mrope_section"):
        sections = [int(s) for s in rope["mrope_section"]]
        plan.array(K.Rope.DIMENSION_SECTIONS, sections + [0] * (4 - len(sections)))
    plan.u32(K.LLM.FULL_ATTENTION_INTERVAL, _interval(c.layer_types))
    plan.u32(K.SSM.CONV_KERNEL, c.linear_conv_kernel_dim)
    plan.u32(K.SSM.STATE_SIZE, c.linear_key_head_dim)
    plan.u32(K.SSM.GROUP_COUNT, c.linear_num_key_heads)
    plan.u32(K.SSM.TIME_STEP_RANK, c.linear_num_value_heads)
    plan.u32(K.SSM.INNER_SIZE, c.linear_value_head_dim * c.linear_num_value_heads)
    if moe:
        plan.u32(K.LLM.EXPERT_COUNT, c.num_experts)
        plan.u32(K.LLM.EXPERT_USED_COUNT, c.num_experts_per_tok)
        plan.u32(K.LLM.EXPERT_FEED_FORWARD_LENGTH, c.moe_intermediate_size)
        plan.u32(K.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, c.shared_expert_intermediate_size)
    if n_mtp:
        plan.u32(K.LLM.NEXTN_PREDICT_LAYERS, n_mtp)


def _split_reader(view: TensorSource, name: str):
    """Readers of the gate and the up half of a stacked ``gate_up_proj`` ``[E, 2I, H]``: the
    tensor is read once, its up half kept until the writer asks for it (written right after)."""
    held: dict[str, torch.Tensor] = {}

    def gate() -> torch.Tensor:
        g, u = view.get(name, torch.float32).chunk(2, dim=1)
        held["up"] = u
        return g

    def up() -> torch.Tensor:
        return held.pop("up") if "up" in held else view.get(name, torch.float32).chunk(2, dim=1)[1]
    return gate, up


def _reader(view: TensorSource, name: str, ops: list[Callable[[torch.Tensor], torch.Tensor]]):
    def read() -> torch.Tensor:
        t = view.get(name, torch.float32)
        for op in ops:
            t = op(t)
        return t
    return read
