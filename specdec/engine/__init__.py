"""The speculative loop, acceptance rules, stop rules and statistics."""

from .acceptance import accept_greedy, accept_sampled
from .generate import GenerationResult, SpeculativeGenerator, Stats

__all__ = ["accept_greedy", "accept_sampled", "GenerationResult", "SpeculativeGenerator", "Stats"]
