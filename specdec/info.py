"""``specdec info``: what a checkpoint holds, read from its headers without loading weights."""

from __future__ import annotations

import os

from .config import read_json
from .errors import CheckpointError
from .loading import is_dflash_config, read_model_config
from .weights.safetensors_io import SafetensorsSource


def describe(path: str) -> dict:
    """Architecture, sizes, storage types, tokenizer and the drafters that fit this target."""
    path = os.path.expanduser(path)
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such file or directory")
    cfg_json = os.path.join(path, "config.json")
    if os.path.isdir(path) and os.path.exists(cfg_json) and is_dflash_config(read_json(cfg_json)):
        return describe_dflash(path)
    if os.path.isdir(path) and os.path.exists(cfg_json):
        from .drafters.mtp_dir import is_mtp_config
        if is_mtp_config(read_json(cfg_json)):
            return describe_mtp(path)
    arch, cfg, gsrc = read_model_config(path)
    src = gsrc if gsrc is not None else SafetensorsSource(path)
    infos = src.infos()
    types = _count_types(infos)
    params = sum(_numel(i.shape) for i in infos.values())
    has_mtp = any(n.startswith("mtp.") or ".nextn." in n for n in infos)
    drafters = ["ngram"]
    if "dflash" in arch.drafters:
        drafters.append("dflash:PATH (a DFlash checkpoint trained for this target)")
    if "mtp:PATH" in arch.drafters:
        drafters.append("mtp:PATH (an MTP head directory trained for this target)")
    if has_mtp and "mtp" in arch.drafters:
        drafters.insert(0, "mtp")
    from .drafters.shipped import shipped_for
    shipped = shipped_for(path)
    for kind in ("mtp", "dflash"):  # shipped ones first, DFlash on top
        if kind in shipped and kind in arch.drafters + (("mtp",) if "mtp:PATH" in arch.drafters else ()):
            drafters.insert(0, f"{kind} (shipped with specdec: {shipped[kind]})")
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
        "storage_types": types,
        "mtp_tensors": has_mtp,
        "drafters": drafters,
    }
    for key in ("layer_types", "num_experts", "num_experts_per_tok", "top_k_experts", "num_kv_shared_layers",
                "hidden_size_per_layer_input"):
        v = getattr(cfg, key, None)
        if v:
            out[key] = v if key != "layer_types" else {t: list(v).count(t) for t in dict.fromkeys(v)}
    dims = getattr(cfg, "attention_dims", None)  # Gemma 4: head size and KV heads per layer type
    if dims:
        out["attention_dims"] = {t: f"{hd}x{kv}kv" for t, (hd, kv) in dims.items()}
    if gsrc is not None:
        m = gsrc.metadata
        out["tokenizer"] = {"source": "gguf", "model": m.get("tokenizer.ggml.model"), "pre": m.get("tokenizer.ggml.pre"),
                            "tokens": _count(m.get("tokenizer.ggml.tokens", [])), "bos": m.get("tokenizer.ggml.bos_token_id"),
                            "eos": m.get("tokenizer.ggml.eos_token_id"), "chat_template": "tokenizer.chat_template" in m}
    else:
        tj = os.path.join(path, "tokenizer.json")
        out["tokenizer"] = {"source": "tokenizer.json" if os.path.exists(tj) else None,
                            "chat_template": os.path.exists(os.path.join(path, "chat_template.jinja")) or _has_template(path)}
    return out


def describe_dflash(path: str) -> dict:
    """A DFlash drafter directory: its block, the target layers it reads, weight bytes."""
    from .drafters.dflash_model import DFlashConfig

    cfg_path = os.path.join(path, "config.json")
    c = DFlashConfig.from_dict(read_json(cfg_path), cfg_path)
    infos = SafetensorsSource(path).infos()
    nbytes = sum(_numel(i.shape) * {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}.get(i.dtype, 1) for i in infos.values())
    return {
        "path": path, "format": "hf", "kind": "DFlash drafter (use as --draft dflash:PATH)",
        "block_size": c.block_size, "drafts_per_step": c.block_size - 1, "layers": c.num_hidden_layers,
        "hidden_size": c.hidden_size, "target_layers": c.num_target_layers,
        "target_layer_ids": list(c.target_layer_ids), "mask_token_id": c.mask_token_id,
        "layer_types": {t: list(c.layer_types).count(t) for t in dict.fromkeys(c.layer_types)},
        "tensors": len(infos), "storage_types": _count_types(infos),
        "weight_bytes": nbytes,
        "shares": "embedding and LM head of the target", **_draft_vocab(path),
    }


def _draft_vocab(path: str) -> dict:
    """A drafter directory's draft vocabulary, when it has one (:mod:`specdec.drafters.draft_vocab`)."""
    from .drafters.factory import VOCAB_FILE

    f = os.path.join(path, VOCAB_FILE)
    if not os.path.isfile(f):
        return {}
    try:
        raw = read_json(f)
        n = len(raw["token_ids"] if isinstance(raw, dict) else raw)
    except Exception:  # noqa: BLE001 - info describes; loading the drafter names the fault
        return {"draft_vocab": f"{VOCAB_FILE} (unreadable)"}
    return {"draft_vocab": f"{n} tokens and the prompt's ({VOCAB_FILE}; used by default on the CPU, on CUDA where it skips >= 64 MiB of head rows; --draft-vocab none: never)"}


def describe_mtp(path: str) -> dict:
    """An MTP drafter directory: the target it was made for, the chain it was trained on, weight bytes."""
    from .drafters.mtp_dir import FIT_FIELDS

    d = read_json(os.path.join(path, "config.json"))
    infos = SafetensorsSource(path).infos()
    nbytes = sum(_numel(i.shape) * {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}.get(i.dtype, 1) for i in infos.values())
    return {
        "path": path, "format": "hf", "kind": "MTP drafter (use as --draft mtp:PATH)",
        **{f: d.get(f) for f in FIT_FIELDS if f in d}, "num_draft_steps_trained": d.get("num_draft_steps_trained"),
        "tensors": len(infos), "storage_types": _count_types(infos), "weight_bytes": nbytes,
        "shares": "embedding and LM head of the target", **_draft_vocab(path),
    }


def _has_template(path: str) -> bool:
    tc = os.path.join(path, "tokenizer_config.json")
    if not os.path.exists(tc):
        return False
    return bool(read_json(tc).get("chat_template"))


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


def _count(v) -> int | None:
    """Length of a metadata array; None when a corrupt file stores something else there."""
    return len(v) if isinstance(v, list) else None


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _count_types(infos) -> dict[str, int]:
    out: dict[str, int] = {}
    for i in infos.values():
        out[i.dtype] = out.get(i.dtype, 0) + 1
    return dict(sorted(out.items()))
