"""Helpers of the DFlash tests: random z-lab style checkpoints, a recording drafter wrapper and
an independent, cache-free reference implementation of the DFlash block forward.

The reference is written from the z-lab ``model.py`` semantics with plain torch ops (no specdec
layers): context = hidden_norm(fc(concat of HF hidden_states[l + 1])), keys/values of every
layer = [k_norm(k_proj(context)); k_norm(k_proj(block))] with RoPE at absolute positions, the
block embedded by the target's raw table times ``input_embedding_scale``, queries from the block
only, per-layer causality and sliding windows, the target's LM head, the drafter's soft cap.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from specdec.drafters.base import Proposal


def drafter_tensors(hidden: int, n_layers: int, n_ids: int, *, heads: int = 4, kv_heads: int = 2, head_dim: int = 8,
                    inter: int = 48, seed: int = 0, scale: float = 0.15) -> dict[str, torch.Tensor]:
    """The full z-lab manifest with random values (norm weights around 1, not exactly 1)."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g) * scale  # noqa: E731
    norm = lambda n: 1.0 + 0.2 * torch.randn(n, generator=g)  # noqa: E731
    sd = {"fc.weight": rnd(hidden, n_ids * hidden), "hidden_norm.weight": norm(hidden), "norm.weight": norm(hidden)}
    for i in range(n_layers):
        p = f"layers.{i}."
        sd.update({
            p + "input_layernorm.weight": norm(hidden), p + "post_attention_layernorm.weight": norm(hidden),
            p + "self_attn.q_proj.weight": rnd(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": rnd(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": rnd(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": rnd(hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": norm(head_dim), p + "self_attn.k_norm.weight": norm(head_dim),
            p + "mlp.gate_proj.weight": rnd(inter, hidden), p + "mlp.up_proj.weight": rnd(inter, hidden),
            p + "mlp.down_proj.weight": rnd(hidden, inter),
        })
    return sd


def write_drafter(path, *, hidden: int, num_target_layers: int, n_layers: int = 2, target_layer_ids=(1, 2),
                  block_size: int = 8, mask_token_id: int = 0, heads: int = 4, kv_heads: int = 2, head_dim: int = 8,
                  inter: int = 48, seed: int = 0, layer_types=None, sliding_window=None, dtype=torch.float32,
                  config: dict | None = None, tensors: dict | None = None) -> tuple[str, dict]:
    """Write ``config.json`` (z-lab layout: DFlash fields under ``dflash_config``) and
    ``model.safetensors``. ``target_layer_ids=None`` omits them (the default formula applies);
    ``config`` overrides fields; ``tensors`` replaces the state dict. Returns (path, config)."""
    os.makedirs(path, exist_ok=True)
    dfc = {"mask_token_id": mask_token_id}
    if target_layer_ids is not None:
        dfc["target_layer_ids"] = list(target_layer_ids)
    cfg = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": n_layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "block_size": block_size,
        "num_target_layers": num_target_layers, "dflash_config": dfc, "tie_word_embeddings": False,
        "sliding_window": sliding_window, "use_sliding_window": sliding_window is not None,
    }
    if layer_types is not None:
        cfg["layer_types"] = list(layer_types)
    cfg.update(config or {})
    n_ids = len(target_layer_ids) if target_layer_ids is not None else n_layers
    sd = tensors if tensors is not None else drafter_tensors(hidden, n_layers, n_ids, heads=heads, kv_heads=kv_heads,
                                                            head_dim=head_dim, inter=inter, seed=seed)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    save_file({k: v.to(dtype).contiguous() if v.is_floating_point() else v.contiguous() for k, v in sd.items()},
              os.path.join(path, "model.safetensors"))
    return str(path), cfg


# --- the independent reference ---------------------------------------------------------------------

def _rms(x, w, eps):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def _rope(x, pos, theta):
    """``x [..., T, d]`` rotate-half RoPE at integer positions ``pos [T]``."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_block_logits(hf_model, sd: dict, cfg: dict, committed: list[int], last_token: int,
                           block_size: int) -> torch.Tensor:
    """Drafter logits ``[block_size - 1, V]`` (float64) after ``committed`` tokens, recomputed from
    scratch: target features from transformers' ``output_hidden_states``, no cache anywhere."""
    dfc = cfg["dflash_config"]
    ids = dfc["target_layer_ids"]
    eps, theta = cfg["rms_norm_eps"], cfg["rope_parameters"]["rope_theta"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    types = cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]
    opt = lambda name, default: dfc.get(name, cfg.get(name, default))  # noqa: E731  (dflash_config first)
    # z-lab: the raw table times the drafter's own scale (never the target's sqrt(hidden) on top),
    # the target's LM head, then the drafter's own multiplier and soft cap, once
    emb_scale, softcap = opt("input_embedding_scale", 1.0), opt("final_logit_softcapping", None)
    is_causal = opt("is_causal", None)
    sd = {k: v.double() for k, v in sd.items()}
    with torch.no_grad():
        hs = hf_model(torch.tensor([committed]), output_hidden_states=True).hidden_states
        feats = torch.cat([hs[i + 1][0] for i in ids], -1).double()
        emb = hf_model.get_input_embeddings().weight.double()
        head = hf_model.lm_head.weight.double()
    s, b = len(committed), block_size
    ctx = _rms(feats @ sd["fc.weight"].T, sd["hidden_norm.weight"], eps)  # [S, H]
    block = torch.tensor([last_token] + [dfc["mask_token_id"]] * (b - 1))
    x = emb[block] * emb_scale
    pos_ctx, pos_blk = torch.arange(s), torch.arange(s, s + b)
    for i, lt in enumerate(types):
        p = f"layers.{i}."
        h = _rms(x, sd[p + "input_layernorm.weight"], eps)
        qn, kn = sd[p + "self_attn.q_norm.weight"], sd[p + "self_attn.k_norm.weight"]
        q = _rms((h @ sd[p + "self_attn.q_proj.weight"].T).view(b, nh, hd), qn, eps).transpose(0, 1)
        kc = _rms((ctx @ sd[p + "self_attn.k_proj.weight"].T).view(s, nkv, hd), kn, eps).transpose(0, 1)
        kb = _rms((h @ sd[p + "self_attn.k_proj.weight"].T).view(b, nkv, hd), kn, eps).transpose(0, 1)
        vc = (ctx @ sd[p + "self_attn.v_proj.weight"].T).view(s, nkv, hd).transpose(0, 1)
        vb = (h @ sd[p + "self_attn.v_proj.weight"].T).view(b, nkv, hd).transpose(0, 1)
        q = _rope(q, pos_blk, theta)
        k = torch.cat([_rope(kc, pos_ctx, theta), _rope(kb, pos_blk, theta)], 1).repeat_interleave(nh // nkv, 0)
        v = torch.cat([vc, vb], 1).repeat_interleave(nh // nkv, 0)
        scores = q @ k.transpose(1, 2) / hd ** 0.5  # [nh, B, S+B]
        qp, kp = pos_blk[:, None], torch.arange(s + b)[None, :]
        visible = torch.ones(b, s + b, dtype=torch.bool)
        # z-lab default: sliding layers are causal, full ones bidirectional (is_causal overrides)
        if (lt == "sliding_attention") if is_causal is None else is_causal:
            visible &= kp <= qp
        if lt == "sliding_attention":  # the window, both sides (only the past side matters when causal)
            visible &= ((qp - kp) < cfg["sliding_window"]) & ((kp - qp) < cfg["sliding_window"])
        scores = scores.masked_fill(~visible, float("-inf"))
        o = (scores.softmax(-1) @ v).transpose(0, 1).reshape(b, nh * hd)
        x = x + o @ sd[p + "self_attn.o_proj.weight"].T
        h = _rms(x, sd[p + "post_attention_layernorm.weight"], eps)
        gate, up = h @ sd[p + "mlp.gate_proj.weight"].T, h @ sd[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    x = _rms(x, sd["norm.weight"], eps)
    logits = (x[1:] @ head.T) * opt("output_multiplier", 1.0)
    return torch.tanh(logits / softcap) * softcap if softcap else logits


# --- a wrapper that drives the real drafter ---------------------------------------------------------

class Steered:
    """Wraps a real DFlash drafter: every call runs the drafter (its caches and forward), and
    the block logits are recorded with the committed sequence they were computed after.

    ``reference`` (prompt + the target's greedy continuation) makes the wrapper propose the
    target's own continuation instead of the drafter's guesses (100% acceptance), with
    ``corrupt`` the chance of spoiling each draft (partial acceptance).
    """

    def __init__(self, inner, reference: list[int] | None = None, corrupt: float = 0.0, vocab: int = 0,
                 record: bool = False, seed: int = 0):
        self.inner, self.ref, self.corrupt, self.vocab, self.record = inner, reference, corrupt, vocab, record
        self.name, self.capture_layers, self.block_size = inner.name, inner.capture_layers, inner.block_size
        self.rng = torch.Generator().manual_seed(seed)
        self.records: list[tuple[list[int], int, torch.Tensor]] = []

    def begin(self, prompt_ids, out):
        self.history = [int(t) for t in prompt_ids.tolist()]
        self.inner.begin(prompt_ids, out)

    def observe(self, tokens, out):
        self.history.extend(int(t) for t in tokens.tolist())
        self.inner.observe(tokens, out)
        assert self.inner.length == len(self.history), "drafter cache must hold exactly the committed positions"

    def propose(self, last_token, k, params, gen):
        prop = self.inner.propose(last_token, k, params, gen)
        if self.record:
            self.records.append((list(self.history), int(last_token), self.inner.block_logits(last_token)))
        if self.ref is None:
            return prop
        pos = len(self.history)
        assert self.ref[pos] == int(last_token)
        toks = list(self.ref[pos + 1: pos + 1 + prop.tokens.shape[0]])
        for i in range(len(toks)):
            if float(torch.rand(1, generator=self.rng)) < self.corrupt:
                toks[i] = (toks[i] + 1 + int(torch.randint(self.vocab - 1, (1,), generator=self.rng))) % self.vocab
        return Proposal(torch.tensor(toks, dtype=torch.int64, device=prop.tokens.device))
