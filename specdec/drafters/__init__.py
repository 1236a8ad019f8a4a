"""Drafters behind one protocol: n-gram lookup, MTP (Qwen3.5 NextN), DFlash (block diffusion).

Exports resolve lazily so that the CLI can read :data:`.factory.SPECS` without importing torch.
"""

from importlib import import_module

_EXPORTS = {"Drafter": "base", "Proposal": "base", "NgramDrafter": "ngram"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'specdec.drafters' has no attribute '{name}'")
    value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value
