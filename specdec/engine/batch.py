"""Plain decoding of many sequences at once, with slots refilled as sequences finish.

A :class:`~specdec.cache.BatchCache` holds ``slots`` sequences. Every step runs one batched
target forward over all slots (one new token per active slot); when enough slots have finished,
waiting prompts are prefilled into them together (right-padded to their longest), so the batch
stays full without waiting for its slowest sequence. Used for self-distillation data
(``specdec train``). :func:`forward_ragged` (rows of different lengths into chosen slots) serves
the prompt chunks of the serving loop (:mod:`.serve_loop`).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..models.base import CausalLM, ForwardOut


@torch.inference_mode()
def generate_batch(model: CausalLM, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop_ids: set[int], *,
                   slots: int = 256, temperature: float = 0.0, seed: int = 0,
                   on_done: Callable[[int, list[int]], None] | None = None) -> list[list[int]]:
    """Continue every prompt (token ids) by at most ``max_new_tokens`` tokens; greedy when
    ``temperature`` is 0. A reply ends with (and keeps) the first stop token. Returns the replies
    in prompt order; ``on_done(index, reply)`` is called as each finishes (progress bars)."""
    n = len(prompts)
    replies: list[list[int] | None] = [None] * n
    if n == 0:
        return []
    dev = model.device
    slots = max(1, min(slots, n))
    cap = max(len(p) for p in prompts) + max_new_tokens
    cache = model.new_batch_cache(slots, cap)
    gen = torch.Generator(device=dev).manual_seed(seed) if temperature > 0 else None
    owner = [-1] * slots  # prompt index held by each slot, -1 when free
    length = [0] * slots  # committed positions per slot (host copy: no device sync to plan a step)
    out_toks: list[list[int]] = [[] for _ in range(slots)]
    nxt = torch.zeros(slots, dtype=torch.long, device=dev)  # the token each slot feeds next
    first = torch.zeros(slots, dtype=torch.long, device=dev)  # a decode row's only (and last) position
    queue = list(range(n))[::-1]
    active = 0

    def pick(logits: torch.Tensor) -> torch.Tensor:
        if temperature <= 0:
            return logits.argmax(-1)
        probs = torch.softmax(logits / temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=gen).reshape(-1)

    def finish(s: int) -> None:
        nonlocal active
        replies[owner[s]] = out_toks[s]
        if on_done is not None:
            on_done(owner[s], out_toks[s])
        owner[s], out_toks[s], length[s] = -1, [], 0
        active -= 1

    def refill() -> None:
        nonlocal active
        free = [s for s in range(slots) if owner[s] < 0][: len(queue)]
        if not free:
            return
        take = [queue.pop() for _ in free]
        lens = [len(prompts[i]) for i in take]
        ids = torch.zeros(len(free), max(lens), dtype=torch.long)
        for r, i in enumerate(take):
            ids[r, : lens[r]] = torch.as_tensor(list(prompts[i]), dtype=torch.long)
        slot_t = torch.tensor(free, device=dev)
        last = torch.tensor(lens, device=dev) - 1
        out = model.forward_batch(ids, cache, torch.zeros(len(free), dtype=torch.long, device=dev), slots=slot_t,
                                  span=max(lens), last=last)
        nxt[slot_t] = pick(out.logits)
        for r, s in enumerate(free):
            owner[s], length[s] = take[r], lens[r]
        active += len(free)

    while queue or active:
        n_free = slots - active
        if queue and (active == 0 or n_free >= max(1, slots // 8) or n_free >= len(queue)):
            refill()
        toks = nxt.tolist()  # the one host sync per step
        for s in range(slots):
            if owner[s] < 0:
                continue
            out_toks[s].append(toks[s])
            if toks[s] in stop_ids or len(out_toks[s]) >= max_new_tokens:
                finish(s)
        if not active and not queue:
            break
        if not active:
            continue
        starts = torch.tensor(length, device=dev)
        out = model.forward_batch(nxt[:, None], cache, starts, slots=range(slots), span=max(length) + 1, last=first)
        nxt = pick(out.logits)
        for s in range(slots):
            if owner[s] >= 0:
                length[s] += 1
    return replies  # type: ignore[return-value]


@torch.inference_mode()
def forward_ragged(model: CausalLM, cache, rows: Sequence[torch.Tensor], starts: Sequence[int], slots: Sequence[int],
                   capture: Sequence[int] = ()) -> ForwardOut:
    """One batched forward of token rows of different lengths: row ``r`` (a 1-d tensor) runs at
    positions ``starts[r] ..`` of cache slot ``slots[r]``, right-padded to the longest row (the
    padding writes past the row's end, which later steps overwrite: the cache needs room for it).
    Returns hidden ``[b, T, H]``, captured ``[b, T, n*H]`` and the logits ``[b, V]`` of each
    row's last real position."""
    dev = model.device
    ids = torch.nn.utils.rnn.pad_sequence([r.to(dev) for r in rows], batch_first=True)
    last = torch.tensor([int(r.numel()) - 1 for r in rows], device=dev)
    return model.forward_batch(ids, cache, torch.tensor(list(starts), device=dev),
                               slots=torch.tensor(list(slots), device=dev), span=max(starts) + ids.shape[1],
                               capture=capture, last=last)
