"""The drafter protocol the engine speaks.

Timeline of one sequence (``L`` = tokens in the target cache):
1. the target prefills the prompt; ``begin(prompt_ids, out)`` sees every prompt row;
2. the engine samples the first new token ``t`` (committed, not yet in the target cache);
3. ``propose(t, k, ...)`` drafts ``k`` tokens to follow ``t``;
4. the target verifies ``[t, drafts]`` at positions ``L..L+k``; ``n`` drafts are accepted;
5. ``observe(tokens, out)`` gets the ``n + 1`` tokens now committed to the cache (``t`` and the
   accepted drafts) with their rows of the verify output; the bonus token becomes the next ``t``.
A drafter's own caches must hold committed positions only when ``propose`` is next called.

A drafter whose class sets ``host_tokens = True`` (n-gram) drafts from token ids alone: the serving
loop then calls ``propose_ids(last_token, k) -> list[int]`` and ``observe(tokens: list[int], None)``,
no torch call per slot.

A drafter instance follows one sequence at a time. ``spawn()`` (optional) returns a new instance
sharing the weights, with its own per-sequence state: the serving loop keeps one per slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..models.base import ForwardOut
from ..sampling import SamplingParams


@dataclass
class Proposal:
    tokens: torch.Tensor  # [k] int64 on the target's device
    probs: torch.Tensor | None = None  # [k, V] the distributions they were sampled from; None = argmax drafts


class Drafter(Protocol):
    name: str
    # Target decoder layers whose outputs ``observe``/``begin`` need in ``out.captured``.
    capture_layers: tuple[int, ...]

    def begin(self, prompt_ids: torch.Tensor, out: ForwardOut) -> None:
        ...

    def propose(self, last_token: int, k: int, params: SamplingParams, gen: torch.Generator | None) -> Proposal:
        ...

    def observe(self, tokens: torch.Tensor, out: ForwardOut) -> None:
        ...


def slice_out(out: ForwardOut, n: int) -> ForwardOut:
    """The first ``n`` rows of a verify output (the committed positions)."""
    return ForwardOut(
        None if out.logits is None else out.logits[:n],
        out.hidden[:n],
        None if out.captured is None else out.captured[:n],
    )
