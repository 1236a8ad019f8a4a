"""Speculative sampling must emit tokens that follow the target's distribution exactly.

Two levels:
- unit: ``accept_sampled`` driving a Markov-chain "target" (next-token distribution = a row of a
  transition matrix), every token produced by speculation, so many samples are cheap and the exact
  joint distribution of the first three tokens is known in closed form;
- end to end: the real engine on a tiny Llama with a vocabulary of 8, four new tokens per run, the
  exact joint computed from the target's own logits with ``probs_from_logits``.

Drafters: the target's own distribution (q = p), uniform q, adversarial q (mass on the target's
least likely tokens, including ones top-k/top-p removed) and argmax drafts with ``probs=None``.

Statistics: Pearson chi-square with cells of expected count < 5 pooled. A test fails when its
p-value is below ``ALPHA = 1e-4``: under a correct sampler each chi-square check has a 1e-4 chance
of failing for a random seed, so the 53 checks in this file together have a false-positive rate
below 0.6% (seeds are fixed, so a given run is deterministic). The sanity tests show the same
checks reject broken acceptance rules with p-values far below ALPHA.
"""

from __future__ import annotations

import bisect
import itertools
import random

import pytest
import torch

import specdec.engine.generate as engine_generate
from _engine_util import (DistDrafter, accept_always_broken, build_llama, model_next_logits, pooled_chi2, resample_from_p_broken, total_variation)
from specdec.engine import SpeculativeGenerator, accept_sampled
from specdec.engine.acceptance import accept_sampled_rows
from specdec.loading import load_model
from specdec.sampling import SamplingParams, probs_from_logits, probs_from_logits_rows

ALPHA = 1e-4
PARAMS = {
    "plain": SamplingParams(temperature=1.0),
    "filtered": SamplingParams(temperature=0.8, top_k=4, top_p=0.9),
}


pytestmark = pytest.mark.usefixtures("single_thread")


# --- unit level: accept_sampled on a Markov-chain target ---------------------------------------------

V = 5
START = 0
UNIT_N = 2000


def _markov_logits(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, V, generator=g) * 1.5  # row = previous token


def _draft_table(mode: str, raw: torch.Tensor, p: torch.Tensor) -> torch.Tensor | None:
    """``[V, V]`` draft distribution per previous token (None: argmax drafts)."""
    if mode == "target":
        return p
    if mode == "uniform":
        return torch.full((V, V), 1.0 / V)
    if mode == "adversarial":
        return torch.softmax(-2.0 * raw, -1)
    return None


def _simulate(mode: str, params: SamplingParams, n: int = UNIT_N, k: int = 2, accept=accept_sampled, seed: int = 0):
    """Counts ``[V, V, V]`` of the first three emitted tokens, and their exact joint distribution.

    Drafts are sampled with Python's ``random`` from precomputed CDFs (cheap); acceptance uses a
    torch generator, as in the engine.
    """
    raw = _markov_logits()
    p = probs_from_logits(raw, params)  # [V, V], the target's processed distribution per state
    q = _draft_table(mode, raw, p)
    cdf = None if q is None else q.double().cumsum(-1).tolist()
    amax = raw.argmax(-1).tolist()
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, V, V)
    for _ in range(n):
        last, out = START, []
        while len(out) < 3:
            drafts, prev = [], last
            for _ in range(min(k, 3 - len(out))):
                prev = amax[prev] if cdf is None else min(bisect.bisect(cdf[prev], rng.random()), V - 1)
                drafts.append(prev)
            qs = None if q is None else q[[last] + drafts[:-1]]
            res = accept(torch.tensor(drafts), qs, p[[last] + drafts], gen).tolist()
            toks = res[1:res[0] + 2]
            out.extend(toks)
            last = toks[-1]
        counts[out[0], out[1], out[2]] += 1
    exact = p[START][:, None, None] * p[:, :, None] * p[None, :, :]
    return counts, exact


@pytest.mark.parametrize("mode", ["target", "uniform", "adversarial", "argmax"])
@pytest.mark.parametrize("pname", list(PARAMS))
def test_accept_sampled_joint_distribution(mode, pname):
    counts, exact = _simulate(mode, PARAMS[pname])
    stat, df, pv = pooled_chi2(counts, exact)
    assert pv > ALPHA, (f"{mode} drafter, {pname}: joint of 3 tokens deviates (chi2={stat:.1f}, df={df}, "
                        f"p={pv:.2e}, TV={total_variation(counts, exact):.3f})")
    for pos, dims in ((0, (1, 2)), (1, (0, 2)), (2, (0, 1))):
        stat, df, pv = pooled_chi2(counts.sum(dims), exact.sum(dims))
        assert pv > ALPHA, f"{mode} drafter, {pname}: token {pos + 1} marginal deviates (p={pv:.2e})"


@pytest.mark.parametrize("broken", [accept_always_broken, resample_from_p_broken])
def test_chi_square_detects_broken_acceptance(broken):
    """The statistical check has power: classic acceptance bugs fail it by a wide margin."""
    counts, exact = _simulate("uniform", PARAMS["plain"], accept=broken)
    _, _, pv = pooled_chi2(counts, exact)
    assert pv < 1e-8, f"{broken.__name__} was not detected (p={pv:.2e})"


def test_zero_probability_tokens_never_emitted():
    """With top-k/top-p a draft outside the kept set must always be rejected."""
    params = PARAMS["filtered"]
    p = probs_from_logits(_markov_logits(), params)
    gen = torch.Generator().manual_seed(3)
    for prev in range(V):
        banned = (p[prev] == 0).nonzero().flatten().tolist()
        assert banned, "the filtered setting should remove some tokens"
        for x in banned:
            q = torch.zeros(1, V)
            q[0, x] = 1.0
            for probs in (q, None):
                res = accept_sampled(torch.tensor([x]), probs, p[[prev, x]], gen).tolist()
                assert res[0] == 0 and p[prev, res[1]] > 0


# --- end to end through the engine -------------------------------------------------------------------

E2E_V = 8
E2E_NEW = 4
E2E_N = 600
PROMPT = [3, 1, 4, 1, 5]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model, raw next-token logits after PROMPT + every prefix of up to E2E_NEW - 1 new tokens)."""
    path = build_llama(tmp_path_factory.mktemp("llama_v8"), vocab=E2E_V, hidden=16, layers=1, heads=2, kv_heads=1,
                       seed=3, head_scale=20.0)
    model = load_model(path, "cpu", tokenizer=False).model
    table = {}
    for length in range(E2E_NEW):
        for prefix in itertools.product(range(E2E_V), repeat=length):
            seq = PROMPT + list(prefix)
            table[prefix] = model(torch.tensor(seq), model.new_cache(len(seq)), logits="last").logits[-1]
    return model, table


def _exact_joint(table, params: SamplingParams) -> torch.Tensor:
    """``[V] * E2E_NEW``: the exact joint distribution of the new tokens under ``params``."""
    joint = torch.zeros([E2E_V] * E2E_NEW, dtype=torch.float64)
    for prefix in itertools.product(range(E2E_V), repeat=E2E_NEW - 1):
        pr = 1.0
        for i in range(E2E_NEW - 1):
            pr *= float(probs_from_logits(table[prefix[:i]], params)[prefix[i]])
        joint[prefix] = pr * probs_from_logits(table[prefix], params).double()
    return joint


def _run(model, table, mode, params, n: int = E2E_N, k: int = 2, wrap=None, static: bool = False) -> torch.Tensor:
    # the drafter reads the target's logits from the precomputed table (drafting is then free);
    # ``wrap(drafter)``: the drafter the engine gets instead; ``static``: acceptance on the static step
    # (StaticAcceptance, a CUDA graph under SPECDEC_STATIC_ACCEPT; here it runs eagerly)
    lookup = lambda seq: table[tuple(seq[len(PROMPT):])]  # noqa: E731
    counts = torch.zeros([E2E_V] * E2E_NEW)
    for s in range(n):
        p = SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=1000 + s)
        d = DistDrafter(lookup, mode)
        g = SpeculativeGenerator(model, wrap(d) if wrap else d, k)
        g.static_accept = static
        res = g.generate(PROMPT, E2E_NEW, p)
        counts[tuple(res.token_ids)] += 1
    return counts


def _check(counts, exact, what):
    # token 1 is sampled at prefill, 2 and 3 are verified drafts, 4 is a bonus token or the first
    # token of a second step: check tokens 1-3 jointly, and the pairs (3, 4) and (2, 4)
    for dims, name in (((3,), "tokens 1-3"), ((0, 1), "tokens 3-4"), ((0, 2), "tokens 2,4")):
        stat, df, pv = pooled_chi2(counts.sum(dims), exact.sum(dims))
        assert pv > ALPHA, (f"{what}: {name} deviate from the target (chi2={stat:.1f}, df={df}, p={pv:.2e}, "
                            f"TV={total_variation(counts.sum(dims), exact.sum(dims)):.3f})")


def test_e2e_target_is_not_degenerate(tiny):
    """The statistical tests only have power if the target spreads its mass (and k/p filter some)."""
    _, table = tiny
    p = probs_from_logits(table[()], PARAMS["plain"])
    assert 0.3 < float(p.max()) < 0.95, p
    assert int((probs_from_logits(table[()], PARAMS["filtered"]) > 0).sum()) < E2E_V


@pytest.mark.parametrize("mode,pname", [("uniform", "plain"), ("argmax", "plain"), ("adversarial", "filtered"),
                                        ("target", "filtered")])
def test_engine_sampling_lossless(tiny, mode, pname):
    model, table = tiny
    params = PARAMS[pname]
    _check(_run(model, table, mode, params), _exact_joint(table, params), f"{mode} drafter, {pname}")


@pytest.mark.parametrize("static", [False, True])
def test_engine_sampling_lossless_blocked_scan(tiny, static, monkeypatch):
    """Sampling's sums by the blocked scan (SPECDEC_BLOCKED_SCAN; the tiny vocabulary of 8 is 2 blocks of 4):
    the output still follows the target, through the eager and the static acceptance, top-k and top-p on."""
    import specdec.sampling as sampling
    monkeypatch.setattr(sampling, "BLOCKED_SCAN", True)
    model, table = tiny
    params = PARAMS["filtered"]
    _check(_run(model, table, "adversarial", params, static=static), _exact_joint(table, params),
           f"adversarial drafter, blocked scan, {'static' if static else 'eager'} acceptance")


def test_engine_sampling_lossless_ngram_first(tiny):
    """``X+ngram`` (drafters/combined.py): n-gram argmax drafts (here a unigram match is enough, so
    both sides propose) and an adversarial drafter's sampled ones, chosen step by step: the output
    still follows the target."""
    from specdec.drafters.combined import NgramFirst
    model, table = tiny
    params, made = PARAMS["filtered"], []
    wrap = lambda d: made.append(NgramFirst(d, min_match=1, min_len=1)) or made[-1]  # noqa: E731
    _check(_run(model, table, "adversarial", params, wrap=wrap), _exact_joint(table, params), "adversarial+ngram")
    lookups, model_proposals = sum(d.lookups for d in made), sum(d.model_proposals for d in made)
    assert lookups > E2E_N // 4 and model_proposals > E2E_N // 4, (lookups, model_proposals)


def test_engine_sampling_detects_broken_rule(tiny, monkeypatch):
    """End-to-end sanity: swapping in a broken acceptance rule fails the same check."""
    model, table = tiny
    monkeypatch.setattr(engine_generate, "accept_sampled", resample_from_p_broken)
    params = PARAMS["plain"]
    counts = _run(model, table, "uniform", params, n=400)
    with pytest.raises(AssertionError):
        _check(counts, _exact_joint(table, params), "broken rule")


def _static_broken(monkeypatch):
    """The static acceptance step with every draft of nonzero target probability kept (uniforms all 0)."""
    from specdec.engine import acceptance
    rows = acceptance.accept_sampled_rows
    monkeypatch.setattr(acceptance, "accept_sampled_rows", lambda d, n, q, p, u: rows(d, n, q, p, torch.zeros_like(u)))


@pytest.mark.parametrize("case", ["adversarial", "argmax", "broken"])
def test_engine_sampling_lossless_static_accept(tiny, case, monkeypatch):
    """The static acceptance (``StaticAcceptance``, captured on CUDA under SPECDEC_STATIC_ACCEPT: drafts padded
    to k, the draws made outside the step), run eagerly here: its output follows the target; a broken rule
    inside it is seen."""
    model, table = tiny
    params = PARAMS["filtered"]
    if case == "broken":
        _static_broken(monkeypatch)
    counts = _run(model, table, "adversarial" if case == "broken" else case, params,
                  n=400 if case == "broken" else E2E_N, static=True)
    if case == "broken":
        with pytest.raises(AssertionError):
            _check(counts, _exact_joint(table, params), "broken static rule")
    else:
        _check(counts, _exact_joint(table, params), f"{case} drafter, static acceptance")


def test_static_acceptance_equals_accept_sampled():
    """``StaticAcceptance`` returns what ``accept_sampled`` returns from a generator in the same state:
    the same ``n`` and emitted tokens, for every draft count up to its k (rows past them left stale from
    earlier calls), argmax and sampled drafts, and the generator left in the same state."""
    from specdec.engine.acceptance import StaticAcceptance
    g = torch.Generator().manual_seed(8)
    K, accepted, outcomes = 4, 0, set()
    static = StaticAcceptance(K, use_graphs=False)
    for trial in range(60):
        params = PARAMS["plain" if trial % 3 else "filtered"]
        d = [4, 0, 2, 3, 1, 4][trial % 6]
        logits = torch.randn(d + 1, V, generator=g) * 2
        p = probs_from_logits(logits, params)
        drafts = torch.randint(0, V, (d,), generator=g)
        drafts[: d // 2] = p[: d // 2].argmax(-1)  # likely tokens: some drafts get accepted
        q = None if trial % 2 else torch.softmax(torch.randn(d, V, generator=g), -1)
        seed = 1000 + trial
        a, b = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        want = accept_sampled(drafts, q, p, a)
        got = static(drafts, q, logits, params, b)
        n = int(want[0])
        assert int(got[0]) == n and torch.equal(got[1: n + 2], want[1: n + 2]), (trial, got, want)
        assert torch.equal(a.get_state(), b.get_state())
        accepted += n
        outcomes.add((d, n))
    assert accepted > 0 and len(outcomes) > 8, outcomes
    assert len(static.steps) == 2  # argmax / sampled drafts under one params; the other params replaced them


@pytest.mark.parametrize("blocked", [False, True])
def test_engine_static_accept_same_tokens(tiny, blocked, monkeypatch):
    """A generator's sampled output on the static acceptance step equals its eager acceptance's, seed for
    seed: speculative (sampled and argmax drafts) and plain decoding with lookahead on static steps (the
    path CUDA's plain sampled decoding takes); with the serial and the blocked scan (SPECDEC_BLOCKED_SCAN)."""
    import specdec.sampling as sampling
    monkeypatch.setattr(sampling, "BLOCKED_SCAN", blocked)
    model, _ = tiny
    drafters = {"uniform": 3, "argmax": 3, None: 0}
    for mode, k in drafters.items():
        for seed in range(6):
            params = SamplingParams(temperature=0.9, top_k=6, seed=seed)
            outs = []
            for static in (False, True):
                d = DistDrafter(model_next_logits(model), mode) if mode else None
                g = SpeculativeGenerator(model, d, k, batch_invariant=mode is None, lookahead=mode is None)
                g.static_accept = static
                outs.append(g.generate(PROMPT, 10, params).token_ids)
                assert (g._acceptance is not None) == static
            assert outs[0] == outs[1], (mode, seed, outs)


def test_engine_sampling_seeded_is_reproducible(tiny):
    model, _ = tiny
    params = SamplingParams(temperature=1.0, seed=11)
    drafter = DistDrafter(model_next_logits(model), "uniform")
    runs = [SpeculativeGenerator(model, drafter, 3).generate(PROMPT, 12, params) for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids


@pytest.mark.parametrize("blocked", [False, True])
def test_inverse_cdf_draws_follow_the_probabilities(blocked, monkeypatch):
    """``sample_inverse_cdf`` (the static MTP proposal's draw): 40,000 draws of one filtered
    distribution match it (chi-square), never a token of probability 0 (top-k, top-p), also at
    uniforms next to 1 (tests/test_mtp.py checks that the static MTP step draws with it). ``blocked``:
    its sums (and top-p's) by the blocked scan (SPECDEC_BLOCKED_SCAN; 40 tokens: 5 blocks of 8)."""
    import specdec.sampling as sampling
    from specdec.sampling import sample_inverse_cdf
    monkeypatch.setattr(sampling, "BLOCKED_SCAN", blocked)
    g = torch.Generator().manual_seed(0)
    q = probs_from_logits(torch.randn(1, 40, generator=g) * 2, SamplingParams(temperature=0.9, top_k=12, top_p=0.95))
    n = 40_000
    toks = sample_inverse_cdf(q.expand(n, -1), torch.rand(n, generator=g))
    counts = torch.bincount(toks, minlength=40).double()
    assert counts[q[0] == 0].sum() == 0
    keep = q[0] > 0
    _, _, p = pooled_chi2(counts[keep], q[0][keep].double())
    assert p > 1e-4, p
    edge = sample_inverse_cdf(q.expand(3, -1), torch.tensor([0.0, 1 - 2 ** -24, 0.5]))
    assert bool((q[0][edge] > 0).all())
    # a sharpened distribution is told apart: the check has power
    q2 = probs_from_logits(torch.log(q.clamp_min(1e-30)) * 1.3, SamplingParams())
    wrong = torch.bincount(sample_inverse_cdf(q2.expand(n, -1), torch.rand(n, generator=g)), minlength=40).double()
    assert pooled_chi2(wrong[keep], q[0][keep].double())[2] < 1e-6


def test_row_cumsum_scans_a_lone_row_as_one_of_two(monkeypatch):
    """``row_cumsum``'s lone-row form (CUDA only: a lone row is scanned by another kernel than each row
    of many, and the captured acceptance, with more rows than the eager one, drew other tokens on the
    H100 until it was used) returns the row's own cumulative sums, whatever the lone row's shape, and
    is taken for a lone row only. On the GPU, scripts/ab_sampled.py's differ column checks the
    equality it buys (13 of 30 random-weight n-gram outputs differed without it)."""
    import specdec.sampling as sampling
    monkeypatch.setattr(sampling, "BLOCKED_SCAN", False)  # the serial scan's path (the blocked one: the test below)
    taken = []
    monkeypatch.setattr(sampling, "_lone_row_scanned_apart", lambda x: taken.append(x.shape) or x.numel() == x.shape[-1])
    g = torch.Generator().manual_seed(1)
    for shape in ((50,), (1, 50), (1, 1, 50), (3, 50)):
        x = torch.rand(shape, generator=g)
        out = sampling.row_cumsum(x)
        assert out.shape == x.shape and torch.equal(out, x.cumsum(-1)), shape
    assert taken == [(50,), (1, 50), (1, 1, 50), (3, 50)]
    monkeypatch.setattr(sampling, "_lone_row_scanned_apart", lambda x: False)
    assert torch.equal(sampling.row_cumsum(x), x.cumsum(-1))


@pytest.mark.parametrize("v", [7, 40, 256, 4096, 49152, 151936])
def test_blocked_scan_is_a_row_invariant_cdf(v, monkeypatch):
    """``_blocked_cumsum`` (SPECDEC_BLOCKED_SCAN): each row's sums are within float rounding of the exact
    ones, decrease nowhere by more than a rounding (block boundaries), and are bit for bit the same whether
    the row is scanned alone or among others, also where a lone row takes CUDA's other path (emulated
    here: as one of two). A row of odd length falls back to the serial scan."""
    import specdec.sampling as sampling
    g = torch.Generator().manual_seed(v)
    x = torch.softmax(torch.randn(3, v, generator=g) * 3, -1)
    for lone_apart in (False, True):
        monkeypatch.setattr(sampling, "_lone_row_scanned_apart", lambda t: lone_apart and t.numel() == t.shape[-1])
        out = sampling._blocked_cumsum(x)
        exact = x.double().cumsum(-1)
        assert out.shape == x.shape and float((out.double() - exact).abs().max()) < 1e-5
        drop = (out[:, :-1] - out[:, 1:]).clamp_min(0)
        assert bool((drop <= 2 * torch.finfo(torch.float32).eps * out[:, 1:]).all())
        for i in range(3):
            assert torch.equal(sampling._blocked_cumsum(x[i]), out[i])
            assert torch.equal(sampling._blocked_cumsum(x[i:i + 1]), out[i:i + 1])
    if v % 2:
        assert torch.equal(sampling._blocked_cumsum(x), x.cumsum(-1))
    else:
        assert not torch.equal(sampling._blocked_cumsum(x), x.cumsum(-1))  # another rounding: the blocks ran


def test_inverse_cdf_never_draws_a_zero_probability_token_across_a_rounding():
    """Sums that step down across a block boundary (the blocked scan's rounding, made large here) must not
    let the draw land on a token of probability 0 just after it: it takes the row's likeliest token."""
    import specdec.sampling as sampling
    q = torch.tensor([[0.3, 0.19, 0.0, 0.51]])
    bad_cdf = torch.tensor([[0.3, 0.49, 0.5, 1.0]])  # token 2 (p = 0) starts a block whose offset overshot
    real = sampling.row_cumsum
    try:
        sampling.row_cumsum = lambda x: bad_cdf
        assert int(torch.searchsorted(bad_cdf, torch.tensor([[0.495]]), right=True)) == 2  # the search lands on it
        tok = sampling.sample_inverse_cdf(q, torch.tensor([0.495]))
    finally:
        sampling.row_cumsum = real
    assert int(tok) == 3  # the likeliest token


def test_accept_sampled_rows_equals_each_row_alone():
    """The serving loop's batched rejection sampling (ragged rows, argmax and sampled drafts mixed,
    rows with different sampling params) gives every row what ``accept_sampled`` gives it alone
    from the same generator: a row's tokens do not depend on the rows beside it."""
    g = torch.Generator().manual_seed(5)
    K, params = 4, [PARAMS["plain"], PARAMS["filtered"], PARAMS["plain"], PARAMS["filtered"], PARAMS["plain"]]
    n_drafts = [4, 0, 2, 3, 1]
    logits = torch.randn(len(params), K + 1, V, generator=g) * 2
    probs = probs_from_logits_rows(logits, params)
    for i, p in enumerate(params):
        assert torch.equal(probs[i], probs_from_logits(logits[i], p))
    drafts = torch.randint(0, V, (len(params), K), generator=g)
    qs = [None if i % 2 else torch.softmax(torch.randn(K, V, generator=g), -1) for i in range(len(params))]
    for i in range(len(params)):  # some drafts are the target's likeliest token, so some get accepted
        drafts[i, : n_drafts[i] // 2 + 1] = probs[i, : n_drafts[i] // 2 + 1].argmax(-1)[:K]
    accepted = 0
    for trial in range(40):
        q = torch.zeros(len(params), K, V).scatter_(2, drafts[..., None], 1.0)
        u = torch.zeros(len(params), 2 * K + 1)
        want = []
        for i, n in enumerate(n_drafts):
            if qs[i] is not None:
                q[i, :n] = qs[i][:n]
            u[i, : 2 * n + 1].uniform_(generator=torch.Generator().manual_seed(100 * trial + i))
            one = accept_sampled(drafts[i, :n], None if qs[i] is None else qs[i][:n], probs[i, : n + 1],
                                 torch.Generator().manual_seed(100 * trial + i))
            want.append(one)
            accepted += int(one[0])
        got = accept_sampled_rows(drafts, torch.tensor(n_drafts), q, probs, u)
        for i, n in enumerate(n_drafts):
            m = int(got[i, 0])
            assert torch.equal(got[i, : m + 2], want[i][: m + 2]), (trial, i, got[i], want[i])
    assert accepted > 0


def test_static_acceptance_step_has_no_host_sync():
    """A CUDA graph cannot hold a host sync (``.item()``, data-dependent Python control flow): the static
    acceptance step compiles as one graph (``fullgraph``), its output equal to the step's own, on the CPU."""
    from specdec.engine.acceptance import _AcceptStep
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.9)
    st = _AcceptStep(3, torch.randn(4, 50, generator=torch.Generator().manual_seed(0)), True, params, use_graphs=False)
    st.q.copy_(torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(1)), -1))
    st.drafts.copy_(torch.tensor([4, 7, 1]))
    st.n.fill_(2)
    st.u.uniform_(generator=torch.Generator().manual_seed(2))
    compiled = torch.compile(st._compute, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(), st._compute())
