"""Tiny Qwen3.5 checkpoints with an MTP block, and an independent MTP reference implementation.

The checkpoints come from transformers (``save_pretrained`` drops ``mtp.*``), then random
``mtp.*`` tensors are added (:func:`_qwen35_util.add_mtp_tensors`) and ``config.json`` gets
``mtp_num_hidden_layers: 1`` as published checkpoints have it.

:class:`ReferenceMTP` recomputes the MTP block from the published description with plain torch
ops and no cache (full causal attention over every row each time), reading the weights straight
from the safetensors file: it shares no code with ``specdec.drafters.mtp``.
"""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F

from _qwen35_util import DENSE, MOE, add_mtp_tensors, hf_model, read_tensors, write_tensors


def build_qwen35(path, *, moe: bool, mtp: bool = True, seed: int = 0, vocab: int | None = None) -> str:
    """Save a tiny random Qwen3.5 (dense or MoE); with ``mtp``, add an MTP block to it.
    ``vocab``: a smaller vocabulary than the shared tiny config's (for statistical tests)."""
    path = str(path)
    if vocab is None:
        hf_model("moe" if moe else "dense", seed).save_pretrained(path)
    else:
        from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

        torch.manual_seed(seed)
        cls, cfg = (Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig) if moe else (Qwen3_5ForCausalLM, Qwen3_5TextConfig)
        cls(cfg(**dict(MOE if moe else DENSE, vocab_size=vocab))).save_pretrained(path)
    if mtp:
        add_mtp_tensors(path, "model.layers.2.", seed=seed + 1)
        set_config(path, mtp_num_hidden_layers=1)
    return path


def set_config(path: str, **fields) -> None:
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as fh:
        cfg = json.load(fh)
    cfg.update(fields)
    with open(cfg_path, "w") as fh:
        json.dump(cfg, fh)


def edit_tensors(path: str, fn) -> None:
    """Rewrite the checkpoint's tensors with ``fn(dict) -> None`` (in place)."""
    t = read_tensors(path)
    fn(t)
    write_tensors(path, t)


# --- the reference ---------------------------------------------------------------------------

def _rms(x, w, eps):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.double())


def _rope(x, pos, rot, theta):
    """``x [T, heads, d]``: rotate-half RoPE on the first ``rot`` channels at ``pos``."""
    inv = 1.0 / theta ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    ang = pos.double()[:, None] * inv[None]  # [T, rot/2]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    a, b, rest = x[..., : rot // 2], x[..., rot // 2: rot], x[..., rot:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, rest], dim=-1)


class ReferenceMTP:
    """The MTP block of the checkpoint at ``path`` (HF layout), in float64, without caches."""

    def __init__(self, path: str, embed_name: str = "model.embed_tokens.weight", head_name: str = "lm_head.weight"):
        with open(os.path.join(path, "config.json")) as fh:
            c = json.load(fh)
        c = c.get("text_config", c)
        self.c = c
        t = {k: v.double() for k, v in read_tensors(path).items()}
        self.w = {k[len("mtp."):]: v for k, v in t.items() if k.startswith("mtp.")}
        self.embed = t[embed_name]
        self.head = t[head_name]
        self.eps = c["rms_norm_eps"]
        rp = c["rope_parameters"]
        self.rot = int(c["head_dim"] * rp["partial_rotary_factor"])
        self.theta = rp["rope_theta"]

    def _ffn(self, x):
        w, p = self.w, "layers.0.mlp."
        if p + "gate_proj.weight" in w:
            return F.linear(F.silu(F.linear(x, w[p + "gate_proj.weight"])) * F.linear(x, w[p + "up_proj.weight"]),
                            w[p + "down_proj.weight"])
        probs = torch.softmax(F.linear(x, w[p + "gate.weight"]), -1)
        top, idx = torch.topk(probs, self.c["num_experts_per_tok"], dim=-1)
        top = top / top.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for r in range(x.shape[0]):
            for j in range(idx.shape[1]):
                e = f"{p}experts.{int(idx[r, j])}."
                h = F.silu(w[e + "gate_proj.weight"] @ x[r]) * (w[e + "up_proj.weight"] @ x[r])
                out[r] += top[r, j] * (w[e + "down_proj.weight"] @ h)
        s = p + "shared_expert."
        shared = F.linear(F.silu(F.linear(x, w[s + "gate_proj.weight"])) * F.linear(x, w[s + "up_proj.weight"]),
                          w[s + "down_proj.weight"])
        return out + torch.sigmoid(F.linear(x, w[p + "shared_expert_gate.weight"])) * shared

    def _layer(self, x):
        w, c, p = self.w, self.c, "layers.0."
        T = x.shape[0]
        nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        h = _rms(x, w[p + "input_layernorm.weight"], self.eps)
        qg = F.linear(h, w[p + "self_attn.q_proj.weight"]).view(T, nh, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(T, nh * hd)
        k = F.linear(h, w[p + "self_attn.k_proj.weight"]).view(T, nkv, hd)
        v = F.linear(h, w[p + "self_attn.v_proj.weight"]).view(T, nkv, hd)
        q = _rms(q, w[p + "self_attn.q_norm.weight"], self.eps)
        k = _rms(k, w[p + "self_attn.k_norm.weight"], self.eps)
        pos = torch.arange(T)
        q, k = _rope(q, pos, self.rot, self.theta), _rope(k, pos, self.rot, self.theta)
        k = k.repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / hd ** 0.5
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        o = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v).reshape(T, nh * hd)
        x = x + F.linear(o * torch.sigmoid(gate), w[p + "self_attn.o_proj.weight"])
        return x + self._ffn(_rms(x, w[p + "post_attention_layernorm.weight"], self.eps))

    def rows(self, tokens: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """MTP outputs (after ``mtp.norm``) for rows ``(hidden[i], tokens[i])`` at positions ``0..``."""
        w = self.w
        e = _rms(self.embed[torch.tensor(tokens)], w["pre_fc_norm_embedding.weight"], self.eps)
        h = _rms(hidden.double(), w["pre_fc_norm_hidden.weight"], self.eps)
        x = F.linear(torch.cat([e, h], -1), w["fc.weight"])
        return _rms(self._layer(x), w["norm.weight"], self.eps)

    def chain(self, target_hidden: torch.Tensor, seq: list[int], k: int, forced: list[int] | None = None):
        """Drafts after ``seq`` (committed tokens; ``target_hidden`` their target hidden states,
        one row fewer than ``seq``: the last token of ``seq`` is the one drafted from).

        Returns (greedy or ``forced`` drafts, logits ``[k, V]``).
        """
        hid = [target_hidden[i] for i in range(target_hidden.shape[0])]
        toks = list(seq[1:])
        drafts, logits = [], []
        for j in range(k):
            g = self.rows(toks, torch.stack(hid))[-1]
            lg = F.linear(g, self.head)
            logits.append(lg)
            d = int(lg.argmax()) if forced is None else forced[j]
            drafts.append(d)
            hid.append(g)
            toks.append(d)
        return drafts, torch.stack(logits)
