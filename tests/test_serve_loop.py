"""The serving loop (continuous batching + speculative decoding): every request's greedy output
equals plain single-sequence decoding for each drafter kind while slots are refilled, drafts
really get accepted and rolled back, seeded sampling repeats and its first token follows the
target distribution, and cancel / queue limits / failures / stop end requests as documented.
Tiny random Llama target, fp32 on the CPU."""

from __future__ import annotations

import pytest
import torch

from _engine_util import DistDrafter, SlotOracle, build_llama, model_next_logits, plain_generate, pooled_chi2
from specdec.drafters.factory import make_drafter
from specdec.drafters.mtp_dir import new_mtp_block, save_mtp_dir
from specdec.engine import SpeculativeGenerator
from specdec.engine.controller import DraftController, expected_tokens
from specdec.engine.serve_loop import EngineLoop, GenRequest
from specdec.errors import ConfigError, ContextOverflowError, QueueFullError, RequestError
from specdec.loading import load_model
from specdec.sampling import SamplingParams, probs_from_logits
from specdec.train.dflash_batch import new_dflash_config, new_dflash_model, save_dflash_dir

VOCAB = 64
GREEDY = SamplingParams()

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(loaded target, {"dflash": dir, "mtp": dir}) for a tiny peaky Llama."""
    root = tmp_path_factory.mktemp("serve")
    path = build_llama(root / "target", vocab=VOCAB, hidden=32, layers=3, seed=3, head_scale=4.0)
    loaded = load_model(path, "cpu", "float32", tokenizer=False)
    cfg = new_dflash_config(loaded, num_layers=1, block_size=4, mask_token_id=VOCAB - 1)
    save_dflash_dir(new_dflash_model(loaded, cfg), cfg, str(root / "dflash"), dtype=None)
    block = new_mtp_block(loaded.model, init_from_layer=-1, generator=torch.Generator().manual_seed(6))
    save_mtp_dir(block, loaded.model, str(root / "mtp"), steps=4, dtype=None)
    return loaded, {"dflash": str(root / "dflash"), "mtp": str(root / "mtp")}


def _requests(n: int = 12, seed: int = 0, repetitive: bool = False) -> list[GenRequest]:
    """Ragged prompts (1..20 tokens), different budgets; ``repetitive`` prompts repeat a pattern."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        size = int(torch.randint(1, 21, (1,), generator=g))
        if repetitive:
            pat = torch.randint(0, VOCAB, (int(torch.randint(2, 5, (1,), generator=g)),), generator=g).tolist()
            prompt = (pat * 10)[:max(size, 6)]
        else:
            prompt = torch.randint(0, VOCAB, (size,), generator=g).tolist()
        out.append(GenRequest(prompt, 6 + 3 * (i % 7), GREEDY))
    return out


def _collect(handle, timeout: float = 60.0):
    """(tokens, last event) of one request."""
    toks, last = [], None
    for ev in handle.events(timeout=timeout):
        if ev.kind == "tokens":
            toks.extend(ev.token_ids)
        last = ev
    return toks, last


def _serve(engine: EngineLoop, reqs: list[GenRequest]):
    engine.start()
    try:
        handles = [engine.submit(r) for r in reqs]
        return [_collect(h) for h in handles]
    finally:
        engine.stop()


def _reference(model, req: GenRequest) -> list[int]:
    """Plain single-sequence greedy decoding, cut after the first stop id."""
    toks = plain_generate(model, req.prompt_ids, req.max_new_tokens).token_ids
    for i, t in enumerate(toks):
        if t in req.stop_ids:
            return toks[: i + 1]
    return toks


# --- greedy: equal to plain decoding, token for token ------------------------------------------------

@pytest.mark.parametrize("kind", ["none", "ngram", "dflash", "mtp"])
def test_greedy_batched_equals_plain(setup, kind):
    loaded, dirs = setup
    model = loaded.model
    reqs = _requests(repetitive=kind == "ngram")
    refs = [_reference(model, r) for r in reqs]
    # a stop id some replies hit: they end early, inside an accepted run, and free their slot
    stop = max(set(t for r in refs for t in r), key=lambda t: sum(r.count(t) for r in refs))
    for r in reqs[::2]:
        r.stop_ids = [stop]
    refs = [_reference(model, r) for r in reqs]
    if kind in ("dflash", "mtp"):
        base = make_drafter(f"{kind}:{dirs[kind]}", loaded)
        full = {tuple(r.prompt_ids): r.prompt_ids + plain_generate(model, r.prompt_ids, r.max_new_tokens).token_ids
                for r in reqs}
        seeds = iter(range(100))
        draft = lambda: SlotOracle(base.spawn(), full, VOCAB, seed=next(seeds))  # noqa: E731
    else:
        draft = None if kind == "none" else kind
    engine = EngineLoop(loaded, draft, max_slots=4, max_queue=16, num_draft_tokens=3)
    engine.prefill_chunk = 8  # prompts of up to 20 tokens prefill in several chunks
    got = _serve(engine, reqs)
    for r, ref, (toks, done) in zip(reqs, refs, got):
        assert done.kind == "done", done.message
        assert toks == ref, f"prompt {r.prompt_ids}"
        assert done.finish_reason == ("stop" if toks[-1] in r.stop_ids else "length")
        assert done.stats["completion_tokens"] == len(toks)
        assert 0 <= done.stats["queued_s"] <= done.stats["ttft_s"] <= done.stats["total_s"]
    m = engine.metrics()
    assert m["requests_finished"] == len(reqs) and m["slots_in_use"] == 0
    if kind != "none":
        assert m["accepted_total"] > 0 and m["accepted_total"] < m["drafted_total"], m


@pytest.mark.parametrize("kind", ["dflash", "mtp"])
def test_real_drafter_steps_match_single_sequence(setup, kind):
    """The real (random) drafter, one per slot, drafts exactly what it drafts serving the
    request alone: the accepted counts of every step match the single-sequence engine's."""
    loaded, dirs = setup
    reqs = _requests(6, seed=4)
    engine = EngineLoop(loaded, f"{kind}:{dirs[kind]}", max_slots=3, num_draft_tokens=3, controller=False)
    got = _serve(engine, reqs)
    for r, (toks, done) in zip(reqs, got):
        alone = SpeculativeGenerator(loaded.model, make_drafter(f"{kind}:{dirs[kind]}", loaded), 3)
        res = alone.generate(r.prompt_ids, r.max_new_tokens)
        assert toks == res.token_ids
        assert done.stats["accepted_per_step"] == res.stats.accepted


# --- sampling ----------------------------------------------------------------------------------------

def test_seeded_sampling_repeats(setup):
    """A seed gives the same tokens, with the controller on or off (a seeded request drafts a
    fixed k, so the controller's timing-driven choices do not move its random stream)."""
    loaded, _ = setup
    params = SamplingParams(temperature=0.9, top_k=20, seed=11)
    req = GenRequest(_requests(1, seed=2, repetitive=True)[0].prompt_ids, 16, params)
    runs = [_serve(EngineLoop(loaded, "ngram", max_slots=2, controller=ctl), [req])[0][0]
            for ctl in (False, False, True)]
    assert runs[0] == runs[1] == runs[2] and len(runs[0]) == 16


def test_first_sampled_token_follows_the_target(setup):
    loaded, _ = setup
    prompts = [[5, 9, 2], [17, 3, 3, 40, 8, 1, 22]]  # ragged: the short one is right-padded in the prefill
    params = SamplingParams(temperature=1.0)
    n = 240
    reqs = [GenRequest(prompts[i % 2], 1, SamplingParams(temperature=1.0, seed=i)) for i in range(2 * n)]
    got = _serve(EngineLoop(loaded, "ngram", max_slots=8, max_queue=2 * n), reqs)
    for j, p in enumerate(prompts):
        counts = torch.bincount(torch.tensor([toks[0] for toks, _ in got[j::2]]), minlength=VOCAB)
        logits = loaded.model(torch.tensor(p), loaded.model.new_cache(16), logits="last").logits[-1]
        _, _, pval = pooled_chi2(counts, probs_from_logits(logits, params))
        assert pval > 1e-4, (p, pval)


# --- lifecycle ---------------------------------------------------------------------------------------

def test_cancel_frees_the_slot(setup):
    loaded, _ = setup
    engine = EngineLoop(loaded, "ngram", max_slots=1)
    cancel_on_first = lambda ev: h1.cancel()  # noqa: E731 - runs on the engine thread, before the next step
    h1 = engine.submit(GenRequest([1, 2, 3], 400, GREEDY), on_event=cancel_on_first)
    h2 = engine.submit(GenRequest([4, 5], 8, GREEDY))  # waits: the only slot is taken
    engine.start()
    try:
        toks1, done1 = _collect(h1)
        toks2, done2 = _collect(h2)
    finally:
        engine.stop()
    assert done1.kind == "done" and done1.finish_reason == "cancelled" and len(toks1) < 400
    assert done2.finish_reason == "length" and toks2 == _reference(loaded.model, GenRequest([4, 5], 8, GREEDY))
    assert engine.metrics()["requests_cancelled"] == 1


def test_request_limits(setup):
    loaded, _ = setup
    engine = EngineLoop(loaded, None, max_slots=2, max_queue=2, max_context=64)
    with pytest.raises(ContextOverflowError, match="context of 64"):
        engine.submit(GenRequest(list(range(64)), 1, GREEDY))
    with pytest.raises(ContextOverflowError, match="exceeds the context"):
        engine.submit(GenRequest([1, 2, 3], 62, GREEDY))
    with pytest.raises(RequestError, match="max_new_tokens"):
        engine.submit(GenRequest([1, 2, 3], 0, GREEDY))
    with pytest.raises(RequestError, match="token ids"):
        engine.submit(GenRequest([1, VOCAB], 4, GREEDY))
    waiting = [engine.submit(GenRequest([1, 2, 3], 4, GREEDY)) for _ in range(2)]
    with pytest.raises(QueueFullError, match="max_queue=2"):
        engine.submit(GenRequest([1, 2, 3], 4, GREEDY))
    engine.stop()  # never started: the waiting requests end with an error
    assert [_collect(h, 5)[1].kind for h in waiting] == ["error", "error"]


def test_stop_ends_running_and_waiting_requests(setup):
    loaded, _ = setup
    engine = EngineLoop(loaded, "ngram", max_slots=1)
    stop_on_first = lambda ev: engine.stop()  # noqa: E731 - on the engine thread: stops after this step
    first = engine.submit(GenRequest([1, 2, 3], 400, GREEDY), on_event=stop_on_first)
    waiting = engine.submit(GenRequest([4, 5], 8, GREEDY))
    engine.start()
    toks, done = _collect(first, 30)
    assert done.kind == "error" and "stopped" in done.message and 0 < len(toks) < 400
    assert _collect(waiting, 5)[1].kind == "error"
    engine.stop()  # again, from the client: a no-op
    assert not engine.metrics()["running"]


def test_failing_drafter_fails_only_its_request(setup):
    loaded, _ = setup

    class Faulty:
        """An n-gram drafter that raises on its third proposal for prompts starting with 7."""

        def __init__(self):
            self.inner, self.calls = make_drafter("ngram", loaded), 0
            self.name, self.capture_layers = "faulty", ()

        def begin(self, prompt_ids, out):
            self.bad = int(prompt_ids[0]) == 7
            self.inner.begin(prompt_ids, out)

        def observe(self, tokens, out):
            self.inner.observe(tokens, out)

        def propose(self, last_token, k, params, gen):
            self.calls += 1
            if self.bad and self.calls == 3:
                raise RuntimeError("drafter broke")
            return self.inner.propose(last_token, k, params, gen)

    reqs = _requests(8, seed=9, repetitive=True)
    reqs[2].prompt_ids, reqs[5].prompt_ids = [7, 1, 2, 1, 2, 1, 2], [7, 3, 3, 3]
    reqs[2].max_new_tokens = reqs[5].max_new_tokens = 30
    got = _serve(EngineLoop(loaded, Faulty, max_slots=3), reqs)
    for i, (r, (toks, done)) in enumerate(zip(reqs, got)):
        if i in (2, 5):
            assert done.kind == "error" and "drafter broke" in done.message
        else:
            assert done.kind == "done" and toks == _reference(loaded.model, r)


def test_unbatched_targets_are_refused(tmp_path):
    from _gemma_util import tiny_model
    tiny_model().save_pretrained(tmp_path / "g")
    loaded = load_model(str(tmp_path / "g"), "cpu", "float32", tokenizer=False)
    with pytest.raises(ConfigError, match=r"continuous batching is not supported for gemma3 targets yet \(supported"):
        EngineLoop(loaded, None)


# --- the cost controller -----------------------------------------------------------------------------

def _settle(ctl: DraftController, alphas, cost) -> int:
    """Feed the controller synthetic step costs until it has measured every k; return its choice."""
    for _ in range(ctl.kmax + 1):
        k = ctl.choose(alphas)
        ctl.record(len(alphas), k, cost(k))
    return ctl.choose(alphas)


def test_controller_choices():
    assert expected_tokens(0.0, 3) == 1.0 and expected_tokens(1.0, 3) == 4.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-12
    # drafting doubles the step cost, drafts rarely accepted: plain decoding wins
    assert _settle(DraftController(4), [0.2] * 4, lambda k: 1.0 if k == 0 else 2.0) == 0
    # good drafts, cost growing slowly with k: draft the most
    assert _settle(DraftController(4), [0.9] * 4, lambda k: 1.0 + 0.05 * k) == 4
    # a middle ground: cost linear in k, alpha 0.7 -> an interior optimum
    k = _settle(DraftController(6), [0.7] * 2, lambda k: 1.0 + 0.3 * k)
    rates = [expected_tokens(0.7, j) / (1.0 + 0.3 * j) for j in range(7)]
    assert k == max(range(7), key=rates.__getitem__) and 0 < k < 6
    # costs are kept per batch-size bucket: a new bucket is explored afresh
    ctl = DraftController(2, explore_every=0)
    _settle(ctl, [0.9], lambda k: 1.0)
    assert ctl.choose([0.9] * 8) == 0 and (8, 0) not in ctl.cost


def test_controller_limited_choices():
    """With ``choices`` the controller measures and picks only those ``k`` (static steps with a
    drafter whose proposals cost the same for any k: 0 or kmax); the loop passes them then."""
    ctl = DraftController(15, choices=(0, 15), explore_every=3)
    picks = set()
    for _ in range(20):
        k = ctl.choose([0.8] * 4)
        ctl.record(4, k, 1.0)
        picks.add(k)
    assert picks == {0, 15} and set(ctl.cost) == {(4, 0), (4, 15)}
    # one slow step (a graph captured at first use) does not make a k look slow: the median of recent steps
    ctl = DraftController(15, choices=(0, 15), explore_every=0)
    for cost15 in (0.5, 1.0, 1.0):
        ctl.record(1, 0, 1.0)
        ctl.record(1, 15, cost15 if cost15 != 0.5 else 100.0)
    assert ctl.choose([0.7]) == 15 and ctl.cost[(1, 15)] == 1.0
    # a close call goes to plain decoding: drafting promising 2 % more than k = 0 does not win
    a = 0.5
    gain = expected_tokens(a, 15)
    ctl = DraftController(15, choices=(0, 15), explore_every=0)
    _settle(ctl, [a], lambda k: 1.0 if k == 0 else gain / 1.02)
    assert ctl.choose([a]) == 0
    ctl = DraftController(15, choices=(0, 15), explore_every=0)
    _settle(ctl, [a], lambda k: 1.0 if k == 0 else gain / 1.05)
    assert ctl.choose([a]) == 15
    for bad in ((16,), (-1, 3), ()):
        with pytest.raises(ValueError, match="choices"):
            DraftController(15, choices=bad)


def test_slot_acceptance_estimate():
    """A slot's acceptance estimate is per draft given the ones before it were accepted (the
    controller's model), not accepted / drafted: a step that accepts 3 of 15 drafts is 3 of 4
    tried, and the model's expected tokens then match the 4 a step commits."""
    from specdec.engine.requests import Slot

    sl = Slot(None, None, None, None, 0)
    assert sl.alpha == 0.5
    for _ in range(40):
        sl.record_drafts(3, 15, 0.3)
    assert abs(sl.alpha - 0.75) < 1e-6 and abs(expected_tokens(sl.alpha, 15) - 4.0) < 0.1
    for _ in range(40):
        sl.record_drafts(4, 4, 0.3)
    assert sl.alpha > 0.99
    before = sl.alpha
    sl.record_drafts(0, 0, 0.3)  # a step that asked for no drafts says nothing
    assert sl.alpha == before
    for _ in range(40):  # asked for 4, offered 1 (an n-gram with a short match), accepted: 1 of 2 tried
        sl.record_drafts(1, 4, 0.3)
    assert abs(sl.alpha - 0.5) < 1e-6
    # a step without drafts moves the estimate towards the loop's (here 0.8): a slot the controller
    # keeps at k = 0 is drafted for again after a few steps, not only when the controller re-explores
    sl.relax(1.6, 2.0, 0.3)
    assert 0.5 < sl.alpha < 0.8
    for _ in range(40):
        sl.relax(1.6, 2.0, 0.3)
    assert abs(sl.alpha - 0.8) < 1e-4


def test_slots_at_k0_relax_towards_the_loop(setup):
    """In the loop: a slot whose drafts failed, stepping at k = 0, moves towards the loop's estimate."""
    loop = EngineLoop(setup[0], "ngram", max_slots=2, controller=True)
    loop._acceptance[:] = [1.6, 2.0]
    loop.controller.choose = lambda alphas, caps=None: 0  # every step k = 0
    seen = []
    real_step = loop._step

    def step(k):
        for sl in loop._slots:
            if sl is not None and sl.out:
                if not seen:
                    sl.hits, sl.tries = 0.2, 2.0  # a slot whose drafts failed
                seen.append(sl.alpha)
        real_step(k)
    loop._step = step
    loop.run([GenRequest([3, 4, 5, 6], 6, GREEDY)])
    assert seen[0] == 0.1 and all(b > a for a, b in zip(seen, seen[1:])) and seen[-1] > 0.6, seen


def test_controller_reexplores():
    ctl = DraftController(2, explore_every=5)
    assert _settle(ctl, [0.1], lambda k: 1.0 + k) == 0
    picks = []
    for _ in range(12):
        k = ctl.choose([0.1])
        ctl.record(1, k, 1.0 + k)
        picks.append(k)
    assert set(picks) > {0}, "a losing k is measured again now and then"


def test_accept_greedy_rows_equals_per_row():
    from specdec.engine import accept_greedy
    from specdec.engine.acceptance import accept_greedy_rows
    g = torch.Generator().manual_seed(0)
    b, k, v = 6, 4, 5
    logits = torch.randn(b, k + 1, v, generator=g)
    n = torch.tensor([0, 1, 4, 2, 4, 3])
    drafts = logits[:, :k].argmax(-1)  # drafts the target agrees with, some spoiled below
    drafts[1, 0] = (drafts[1, 0] + 1) % v
    drafts[4, 2] = (drafts[4, 2] + 1) % v
    drafts[torch.arange(k)[None, :] >= n[:, None]] = 0  # padding
    rows = accept_greedy_rows(drafts, n, logits)
    for i in range(b):
        want = accept_greedy(drafts[i, : n[i]], logits[i, : n[i] + 1])
        assert rows[i, : want.numel()].tolist() == want.tolist(), i


def test_greedy_exact_beside_sampled_requests(setup):
    """Greedy and sampled requests share steps; the greedy ones still equal plain decoding."""
    loaded, dirs = setup
    reqs = _requests(8, seed=6)
    for i in (1, 4, 6):
        reqs[i].params = SamplingParams(temperature=1.0, top_p=0.9, seed=i)
    got = _serve(EngineLoop(loaded, f"mtp:{dirs['mtp']}", max_slots=4, num_draft_tokens=2), reqs)
    for i, (r, (toks, done)) in enumerate(zip(reqs, got)):
        assert done.kind == "done", done.message
        assert len(toks) == r.max_new_tokens
        if r.params.greedy:
            assert toks == _reference(loaded.model, r)


@pytest.mark.parametrize("kind, static", [("mtp", False), ("adversarial", False), ("adversarial", True)])
def test_sampled_two_tokens_follow_the_target(tmp_path, kind, static):
    """The second token comes out of a verify step (sampled drafts with their probabilities,
    rejection sampling per slot): the joint of the first two tokens must be the target's. The
    adversarial drafter samples the target's unlikely tokens: misused draft probabilities show.
    ``static``: the verify steps run as the static batched step (CUDA's default), uncaptured."""
    path = build_llama(tmp_path / "t8", vocab=8, hidden=32, layers=2, seed=1, head_scale=2.0)
    loaded = load_model(path, "cpu", "float32", tokenizer=False)
    model = loaded.model
    if kind == "mtp":
        save_mtp_dir(new_mtp_block(model, init_from_layer=-1, generator=torch.Generator().manual_seed(2)), model,
                     str(tmp_path / "h"), dtype=None)
        draft = f"mtp:{tmp_path / 'h'}"
    else:
        draft = lambda: DistDrafter(model_next_logits(model), "adversarial")  # noqa: E731
    prompt, params, n = [3, 1, 4, 1, 5], SamplingParams(temperature=1.0), 800
    reqs = [GenRequest(prompt, 2, SamplingParams(temperature=1.0, seed=i)) for i in range(n)]
    engine = EngineLoop(loaded, draft, max_slots=8, max_queue=n, num_draft_tokens=1, controller=False,
                        static_steps=static)
    got = _serve(engine, reqs)
    assert bool(engine._static) == static
    counts = torch.zeros(8, 8)
    for toks, _ in got:
        counts[toks[0], toks[1]] += 1

    def probs(seq):
        return probs_from_logits(model(torch.tensor(seq), model.new_cache(16), logits="last").logits[-1], params)
    p1 = probs(prompt)
    joint = torch.stack([p1[a] * probs(prompt + [a]) for a in range(8)])
    _, _, pval = pooled_chi2(counts, joint)
    assert pval > 1e-4, pval
    assert engine.metrics()["accepted_total"] > 0  # some second tokens were accepted drafts


def test_full_context_beside_drafting_rows(setup):
    """A request that fills its context exactly drafts nothing in its last steps, yet its row is
    padded to the step's widest: the padding lands in the cache's spare rows."""
    loaded, _ = setup
    pat = [5, 6, 7, 8]
    reqs = [GenRequest((pat * 10)[:40], 24, GREEDY), GenRequest(pat * 3, 40, GREEDY), GenRequest([9, 9, 9], 50, GREEDY)]
    engine = EngineLoop(loaded, "ngram", max_slots=3, max_context=64, num_draft_tokens=4, controller=False)
    got = _serve(engine, reqs)
    for r, (toks, done) in zip(reqs, got):
        assert done.kind == "done", done.message
        assert toks == _reference(loaded.model, r)
    assert engine.metrics()["accepted_total"] > 0


def test_dflash_block_size_sets_the_draft_length(setup):
    loaded, dirs = setup
    engine = EngineLoop(loaded, f"dflash:{dirs['dflash']}", block_size=3, num_draft_tokens=7)
    assert engine.metrics()["max_draft_tokens"] == 2
    with pytest.raises(ConfigError, match="block_size"):
        EngineLoop(loaded, "ngram", block_size=3)


def test_raising_callback_cancels_its_request(setup):
    loaded, _ = setup

    def broken(ev):
        raise OSError("client went away")

    engine = EngineLoop(loaded, None, max_slots=2)
    engine.start()
    try:
        bad = engine.submit(GenRequest([1, 2, 3], 300, GREEDY), on_event=broken)
        good = engine.submit(GenRequest([4, 5, 6], 10, GREEDY))
        toks, done = _collect(bad)
        assert done.finish_reason == "cancelled" and len(toks) < 300
        assert _collect(good)[0] == _reference(loaded.model, GenRequest([4, 5, 6], 10, GREEDY))
    finally:
        engine.stop()
    idle = EngineLoop(loaded, None)  # never started: no event comes
    h = idle.submit(GenRequest([1], 2, GREEDY))
    with pytest.raises(TimeoutError):
        next(h.events(timeout=0.05))
    idle.stop()


def test_failing_forward_fails_its_step_only(setup, monkeypatch):
    loaded, _ = setup
    model = loaded.model
    real, calls = model.forward_batch, {"verify": 0}

    def flaky(*args, **kw):
        if kw.get("logits") == "all":
            calls["verify"] += 1
            if calls["verify"] == 3:
                raise RuntimeError("device fault")
        return real(*args, **kw)

    monkeypatch.setattr(model, "forward_batch", flaky)
    engine = EngineLoop(loaded, "ngram", max_slots=2)
    first = [engine.submit(GenRequest([1, 2, 3], 20, GREEDY)), engine.submit(GenRequest([4, 5], 20, GREEDY))]
    engine.start()  # both join the first boundary together, so the third verify step holds both
    try:
        results = [_collect(h) for h in first]
        later = _collect(engine.submit(GenRequest([6, 7, 8], 12, GREEDY)))
    finally:
        engine.stop()
    assert [done.kind for _, done in results] == ["error", "error"]
    assert all("device fault" in done.message for _, done in results)
    assert later[1].kind == "done" and later[0] == _reference(model, GenRequest([6, 7, 8], 12, GREEDY))


def test_prompt_chunks_interleave_with_decode_steps(setup):
    """Driven by hand (no thread): prompts advance one chunk per boundary while other requests
    decode; a prompt whose last chunk ends near the context limit is not padded past its cache
    rows when it shares a boundary with a wider chunk."""
    loaded, _ = setup
    model = loaded.model
    engine = EngineLoop(loaded, None, max_slots=3, max_context=64)
    engine.prefill_chunk = 24
    a = GenRequest(list(range(1, 61)), 4, GREEDY)  # chunks at 0, 24, 48: the last ends at 60
    b = GenRequest(list(range(3, 33)), 6, GREEDY)  # joins when a's last chunk runs: width 24
    c = GenRequest([7, 8, 9], 30, GREEDY)  # decodes all along
    handles = [engine.submit(c), engine.submit(a)]
    with torch.inference_mode():
        engine._step(engine._boundary().k)
        assert engine._slots[1].length == 24 and len(engine._slots[0].out) == 2  # a: one chunk; c: decoding
        engine._step(engine._boundary().k)
        handles.append(engine.submit(b))
        for _ in range(40):
            engine._step(engine._boundary().k)
        engine._deliver()  # what the loop's drivers do when no step follows
    for h, r in zip(handles, (c, a, b)):
        toks, done = _collect(h, 1)
        assert done.kind == "done", done.message
        assert toks == _reference(model, r)


def test_slot_drafters_are_kept_across_requests(setup, monkeypatch):
    """A slot keeps its built-in drafter across requests (a DFlash drafter keeps its context
    buffers and static block: one capture per slot on CUDA), and ``begin`` starts it afresh: the
    drafts each request gets through a reused drafter (stale context rows past its length) equal
    those of a fresh drafter, and replies equal plain decoding. A failed request drops its drafter."""
    from specdec.drafters import dflash as dfm

    loaded, dirs = setup
    drafts, spawned = {}, []
    orig_spawn, orig_begin, orig_propose = dfm.DFlashDrafter.spawn, dfm.DFlashDrafter.begin, dfm.DFlashDrafter.propose

    def spawn(self):
        d = orig_spawn(self)
        d.static_steps = True  # the static block path (eager on the CPU), which reads the whole buffers
        spawned.append(d)
        return d

    def begin(self, prompt_ids, out):
        self.key = tuple(prompt_ids.tolist())
        orig_begin(self, prompt_ids, out)

    def propose(self, last_token, k, params, gen):
        p = orig_propose(self, last_token, k, params, gen)
        drafts.setdefault(self.key, []).append(p.tokens.tolist())
        return p

    monkeypatch.setattr(dfm.DFlashDrafter, "spawn", spawn)
    monkeypatch.setattr(dfm.DFlashDrafter, "begin", begin)
    monkeypatch.setattr(dfm.DFlashDrafter, "propose", propose)
    reqs = _requests(6, seed=4, repetitive=True)
    spec = f"dflash:{dirs['dflash']}"
    kept = _serve(EngineLoop(loaded, spec, max_slots=1, controller=False), reqs)  # one slot: one drafter for all
    assert len(spawned) == 1
    reused, drafts = drafts, {}
    for r in reqs:  # each request with a drafter of its own
        _serve(EngineLoop(loaded, spec, max_slots=1, controller=False), [r])
    assert len(spawned) == 1 + len(reqs)
    assert reused == drafts and sum(len(v) for v in drafts.values()) > len(reqs)
    for r, (toks, done) in zip(reqs, kept):
        assert done.kind == "done" and toks == _reference(loaded.model, r)
    engine = EngineLoop(loaded, spec, max_slots=1)
    engine._slot_drafters[0] = "kept"
    engine._slots[0] = type("S", (), {"handle": type("H", (), {"_send": lambda self, ev: None})()})()
    engine._fail(0, "x")
    assert 0 not in engine._slot_drafters


def test_loop_controller_choices(setup):
    """Static steps with DFlash or n-gram: the controller weighs k = 0 against kmax only; eager
    steps (whose width follows k) and MTP (whose proposals cost a pass per draft) weigh every k."""
    loaded, dirs = setup
    for spec, static, want in ((f"dflash:{dirs['dflash']}", True, (0, 3)), ("ngram", True, (0, 4)),
                               ("ngram", False, (0, 1, 2, 3, 4)), (f"mtp:{dirs['mtp']}", True, (0, 1, 2, 3, 4))):
        assert EngineLoop(loaded, spec, max_slots=2, static_steps=static).controller.choices == want, spec


def test_new_requests_start_from_the_loops_acceptance(setup):
    """A new request's acceptance estimate starts from the loop's (every slot's drafts so far), not
    from a fixed guess: the loop's starts optimistic (9 in 10, so that it drafts and learns), falls
    when drafts are rejected and rises when they are accepted, and the next request's slot starts
    there (a slot kept at k = 0 would never learn its own rate). The controller is made to draft
    every step (its own choices follow measured step times)."""
    loaded, dirs = setup
    model = loaded.model
    reqs = _requests(2, seed=8)
    for r in reqs:
        r.max_new_tokens = 40
    base = make_drafter(f"dflash:{dirs['dflash']}", loaded)
    full = {tuple(r.prompt_ids): r.prompt_ids + plain_generate(model, r.prompt_ids, r.max_new_tokens).token_ids
            for r in reqs}
    spoil = [1.0]
    engine = EngineLoop(loaded, lambda: SlotOracle(base.spawn(), full, VOCAB, spoil=spoil[0]), max_slots=1)
    seen = []
    engine.controller.choose = lambda alphas, caps=None: seen.append(list(alphas)) or engine.kmax
    assert engine._acceptance == [1.8, 2.0]
    assert engine.run(reqs[:1]) == [_reference(model, reqs[0])]  # drafts never accepted: it falls
    assert seen[0] == [pytest.approx(0.9)]
    low = engine._acceptance[0] / engine._acceptance[1]
    assert low < 0.3, engine._acceptance
    spoil[0], seen[:] = 0.0, []
    assert engine.run(reqs[1:]) == [_reference(model, reqs[1])]  # always accepted: it rises
    assert seen[0] == [pytest.approx(low)]  # the new request started from the loop's estimate
    assert engine._acceptance[0] / engine._acceptance[1] > 0.7, engine._acceptance


def test_controller_calibrates_the_model():
    """Steps with drafts that commit fewer tokens than the model predicted (an n-gram's bursty
    acceptance: per-slot rates say 0.6, steps commit 1.2 tokens a slot) scale its predictions down,
    so plain decoding wins again; steps that commit what was predicted leave drafting on."""
    alphas = [0.6] * 16
    cost = {0: 1.0, 4: 1.5}  # a 4-draft step costs 1.5 plain steps; the model promises 2.3 tokens a slot

    def run(committed_per_slot: float) -> list[int]:
        ctl = DraftController(4, choices=(0, 4), explore_every=10)
        picks = []
        for _ in range(200):
            k = ctl.choose(alphas)
            ctl.record(16, k, cost[k], tokens=round(16 * (committed_per_slot if k else 1.0)))
            picks.append(k)
        return picks

    fooled = run(1.2)
    assert fooled[-100:].count(4) <= 10, "only the re-exploring steps draft"
    honest = run(expected_tokens(0.6, 4))
    assert honest[-100:].count(4) >= 90
    # no tokens reported: the model alone (drafting, as the rates promise)
    ctl = DraftController(4, choices=(0, 4), explore_every=0)
    for _ in range(20):
        k = ctl.choose(alphas)
        ctl.record(16, k, cost[k])
    assert ctl.choose(alphas) == 4 and ctl.calibration(16, 4) == 1.0
    # per batch bucket: 16 slots' drafts commit what was promised, 4 slots' commit nothing; a bucket
    # without steps of its own borrows every bucket's
    ctl = DraftController(4, choices=(0, 4), explore_every=0, calib_min=4)
    for _ in range(40):
        for n, per_slot in ((16, expected_tokens(0.6, 4)), (4, 1.0)):
            k = ctl.choose([0.6] * n)
            ctl.record(n, k, cost[k], tokens=round(n * (per_slot if k else 1.0)))
    assert ctl.choose([0.6] * 16) == 4 and ctl.choose([0.6] * 4) == 0
    assert ctl.calibration(16, 4) > 0.95 and ctl.calibration(4, 4) < 0.5
    assert ctl.calibration(4, 4) < ctl.calibration(2, 4) <= ctl.calibration(16, 4) + 1e-9  # pooled: between


def test_controller_caps_and_close_losses():
    """A slot with few tokens left cannot take many drafts: the model counts at most its cap (the
    tokens it has left). A k that loses by little is measured again every ``explore_near`` steps
    (a k = 0 step teaches the model nothing), one that loses by much only every ``explore_every``."""
    cost = {0: 1.0, 4: 1.3}
    ctl = DraftController(4, choices=(0, 4), explore_every=0)
    _settle(ctl, [0.9] * 4, lambda k: cost[k])
    assert ctl.choose([0.9] * 4) == 4
    assert ctl.choose([0.9] * 4, caps=[0] * 4) == 0  # every request about to end: nothing to gain
    assert ctl.choose([0.9] * 4, caps=[1] * 4) == 4  # one draft each: 1.9 tokens for 1.3x the cost

    def picks(alpha: float, steps: int = 60) -> list[int]:
        ctl = DraftController(4, choices=(0, 4), explore_every=0, explore_near=10)
        _settle(ctl, [alpha] * 4, lambda k: cost[k])
        out = []
        for _ in range(steps):
            k = ctl.choose([alpha] * 4)
            ctl.record(4, k, cost[k])
            out.append(k)
        return out

    close = picks(0.2)  # 1.25 tokens for 1.3x: 4 % short
    assert 4 <= close.count(4) <= 7, close
    assert picks(0.05).count(4) == 0  # 1.05 tokens for 1.3x: far off
