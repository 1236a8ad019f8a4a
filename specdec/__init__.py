"""specdec: lossless speculative decoding (MTP, DFlash, n-gram drafters) in PyTorch.

The exports are resolved lazily (module ``__getattr__``): ``import specdec.cli`` and
``specdec --help`` must not pay for importing torch.
"""

from importlib import import_module

__version__ = "0.1.0"

# public name -> the submodule that defines it
_EXPORTS = {
    "LLM": "api", "Target": "api", "load_target": "api", "SamplingParams": "sampling",
    "SpecdecError": "errors", "CheckpointError": "errors", "ConfigError": "errors",
    "ContextOverflowError": "errors", "RequestError": "errors",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'specdec' has no attribute '{name}'")
    value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
