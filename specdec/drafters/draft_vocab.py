"""A drafter's vocabulary: the tokens it may propose (SGLang's ``--speculative-token-map``, EAGLE-3's
draft vocabulary), so that its LM head reads those rows only.

A model drafter's step ends in the target's LM head: on the qwen3.5-9b shape a 248,320 x 4,096 bf16
matrix, 2 GB, read once per MTP draft (three times a K = 3 proposal) where the MTP layer itself reads
about 0.5 GB. Over a draft vocabulary of the N most frequent tokens the head reads ``N / V`` of that.
The target still verifies against its whole vocabulary, so output is unchanged (greedy: the same
tokens; sampled: the drafts' probabilities are 0 off the vocabulary, and the acceptance test with the
residual ``max(p - q, 0)`` keeps the target's distribution); what can change is tau: a token off the
vocabulary is never drafted.

Files (``--draft-vocab FILE``): a JSON list of token ids, or ``{"token_ids": [...]}``, or a ``.pt``
holding a 1-D integer tensor or a list (SGLang's hot-token map); any order, no repeats.
:func:`token_counts_vocab` makes one from token counts (``specdec train`` writes ``draft_vocab.json``
beside a trained drafter: its training replies' most frequent tokens).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..errors import ConfigError


def load_token_ids(path: str, vocab_size: int) -> list[int]:
    """The token ids of a draft-vocabulary file (see the module docstring), checked against ``vocab_size``."""
    if not os.path.isfile(path):
        raise ConfigError(f"draft vocabulary {path}: no such file")
    try:
        if path.endswith(".pt"):
            raw = torch.load(path, map_location="cpu", weights_only=True)
        else:
            with open(path, encoding="utf-8") as fh:
                raw = json.load(fh)
    except Exception as e:  # noqa: BLE001 - any unreadable file gets one line naming it
        raise ConfigError(f"draft vocabulary {path}: unreadable ({type(e).__name__}: {e})") from None
    if isinstance(raw, dict):
        raw = raw.get("token_ids")
    if isinstance(raw, torch.Tensor):
        if raw.dim() != 1 or raw.is_floating_point() or raw.is_complex():
            raise ConfigError(f"draft vocabulary {path}: want a 1-D integer tensor, got {raw.dtype} {tuple(raw.shape)}")
        raw = raw.tolist()
    if not isinstance(raw, list) or not raw or not all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
        raise ConfigError(f"draft vocabulary {path}: want a non-empty list of token ids (JSON, or "
                          '{"token_ids": [...]}, or a .pt tensor)')
    bad = [t for t in raw if not 0 <= t < vocab_size]
    if bad:
        raise ConfigError(f"draft vocabulary {path}: token id {bad[0]} outside the target's vocabulary of {vocab_size}")
    if len(set(raw)) != len(raw):
        raise ConfigError(f"draft vocabulary {path}: repeated token ids")
    return raw


def token_counts_vocab(counts: torch.Tensor, size: int, always: list[int] = ()) -> list[int]:
    """The ``size`` most counted token ids (``counts [V]``; ties by id), the ``always`` ones included."""
    order = sorted(range(counts.numel()), key=lambda t: (-int(counts[t]), t))
    chosen = list(dict.fromkeys([int(t) for t in always] + order))[:max(size, len(always))]
    return sorted(chosen)


class DraftVocab:
    """Logits over a token subset: ``ids`` (a list or 1-D tensor of ids of a ``vocab_size``
    vocabulary) and the LM head ``weight [V, H]`` whose rows they pick (copied once, here: ``len(ids)
    x H`` more memory, the head's rows are read from the copy). ``source`` names it in errors and
    reports."""

    def __init__(self, ids, weight: torch.Tensor, vocab_size: int, source: str = "draft vocabulary"):
        ids = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
        if weight.shape[0] < vocab_size:
            raise ConfigError(f"{source}: the LM head has {weight.shape[0]} rows, not the vocabulary's {vocab_size} "
                              "(a tensor-parallel rank's shard? draft vocabularies need the whole head)")
        self.source, self.vocab_size = source, vocab_size
        self.ids = ids.to(weight.device)
        with torch.no_grad():
            self.rows = weight.detach().index_select(0, self.ids).contiguous()

    def __len__(self) -> int:
        return self.ids.numel()

    def logits(self, h: torch.Tensor, post: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """``h [..., H]`` -> fp32 ``[..., V]``: the head's logits of the subset (then ``post``, e.g. a
        soft cap, applied to them only), ``-inf`` for every other token."""
        sub = F.linear(h, self.rows).float()
        if post is not None:
            sub = post(sub)
        out = sub.new_full((*sub.shape[:-1], self.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.ids, sub)

    def covers(self, token_ids) -> float:
        """The fraction of ``token_ids`` in the subset (how often a drafter could propose the right token)."""
        ids = torch.as_tensor(list(token_ids), dtype=torch.int64)
        if ids.numel() == 0:
            return 1.0
        return torch.isin(ids, self.ids.cpu()).float().mean().item()
