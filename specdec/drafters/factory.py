"""Build a drafter from a user-facing spec: ``none``, ``ngram``, ``mtp``, ``dflash:PATH``."""

from __future__ import annotations

from ..errors import ConfigError
from .ngram import NgramDrafter

SPECS = "none | ngram | mtp | dflash:PATH"


def make_drafter(spec, loaded, *, block_size: int | None = None):
    """``loaded`` is the target's :class:`~specdec.loading.LoadedModel`. Returns a drafter or None."""
    if spec is None or spec == "none":
        if block_size is not None:
            raise ConfigError("block_size was given but no DFlash drafter is used")
        return None
    if not isinstance(spec, str):
        return spec  # already a drafter object
    if block_size is not None and not spec.startswith("dflash:"):
        raise ConfigError(f"block_size applies to DFlash drafters only, not '{spec}' (use num_draft_tokens)")
    if spec == "ngram":
        return NgramDrafter()
    if spec == "mtp":
        from .mtp import load_mtp_drafter
        return load_mtp_drafter(loaded)
    if spec.startswith("dflash:"):
        from .dflash import load_dflash_drafter
        return load_dflash_drafter(spec[len("dflash:"):], loaded, block_size=block_size)
    raise ConfigError(f"unknown drafter '{spec}'; expected {SPECS}")
