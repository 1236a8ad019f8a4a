"""Qwen3.5 / Qwen3.6 checkpoints as the model sees them: HF names and HF conventions.

Every conversion lives here and acts on tensors as they are read (the file is never changed,
so building a view twice converts nothing twice):

HF safetensors (:func:`hf_view`)
    ``model.`` / ``model.language_model.`` names; per-expert MoE tensors are stacked
    (:func:`~specdec.models.moe.stacked_experts_view`); ``mtp.*`` and ``model.visual.*`` are
    left out of the target's view (the MTP drafter reads ``mtp.*`` itself).

GGUF ``qwen35`` / ``qwen35moe`` as llama.cpp's ``convert_hf_to_gguf.py`` writes them
(:func:`gguf_view`), undoing each of its changes:

- every ``*_norm`` weight except ``ssm_norm`` has the zero-centred ``+1`` baked in: we subtract
  1 so the model applies ``1 + w`` exactly once, whatever the format (HF convention throughout);
- ``ssm_a`` holds ``-exp(A_log)``: we take ``log(-ssm_a)``;
- ``ssm_conv1d`` is ``[C, K]``: we restore ``[C, 1, K]``; ``ssm_dt.bias`` is ``dt_bias``;
- with fewer key heads than value heads, the value heads of ``attn_qkv`` (v rows),
  ``attn_gate``, ``ssm_alpha``, ``ssm_beta``, ``ssm_a``, ``ssm_dt``, ``ssm_conv1d`` (v channels)
  and ``ssm_out`` (columns) are reordered from grouped-by-key-head to tiled order for ggml's
  broadcast: we put them back in grouped order;
- experts are ``ffn_{gate,up,down}_exps`` (or a fused ``ffn_gate_up_exps``); the shared
  expert gate may be 1-D;
- full-attention q/k/v may be fused into one ``attn_qkv`` (``--fuse-qkv``);
- ``nextn_predict_layers`` MTP blocks sit at ``blk.{n_layer}..``: hidden from the target;
  with ``mtp=True`` they appear under HF's ``mtp.*`` names (``nextn.eh_proj`` -> ``mtp.fc``,
  ``nextn.enorm`` -> ``mtp.pre_fc_norm_embedding``, ``nextn.hnorm`` ->
  ``mtp.pre_fc_norm_hidden``, ``nextn.shared_head_norm`` -> ``mtp.norm``, the block's
  tensors -> ``mtp.layers.{k}.*``), converted the same way.

Tensor parallelism: both views read a rank's slice of a split tensor without the rest where the
file allows (``SourceView.get_slice``): HF tensors by safetensors slices; GGUF tensors by block
rows, the value heads of the linear-attention tensors as ``per_k`` runs of llama.cpp's tiled
order (:func:`_tiled_part`), fused attention ``attn_qkv`` by its q/k/v rows. Read whole, then
sliced: columns of quantized tensors (``ssm_out``, as ``attn_output`` / ``ffn_down`` in
``GGUFSource.get_slice``: quantization blocks run along rows) and the MoE expert stacks.
"""

from __future__ import annotations

import math
import re
from typing import Callable

import torch

from ..errors import CheckpointError
from ..weights.source import TensorInfo, TensorSource
from .gguf_names import gguf_meta, is_number, meta_getters
from .moe import stacked_experts_view
from .source_view import SourceView, ViewTensor, base_slice, derived, passthrough

HF_HIDDEN_PREFIXES = ("mtp.", "model.mtp.", "model.visual.", "visual.")


def hf_view(source: TensorSource) -> SourceView:
    """The target's view of an HF checkpoint: experts stacked, MTP and vision tensors left out."""
    return stacked_experts_view(source).without(lambda n: n.startswith(HF_HIDDEN_PREFIXES))


# --- GGUF metadata -------------------------------------------------------------------

def gguf_config(meta: dict) -> dict:
    """Translate ``qwen35.*`` / ``qwen35moe.*`` GGUF metadata to a Qwen3.5 config dict."""
    arch = str(meta.get("general.architecture"))
    need, opt = meta_getters(meta, arch)

    d = gguf_meta(meta, arch)
    nextn = int(opt("nextn_predict_layers", 0) or 0)
    n_layer = d["num_hidden_layers"] - nextn
    head_dim = int(opt("attention.key_length") or d["hidden_size"] // d["num_attention_heads"])
    if head_dim < 1:
        raise CheckpointError(f"GGUF metadata: head dimension {head_dim} (from '{arch}.attention.key_length' or "
                              f"'{arch}.embedding_length') is not positive")
    rot = int(opt("rope.dimension_count") or head_dim)  # llama.cpp's default n_rot is the head dim
    n_v = need("ssm.time_step_rank", "count")
    d.update(
        model_type="qwen3_5_moe_text" if arch == "qwen35moe" else "qwen3_5_text",
        num_hidden_layers=n_layer,
        mtp_num_hidden_layers=nextn,
        head_dim=head_dim,
        partial_rotary_factor=rot / head_dim,
        linear_conv_kernel_dim=int(need("ssm.conv_kernel")),
        linear_key_head_dim=int(need("ssm.state_size")),
        linear_num_key_heads=int(need("ssm.group_count")),
        linear_num_value_heads=n_v,
        linear_value_head_dim=int(need("ssm.inner_size")) // n_v,
    )
    sections = opt("rope.dimension_sections", kind="numbers")
    if sections is not None and not d.get("rope_scaling"):
        d["rope_scaling"] = {"rope_type": "default", "mrope_section": [int(s) for s in sections][:3]}
    recurrent = opt("attention.recurrent_layers", kind="list")
    if recurrent is not None:
        d["layer_types"] = ["linear_attention" if r else "full_attention" for r in list(recurrent)[:n_layer]]
    else:
        d["full_attention_interval"] = int(opt("full_attention_interval", 4))
    if arch == "qwen35moe":
        ff = need("expert_feed_forward_length", "any")
        if not (is_number(ff) or isinstance(ff, list) and ff and all(is_number(x) for x in ff)):
            raise CheckpointError(f"GGUF metadata '{arch}.expert_feed_forward_length' must be a number or an array "
                                  f"of numbers, got {str(repr(ff))[:80]}")
        if isinstance(ff, (list, tuple)):
            if len(set(ff)) != 1:
                raise CheckpointError(f"GGUF metadata '{arch}.expert_feed_forward_length' varies per layer ({sorted(set(ff))}); unsupported")
            ff = ff[0]
        d.update(num_experts=int(need("expert_count")), num_experts_per_tok=int(need("expert_used_count")),
                 moe_intermediate_size=int(ff),
                 shared_expert_intermediate_size=int(opt("expert_shared_feed_forward_length", 0) or 0))
    return d


# --- GGUF tensors ------------------------------------------------------------------------

def _shift_norm(t: torch.Tensor) -> torch.Tensor:
    return t - 1.0  # llama.cpp stores 1 + w for zero-centred norms


def _untile(t: torch.Tensor, dim: int, n_k: int, per_k: int, head: int) -> torch.Tensor:
    """Value heads along ``dim`` from llama.cpp's tiled order (``v * n_k + k``) back to HF's
    grouped order (``k * per_k + v``)."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], per_k, n_k, head, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape)


def gguf_view(config, source: TensorSource, mtp: bool = False) -> SourceView:
    """llama.cpp ``qwen35`` / ``qwen35moe`` tensors under the model's parameter names
    (``layers.{i}.linear_attn.A_log`` ...), converted to HF conventions (module docstring).

    MTP blocks are left out unless ``mtp``. Names the map does not know pass through unchanged,
    so the strict loader reports them.
    """
    c = config
    infos = source.infos()
    n_layer = c.num_hidden_layers
    n_k, n_v = c.linear_num_key_heads, c.linear_num_value_heads
    per_k, kd = n_v // n_k, c.linear_num_key_heads * c.linear_key_head_dim
    reorder = n_k != n_v

    def v_rows(head: int, offset: int = 0) -> Callable[[torch.Tensor], torch.Tensor]:
        def fix(t: torch.Tensor) -> torch.Tensor:
            if not reorder:
                return t
            return torch.cat([t[:offset], _untile(t[offset:], 0, n_k, per_k, head)], dim=0)
        return fix

    def conv(t: torch.Tensor) -> torch.Tensor:
        return v_rows(c.linear_value_head_dim, 2 * kd)(t.reshape(t.shape[0], -1))[:, None, :]

    def a_log(t: torch.Tensor) -> torch.Tensor:
        return v_rows(1)(torch.log(-t))

    def out_cols(t: torch.Tensor) -> torch.Tensor:
        return _untile(t, 1, n_k, per_k, c.linear_value_head_dim) if reorder else t

    # Linear-attention tensors read in part (a tensor-parallel rank's heads): llama.cpp name ->
    # (the dim its value heads run along, entries per head, entries before the value heads, what
    # to do to the entries read). See _tiled_part.
    dv = c.linear_value_head_dim
    tiled = {"attn_qkv.weight": (0, dv, 2 * kd, None), "attn_gate.weight": (0, dv, 0, None),
             "ssm_beta.weight": (0, 1, 0, None), "ssm_alpha.weight": (0, 1, 0, None),
             "ssm_conv1d.weight": (0, dv, 2 * kd, lambda t: t.reshape(t.shape[0], 1, -1)),
             "ssm_dt.bias": (0, 1, 0, None), "ssm_a": (0, 1, 0, lambda t: torch.log(-t)),
             "ssm_out.weight": (1, dv, 0, None)}

    ident = None
    common = {"attn_norm.weight": ("input_layernorm.weight", _shift_norm),
              "post_attention_norm.weight": ("post_attention_layernorm.weight", _shift_norm)}
    attention = {
        "attn_q.weight": ("self_attn.q_proj.weight", ident), "attn_k.weight": ("self_attn.k_proj.weight", ident),
        "attn_v.weight": ("self_attn.v_proj.weight", ident), "attn_output.weight": ("self_attn.o_proj.weight", ident),
        "attn_q_norm.weight": ("self_attn.q_norm.weight", _shift_norm),
        "attn_k_norm.weight": ("self_attn.k_norm.weight", _shift_norm),
    }
    linear = {
        "attn_qkv.weight": ("linear_attn.in_proj_qkv.weight", v_rows(c.linear_value_head_dim, 2 * kd)),
        "attn_gate.weight": ("linear_attn.in_proj_z.weight", v_rows(c.linear_value_head_dim)),
        "ssm_beta.weight": ("linear_attn.in_proj_b.weight", v_rows(1)),
        "ssm_alpha.weight": ("linear_attn.in_proj_a.weight", v_rows(1)),
        "ssm_conv1d.weight": ("linear_attn.conv1d.weight", conv),
        "ssm_dt.bias": ("linear_attn.dt_bias", v_rows(1)),
        "ssm_a": ("linear_attn.A_log", a_log),
        "ssm_norm.weight": ("linear_attn.norm.weight", ident),  # plain w: no +1 in either format
        "ssm_out.weight": ("linear_attn.out_proj.weight", out_cols),
    }
    ffn = {
        "ffn_gate.weight": ("mlp.gate_proj.weight", ident), "ffn_up.weight": ("mlp.up_proj.weight", ident),
        "ffn_down.weight": ("mlp.down_proj.weight", ident),
        "ffn_gate_inp.weight": ("mlp.gate.weight", ident),
        "ffn_gate_up_exps.weight": ("mlp.experts.gate_up_proj", ident),
        "ffn_down_exps.weight": ("mlp.experts.down_proj", ident),
        "ffn_gate_shexp.weight": ("mlp.shared_expert.gate_proj.weight", ident),
        "ffn_up_shexp.weight": ("mlp.shared_expert.up_proj.weight", ident),
        "ffn_down_shexp.weight": ("mlp.shared_expert.down_proj.weight", ident),
    }
    nextn = {"nextn.eh_proj.weight": ("fc.weight", ident),
             "nextn.enorm.weight": ("pre_fc_norm_embedding.weight", _shift_norm),
             "nextn.hnorm.weight": ("pre_fc_norm_hidden.weight", _shift_norm),
             "nextn.shared_head_norm.weight": ("norm.weight", _shift_norm),
             "nextn.embed_tokens.weight": ("embed_tokens.weight", ident),
             "nextn.shared_head_head.weight": ("shared_head.head.weight", ident)}
    top = {"token_embd.weight": ("embed_tokens.weight", ident), "output_norm.weight": ("norm.weight", _shift_norm),
           "output.weight": ("lm_head.weight", ident)}

    _check_gguf_complete(c, source, linear, attention)
    tensors: dict[str, ViewTensor] = {}

    def add(gname: str, pname: str, fix, shape=None, tiling=None) -> None:
        info = infos[gname]
        shape = tuple(shape or info.shape)
        if fix is None:
            tensors[pname] = ViewTensor(TensorInfo(pname, shape, info.dtype, info.is_float, info.file),
                                        lambda g=gname: source.get(g, torch.float32),
                                        (lambda dim, a, b, g=gname: base_slice(source, g, dim, a, b))
                                        if shape == info.shape else None)
        else:
            t = derived(source, pname, [gname], shape, fix)
            if tiling is not None:
                t = ViewTensor(t.info, t.read, _tiled_part(source, gname, t.read, n_k, per_k, *tiling))
            tensors[pname] = t

    blk = re.compile(r"^blk\.(\d+)\.(.+)$")
    for gname, info in infos.items():
        if gname in top:
            add(gname, *top[gname])
            continue
        m = blk.match(gname)
        if not m:
            tensors[gname] = passthrough(source, gname)
            continue
        i, rest = int(m[1]), m[2]
        if i >= n_layer:
            if not mtp:
                continue  # the MTP block belongs to the drafter
            if rest in nextn:
                if i == n_layer:
                    pname, fix = nextn[rest]
                    add(gname, f"mtp.{pname}", fix)
                else:
                    tensors[gname] = passthrough(source, gname)
                continue
            prefix, is_linear = f"mtp.layers.{i - n_layer}.", False
        else:
            prefix, is_linear = f"layers.{i}.", c.layer_types[i] == "linear_attention"
        table = {**common, **ffn, **(linear if is_linear else attention)}
        if rest in table:
            pname, fix = table[rest]
            shape = (info.shape[0], 1, math.prod(info.shape[1:])) if rest == "ssm_conv1d.weight" else None
            add(gname, prefix + pname, fix, shape, tiled.get(rest) if is_linear else None)
        elif rest == "ffn_gate_inp_shexp.weight":
            hidden = info.shape[-1]
            add(gname, prefix + "mlp.shared_expert_gate.weight", lambda t: t.reshape(1, -1), (1, hidden))
        elif rest in ("ffn_gate_exps.weight", "ffn_up_exps.weight"):
            other = f"blk.{i}.ffn_up_exps.weight" if rest == "ffn_gate_exps.weight" else f"blk.{i}.ffn_gate_exps.weight"
            if other not in infos:
                raise CheckpointError(f"{source.path}: tensor '{gname}' has no partner '{other}'")
            if rest == "ffn_gate_exps.weight":
                e, inter, hidden = info.shape
                tensors[prefix + "mlp.experts.gate_up_proj"] = derived(
                    source, prefix + "mlp.experts.gate_up_proj", [gname, other], (e, 2 * inter, hidden),
                    lambda g, u: torch.cat([g, u], dim=1), part=_gate_up_experts(source, gname, other))
        elif rest == "attn_qkv.weight" and not is_linear:
            q_rows = c.num_attention_heads * c.head_dim * 2  # query and output gate
            kv_rows = c.num_key_value_heads * c.head_dim
            if info.shape[0] != q_rows + 2 * kv_rows:
                raise CheckpointError(f"{info.file}: fused tensor '{gname}' has {info.shape[0]} rows, "
                                      f"expected {q_rows + 2 * kv_rows} (q+gate, k, v)")
            for proj, lo, hi in (("q", 0, q_rows), ("k", q_rows, q_rows + kv_rows),
                                 ("v", q_rows + kv_rows, q_rows + 2 * kv_rows)):
                whole = derived(source, prefix + f"self_attn.{proj}_proj.weight", [gname], (hi - lo, info.shape[1]),
                                lambda t, lo=lo, hi=hi: t[lo:hi])
                tensors[prefix + f"self_attn.{proj}_proj.weight"] = ViewTensor(
                    whole.info, whole.read, lambda dim, a, b, g=gname, lo=lo, read=whole.read: (
                        base_slice(source, g, 0, lo + a, lo + b) if dim == 0
                        else read().narrow(dim, a, b - a).contiguous()))
        else:
            tensors[gname] = passthrough(source, gname)
    return SourceView(source, tensors)


def _gate_up_experts(source: TensorSource, gate: str, up: str):
    """A slice reader for ``gate_up_proj`` made of ``ffn_{gate,up}_exps``: a block of experts
    (dim 0) reads and dequantizes only their rows of both tensors; along another dim, the whole."""
    def read_slice(dim: int, start: int, stop: int) -> torch.Tensor:
        if dim == 0:
            g, u = (source.get_slice(n, 0, start, stop, torch.float32) for n in (gate, up))  # a GGUFSource
            return torch.cat([g, u], dim=1)
        whole = torch.cat([source.get(gate, torch.float32), source.get(up, torch.float32)], dim=1)
        return whole.narrow(dim, start, stop - start).contiguous()
    return read_slice


_FLOAT_TYPES = ("F32", "F16", "BF16")


def _tiled_part(source: TensorSource, gname: str, whole: Callable[[], torch.Tensor], n_k: int, per_k: int,
                dim: int, head: int, offset: int, post: Callable | None) -> Callable[[int, int, int], torch.Tensor]:
    """``part(dim, start, stop)`` of a linear-attention tensor in HF's grouped value-head order,
    read from llama.cpp's tiled order without the rest: grouped head ``k * per_k + v`` is tiled
    head ``v * n_k + k``, so a rank's value heads are ``per_k`` runs of the file, each read alone
    (quantized rows decode per block row), then ``post`` (``A_log = log(-ssm_a)``, the conv's
    ``[C, 1, K]``). Columns of a quantized tensor (``ssm_out``) cross quantization blocks: that
    tensor is dequantized whole, then its columns picked. A slice along another dim than the
    heads' is taken from the whole converted tensor."""
    quantized_cols = dim != 0 and source.infos()[gname].dtype not in _FLOAT_TYPES

    def part(d: int, start: int, stop: int) -> torch.Tensor:
        if d != dim:
            return whole().narrow(d, start, stop - start).contiguous()
        j = torch.arange(start, stop)
        rel = (j - offset).clamp(min=0)
        h, w = rel // head, rel % head
        k, v = h // per_k, h % per_k
        idx = torch.where(j < offset, j, offset + (v * n_k + k) * head + w)  # file entry of each entry wanted
        if quantized_cols:
            t = source.get(gname, torch.float32).index_select(dim, idx)
        else:
            cut = ((idx[1:] != idx[:-1] + 1).nonzero().flatten() + 1).tolist()
            runs = [(int(idx[a]), int(idx[b - 1]) + 1) for a, b in zip([0] + cut, cut + [len(idx)])]
            t = torch.cat([base_slice(source, gname, dim, a, b) for a, b in runs], dim=dim)
        return post(t) if post is not None else t
    return part


def _check_gguf_complete(c, source: TensorSource, linear: dict, attention: dict) -> None:
    """Name the first missing llama.cpp tensors of the main stack (before any conversion)."""
    have = source.infos()
    moe = hasattr(c, "moe_intermediate_size")
    missing: list[str] = [n for n in ("token_embd.weight", "output_norm.weight") if n not in have]
    for i, kind in enumerate(c.layer_types):
        b = f"blk.{i}."
        want = ["attn_norm.weight", "post_attention_norm.weight"]
        alternatives: list[tuple[list[str], list[str]]] = []
        if kind == "linear_attention":
            want += list(linear)
        else:
            want += ["attn_output.weight", "attn_q_norm.weight", "attn_k_norm.weight"]
            alternatives.append((["attn_q.weight", "attn_k.weight", "attn_v.weight"], ["attn_qkv.weight"]))
        if moe:
            want += ["ffn_gate_inp.weight", "ffn_down_exps.weight"]
            alternatives.append((["ffn_gate_exps.weight", "ffn_up_exps.weight"], ["ffn_gate_up_exps.weight"]))
            if c.shared_expert_intermediate_size:
                want += ["ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight", "ffn_gate_inp_shexp.weight"]
        else:
            want += ["ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"]
        missing += [b + n for n in want if b + n not in have]
        for split, fused in alternatives:
            if not all(b + n in have for n in split) and not all(b + n in have for n in fused):
                missing += [b + n for n in split if b + n not in have]
    if missing:
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise CheckpointError(f"{source.path}: missing tensor(s) {missing[:8]}{more} "
                              f"(llama.cpp names, {'qwen35moe' if moe else 'qwen35'} layout)")
