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
    # p == q exactly leaves no residual mass; rejection then has probability 0, any row works. Left
    # unnormalised (the inverse CDF scales by its total): a sum's rounding depends on how many rows
    # the reduction has, and the captured step has more rows than the eager one.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
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


class StaticAcceptance:
    """:func:`accept_sampled` as one static step (a CUDA graph on CUDA): the target's filtered
    probabilities and the whole rejection test, over device buffers the step's inputs are copied
    into, so a sampled decoding step costs the host a handful of launches (the copies, the
    uniforms, the replay), not the ~40 small kernels of the eager form.

    One step per (argmax or sampled drafts, logits dtype, vocabulary, sampling params), for up to
    ``k`` drafts: ``d <= k`` drafts fill the first ``d`` rows and ``n_drafts`` masks the rest
    (:func:`accept_sampled_rows`). The ``2d + 1`` uniforms are drawn from the request's generator
    outside the step, as :func:`accept_sampled` draws them, so it returns what
    :func:`accept_sampled` returns: the same tokens for the same generator (tested on the CPU,
    where the step runs eagerly; on the GPU scripts/ab_sampled.py counts the outputs that differ).
    Other sampling params replace the steps held. The returned tensor is the step's output buffer,
    valid until the next call."""

    def __init__(self, k: int, use_graphs: bool):
        self.k, self.use_graphs = k, use_graphs
        self.steps: dict[tuple, _AcceptStep] = {}

    def __call__(self, drafts: torch.Tensor, draft_probs: torch.Tensor | None, logits: torch.Tensor,
                 params, gen: torch.Generator) -> torch.Tensor:
        d = drafts.shape[0]
        if d > self.k:
            raise ValueError(f"{d} drafts: this acceptance step takes at most {self.k}")
        sampling = params.filter_key
        key = (draft_probs is not None, logits.dtype, logits.shape[-1], sampling)
        st = self.steps.get(key)
        if st is None:
            self.steps = {kk: s for kk, s in self.steps.items() if kk[3] == sampling}
            st = self.steps[key] = _AcceptStep(self.k, logits, draft_probs is not None, params, self.use_graphs)
        return st(drafts, draft_probs, logits, gen)


class _AcceptStep:
    """One :class:`StaticAcceptance` step: static buffers and, on CUDA, its captured graph."""

    def __init__(self, k: int, logits: torch.Tensor, sampled_drafts: bool, params, use_graphs: bool):
        from ..models.graphs import capture  # the engine's one capture (side-stream warm-ups, no GC)

        dev, v = logits.device, logits.shape[-1]
        self.params, self.k = params, k
        self.logits = torch.zeros(k + 1, v, dtype=logits.dtype, device=dev)
        self.drafts = torch.zeros(k, dtype=torch.int64, device=dev)
        self.q = torch.zeros(k, v, dtype=torch.float32, device=dev) if sampled_drafts else None
        self.n = torch.zeros(1, dtype=torch.int64, device=dev)
        self.u = torch.zeros(2 * k + 1, dtype=torch.float32, device=dev)
        self._n = 0  # the drafts n holds (written only when it changes)
        self.graph, self.out = None, None
        if use_graphs:
            self.graph, self.out = capture(self._compute, dev)

    def _compute(self) -> torch.Tensor:
        from ..sampling import probs_from_logits
        p = probs_from_logits(self.logits, self.params)
        q = None if self.q is None else self.q[None]
        return accept_sampled_rows(self.drafts[None], self.n, q, p[None], self.u[None])[0]

    def __call__(self, drafts: torch.Tensor, draft_probs: torch.Tensor | None, logits: torch.Tensor,
                 gen: torch.Generator) -> torch.Tensor:
        d = drafts.shape[0]
        self.logits[: d + 1].copy_(logits)
        if d:
            self.drafts[:d].copy_(drafts)
            if self.q is not None:
                self.q[:d].copy_(draft_probs)
        if d != self._n:
            self.n.fill_(d)
            self._n = d
        self.u[: 2 * d + 1].uniform_(0.0, 1.0, generator=gen)  # torch.rand(2d + 1, generator=gen)'s draws
        if self.graph is None:
            return self._compute()
        self.graph.replay()
        return self.out
