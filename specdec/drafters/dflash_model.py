"""The DFlash block-diffusion drafter network (z-lab checkpoint format): config and math.

A DFlash drafter drafts a whole block in one forward pass. The block is the last committed
token followed by ``B - 1`` mask tokens, embedded with the *target's* embedding table. The
context enters only through keys and values: the target's hidden states after the layers in
``target_layer_ids`` (decoder-layer outputs before the final norm, except the last layer's,
which is taken after it as in HF's ``hidden_states``; concatenated in that order) go through ``fc`` and ``hidden_norm``, and every drafter layer projects that one context
stream with its own ``k_proj``/``k_norm``/``v_proj`` (no ``input_layernorm``). The residual
stream starts from the block embeddings; queries come from the block only. Full-attention
layers are bidirectional inside the block, sliding-window layers are causal by default
(z-lab ``model.py``: ``is_causal`` defaults to ``layer_type == "sliding_attention"``). The
final norm and the *target's* LM head turn rows ``1..B-1`` into drafts. Every RMSNorm here is
the plain (Qwen3) kind, ``x̂ · w``.

Positions: context keys sit at their absolute positions ``0..start-1``, the block at
``start..start+B-1`` where ``start`` is the position of the last committed token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..config import MAX_INT, MAX_LAYERS, _normalise_rope
from ..cpu_linear import Linear, linear
from ..models.gguf_names import is_number
from ..errors import ConfigError
from ..models.layers import RMSNorm, RotaryEmbedding, SwiGLU, apply_rope, attend

FULL, SLIDING = "full_attention", "sliding_attention"

# Config switches of DFlash variants this module does not implement: refusing them beats
# loading a checkpoint and drafting garbage.
_UNSUPPORTED = {
    "use_swa": "all-layer sliding attention (MiMo style)",
    "swa_window_size": "a separate sliding window size",
    "attention_sink_bias": "attention sink biases",
    "conv_kernel_size": "DFlash2 grouped dynamic convolutions",
    "selector_rank": "the DFlash2 candidate selector",
    "target_layer_fusion_mode": "target layer fusion",
}


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The target layers a z-lab drafter reads when its config names none.

    One drafter layer reads the middle target layer (``L // 2``); otherwise the layers are
    spread evenly from 1 to ``L - 3`` and rounded with Python's ``round`` (half to even), as
    z-lab's ``build_target_layer_ids`` does.
    """
    if num_draft_layers < 1:
        raise ConfigError(f"a DFlash drafter needs at least one layer, got {num_draft_layers}")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass(frozen=True)
class DFlashConfig:
    """What a DFlash ``config.json`` says, after defaults and validation."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    partial_rotary_factor: float
    block_size: int
    target_layer_ids: tuple[int, ...]
    target_layer_ids_default: bool  # True when derived with default_target_layer_ids
    mask_token_id: int
    num_target_layers: int | None
    layer_types: tuple[str, ...]
    windows: tuple[int | None, ...]  # per layer: sliding window or None
    causal: tuple[bool, ...]  # per layer: causal inside the block
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json") -> "DFlashConfig":
        """Parse a z-lab config. DFlash fields are read from ``dflash_config`` first, then
        from the top level (both layouts exist in published checkpoints)."""
        dc = d.get("dflash_config") or {}
        if not isinstance(dc, dict):
            raise ConfigError(f"{source}: 'dflash_config' must be an object")

        def get(name, default=None):
            return dc[name] if dc.get(name) is not None else (d[name] if d.get(name) is not None else default)

        archs = d.get("architectures") or []
        if not isinstance(archs, list):
            raise ConfigError(f"{source}: 'architectures' must be a list, got {str(repr(archs))[:80]}")
        if any("DFlash2" in str(a) for a in archs):
            raise ConfigError(f"{source}: architecture {archs} (DFlash2) is not supported; only DFlashDraftModel is")
        for key, what in _UNSUPPORTED.items():
            v = get(key)
            if v not in (None, False, "none", 0):
                raise ConfigError(f"{source}: field '{key}'={v!r} asks for {what}, which specdec does not support")
        if get("use_aux_hidden_state", True) is not True:
            raise ConfigError(f"{source}: 'use_aux_hidden_state'=false is not supported (DFlash reads target layers)")
        if d.get("attention_bias") or d.get("mlp_bias"):
            raise ConfigError(f"{source}: attention_bias/mlp_bias are not supported for DFlash drafters")
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{source}: hidden_act '{d.get('hidden_act')}' is not supported (expected silu)")

        def req_int(name, lo=1, value=None, hi=MAX_INT):
            v = get(name) if value is None else value
            if v is None:
                raise ConfigError(f"{source}: required field '{name}' is missing")
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise ConfigError(f"{source}: field '{name}' must be an integer in {lo}..{hi}, got {v!r}")
            return v

        def num(name, v, lo=float("-inf")):
            if not is_number(v) or v < lo:
                raise ConfigError(f"{source}: field '{name}' must be a finite number >= {lo:g}, got {str(repr(v))[:80]}")
            return float(v)

        hidden = req_int("hidden_size")
        n_layers = req_int("num_hidden_layers", hi=MAX_LAYERS)
        n_heads = req_int("num_attention_heads")
        n_kv = req_int("num_key_value_heads") if get("num_key_value_heads") is not None else n_heads
        if n_heads % n_kv:
            raise ConfigError(f"{source}: num_attention_heads={n_heads} is not a multiple of num_key_value_heads={n_kv}")
        head_dim = req_int("head_dim") if get("head_dim") is not None else hidden // n_heads
        target_hidden = get("target_hidden_size", hidden)
        if target_hidden != hidden:
            raise ConfigError(f"{source}: target_hidden_size={target_hidden} differs from hidden_size={hidden}; "
                              "the drafter shares the target's embedding and head, so both must be equal")

        rope = _normalise_rope(d)
        if "rope_theta" not in rope:
            raise ConfigError(f"{source}: no RoPE base: set 'rope_theta' or 'rope_parameters.rope_theta'")

        block_size = req_int("block_size", lo=2)
        mask = req_int("mask_token_id", lo=0)
        n_target = get("num_target_layers")
        if n_target is not None:
            n_target = req_int("num_target_layers", value=n_target)
        ids = get("target_layer_ids")
        derived = ids is None
        if derived:
            if n_target is None:
                raise ConfigError(f"{source}: neither 'target_layer_ids' nor 'num_target_layers' is set")
            ids = default_target_layer_ids(n_target, n_layers)
        if not isinstance(ids, (list, tuple)) or not ids or not all(type(i) is int and i >= 0 for i in ids):
            raise ConfigError(f"{source}: 'target_layer_ids' must be a non-empty list of layer indices, got {ids!r}")

        layer_types = d.get("layer_types")
        window = d.get("sliding_window")
        if layer_types is None:
            # transformers' Qwen3Config: sliding only with use_sliding_window, from max_window_layers on
            use = bool(d.get("use_sliding_window", False)) and window is not None
            first = d.get("max_window_layers", 28)
            layer_types = [SLIDING if use and i >= first else FULL for i in range(n_layers)]
        if len(layer_types) != n_layers or any(t not in (FULL, SLIDING) for t in layer_types):
            raise ConfigError(f"{source}: 'layer_types' must list {n_layers} entries of {FULL!r}/{SLIDING!r}, "
                              f"got {layer_types!r}")
        if SLIDING in layer_types and (not isinstance(window, int) or window < 1):
            raise ConfigError(f"{source}: sliding_attention layers need an integer 'sliding_window', got {window!r}")
        causal_flag = get("is_causal", get("causal"))
        if causal_flag is not None and not isinstance(causal_flag, bool):
            raise ConfigError(f"{source}: 'is_causal' must be true or false, got {causal_flag!r}")
        windows = tuple(window if t == SLIDING else None for t in layer_types)
        causal = tuple((t == SLIDING) if causal_flag is None else causal_flag for t in layer_types)

        softcap = get("final_logit_softcapping")
        return cls(
            hidden_size=hidden, intermediate_size=req_int("intermediate_size"), num_hidden_layers=n_layers,
            num_attention_heads=n_heads, num_key_value_heads=n_kv, head_dim=head_dim,
            rms_norm_eps=num("rms_norm_eps", d.get("rms_norm_eps", 1e-6)), rope_theta=num("rope_theta", rope["rope_theta"], lo=1e-30),
            rope_scaling=rope.get("rope_scaling"),
            partial_rotary_factor=num("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0)),
            block_size=block_size, target_layer_ids=tuple(ids), target_layer_ids_default=derived, mask_token_id=mask,
            num_target_layers=n_target, layer_types=tuple(layer_types), windows=windows, causal=causal,
            input_embedding_scale=num("input_embedding_scale", get("input_embedding_scale", 1.0)),
            output_multiplier=num("output_multiplier", get("output_multiplier", 1.0)),
            final_logit_softcapping=None if not softcap else num("final_logit_softcapping", softcap),
        )


class DFlashAttention(nn.Module):
    """Queries from the block; keys/values from the cached context plus the block itself."""

    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.scale = c.head_dim ** -0.5

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [..., T, H]`` -> roped, normed keys and plain values, each ``[..., n_kv, T, d]``
        (leading batch dimensions are for training, see :mod:`specdec.train.dflash_batch`)."""
        shape = (*x.shape[:-1], self.n_kv, self.head_dim)
        k = self.k_norm(self.k_proj(x).view(shape)).transpose(-3, -2)
        v = self.v_proj(x).view(shape).transpose(-3, -2)
        return apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, k_ctx, v_ctx, mask):
        """``x [B, H]`` (normed block); ``k_ctx, v_ctx [n_kv, S, d]`` -> ``[B, H]``. Many sequences at
        once: ``x [N, B, H]``, ``cos/sin [N, 1, B, r]``, ``k_ctx, v_ctx [N, n_kv, S, d]``, ``mask
        [N, 1, B, S + B]`` -> ``[N, B, H]``."""
        lead = x.shape[:-1]
        q = self.q_norm(self.q_proj(x).view(*lead, self.n_heads, self.head_dim)).transpose(-3, -2)
        q = apply_rope(q, cos, sin)
        k, v = self.kv(x, cos, sin)
        o = attend(q, torch.cat([k_ctx, k], dim=-2), torch.cat([v_ctx, v], dim=-2), mask, self.scale)
        return self.o_proj(o.transpose(-3, -2).reshape(*lead, -1))


class DFlashLayer(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DFlashAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)

    def forward(self, x, cos, sin, k_ctx, v_ctx, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_ctx, v_ctx, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def _by_position(ok: torch.Tensor, kpos: torch.Tensor, q: torch.Tensor, window: int | None, causal: bool) -> torch.Tensor:
    """``ok`` (valid keys) narrowed by position: keys after the query when ``causal``, and keys
    ``window`` or more positions away (before it; after it too when not causal)."""
    if causal:
        ok = ok & (kpos <= q)
    if window is not None:
        ok = ok & ((q - kpos) < window)
        if not causal:
            ok = ok & ((kpos - q) < window)
    return ok


def block_mask(start: int, b: int, lo: int, window: int | None, causal: bool, device) -> torch.Tensor | None:
    """Boolean ``[b, start + b - lo]``: which keys (positions ``lo..start+b-1``) block query
    ``i`` (position ``start + i``) sees. None means every key (bidirectional, no window)."""
    if window is None and not causal:
        return None
    q = torch.arange(start, start + b, device=device)[:, None]
    k = torch.arange(lo, start + b, device=device)[None, :]
    ok = torch.ones(b, start + b - lo, dtype=torch.bool, device=device)
    if causal:
        ok &= k <= q
    if window is not None:
        ok &= (q - k) < window
        if not causal:
            ok &= (k - q) < window
    return ok


class DFlashDraftModel(nn.Module):
    """The drafter's own weights: ``fc``, ``hidden_norm``, ``layers.*``, ``norm`` (no embedding
    or LM head: those are the target's). Parameter names equal the checkpoint's tensor names."""

    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.config = c
        self.fc = Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary = RotaryEmbedding(c.head_dim, c.rope_theta, c.partial_rotary_factor, c.rope_scaling)

    def context_kv(self, feats: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Captured target features ``[T, n_ids * H]`` at ``positions [T]`` -> per drafter layer
        the context keys (roped at those positions) and values, ``[n_kv, T, d]`` each."""
        ctx = self.hidden_norm(self.fc(feats.to(self.fc.weight.dtype)))
        cos, sin = self.rotary.cos_sin(positions, ctx.dtype)
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    def block_hidden(self, x: torch.Tensor, start: int, ctx_kv) -> torch.Tensor:
        """Block embeddings ``x [B, H]`` at positions ``start..`` with per-layer context
        ``ctx_kv[i] = (k, v)`` covering positions ``0..start-1`` -> final-normed ``[B, H]``."""
        b = x.shape[0]
        pos = torch.arange(start, start + b, device=x.device)
        cos, sin = self.rotary.cos_sin(pos, x.dtype)
        masks: dict = {}
        for i, layer in enumerate(self.layers):
            window, causal = self.config.windows[i], self.config.causal[i]
            # keys older than the window are invisible to every block query: skip them
            lo = 0 if window is None else max(0, start - window + 1)
            key = (lo, window, causal)
            if key not in masks:
                masks[key] = block_mask(start, b, lo, window, causal, x.device)
            k_ctx, v_ctx = ctx_kv[i]
            x = layer(x, cos, sin, k_ctx[:, lo:start], v_ctx[:, lo:start], masks[key])
        return self.norm(x)

    def block_hidden_static(self, x: torch.Tensor, start: torch.Tensor, ctx_kv) -> torch.Tensor:
        """:meth:`block_hidden` with static shapes for CUDA graphs: ``start`` is a 0-d device
        tensor and ``ctx_kv[i]`` are whole context buffers ``[n_kv, cap, d]``, slots at or past
        ``start`` masked out; windows and causality become masks by position."""
        b, cap = x.shape[0], ctx_kv[0][0].shape[1]
        pos = start + torch.arange(b, device=x.device)
        cos, sin = self.rotary.cos_sin(pos, x.dtype)
        slots = torch.arange(cap, device=x.device)
        kpos = torch.cat([slots, pos])[None, :]
        valid = torch.cat([slots < start, torch.ones(b, dtype=torch.bool, device=x.device)])[None, :]
        q = pos[:, None]
        masks: dict = {}
        for i, layer in enumerate(self.layers):
            window, causal = self.config.windows[i], self.config.causal[i]
            key = (window, causal)
            if key not in masks:
                masks[key] = _by_position(valid.expand(b, -1), kpos, q, window, causal)
            k_ctx, v_ctx = ctx_kv[i]
            x = layer(x, cos, sin, k_ctx, v_ctx, masks[key])
        return self.norm(x)

    def context_kv_slots(self, feats: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`context_kv` for many sequences: ``feats [S, W, n_ids * H]`` at ``positions [S, W]``
        -> per layer keys and values ``[S, n_kv, W, d]``."""
        s, w = positions.shape
        ctx = self.hidden_norm(self.fc(feats.to(self.fc.weight.dtype)))
        cos, sin = self.rotary.cos_sin(positions.reshape(-1), ctx.dtype)
        cos, sin = cos.view(s, 1, w, -1), sin.view(s, 1, w, -1)
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    def block_hidden_slots(self, x: torch.Tensor, starts: torch.Tensor, ctx_kv) -> torch.Tensor:
        """:meth:`block_hidden_static` for many sequences: ``x [S, B, H]``, ``starts [S]`` (device),
        ``ctx_kv[i] = (K, V) [S, n_kv, span, d]`` with each slot's positions at or past its start
        masked out -> ``[S, B, H]``. Every row depends on its own slot's inputs only."""
        s, b = x.shape[:2]
        span = ctx_kv[0][0].shape[2]
        dev = x.device
        pos = starts[:, None] + torch.arange(b, device=dev)[None, :]  # [S, B]
        cos, sin = self.rotary.cos_sin(pos.reshape(-1), x.dtype)
        cos, sin = cos.view(s, 1, b, -1), sin.view(s, 1, b, -1)
        ctx_pos = torch.arange(span, device=dev)[None, :].expand(s, -1)
        kpos = torch.cat([ctx_pos, pos], dim=1)[:, None, :]  # [S, 1, span + B]
        valid = torch.cat([ctx_pos < starts[:, None], torch.ones(s, b, dtype=torch.bool, device=dev)], dim=1)
        q = pos[:, :, None]  # [S, B, 1]
        masks: dict = {}
        for i, layer in enumerate(self.layers):
            window, causal = self.config.windows[i], self.config.causal[i]
            key = (window, causal)
            if key not in masks:  # [S, 1, B, span + B]
                masks[key] = _by_position(valid[:, None, :].expand(s, b, -1), kpos, q, window, causal)[:, None]
            k_ctx, v_ctx = ctx_kv[i]
            x = layer(x, cos, sin, k_ctx, v_ctx, masks[key])
        return self.norm(x)

    def logits(self, h: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
        """Final-normed ``h`` through the target's LM head, with the drafter's own logit
        multiplier and soft cap (z-lab ``compute_logits``), fp32."""
        return self.scale_logits(linear(h, head_weight).float())

    def scale_logits(self, out: torch.Tensor) -> torch.Tensor:
        """fp32 logits of the target's LM head -> the drafter's (its multiplier and soft cap)."""
        c = self.config
        if c.output_multiplier != 1.0:
            out = out * c.output_multiplier
        if c.final_logit_softcapping:
            out = torch.tanh(out / c.final_logit_softcapping) * c.final_logit_softcapping
        return out
