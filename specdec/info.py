"""``specdec info``: what a checkpoint holds, read from its headers without loading weights."""

from __future__ import annotations

import os

from .loading import read_model_config
from .weights.safetensors_io import SafetensorsSource


def describe(path: str) -> dict:
    """Architecture, sizes, storage types, tokenizer and the drafters that fit this target."""
    path = os.path.expanduser(path)
    arch, cfg, gsrc = read_model_config(path)
    src = gsrc if gsrc is not None else SafetensorsSource(path)
    infos = src.infos()
    types: dict[str, int] = {}
    params = 0
    for i in infos.values():
        types[i.dtype] = types.get(i.dtype, 0) + 1
        n = 1
        for s in i.shape:
            n *= s
        params += n
    has_mtp = any(n.startswith("mtp.") or ".nextn." in n for n in infos)
    drafters = ["ngram", "dflash:PATH (a DFlash checkpoint trained for this target)"]
    if has_mtp and "mtp" in arch.drafters:
        drafters.insert(0, "mtp")
    out = {
        "path": path,
        "format": "gguf" if gsrc is not None else "hf",
        "architecture": arch.name,
        "model_type": cfg.model_type,
        "layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "attention_heads": cfg.num_attention_heads,
        "kv_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "context_length": cfg.max_position_embeddings,
        "tied_embeddings": cfg.tie_word_embeddings,
        "parameters": params,
        "tensors": len(infos),
        "storage_types": dict(sorted(types.items())),
        "mtp_tensors": has_mtp,
        "drafters": drafters,
    }
    for key in ("layer_types", "num_experts", "num_experts_per_tok"):
        v = getattr(cfg, key, None)
        if v:
            out[key] = v if key != "layer_types" else {t: list(v).count(t) for t in dict.fromkeys(v)}
    if gsrc is not None:
        m = gsrc.metadata
        out["tokenizer"] = {"source": "gguf", "model": m.get("tokenizer.ggml.model"), "pre": m.get("tokenizer.ggml.pre"),
                            "tokens": len(m.get("tokenizer.ggml.tokens", [])), "bos": m.get("tokenizer.ggml.bos_token_id"),
                            "eos": m.get("tokenizer.ggml.eos_token_id"), "chat_template": "tokenizer.chat_template" in m}
    else:
        tj = os.path.join(path, "tokenizer.json")
        out["tokenizer"] = {"source": "tokenizer.json" if os.path.exists(tj) else None,
                            "chat_template": os.path.exists(os.path.join(path, "chat_template.jinja")) or _has_template(path)}
    return out


def _has_template(path: str) -> bool:
    import json
    tc = os.path.join(path, "tokenizer_config.json")
    if not os.path.exists(tc):
        return False
    with open(tc, encoding="utf-8") as fh:
        return bool(json.load(fh).get("chat_template"))


def format_info(d: dict) -> str:
    lines = []
    for k, v in d.items():
        if isinstance(v, dict):
            v = ", ".join(f"{a}={b}" for a, b in v.items())
        elif isinstance(v, list):
            v = ", ".join(str(x) for x in v)
        elif k == "parameters":
            v = f"{v:,} ({v / 1e6:.1f} M)"
        lines.append(f"{k:>18}: {v}")
    return "\n".join(lines)
