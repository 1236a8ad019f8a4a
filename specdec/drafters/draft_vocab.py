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

from ..cpu_linear import linear
from ..errors import ConfigError
from ..models import fused_layer


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
    order = torch.sort(-counts.to(torch.int64), stable=True).indices.tolist()  # a stable sort: ties by id
    chosen = list(dict.fromkeys([int(t) for t in always] + order))[:max(size, len(always))]
    return sorted(chosen)


# Prompt tokens off the vocabulary drafted too, at most this many a request (the last ones): replies copy
# the prompt's words ("muffins"), which no fixed list has. On the CPU, a SmolLM2 GSM8K-style prompt with
# the shipped MTP head drafted at tau 2.64 over a 16,384-token vocabulary made from 128 GSM8K train
# replies, 2.88 with the prompt's tokens added, as with the whole head.
PROMPT_TOKENS = 1024


def _first_distinct(tokens: list[int], n: int) -> list[int]:
    """The first ``n`` distinct values of ``tokens``, in order of first appearance."""
    seen: dict[int, None] = {}
    for t in tokens:
        if t not in seen:
            seen[t] = None
            if len(seen) == n:
                break
    return list(seen)


class PromptPart:
    """A request's prompt tokens off a :class:`DraftVocab`: ``ids [P]`` and their head rows ``[P, H]``,
    fixed-size buffers refilled in place for each request (captured steps keep reading them); unused
    entries hold the id ``V`` (one past the vocabulary: :meth:`DraftVocab.logits` writes them to a
    column it drops) and zero rows. One part per sequence of a batch: ``ids [slots, P]``, ``rows
    [slots, P, H]`` (:meth:`slot` is one of them, :meth:`first` the first ``n``)."""

    def __init__(self, ids: torch.Tensor, rows: torch.Tensor):
        self.ids, self.rows = ids, rows

    @classmethod
    def empty(cls, vocab: "DraftVocab", capacity: int, slots: int | None = None) -> "PromptPart":
        lead = () if slots is None else (slots,)
        return cls(torch.full((*lead, capacity), vocab.vocab_size, dtype=torch.int64, device=vocab.ids.device),
                   vocab.rows.new_zeros(*lead, capacity, vocab.rows.shape[1]))

    def slot(self, s: int) -> "PromptPart":
        return PromptPart(self.ids[s], self.rows[s])

    def first(self, n: int) -> "PromptPart":
        return PromptPart(self.ids[:n], self.rows[:n])


class DraftVocab:
    """Logits over a token subset: ``ids`` (a list or 1-D tensor of ids of a ``vocab_size``
    vocabulary) and the LM head ``weight [V, H]`` whose rows they pick (copied once, here: ``len(ids)
    x H`` more memory, the head's rows are read from the copy), plus per request the prompt's tokens
    off it (:meth:`prompt_part`). ``source`` names it in errors and reports."""

    def __init__(self, ids, weight: torch.Tensor, vocab_size: int, source: str = "draft vocabulary",
                 prompt_tokens: int | None = None):
        ids = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
        if (ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab_size
                or ids.unique().numel() != ids.numel()):
            raise ConfigError(f"{source}: want distinct token ids in 0..{vocab_size - 1}")
        if weight.shape[0] < vocab_size:
            raise ConfigError(f"{source}: the LM head has {weight.shape[0]} rows, not the vocabulary's {vocab_size} "
                              "(a tensor-parallel rank's shard? draft vocabularies need the whole head)")
        self.source, self.vocab_size, self.weight = source, vocab_size, weight
        self.prompt_tokens = PROMPT_TOKENS if prompt_tokens is None else prompt_tokens
        self.ids = ids.to(weight.device)
        with torch.no_grad():
            self.rows = weight.detach().index_select(0, self.ids).contiguous()
        self._in = torch.zeros(vocab_size, dtype=torch.bool)  # on the host: prompt_part picks there
        self._in[ids.cpu()] = True
        self.rows_int8 = None  # the rows as fused_layer.Int8Rows, read on CUDA instead (use_int8)

    def use_int8(self) -> None:
        """Read the subset's rows as int8, a scale a row (``fused_layer.Int8Rows``, the fused GEMM) where a
        forward takes the fused kernels: half the bytes (a DFlash drafter's ``--draft-int8``). The prompt
        part's few rows stay as they are."""
        self.rows_int8 = fused_layer.Int8Rows.of(self.rows)

    def __len__(self) -> int:
        return self.ids.numel()

    def nbytes(self) -> int:
        """The copied head rows, and their int8 copy (a request's prompt part adds ``prompt_tokens`` rows)."""
        return self.rows.numel() * self.rows.element_size() + (self.rows_int8.nbytes() if self.rows_int8 is not None else 0)

    @torch.no_grad()
    def prompt_part(self, prompt_ids: torch.Tensor, part: PromptPart | None = None) -> PromptPart | None:
        """The prompt's tokens off the vocabulary (the last ``prompt_tokens`` distinct ones, the last one
        first) written into ``part`` (made when None); None when ``prompt_tokens`` is 0. The tokens are
        picked on the host (a device prompt is read back once) where the device form (a boolean index, a
        unique, a scatter-min and a sort) waited on the device several times."""
        if not self.prompt_tokens:
            return None
        part = part or PromptPart.empty(self, self.prompt_tokens)
        ids = prompt_ids.reshape(-1).cpu()
        off = ids[~self._in[ids]].flip(0).tolist()  # the last ones first
        new = _first_distinct(off, part.ids.numel())
        n = len(new)
        sel = torch.tensor(new, dtype=torch.int64).to(part.ids.device)
        part.ids[:n] = sel
        part.ids[n:] = self.vocab_size
        part.rows[:n] = self.weight.detach().index_select(0, sel)
        part.rows[n:] = 0
        return part

    def logits(self, h: torch.Tensor, post: Callable[[torch.Tensor], torch.Tensor] | None = None,
               part: PromptPart | None = None) -> torch.Tensor:
        """``h [..., H]`` -> fp32 ``[..., V]``: the head's logits of the subset and of ``part``'s tokens
        (then ``post``, e.g. a soft cap, applied to them only), ``-inf`` for every other token. A part
        of several slots (``ids [S, P]``) goes with ``h [S, R, H]``: row ``s`` takes slot ``s``'s tokens."""
        if self.rows_int8 is not None and fused_layer.usable(h):
            sub = fused_layer.linear(h, self.rows_int8).float()
        else:
            sub = linear(h, self.rows).float()
        sub = post(sub) if post is not None else sub
        if part is None:
            return sub.new_full((*sub.shape[:-1], self.vocab_size), float("-inf")).index_copy_(-1, self.ids, sub)
        out = sub.new_full((*sub.shape[:-1], self.vocab_size + 1), float("-inf")).index_copy_(-1, self.ids, sub)
        if part.ids.dim() == 2:
            extra = torch.bmm(h, part.rows.transpose(1, 2)).float()  # [S, R, P]
            extra = post(extra) if post is not None else extra
            out.scatter_(-1, part.ids[:, None, :].expand(-1, h.shape[1], -1), extra)  # unused entries: column V
            return out[..., : self.vocab_size]
        extra = linear(h, part.rows).float()
        out.index_copy_(-1, part.ids, post(extra) if post is not None else extra)  # unused entries: column V
        return out[..., : self.vocab_size]
