"""History lookup ("prompt lookup") drafter: the cheap baseline that needs no weights.

To draft after the current context, find the most recent earlier occurrence of its last
``n`` tokens (trying the longest ``n`` first) and propose the tokens that followed it.
"""

from __future__ import annotations

import torch

from ..models.base import ForwardOut
from ..sampling import SamplingParams
from .base import Proposal


class NgramDrafter:
    name = "ngram"
    flat_draft_cost = True  # a proposal costs the same for any k (the serving controller reads it)
    capture_layers: tuple[int, ...] = ()

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.history: list[int] = []
        self.device = torch.device("cpu")

    def spawn(self) -> "NgramDrafter":
        """A drafter with the same settings and no history (one per sequence of a batch)."""
        return NgramDrafter(self.max_ngram, self.min_ngram)

    def begin(self, prompt_ids: torch.Tensor, out: ForwardOut) -> None:
        self.history = [int(t) for t in prompt_ids.tolist()]
        self.device = out.hidden.device

    def observe(self, tokens: torch.Tensor, out: ForwardOut) -> None:
        self.history.extend(int(t) for t in tokens.tolist())

    def lookup(self, context: list[int], k: int) -> list[int]:
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            tail = context[-n:]
            # scan backwards for the latest earlier match that has a continuation
            for s in range(len(context) - n - 1, -1, -1):
                if context[s:s + n] == tail:
                    return context[s + n:s + n + k]
        return []

    def propose(self, last_token: int, k: int, params: SamplingParams, gen) -> Proposal:
        found = self.lookup(self.history + [int(last_token)], k) if k > 0 else []
        return Proposal(torch.tensor(found, dtype=torch.int64, device=self.device))
