"""Acceptance: which drafted tokens to keep, and the token that follows them.

Both functions are pure (tensors in, tensors out) and stay on the device; the caller reads the
packed result once. The result ``[1 + k + 1]`` is ``n`` (accepted drafts) followed by the ``k+1``
candidate output tokens, of which the first ``n + 1`` are emitted.
"""

from __future__ import annotations

import torch

from ..sampling import sample_inverse_cdf


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
    ``p_i`` with ``x`` removed. Draws ``2k + 1`` uniforms from ``gen`` (k tests, k + 1 draws by
    inverse CDF): :func:`accept_sampled_rows` on one row.
    """
    k = draft.shape[0]
    u = torch.rand(2 * k + 1, device=target_probs.device, generator=gen)
    n = torch.full((1,), k, dtype=torch.int64, device=draft.device)
    q = None if draft_probs is None else draft_probs[None]
    return accept_sampled_rows(draft[None], n, q, target_probs[None], u[None])[0]


def accept_sampled_rows(drafts: torch.Tensor, n_drafts: torch.Tensor, draft_probs: torch.Tensor | None,
                        target_probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """:func:`accept_sampled` for many rows at once (a batched verify step), from given uniforms.

    ``drafts [b, K]`` right-padded, ``n_drafts [b]`` real drafts per row, ``draft_probs [b, K, V]``
    (``None``: every row's drafts are argmax drafts; a caller mixing both gives one-hot rows),
    ``target_probs [b, K+1, V]``, ``u [b, 2K+1]``: row ``i`` uses ``u[i, :n_i]`` for its tests and
    ``u[i, n_i:2n_i+1]`` for its draws, so it gets what :func:`accept_sampled` gets from a
    generator yielding those uniforms, whatever the other rows hold. Returns ``[b, 1 + K + 1]``:
    ``n`` then the output tokens, of which the first ``n + 1`` are emitted.
    """
    b, k = drafts.shape
    p = target_probs.float()
    dev = p.device
    real = torch.arange(k, device=dev)[None, :] < n_drafts[:, None]  # [b, K]
    idx = drafts[..., None]
    q = torch.zeros_like(p[:, :k]).scatter_(2, idx, 1.0) if draft_probs is None else draft_probs.float()
    px, qx = p[:, :k].gather(2, idx)[..., 0], q.gather(2, idx)[..., 0]
    keep = (u[:, :k] * qx < px) & real  # u < p/q without dividing by q
    n = keep.to(torch.int64).cumprod(1).sum(1)  # [b]
    # row j < n_i: the residual max(0, p - q); row n_i (and the padding): p itself
    residual = torch.cat([torch.where(real[..., None], (p[:, :k] - q).clamp_min(0), p[:, :k]), p[:, k:]], dim=1)
    mass = residual.sum(-1, keepdim=True)
    # p == q exactly leaves no residual mass; rejection then has probability 0, any row works.
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p)
    draws = (n_drafts[:, None] + torch.arange(k + 1, device=dev)[None, :]).clamp_max(2 * k)
    fallback = sample_inverse_cdf(residual.reshape(b * (k + 1), -1), u.gather(1, draws).reshape(-1)).view(b, k + 1)
    out = torch.where(torch.arange(k + 1, device=dev)[None, :] < n[:, None],
                      torch.cat([drafts, fallback[:, k:]], dim=1), fallback)
    return torch.cat([n[:, None], out], dim=1)


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
