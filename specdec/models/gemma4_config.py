"""The Gemma 4 text config (``gemma4_text``, or the ``text_config`` of a ``gemma4`` checkpoint).

Mirrors transformers' ``Gemma4TextConfig`` and resolves what it derives at load time, so the
model code reads plain per-layer facts:

- ``layer_types``: ``sliding_attention`` / ``full_attention`` (default: every 6th layer full); as
  in transformers the last layer is made ``full_attention`` (with a warning) when it is not.
- per layer type, the head size and KV-head count (``attention_dims``): sliding layers use
  ``head_dim`` / ``num_key_value_heads``; full layers the overrides of ``per_layer_config``
  (transformers 5 writes it) or, when absent, ``global_head_dim`` and, with
  ``attention_k_eq_v``, ``num_global_key_value_heads``. Overrides must agree within a type.
- per layer type, the RoPE (``rope``: base, rotated fraction, frequency divisor) from
  ``rope_parameters[type]``: ``default`` or ``proportional`` (the first ``partial_rotary_factor``
  of each rotate-half pair rotates at ``base ** (-2i / head_dim)``, the rest does not rotate).
- ``kv_source[i]``: for the last ``num_kv_shared_layers`` layers, the layer whose keys and values
  they reuse (the last earlier layer of the same type); None for layers with their own KV.

Anything else a field can ask for that the model does not compute is refused here, naming it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from ..config import ModelConfig
from ..errors import ConfigError

LAYER_TYPES = ("sliding_attention", "full_attention")
ROPE_TYPES = ("default", "proportional")
# transformers' defaults when config.json carries no rope_parameters
_DEFAULT_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                 "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}


@dataclass
class Gemma4Config(ModelConfig):
    """``Gemma4TextConfig``; defaults mirror transformers'."""

    rope_types = ROPE_TYPES  # the global (full-attention) entry is read again per type below

    num_key_value_heads: int = 4
    head_dim: int = 256
    max_position_embeddings: int = 131_072
    tie_word_embeddings: bool = True
    hidden_activation: str = "gelu_pytorch_tanh"
    sliding_window: int = 512
    layer_types: list | None = None
    final_logit_softcapping: float | None = None
    use_bidirectional_attention: str | None = None
    vocab_size_per_layer_input: int = 262_144
    hidden_size_per_layer_input: int = 256
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    enable_moe_block: bool = False
    use_double_wide_mlp: bool = False
    num_experts: int | None = None
    top_k_experts: int | None = None
    moe_intermediate_size: int | None = None
    global_head_dim: int = 512
    num_global_key_value_heads: int | None = None
    per_layer_config: dict | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        mt = self.model_type
        if self.hidden_activation != "gelu_pytorch_tanh":
            raise ConfigError(f"{mt} config: hidden_activation '{self.hidden_activation}' is not supported "
                              "(gelu_pytorch_tanh)")
        if self.use_bidirectional_attention not in (None, "vision"):
            # "vision" makes image tokens attend both ways; text alone stays causal
            raise ConfigError(f"{mt} config: use_bidirectional_attention={self.use_bidirectional_attention!r} is not "
                              "supported (a causal target is needed)")
        self._layer_types()
        if "sliding_attention" in self.layer_types and not self.sliding_window > 0:
            raise ConfigError(f"{mt} config: sliding_window must be a positive integer for sliding_attention layers, "
                              f"got {self.sliding_window!r}")
        self.attention_dims = self._attention_dims()
        self.rope = {t: self._rope(t) for t in dict.fromkeys(self.layer_types)}
        self.kv_source = self._kv_sources()
        if self.enable_moe_block:
            for f in ("num_experts", "top_k_experts", "moe_intermediate_size"):
                if not getattr(self, f):
                    raise ConfigError(f"{mt} config: enable_moe_block=true needs a positive '{f}', got {getattr(self, f)!r}")
            if self.top_k_experts > self.num_experts:
                raise ConfigError(f"{mt} config: top_k_experts={self.top_k_experts} exceeds num_experts={self.num_experts}")
        if self.hidden_size_per_layer_input and self.vocab_size_per_layer_input < self.vocab_size:
            raise ConfigError(f"{mt} config: vocab_size_per_layer_input={self.vocab_size_per_layer_input} is smaller "
                              f"than vocab_size={self.vocab_size} (tokens past it have no per-layer embedding)")

    def _layer_types(self) -> None:
        mt, n = self.model_type, self.num_hidden_layers
        if self.layer_types is None:
            self.layer_types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
        self.layer_types = list(self.layer_types)
        if len(self.layer_types) != n:
            raise ConfigError(f"{mt} config: layer_types has {len(self.layer_types)} entries for num_hidden_layers={n}")
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ConfigError(f"{mt} config: layer_types {bad} not supported ({', '.join(LAYER_TYPES)})")
        if self.layer_types[-1] != "full_attention":
            warnings.warn(f"{mt} config: layer_types ends in '{self.layer_types[-1]}'; the last layer is made "
                          "full_attention, as transformers does", stacklevel=3)
            self.layer_types[-1] = "full_attention"

    def _attention_dims(self) -> dict[str, tuple[int, int]]:
        """(head_dim, KV heads) per layer type."""
        mt, n = self.model_type, self.num_hidden_layers
        per_layer = [(self.head_dim, self.num_key_value_heads)] * n
        if self.per_layer_config is not None:
            for key, over in self.per_layer_config.items():
                i = int(key) if str(key).isdigit() else -1
                if not 0 <= i < n or not isinstance(over, dict):
                    raise ConfigError(f"{mt} config: per_layer_config entry {str(key)[:20]!r} must map a layer index "
                                      f"below {n} to an object")
                extra = sorted(set(over) - {"head_dim", "num_key_value_heads"})
                if extra:
                    raise ConfigError(f"{mt} config: per_layer_config overrides {extra} are not supported "
                                      "(head_dim, num_key_value_heads)")
                hd, kv = over.get("head_dim", self.head_dim), over.get("num_key_value_heads", self.num_key_value_heads)
                if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (hd, kv)):
                    raise ConfigError(f"{mt} config: per_layer_config[{key}] sizes must be positive integers, "
                                      f"got head_dim={hd!r}, num_key_value_heads={kv!r}")
                per_layer[i] = (hd, kv)
        else:  # what transformers derives from the older fields
            kv = self.num_global_key_value_heads if self.attention_k_eq_v and self.num_global_key_value_heads else None
            full = (self.global_head_dim, kv or self.num_key_value_heads)
            per_layer = [full if t == "full_attention" else d for t, d in zip(self.layer_types, per_layer)]
        dims: dict[str, tuple[int, int]] = {}
        for i, (t, d) in enumerate(zip(self.layer_types, per_layer)):
            if dims.setdefault(t, d) != d:
                raise ConfigError(f"{mt} config: per_layer_config gives layer {i} ({t}) head_dim/num_key_value_heads "
                                  f"{d}, other {t} layers {dims[t]} (they must agree within a layer type)")
            if not d[0] > 0 or self.num_attention_heads % d[1]:
                raise ConfigError(f"{mt} config: {t} layers: head_dim={d[0]} must be positive and "
                                  f"num_attention_heads={self.num_attention_heads} a multiple of {d[1]} KV heads")
        return dims

    def _rope(self, layer_type: str) -> tuple[float, float, float]:
        """(base, rotated fraction, frequency divisor) of one layer type."""
        mt = self.model_type
        params = self.raw.get("rope_parameters")
        if params is None and self.raw.get("rope_scaling"):
            raise ConfigError(f"{mt} config: rope_scaling is not read for Gemma 4 (its RoPE is rope_parameters, "
                              "one object per layer type)")
        params = params or _DEFAULT_ROPE
        p = params.get(layer_type) if isinstance(params, dict) else None
        if not isinstance(p, dict):
            raise ConfigError(f"{mt} config: rope_parameters must hold an object for every layer type; "
                              f"'{layer_type}' has none")
        kind = p.get("rope_type", "default")
        if kind not in ROPE_TYPES:
            raise ConfigError(f"{mt} config: {layer_type} rope_type '{kind}' is not supported ({', '.join(ROPE_TYPES)})")
        allowed = {"rope_type", "rope_theta"} | ({"partial_rotary_factor", "factor"} if kind == "proportional" else set())
        extra = sorted(set(p) - allowed)
        if extra:
            raise ConfigError(f"{mt} config: rope_parameters['{layer_type}'] fields {extra} are not supported "
                              f"with rope_type '{kind}'")
        theta, frac, factor = p.get("rope_theta"), p.get("partial_rotary_factor", 1.0), p.get("factor", 1.0)
        for name, v in (("rope_theta", theta), ("partial_rotary_factor", frac), ("factor", factor)):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise ConfigError(f"{mt} config: rope_parameters['{layer_type}'].{name} must be a positive number, "
                                  f"got {v!r}")
        if frac > 1:
            raise ConfigError(f"{mt} config: rope_parameters['{layer_type}'].partial_rotary_factor={frac} exceeds 1")
        return float(theta), float(frac), float(factor)

    def _kv_sources(self) -> list[int | None]:
        mt, n, shared = self.model_type, self.num_hidden_layers, self.num_kv_shared_layers
        if not 0 <= shared < n:
            raise ConfigError(f"{mt} config: num_kv_shared_layers={shared} must be below num_hidden_layers={n} "
                              "(some layer must compute the keys and values the others reuse)")
        first = n - shared
        last_of = {t: i for i, t in enumerate(self.layer_types[:first])}
        if shared and set(last_of) != set(self.layer_types):
            raise ConfigError(f"{mt} config: num_kv_shared_layers={shared} leaves no earlier layer of type(s) "
                              f"{sorted(set(self.layer_types) - set(last_of))} to share keys and values with")
        return [None if i < first else last_of[self.layer_types[i]] for i in range(n)]
