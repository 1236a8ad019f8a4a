"""Target model architectures (one file per family) behind a registry."""

from .base import CausalLM, ForwardOut, StepContext
from .registry import Architecture, by_gguf_arch, by_hf_model_type, register, supported

__all__ = ["CausalLM", "ForwardOut", "StepContext", "Architecture", "by_gguf_arch", "by_hf_model_type", "register", "supported"]
