"""specdec: lossless speculative decoding (MTP, DFlash, n-gram drafters) in PyTorch."""

from .api import LLM, Target, load_target
from .errors import CheckpointError, ConfigError, ContextOverflowError, RequestError, SpecdecError
from .sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "Target", "load_target", "SamplingParams", "SpecdecError", "CheckpointError",
           "ConfigError", "ContextOverflowError", "RequestError"]
