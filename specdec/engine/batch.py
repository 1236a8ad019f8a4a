"""Batch jobs on the serving loop, and the ragged batched forward it uses.

:func:`generate_batch` (self-distillation data for ``specdec train``) runs its prompts through
:meth:`~specdec.engine.serve_loop.EngineLoop.run`: the same loop, slots and batched target forward
that serve requests; there is no second engine loop. :func:`forward_ragged` (rows of different
lengths into chosen slots) is the loop's prefill forward.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..models.base import CausalLM, ForwardOut


def generate_batch(model: CausalLM, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
                   stop_ids: set[int], *,
                   slots: int = 256, temperature: float = 0.0, seed: int = 0,
                   on_done: Callable[[int, list[int]], None] | None = None,
                   static_steps: bool | None = None) -> list[list[int]]:
    """Continue every prompt (token ids) by at most ``max_new_tokens`` tokens (one number, or one per
    prompt) on the serving loop (plain decoding, ``slots`` sequences at a time); greedy when
    ``temperature`` is 0, else prompt ``i`` is sampled with seed ``seed + i``. A reply ends with (and keeps) the first stop token.
    Returns the replies in prompt order; ``on_done(index, reply)`` is called as each finishes.
    ``static_steps``: see :class:`~specdec.engine.serve_loop.EngineLoop` (default: on CUDA). Not
    ``exact``: a batch job prefills the prompts joining together in one forward (up to an eighth
    of ``slots`` prompts in one forward instead of one static step per 32 tokens of each), so a
    reply's bits may depend on which prompts it was batched with."""
    from ..sampling import SamplingParams
    from .requests import GenRequest
    from .serve_loop import EngineLoop

    if not prompts:
        return []
    budgets = [int(max_new_tokens)] * len(prompts) if isinstance(max_new_tokens, int) else [int(n) for n in max_new_tokens]
    if len(budgets) != len(prompts):
        raise ValueError(f"{len(budgets)} max_new_tokens for {len(prompts)} prompts")
    reqs = [GenRequest([int(t) for t in p], n,
                       SamplingParams(temperature=temperature, seed=None if temperature <= 0 else seed + i),
                       tuple(stop_ids)) for i, (p, n) in enumerate(zip(prompts, budgets))]
    context = max(len(p) + n for p, n in zip(prompts, budgets))
    loop = EngineLoop(model, "none", max_slots=max(1, min(slots, len(prompts))), max_queue=0,
                      max_context=min(context, model.max_context), controller=False, static_steps=static_steps,
                      exact=False)
    return loop.run(reqs, on_done)


def reply_progress(total: int, desc: str, unit: str, initial: int = 0):
    """A tqdm bar for a :func:`generate_batch` run and the ``on_done`` that advances it, showing
    tokens/s; returns ``(bar, on_done, tokens)``, ``tokens[0]`` the reply tokens counted so far."""
    from tqdm.auto import tqdm

    bar = tqdm(total=total, initial=initial, desc=desc, unit=unit)
    tokens = [0]

    def on_done(i: int, reply: list[int]) -> None:
        tokens[0] += len(reply)
        bar.update(1)
        bar.set_postfix(tok_s=f"{tokens[0] / max(bar.format_dict['elapsed'], 1e-9):.0f}", refresh=False)
    return bar, on_done, tokens


@torch.inference_mode()
def forward_ragged(model: CausalLM, cache, rows: Sequence[torch.Tensor], starts: Sequence[int], slots: Sequence[int],
                   capture: Sequence[int] = ()) -> ForwardOut:
    """One batched forward of token rows of different lengths: row ``r`` (a 1-d tensor) runs at
    positions ``starts[r] ..`` of cache slot ``slots[r]``, right-padded to the longest row (the
    padding writes past the row's end, which later steps overwrite: the cache needs room for it).
    Returns hidden ``[b, T, H]``, captured ``[b, T, n*H]`` and the logits ``[b, V]`` of each
    row's last real position. Linear-attention states are committed after each row's real
    positions (a prefill: no rollback into it)."""
    dev = model.device
    ids = torch.nn.utils.rnn.pad_sequence([r.to(dev) for r in rows], batch_first=True)
    n = torch.tensor([int(r.numel()) for r in rows], device=dev)
    return model.forward_batch(ids, cache, torch.tensor(list(starts), device=dev),
                               slots=torch.tensor(list(slots), device=dev), span=max(starts) + ids.shape[1],
                               capture=capture, last=n - 1, commit=n)
