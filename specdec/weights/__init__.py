"""Checkpoint readers (safetensors, GGUF), name maps, strict loading and dtype placement."""

from .source import TensorInfo, TensorSource
from .loader import load_into

__all__ = ["TensorInfo", "TensorSource", "load_into"]
