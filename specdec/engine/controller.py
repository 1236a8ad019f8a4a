"""How many tokens to draft per step when serving: the choice that maximises committed tokens
per second, from measured step times and measured acceptance.

A step with ``k`` drafts per slot commits, per slot with acceptance rate ``a``, on average

    E[tokens](k) = 1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a)

(accepted drafts plus the bonus token, drafts accepted independently with probability ``a``),
and costs the wall time of the step, which depends on the batch size and on ``k`` (drafting,
and a verify forward of ``k + 1`` rows per slot). Drafting pays off only when the tokens gained
outweigh the longer step: with a poor drafter, or a large batch whose forward is compute-bound,
``k = 0`` (plain decoding) wins. The controller is pure bookkeeping (no torch, no clock): the
loop hands it step times and acceptance rates and asks for ``k``.
"""

from __future__ import annotations

import collections
import statistics


def expected_tokens(alpha: float, k: int) -> float:
    """Mean tokens one slot commits in a step with ``k`` drafts accepted at rate ``alpha``."""
    a = min(max(alpha, 0.0), 1.0)
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def bucket(batch: int) -> int:
    """Batch sizes share a cost estimate by power-of-two bucket (1, 2, 4, 8, ...)."""
    return 1 << max(0, batch - 1).bit_length()


class DraftController:
    """Picks ``k`` in ``0..kmax`` (or among ``choices``) per step from step times per (batch bucket,
    k): the median of the last ``window`` measured, so that one slow step (a CUDA graph captured at
    its first use, a pause) does not make a ``k`` look slow for long. On the H200 the all-slots
    DFlash block's capture inside the first k = 15 step at 1 client, kept in an average, left the
    controller at k = 0: 298 tok/s where drafting gave 576.

    ``choices``: the ``k`` worth trying. With static steps every step with drafts runs the same
    width (``kmax + 1`` rows a slot), so for a drafter whose proposal costs the same for any ``k``
    (DFlash's block, n-gram lookups) a step costs the same for every ``k > 0`` and ``kmax``
    commits the most: ``(0, kmax)`` then spares the loop exploring ``k`` that cannot win.

    ``margin``: a ``k > 0`` must promise that much more than ``k = 0`` (plain decoding wins a
    close call: measured costs are noisy, and a wrong draft-heavy choice is what costs).
    ``choose`` explores a (bucket, k) pair it has never measured, and every ``explore_every``-th
    step of a bucket re-measures the pair measured longest ago (costs drift as contexts grow),
    so a ``k`` that once lost is tried again; one that lost by less than ``near`` is tried again
    every ``explore_near`` steps of the bucket.

    Calibration: the tokens a step with ``k > 0`` drafts really committed, against what the model
    above predicted for it (``record(..., tokens=)``), over the last ``calib_window`` such steps of
    the batch bucket (of every bucket until it has ``calib_min`` of its own), scale that ``k``'s
    prediction. The model takes drafts as accepted independently; an n-gram's are
    not (whole runs, then nothing), and per-slot rates learnt in a burst outlive it. On the H200
    (1050165, SmolLM2, GSM8K chat, 16 clients) n-gram steps with 4 drafts committed 1.2 tokens a
    slot, cost ~1.5x a plain step, and were chosen for 110 of 236 steps: 0.89x plain. Per bucket:
    at 79ff4af, 4 clients, the k = 4 steps committed 1.03 tokens a slot, chosen on a calibration
    that 32 clients' steps (1.3 tokens a slot) had set.
    """

    def __init__(self, kmax: int, explore_every: int = 50, window: int = 5, choices: tuple[int, ...] | None = None,
                 margin: float = 0.03, calib_window: int = 32, calib_min: int = 8, near: float = 0.15,
                 explore_near: int = 10):
        if kmax < 0:
            raise ValueError(f"kmax must be >= 0, got {kmax}")
        self.kmax, self.explore_every, self.window = kmax, explore_every, window
        self.margin = margin  # drafting must promise this much more than k = 0 (noise must not tip it)
        self.choices = tuple(range(kmax + 1)) if choices is None else tuple(sorted(set(choices)))
        if not self.choices or min(self.choices) < 0 or max(self.choices) > kmax:
            raise ValueError(f"choices must lie in 0..{kmax}, got {choices!r}")
        self.cost: dict[tuple[int, int], float] = {}  # (bucket, k) -> median seconds per step (recent)
        self.samples: dict[tuple[int, int], collections.deque] = {}  # (bucket, k) -> the last `window` step times
        self.seen: dict[tuple[int, int], int] = {}  # (bucket, k) -> step count at its last measurement
        self.steps: dict[int, int] = {}  # bucket -> steps chosen
        # (bucket, k) -> (committed, predicted) tokens of its last steps; the last choice's prediction
        self.outcomes: dict[tuple[int, int], collections.deque] = {}
        self.calib_window, self.calib_min = calib_window, calib_min
        self.near, self.explore_near = near, explore_near  # a k > 0 within `near` of k = 0: re-measured every `explore_near` steps
        self._predicted: tuple[int, float] | None = None

    def choose(self, alphas: list[float], caps: list[int] | None = None) -> int:
        """``k`` for a step over slots whose acceptance rates are ``alphas`` and that may take at
        most ``caps`` drafts each (the tokens a request has left; None: no cap)."""
        k = self._choose(alphas, caps)
        self._predicted = (k, self._tokens(alphas, caps, k))
        return k

    @staticmethod
    def _tokens(alphas: list[float], caps: list[int] | None, k: int) -> float:
        if caps is None:
            return sum(expected_tokens(a, k) for a in alphas)
        return sum(expected_tokens(a, min(k, c)) for a, c in zip(alphas, caps))

    def _choose(self, alphas: list[float], caps: list[int] | None) -> int:
        if self.kmax == 0 or not alphas:
            return 0
        b = bucket(len(alphas))
        n = self.steps[b] = self.steps.get(b, 0) + 1
        ks = self.choices
        unmeasured = [k for k in ks if (b, k) not in self.cost]
        if unmeasured:
            return unmeasured[0]
        if self.explore_every and n % self.explore_every == 0:
            return min(ks, key=lambda k: self.seen[(b, k)])
        rates = {k: self.rate(alphas, b, k, caps) * (1.0 - self.margin if k else 1.0) for k in ks}
        best = max(ks, key=lambda k: (rates[k], -k))
        if best == 0 and len(ks) > 1 and self.explore_near:
            # a close loss is measured again sooner: a k = 0 step teaches the model nothing (no drafts,
            # no calibration), so one unlucky window would otherwise keep drafting off for explore_every steps
            k = max(ks[1:], key=lambda j: rates[j])
            if rates[k] >= (1.0 - self.near) * rates[0] and n - self.seen[(b, k)] >= self.explore_near:
                return k
        return best

    def calibration(self, b: int, k: int) -> float:
        """Committed over predicted tokens of the last steps of bucket ``b`` with ``k`` drafts, or of
        every bucket's while ``b`` has fewer than ``calib_min`` (1 before any)."""
        q = self.outcomes.get((b, k), ())
        if len(q) < self.calib_min:
            q = [o for (_, kk), qq in self.outcomes.items() if kk == k for o in qq]
        if not q:
            return 1.0
        return sum(t for t, _ in q) / max(sum(p for _, p in q), 1e-9)

    def rate(self, alphas: list[float], b: int, k: int, caps: list[int] | None = None) -> float:
        """Expected committed tokens per second of a step with ``k`` drafts (bucket ``b``)."""
        tokens = self._tokens(alphas, caps, k) * (self.calibration(b, k) if k else 1.0)
        return tokens / max(self.cost[(b, k)], 1e-9)

    def record(self, batch: int, k: int, seconds: float, tokens: int | None = None) -> None:
        """A step over ``batch`` slots with ``k`` drafts took ``seconds`` and committed ``tokens``
        (accepted drafts and a bonus token a slot, before stops; None: not counted)."""
        b = bucket(batch)
        if tokens is not None and k and self._predicted is not None and self._predicted[0] == k:
            q = self.outcomes.setdefault((b, k), collections.deque(maxlen=self.calib_window))
            q.append((tokens, self._predicted[1]))
        self._predicted = None
        key = (b, k)
        q = self.samples.setdefault(key, collections.deque(maxlen=self.window))
        q.append(seconds)
        self.cost[key] = statistics.median(q)
        self.seen[key] = self.steps.get(b, 0)
