"""Typed model configs, parsed from HF ``config.json`` or from GGUF metadata.

Each architecture module declares a dataclass deriving from :class:`ModelConfig` that mirrors
the fields of its ``config.json``; :func:`parse_config` fills it, converting transformers 4
(``rope_theta`` / ``rope_scaling``) and 5 (``rope_parameters``) layouts to one shape. No
tensors are touched here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .errors import ConfigError

C = TypeVar("C", bound="ModelConfig")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# Upper bound of every integer config field (sizes, counts, token ids): above any real model's,
# and low enough that products of a few of them cannot overflow torch's int64 shapes.
MAX_INT = 2**31 - 1
# Upper bound of a layer count: far above any real model's, low enough that a corrupt count
# cannot make the per-layer lists and modules built from it exhaust time or memory.
MAX_LAYERS = 4096


@dataclass
class ModelConfig:
    """Fields shared by every decoder-only target. Architecture configs add their own."""

    # RoPE types this family's rotary embedding computes (a class attribute, not a field)
    rope_types = SUPPORTED_ROPE_TYPES

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int = 0
    head_dim: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # rope_type plus its parameters (llama3 factor etc.), without rope_theta.
    rope_scaling: dict | None = None
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    # Everything config.json held, for fields only one component reads (e.g. MTP settings).
    raw: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for f in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            if not getattr(self, f) > 0:
                raise ConfigError(f"field '{f}' must be positive, got {getattr(self, f)}")
        if not self.rope_theta > 0 or self.rms_norm_eps < 0:
            raise ConfigError(f"rope_theta={self.rope_theta} must be positive and rms_norm_eps={self.rms_norm_eps} "
                              f"not negative")
        if self.num_hidden_layers > MAX_LAYERS:
            raise ConfigError(f"field 'num_hidden_layers' = {self.num_hidden_layers} exceeds {MAX_LAYERS}")
        if not self.num_key_value_heads:
            self.num_key_value_heads = self.num_attention_heads
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if not self.head_dim > 0:
            raise ConfigError(f"field 'head_dim' must be positive, got {self.head_dim} (hidden_size="
                              f"{self.hidden_size} / num_attention_heads={self.num_attention_heads})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )


def _normalise_rope(d: dict) -> dict:
    """Fold ``rope_parameters`` (transformers 5) and ``rope_scaling`` (4.x) into our fields."""
    out = dict(d)
    params = d.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params and isinstance(params["full_attention"], dict):
        params = params["full_attention"]  # per-layer-type dict (Gemma style): the global one
    scaling = dict(params) if isinstance(params, dict) else dict(d.get("rope_scaling") or {})
    if "rope_theta" in scaling:
        out["rope_theta"] = scaling.pop("rope_theta")
    if "partial_rotary_factor" in scaling:
        out["partial_rotary_factor"] = scaling.pop("partial_rotary_factor")
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default" and set(scaling) <= {"rope_type", "mrope_section", "mrope_interleaved"}:
        # plain RoPE; keep the mRoPE section if any (text positions make it plain RoPE anyway)
        out["rope_scaling"] = scaling if "mrope_section" in scaling else None
    else:
        out["rope_scaling"] = scaling
    return out


def parse_config(cls: type[C], d: dict, source: str = "config.json") -> C:
    """Build ``cls`` from a config dict, raising :class:`ConfigError` naming a missing field."""
    d = _normalise_rope(d)
    eos = d.get("eos_token_id")
    d["eos_token_id"] = [] if eos is None else ([eos] if isinstance(eos, int) and not isinstance(eos, bool) else eos)
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name == "raw":
            continue
        if f.name in d and d[f.name] is not None:
            check_field(f.name, d[f.name], hints[f.name], source)
            kwargs[f.name] = d[f.name]
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:  # type: ignore[misc]
            raise ConfigError(f"{source}: required field '{f.name}' is missing (model_type={d.get('model_type')!r})")
    kind = (d.get("rope_scaling") or {}).get("rope_type", "default")
    if kind not in cls.rope_types:
        raise ConfigError(f"{source}: rope_type '{kind}' is not supported (supported: {', '.join(cls.rope_types)})")
    try:
        return cls(raw=d, **kwargs)
    except TypeError as e:
        raise ConfigError(f"{source}: {e}") from e
    except ConfigError as e:  # __post_init__ checks do not know the file
        raise e if str(e).startswith(source) else ConfigError(f"{source}: {e}") from e


def check_field(name: str, value, hint, source: str) -> None:
    """Refuse ``value`` unless it fits the field's annotation ``hint`` (int, float, bool, str,
    dict, list, list[int], X | None). Integers must lie in 0..MAX_INT and floats be finite, so a
    corrupt config fails here, naming the field, rather than deep inside torch."""
    if _fits(value, hint):
        return
    raise ConfigError(f"{source}: field '{name}' must be {_describe(hint)}, got {str(repr(value))[:80]}")


def _fits(value, hint) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_INT
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if hint in (bool, str, dict, list):
        return isinstance(value, hint)
    if origin is list:
        return isinstance(value, list) and all(_fits(v, args[0]) for v in value) if args else isinstance(value, list)
    return True  # a type this checker does not know: left to the config class


def _describe(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    return {int: f"an integer in 0..{MAX_INT}", float: "a finite number", bool: "true or false", str: "a string",
            dict: "an object", list: "a list", type(None): "null"}.get(hint) or (
        f"a list of {_describe(args[0])}s" if origin is list and args else str(hint))


def read_json(path: str) -> dict:
    """Read a JSON file, turning a parse error into a :class:`ConfigError` naming the file."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError as e:
        raise ConfigError(f"{path}: file not found") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from e
    except (OSError, RecursionError) as e:
        raise ConfigError(f"{path}: cannot read ({e})") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object at top level")
    return data


def generation_eos_ids(folder: str) -> list[int]:
    """``eos_token_id`` (an id or a list of ids) of ``generation_config.json`` in an HF checkpoint
    folder; [] when the file or the field is absent. Instruct checkpoints often name their
    end-of-turn token only there."""
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return []
    eos = read_json(path).get("eos_token_id")
    if eos is None:
        return []
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ConfigError(f"{path}: field 'eos_token_id' must be a token id or a list of token ids, got {eos!r}")
    return ids


def text_config(d: dict) -> dict:
    """Return the text-model part of a (possibly vision-language wrapped) HF config dict."""
    if "text_config" in d and isinstance(d["text_config"], dict):
        inner = dict(d["text_config"])
        for k in ("tie_word_embeddings", "eos_token_id", "bos_token_id"):
            if k in d and k not in inner:
                inner[k] = d[k]
        inner.setdefault("model_type", d.get("model_type", ""))
        return inner
    return d
