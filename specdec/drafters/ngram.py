"""History lookup ("prompt lookup") drafter: the cheap baseline that needs no weights.

To draft after the current context, find the most recent earlier occurrence of its last
``n`` tokens (trying the longest ``n`` first) and propose the tokens that followed it.

The drafter keeps an index from every ``n``-gram of its history to where its latest occurrence's
continuation starts, extended as tokens are observed, so that a proposal costs ``max_ngram``
dictionary lookups, not a scan of the history: the serving loop asks every slot each step.
"""

from __future__ import annotations

import torch

from ..models.base import ForwardOut
from ..sampling import SamplingParams
from .base import Proposal


def lookup(context: list[int], k: int, max_ngram: int, min_ngram: int = 1) -> list[int]:
    """The reference rule, by scanning: for ``n`` from ``max_ngram`` down to ``min_ngram``, the
    latest earlier occurrence of ``context``'s last ``n`` tokens that has a continuation gives up
    to ``k`` tokens of it. :class:`NgramDrafter` gives the same answer from its index."""
    for n in range(min(max_ngram, len(context) - 1), min_ngram - 1, -1):
        tail = context[-n:]
        for s in range(len(context) - n - 1, -1, -1):
            if context[s:s + n] == tail:
                return context[s + n:s + n + k]
    return []


class NgramDrafter:
    name = "ngram"
    flat_draft_cost = True  # a proposal costs the same for any k (the serving controller reads it)
    capture_layers: tuple[int, ...] = ()
    # a host-token drafter: the serving loop calls propose_ids() for a list of drafts and hands
    # observe() the fed tokens as a list with ``out=None``, no torch call per slot (a torch call
    # can hand the GIL to a client thread: ~45 us a slot on the H200's host)
    host_tokens = True

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.history: list[int] = []
        self._index: dict[tuple[int, ...], int] = {}  # n-gram -> start of its latest continuation
        self._indexed = 0  # history positions p < this are indexed as continuations

    def spawn(self) -> "NgramDrafter":
        """A drafter with the same settings and no history (one per sequence of a batch)."""
        return NgramDrafter(self.max_ngram, self.min_ngram)

    def begin(self, prompt_ids: torch.Tensor, out: ForwardOut) -> None:
        self.history = [int(t) for t in prompt_ids.tolist()]
        self._index, self._indexed = {}, 0

    def observe(self, tokens: torch.Tensor | list[int], out: ForwardOut | None) -> None:
        self.history.extend(tokens if isinstance(tokens, list) else [int(t) for t in tokens.tolist()])

    def _extend_index(self) -> None:
        h, index = self.history, self._index
        for p in range(max(self._indexed, 1), len(h)):  # h[p] continues the n-grams ending at p - 1
            for n in range(self.min_ngram, min(self.max_ngram, p) + 1):
                index[tuple(h[p - n:p])] = p  # later occurrences overwrite: the latest wins
        self._indexed = len(h)

    def propose_ids(self, last_token: int, k: int) -> list[int]:
        """Up to ``k`` drafts to follow ``history + [last_token]`` (:func:`lookup`'s answer)."""
        if k <= 0:
            return []
        self._extend_index()
        h, last = self.history, int(last_token)
        for n in range(min(self.max_ngram, len(h)), self.min_ngram - 1, -1):
            tail = (*h[len(h) - n + 1:], last)
            # the latest occurrence is the one ending the history, continued by last_token itself
            c = len(h) if tuple(h[len(h) - n:]) == tail else self._index.get(tail)
            if c is not None:
                return (h[c:c + k] + [last])[:k] if c + k > len(h) else h[c:c + k]
        return []

    def propose(self, last_token: int, k: int, params: SamplingParams, gen) -> Proposal:
        # on the host: the engines copy drafts to the device (the serving loop all slots' in one copy)
        return Proposal(torch.tensor(self.propose_ids(last_token, k), dtype=torch.int64))
