"""Load a target from a local HF directory or GGUF file: config, weights, tokenizer."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .config import generation_eos_ids, parse_config, read_json, text_config
from .errors import CheckpointError, ConfigError
from .models import CausalLM, by_gguf_arch, by_hf_model_type
from .models.registry import Architecture
from .parallel.tp import Shard, param_slices
from .tokenizer import Tokenizer
from .weights import load_into
from .weights.loader import check_layer_count
from .weights.gguf_io import GGUFSource
from .weights.safetensors_io import SafetensorsSource

_HF_PREFIXES = ("model.language_model.", "model.")


@dataclass
class LoadedModel:
    model: CausalLM
    tokenizer: Tokenizer | None
    arch: Architecture
    path: str
    source: object  # GGUFSource | SafetensorsSource, kept for drafters that read more tensors
    format: str  # "gguf" | "hf"


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        d = None
    if d is None or d.type not in ("cpu", "cuda"):
        raise ConfigError(f"device '{device}' is not supported; use cpu, cuda or cuda:N")
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device '{device}' requested but CUDA is not available; use --device cpu")
    if d.type == "cuda" and d.index is not None and d.index >= torch.cuda.device_count():
        raise ConfigError(f"device '{device}': this machine has {torch.cuda.device_count()} CUDA device(s)")
    return d


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ConfigError(f"dtype '{dtype}' is not supported; use one of {', '.join(table)}")
    return table[dtype]


def is_gguf(path: str) -> bool:
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as fh:
        return fh.read(4) == b"GGUF"


def hf_param_name(name: str) -> str:
    for p in _HF_PREFIXES:
        if name.startswith(p):
            return name[len(p):]
    return name


def read_model_config(path: str):
    """(Architecture, config) of a checkpoint without reading its tensors."""
    if is_gguf(path):
        src = GGUFSource(path)
        arch = by_gguf_arch(src.architecture, path)
        try:
            d = arch.gguf_config(src.metadata)
        except CheckpointError as e:  # the metadata readers name the key, not the file
            raise CheckpointError(f"{path}: {e}") from e
        d["tie_word_embeddings"] = "output.weight" not in src.infos()
        if arch.gguf_tensor_config is not None:
            arch.gguf_tensor_config(d, src)
        return arch, parse_config(arch.config_cls, d, source=path), src
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a GGUF file or an HF checkpoint directory")
    cfg_path = os.path.join(path, "config.json")
    raw = read_json(cfg_path)
    if is_dflash_config(raw):
        raise ConfigError(f"{cfg_path}: this is a DFlash drafter checkpoint, not a target model; "
                          f"use it as --draft dflash:{path}")
    d = text_config(raw)
    if "model_type" not in d:
        raise ConfigError(f"{cfg_path}: field 'model_type' is missing")
    if not isinstance(d["model_type"], str):
        raise ConfigError(f"{cfg_path}: field 'model_type' must be a string, got {str(repr(d['model_type']))[:80]}")
    arch = by_hf_model_type(d["model_type"], cfg_path)
    cfg = parse_config(arch.config_cls, d, source=cfg_path)
    # stop ids named only in generation_config.json (an instruct model's end-of-turn token)
    cfg.eos_token_id += [i for i in dict.fromkeys(generation_eos_ids(path)) if i not in cfg.eos_token_id]
    return arch, cfg, None


def is_dflash_config(d: dict) -> bool:
    """Whether a config.json describes a DFlash drafter (z-lab format)."""
    archs = d.get("architectures")
    return "dflash_config" in d or isinstance(archs, list) and any("DFlash" in str(a) for a in archs)


def load_model(path: str, device: str | torch.device | None = None, dtype=None, tokenizer: bool = True,
               shard: Shard | None = None) -> LoadedModel:
    """Load a target model (and its tokenizer) strictly from ``path``. With a ``shard``
    (tensor parallelism, inside a rank's process) the model is that rank's part, and only its
    slices of the split weights are read."""
    path = os.path.expanduser(str(path))
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such file or directory")
    dev = resolve_device(str(device) if isinstance(device, torch.device) else device)
    dt = resolve_dtype(dtype, dev)
    arch, cfg, gsrc = read_model_config(path)
    src = gsrc if gsrc is not None else SafetensorsSource(path)
    check_layer_count(cfg.num_hidden_layers, len(src.infos()), path)
    if shard is not None and not arch.model_cls.tensor_parallel:
        raise ConfigError(f"{path}: tensor parallelism supports Llama-family, Qwen3 and Qwen3.5 dense targets, "
                          f"not {arch.name} yet")
    with torch.device("meta"):
        model = arch.model_cls(cfg) if shard is None else arch.model_cls(cfg, shard=shard)
    if gsrc is not None:
        view = gsrc
        if arch.target_view is not None:
            view = arch.target_view(cfg, src, "gguf")
        names = arch.gguf_names(cfg)
        ignore = set(arch.gguf_ignore)
        transform = arch.gguf_transform(cfg)
        fmt = "gguf"
    else:
        view = src
        if arch.target_view is not None:
            view = arch.target_view(cfg, src, "hf")
        infos = view.infos()
        if arch.hf_names is not None:
            names = arch.hf_names(cfg, infos)
        else:
            names = {n: hf_param_name(n) for n in infos}
        ignore = {n for n in infos if any(n.startswith(p) for p in arch.hf_ignore_prefixes)}
        if cfg.tie_word_embeddings and "lm_head.weight" in infos:
            ignore.add("lm_head.weight")
        names = {k: v for k, v in names.items() if k not in ignore}
        transform = arch.hf_transform(cfg)
        fmt = "hf"
    load_into(model, view, names, dtype=dt, device=dev, transform=transform, ignore=ignore,
              desc=f"loading {os.path.basename(path.rstrip('/'))}", slices=param_slices(model) if shard else None)
    if "rope_freqs.weight" in src.infos() and not arch.gguf_rope_freqs_in_config:
        model.rotary.freq_factors = src.get("rope_freqs.weight", torch.float32)
    model.eval()
    model.fuse_projections()
    tok = None
    if tokenizer:
        if fmt == "gguf":
            # a GGUF written without a vocabulary (``convert --no-vocab``) loads with no tokenizer
            if "tokenizer.ggml.model" in src.metadata:
                tok = Tokenizer.from_gguf(src.metadata, path)
        elif os.path.exists(os.path.join(path, "tokenizer.json")):
            tok = Tokenizer.from_hf_dir(path, cfg.eos_token_id)
    return LoadedModel(model, tok, arch, path, src, fmt)
