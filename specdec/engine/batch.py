"""Plain decoding of many sequences at once, with slots refilled as sequences finish.

A :class:`~specdec.cache.BatchCache` holds ``slots`` sequences. Every step runs one batched
target forward over all slots (one new token per active slot); when enough slots have finished,
waiting prompts are prefilled into them together (right-padded to their longest), so the batch
stays full without waiting for its slowest sequence. Used for self-distillation data
(``specdec train``). :func:`prefill_slots` (many prompts into chosen slots, chunked) is shared
with the serving loop (:mod:`.serve_loop`).
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
        out = model.forward_batch(nxt[:, None], cache, starts, slots=range(slots), span=max(length) + 1,
                                  last=torch.zeros(slots, dtype=torch.long, device=dev))
        nxt = pick(out.logits)
        for s in range(slots):
            if owner[s] >= 0:
                length[s] += 1
    return replies  # type: ignore[return-value]


@torch.inference_mode()
def prefill_slots(model: CausalLM, cache, prompts: Sequence[torch.Tensor], slots: Sequence[int],
                  capture: Sequence[int] = (), chunk: int = 512, keep_rows: bool = True) -> list[ForwardOut]:
    """Prefill ``prompts`` (1-d token tensors) into cache ``slots`` together: right-padded to the
    longest, ``chunk`` positions per forward (a prompt drops out of the chunks past its end).

    Returns per prompt a :class:`ForwardOut` shaped like a single-sequence prefill's, for a
    drafter's ``begin``: logits ``[1, V]`` of its last position, and with ``keep_rows`` its
    hidden ``[L, H]`` and captured ``[L, n*H]`` rows (else an empty hidden and no captured).
    """
    dev, lens = model.device, [int(p.numel()) for p in prompts]
    hid: list[list] = [[] for _ in prompts]
    cap: list[list] = [[] for _ in prompts]
    last: list = [None] * len(prompts)
    for c0 in range(0, max(lens), chunk):
        rows = [i for i in range(len(prompts)) if lens[i] > c0]
        t = min(chunk, max(lens[i] for i in rows) - c0)
        ids = torch.zeros(len(rows), t, dtype=torch.int64)
        for r, i in enumerate(rows):
            seg = prompts[i][c0:c0 + t]
            ids[r, : seg.numel()] = seg
        at = torch.tensor([min(lens[i] - c0, t) - 1 for i in rows], device=dev)
        out = model.forward_batch(ids, cache, torch.full((len(rows),), c0, device=dev),
                                  slots=torch.tensor([slots[i] for i in rows], device=dev), span=c0 + t,
                                  capture=capture, last=at)
        for r, i in enumerate(rows):
            m = min(lens[i] - c0, t)
            if keep_rows:
                hid[i].append(out.hidden[r, :m])
                if out.captured is not None:
                    cap[i].append(out.captured[r, :m])
            if lens[i] <= c0 + t:
                last[i] = out.logits[r: r + 1]
    empty = torch.empty(0, device=dev)
    return [ForwardOut(last[i], torch.cat(hid[i]) if keep_rows else empty, torch.cat(cap[i]) if cap[i] else None)
            for i in range(len(prompts))]
