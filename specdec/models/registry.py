"""Architecture registry keyed by HF ``model_type`` and GGUF ``general.architecture``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..errors import ConfigError


def _no_transform(config):
    return None


@dataclass(frozen=True)
class Architecture:
    """How to build, name and convert one model family.

    ``hf_names(config, checkpoint_names)`` maps HF checkpoint tensor names to parameter names
    (default: strip the ``model.`` / ``model.language_model.`` prefix); ``gguf_names(config)``
    maps llama.cpp names; ``*_transform(config)`` returns a per-tensor fix-up or None.
    ``target_view(config, source, fmt)``, when set, returns the view of the checkpoint the
    target loads from (``fmt`` is "hf" or "gguf"): it may leave out tensors another component
    owns (an MTP block) and present converted ones (stacked experts, renamed GGUF tensors);
    the names maps then apply to the view's names. ``LoadedModel.source`` stays the raw source.
    ``gguf_tensor_config(config_dict, source)``, when set, completes the config dict of a GGUF
    file with what llama.cpp expresses by tensors rather than metadata (Gemma 4: k=v attention,
    proportional RoPE in ``rope_freqs``; Llama: attention and MLP biases).
    """

    name: str
    hf_model_types: tuple[str, ...]
    gguf_archs: tuple[str, ...]
    config_cls: type
    model_cls: type
    gguf_config: Callable[[dict], dict]
    gguf_names: Callable[..., dict]
    hf_names: Callable[..., dict] | None = None
    hf_transform: Callable = _no_transform
    gguf_transform: Callable = _no_transform
    gguf_ignore: tuple[str, ...] = ()
    hf_ignore_prefixes: tuple[str, ...] = ()
    target_view: Callable | None = None
    gguf_tensor_config: Callable | None = None
    # where a GGUF's ``rope_freqs.weight`` goes: the rotary's per-pair divisors (Llama 3), or
    # already into the config by ``gguf_tensor_config`` (Gemma 4's proportional RoPE)
    gguf_rope_freqs_in_config: bool = False
    drafters: tuple[str, ...] = field(default=("ngram", "dflash"))


_BY_HF: dict[str, Architecture] = {}
_BY_GGUF: dict[str, Architecture] = {}


def register(arch: Architecture) -> None:
    for t in arch.hf_model_types:
        _BY_HF[t] = arch
    for t in arch.gguf_archs:
        _BY_GGUF[t] = arch


def _load_all() -> None:
    # Importing the modules runs their register() calls.
    from . import gemma3, gemma4, llama, qwen35  # noqa: F401


def supported() -> tuple[list[str], list[str]]:
    _load_all()
    return sorted(_BY_HF), sorted(_BY_GGUF)


def by_hf_model_type(model_type: str, source: str) -> Architecture:
    _load_all()
    if model_type not in _BY_HF:
        raise ConfigError(f"{source}: model_type '{model_type}' is not supported; supported: {', '.join(sorted(_BY_HF))}")
    return _BY_HF[model_type]


def by_gguf_arch(arch: str, source: str) -> Architecture:
    _load_all()
    if arch not in _BY_GGUF:
        raise ConfigError(f"{source}: GGUF architecture '{arch}' is not supported; supported: {', '.join(sorted(_BY_GGUF))}")
    return _BY_GGUF[arch]
