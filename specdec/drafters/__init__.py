"""Drafters behind one protocol: n-gram lookup, MTP (Qwen3.5 NextN), DFlash (block diffusion)."""

from .base import Drafter, Proposal
from .ngram import NgramDrafter

__all__ = ["Drafter", "Proposal", "NgramDrafter"]
