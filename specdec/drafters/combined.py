"""``X+ngram``: history lookup first, a model drafter (DFlash or MTP) where the history has no match.

Each step, the n-gram index is asked for a continuation of the last ``min_match`` tokens (the
trigram by default) at least ``min_len`` tokens long; found, it is the proposal (no drafter forward
that step); else the model drafter proposes. Both follow every committed token, so the model
drafter's context stays whole. The choice depends on the committed tokens only, so a seeded sampled
request repeats; n-gram drafts are argmax drafts (``probs=None``), which acceptance takes as they come.
A DFlash drafter writes its pending context rows at a lookup step too (``catch_up``), so they never
exceed what its static flush takes; an MTP head catches up at its next proposal, eagerly when more
rows wait than its static step holds (``k + 1``): not measured on the GPU yet.

Measured on SmolLM2-135M-Instruct with the shipped DFlash drafter (CPU, 16 HumanEval prompts, 96
tokens, BENCHMARKS.md): tau 2.26 for DFlash alone, 1.93 for n-gram alone, 3.10 for this rule with
``min_match=3, min_len=3`` (2.96 with any trigram continuation, 2.79 with bigrams).
"""

from __future__ import annotations

import torch

from ..hostcopy import device_ints
from ..models.base import ForwardOut
from ..sampling import SamplingParams
from .base import Proposal
from .ngram import NgramDrafter

MIN_MATCH = 3  # the n-gram (trailing tokens) a lookup must match
MIN_LEN = 3  # and the continuation it must offer


class NgramFirst:
    """A model drafter ``base`` behind an n-gram lookup (see the module docstring)."""

    def __init__(self, base, min_match: int = MIN_MATCH, min_len: int = MIN_LEN):
        if min_match < 1 or min_len < 1:
            raise ValueError(f"need min_match >= 1 and min_len >= 1, got {min_match}, {min_len}")
        self.base, self.min_len = base, min_len
        self.ngram = NgramDrafter(max(3, min_match), min_ngram=min_match)
        self.name = f"{base.name}+ngram"
        self.capture_layers = base.capture_layers
        self.device = None
        self.lookups = self.model_proposals = 0  # proposals each side made (for bench and tests)

    # settings read or set by the engines belong to the model drafter
    @property
    def block_size(self):
        return getattr(self.base, "block_size", None)

    @property
    def flat_draft_cost(self) -> bool:
        """The serving controller's reading: a lookup costs nothing, so as flat as the model drafter."""
        return getattr(self.base, "flat_draft_cost", False)

    @property
    def compile(self):
        return getattr(self.base, "compile", False)

    @compile.setter
    def compile(self, on: bool) -> None:
        if hasattr(self.base, "compile"):
            self.base.compile = on

    def spawn(self) -> "NgramFirst":
        """One per sequence: the model drafter's ``spawn`` (shared weights) and an empty history."""
        return NgramFirst(self.base.spawn(), self.ngram.min_ngram, self.min_len)

    def begin(self, prompt_ids: torch.Tensor, out: ForwardOut) -> None:
        self.device = prompt_ids.device
        self.base.begin(prompt_ids, out)
        self.ngram.begin(prompt_ids, out)

    def observe(self, tokens: torch.Tensor, out: ForwardOut) -> None:
        self.base.observe(tokens, out)
        self.ngram.observe(tokens, out)

    def propose(self, last_token: int, k: int, params: SamplingParams, gen: torch.Generator | None) -> Proposal:
        ids = self.ngram.propose_ids(last_token, k)
        if len(ids) >= min(self.min_len, k):
            self.lookups += 1
            catch_up = getattr(self.base, "catch_up", None)
            if catch_up is not None:  # DFlash: the rows of the last step written now, as its own propose would
                catch_up()
            return Proposal(device_ints(ids, self.device))
        self.model_proposals += 1
        return self.base.propose(last_token, k, params, gen)
