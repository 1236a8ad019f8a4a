"""Acceptance: which drafted tokens to keep, and the token that follows them.

Both functions are pure (tensors in, tensors out) and stay on the device; the caller reads the
packed result once. The result ``[1 + k + 1]`` is ``n`` (accepted drafts) followed by the ``k+1``
candidate output tokens, of which the first ``n + 1`` are emitted.
"""

from __future__ import annotations

import torch


def accept_greedy(draft: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Longest prefix of ``draft [k]`` equal to the target argmax, plus the target's next token.

    ``target_logits [k+1, V]``: row i is the target's prediction after ``draft[:i]``.
    Output tokens are the target argmax at every row: equal to the draft on the accepted prefix,
    and the bonus (correction) token at row n.
    """
    target = target_logits.argmax(-1)
    k = draft.shape[0]
    n = (draft == target[:k]).to(torch.int64).cumprod(0).sum().reshape(1)
    return torch.cat([n, target])


def accept_sampled(draft: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                   gen: torch.Generator) -> torch.Tensor:
    """Speculative (rejection) sampling: emitted tokens follow ``target_probs`` exactly.

    Draft token ``x_i`` drawn from ``q_i`` is kept with probability ``min(1, p_i(x)/q_i(x))``;
    at the first rejection the output is drawn from ``norm(max(0, p_i - q_i))``; if all k are
    kept, the bonus is drawn from ``p_k``. ``draft_probs=None`` means argmax (deterministic)
    drafts, i.e. ``q_i`` one-hot at ``x_i``: keep with probability ``p_i(x)``, else draw from
    ``p_i`` with ``x`` removed.
    """
    k = draft.shape[0]
    p = target_probs.float()
    rows = torch.arange(k, device=p.device)
    px = p[rows, draft]
    if draft_probs is None:
        q = torch.zeros_like(p[:k]).scatter_(1, draft[:, None], 1.0)
    else:
        q = draft_probs.float()
    qx = q[rows, draft]
    u = torch.rand(k, device=p.device, generator=gen)
    keep = u * qx < px  # u < p/q without dividing by q
    n = keep.to(torch.int64).cumprod(0).sum().reshape(1)
    residual = torch.cat([(p[:k] - q).clamp_min(0), p[k:]], dim=0)
    mass = residual.sum(-1, keepdim=True)
    # p == q exactly leaves no residual mass; rejection then has probability 0, any row works.
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p)
    fallback = torch.multinomial(residual, 1, generator=gen).squeeze(1)  # [k+1]
    out = torch.where(torch.arange(k + 1, device=p.device) < n, torch.cat([draft, fallback[k:]]), fallback)
    return torch.cat([n, out])


def accept_greedy_rows(drafts: torch.Tensor, n_drafts: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """:func:`accept_greedy` for many rows at once (a batched verify step).

    ``drafts [b, K]`` right-padded, ``n_drafts [b]`` real drafts per row, ``target_logits
    [b, K+1, V]``. Returns ``[b, 1 + K + 1]``: row ``i`` starts with what
    ``accept_greedy(drafts[i, :n_i], target_logits[i, :n_i + 1])`` returns (``n`` then the
    ``n_i + 1`` target tokens); the entries after those belong to padding.
    """
    target = target_logits.argmax(-1)  # [b, K+1]
    k = drafts.shape[1]
    real = torch.arange(k, device=drafts.device)[None, :] < n_drafts[:, None]
    n = ((drafts == target[:, :k]) & real).to(torch.int64).cumprod(1).sum(1, keepdim=True)
    return torch.cat([n, target], dim=1)
