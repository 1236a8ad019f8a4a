"""Static batched verify steps (``EngineLoop(static_steps=True)``, CUDA graphs on CUDA): on the
CPU the very function the graph captures runs eagerly, so these tests check the math the GPU
replays. A static step equals the eager batched forward row for row (logits, hidden, captured
features, cache writes, idle slots untouched), and so does the one-slot static prefill step; the
loop's greedy output equals plain single-sequence decoding with n-gram, spoiled-oracle and real
DFlash drafters; and a request's logits are bitwise the same served alone or beside three others
(more in test_serve_exact.py). Tiny random Llama, fp32."""

from __future__ import annotations

import pytest
import torch

from _engine_util import SlotOracle, build_llama
from test_serve_loop import GREEDY, VOCAB, _reference, _requests, _serve
from specdec.drafters.factory import make_drafter
from specdec.engine import SpeculativeGenerator
from specdec.engine.batch import forward_ragged, generate_batch
from specdec.engine.serve_loop import EngineLoop, GenRequest
from specdec.loading import load_model
from specdec.models.base import ForwardOut
from specdec.models.graphed_batch import GraphedBatch, GraphedPrefill
from specdec.sampling import SamplingParams
from specdec.train.dflash_batch import new_dflash_config, new_dflash_model, save_dflash_dir

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(loaded tiny peaky Llama, DFlash drafter dir capturing layers of it)."""
    root = tmp_path_factory.mktemp("static")
    loaded = load_model(build_llama(root / "target", vocab=VOCAB, hidden=32, layers=3, seed=3, head_scale=4.0),
                        "cpu", "float32", tokenizer=False)
    cfg = new_dflash_config(loaded, num_layers=1, block_size=4, mask_token_id=VOCAB - 1)
    save_dflash_dir(new_dflash_model(loaded, cfg), cfg, str(root / "dflash"), dtype=None)
    return loaded, str(root / "dflash")


def test_static_step_equals_eager_forward_batch(setup):
    """Ragged rows in scattered slots, one slot mid-prefill and one free: the static step's rows
    equal the eager forward's, it writes the same KV at the rows' positions, and an idle slot's
    committed positions stay untouched."""
    model = setup[0].model
    capture, width, n_slots = (0, 2), 4, 5
    cache = model.new_batch_cache(n_slots, 40, spare=width)
    g = torch.Generator().manual_seed(1)
    prompts = {0: 5, 1: 9, 2: 7, 4: 2}  # slot -> committed length; slot 2 is "prefilling" (idle), 3 is free
    rows = [torch.randint(0, VOCAB, (n,), generator=g) for n in prompts.values()]
    forward_ragged(model, cache, rows, [0] * len(rows), list(prompts))
    eager_cache = model.new_batch_cache(n_slots, 40, spare=width)
    for a, b in zip(eager_cache.layers, cache.layers):
        a.k.copy_(b.k)
        a.v.copy_(b.v)

    live, n_drafts = [0, 1, 4], [3, 0, 2]  # slot -> drafts in this step (padded to width - 1)
    ids = torch.randint(0, VOCAB, (len(live), width), generator=g)
    lengths = [prompts[s] for s in live]
    ref = model.forward_batch(ids, eager_cache, torch.tensor(lengths), slots=torch.tensor(live),
                              span=max(lengths) + width, capture=capture, logits="all")
    step = GraphedBatch(model, cache, width, capture)
    starts = [prompts.get(s, 0) for s in range(n_slots)]
    out = step(ids, live, starts)
    for i, (s, n) in enumerate(zip(live, n_drafts)):
        for name in ("logits", "hidden", "captured"):
            torch.testing.assert_close(getattr(out, name)[s, : n + 1], getattr(ref, name)[i, : n + 1],
                                       atol=1e-5, rtol=1e-5, msg=lambda m: f"slot {s} {name}: {m}")
        for a, b in zip(cache.layers, eager_cache.layers):  # the same KV entries, in the right slot
            torch.testing.assert_close(a.k[s, :, : prompts[s] + n + 1], b.k[s, :, : prompts[s] + n + 1],
                                       atol=1e-5, rtol=1e-5)
    for a, b in zip(cache.layers, eager_cache.layers):  # the prefilling slot keeps its committed prompt
        assert torch.equal(a.k[2, :, :7], b.k[2, :, :7]) and torch.equal(a.v[2, :, :7], b.v[2, :, :7])


def test_static_prefill_equals_eager_forward(setup):
    """A 13-token prompt in chunks of 5 (the last one padded) into slot 2 of 4: the same last
    logits, hidden rows, captured rows and KV as one eager forward of the whole prompt; the
    other slots' committed positions untouched."""
    model = setup[0].model
    cache, ref = (model.new_batch_cache(4, 30, spare=4) for _ in range(2))
    prompt = torch.randint(0, VOCAB, (13,), generator=torch.Generator().manual_seed(2))
    want = forward_ragged(model, ref, [prompt], [0], [2], (0, 2))
    for a in cache.layers:
        a.k.fill_(7.0)
    step, outs = GraphedPrefill(model, cache, 5, (0, 2)), []
    for i in range(0, 13, 5):
        outs.append(step(prompt[i: i + 5], 2, i))
    hidden = torch.cat([o.hidden[0, : min(5, 13 - i)] for o, i in zip(outs, range(0, 13, 5))])
    captured = torch.cat([o.captured[0, : min(5, 13 - i)] for o, i in zip(outs, range(0, 13, 5))])
    close = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[-1].logits, want.logits, **close)
    torch.testing.assert_close(hidden, want.hidden[0], **close)
    torch.testing.assert_close(captured, want.captured[0], **close)
    for a, b in zip(cache.layers, ref.layers):
        torch.testing.assert_close(a.k[2, :, :13], b.k[2, :, :13], **close)
        torch.testing.assert_close(a.v[2, :, :13], b.v[2, :, :13], **close)
        assert bool((a.k[[0, 1, 3]] == 7.0).all())
    with pytest.raises(RuntimeError, match="does not fit"):
        step(prompt[:3], 2, 30)


@pytest.mark.parametrize("kind", ["ngram", "oracle-dflash"])
def test_static_greedy_equals_plain(setup, kind):
    """Concurrent requests, slots refilled, prompts prefilled in chunks while others decode,
    drafts accepted and rolled back: every output equals plain greedy decoding."""
    loaded, dflash = setup
    model = loaded.model
    reqs = _requests(10, seed=2, repetitive=kind == "ngram")
    if kind == "ngram":
        draft = "ngram"
    else:
        base = make_drafter(f"dflash:{dflash}", loaded)
        full = {tuple(r.prompt_ids): r.prompt_ids + _reference(model, r) for r in reqs}
        seeds = iter(range(100))
        draft = lambda: SlotOracle(base.spawn(), full, VOCAB, seed=next(seeds))  # noqa: E731
    engine = EngineLoop(loaded, draft, max_slots=4, max_queue=16, num_draft_tokens=3, static_steps=True)
    engine.prefill_chunk = 8
    # every other step re-measures the other k: drafts and plain steps mixed, whatever the
    # controller makes of this tiny model's costs (its calibration may rule drafting out)
    engine.controller.explore_every = 2
    got = _serve(engine, reqs)
    for r, (toks, done) in zip(reqs, got):
        assert done.kind == "done", done.message
        assert toks == _reference(model, r), f"prompt {r.prompt_ids}"
    m = engine.metrics()
    assert 0 < m["accepted_total"] < m["drafted_total"], m
    # the controller tried k = 0 too: exact on the CPU, every step took the full shape (all slots,
    # kmax + 1 wide); other shapes only where checked, on CUDA (test below)
    assert m["k_chosen"].get(0, 0) > 0, m
    assert set(engine._static) == {(4, 4, engine.cache.max_len)}, m


@pytest.mark.parametrize("check", ["same", "differs", "cpu"])
def test_exact_other_shapes_only_where_checked(setup, monkeypatch, check):
    """exact: steps without drafts (1 wide) and steps over the first 1, 2, ... slots only (slot
    buckets) run alone once their shape's first SHAPE_CHECKS steps, each also run in the full
    shape, gave the same bits; one that does not sends every step to the full shape for good.
    The comparison is made to agree or to differ here (the check is on, as on CUDA), or left off,
    as the CPU has it: full steps only. Replies equal plain greedy decoding each way (the tiny
    peaky model's argmax does not move with the bits)."""
    import itertools

    from specdec.engine import loop_work
    from specdec.models.graphed_batch import GraphedBatch

    loaded = setup[0]
    if check != "cpu":
        monkeypatch.setattr(loop_work, "same_bits", lambda a, b: check == "same")
    shapes = []
    call = GraphedBatch.__call__
    monkeypatch.setattr(GraphedBatch, "__call__", lambda self, *a: shapes.append((self.rows, self.width)) or call(self, *a))
    reqs = _requests(8, seed=3, repetitive=True)
    engine = EngineLoop(loaded, "ngram", max_slots=4, num_draft_tokens=3, static_steps=True)
    assert engine.slot_buckets and engine._shapes_exact is False  # the CPU: checks off
    engine._shapes_exact = check != "cpu"
    steps = itertools.count()
    engine.controller.choose = lambda alphas, caps=None: 3 if next(steps) % 3 == 2 else 0
    got = engine.run(reqs[:5]) + engine.run(reqs[5:6]) + engine.run(reqs[6:])  # 4, 1 and 2 at once: buckets 4, 1, 2
    for r, toks in zip(reqs, got):
        assert toks == _reference(loaded.model, r)
    m = engine.metrics()
    full = (4, 4)
    if check == "same":
        checked = m["checked_steps"]
        assert {(n, w) for n, w, _ in checked} >= {(1, 1), (1, 4), (2, 1), (4, 1)}, checked
        assert set(engine._checked.values()) == {loop_work.SHAPE_CHECKS}
        # every checked step also ran the full shape; steps of other shapes then ran alone
        assert len(shapes) == m["steps_total"] + loop_work.SHAPE_CHECKS * len(checked)
        assert sum(s != full for s in shapes) > len(checked) * loop_work.SHAPE_CHECKS
    elif check == "differs":
        assert not engine._shapes_exact and m["checked_steps"] is None
        assert sum(s != full for s in shapes) == 1 and len(shapes) == m["steps_total"] + 1  # one check, then full
    else:
        assert set(shapes) == {full} and len(shapes) == m["steps_total"]


@pytest.mark.parametrize("mode", ["checked", "full", "inexact"])
def test_warmup_builds_the_steps_before_serving(setup, monkeypatch, mode):
    """``warmup()`` builds the shortest span's static steps for every slot bucket and width before
    any request, running the shape checks (exact); serving then builds no step of that span."""
    from specdec.engine import loop_work

    loaded = setup[0]
    monkeypatch.setattr(loop_work, "same_bits", lambda a, b: True)
    engine = EngineLoop(loaded, "ngram", max_slots=4, num_draft_tokens=3, static_steps=True,
                        exact=mode != "inexact", span_buckets=mode == "checked")
    engine._shapes_exact = mode == "checked"  # on CUDA, the checks; the CPU's exact loop takes the full shape
    built = engine.warmup()
    spans = (256, 512) if mode == "checked" else (engine.cache.max_len,)
    want = {(4, 4, sp) for sp in spans} if mode == "full" else {
        (n, w, sp) for n in (1, 2, 4) for w in (1, 4) for sp in spans}
    assert set(engine._static) == want and built == len(want)
    if mode == "checked":
        assert engine._checked == {sh: loop_work.SHAPE_CHECKS for sh in want if sh[:2] != (4, 4)}
        assert engine._idle_start == 0
    reqs = _requests(5, seed=7, repetitive=True)
    for r, toks in zip(reqs, engine.run(reqs)):
        assert toks == _reference(loaded.model, r)
    assert set(engine._static) == want  # nothing built while serving
    assert engine.warmup() == 0  # between batches: nothing left to build
    engine.start()
    try:
        with pytest.raises(RuntimeError, match="before start"):
            engine.warmup()
    finally:
        engine.stop()


def test_inexact_k0_runs_the_narrow_step(setup):
    """exact=False: steps without drafts run the 1-wide static step, prompts prefill together
    (eagerly), and the output still equals plain greedy decoding."""
    loaded = setup[0]
    reqs = _requests(8, seed=2, repetitive=True)
    engine = EngineLoop(loaded, "ngram", max_slots=4, num_draft_tokens=3, static_steps=True, exact=False)
    engine.controller.choose = lambda alphas, caps=None: 0 if len(alphas) > 1 else 3
    for r, toks in zip(reqs, engine.run(reqs)):
        assert toks == _reference(loaded.model, r)
    assert sorted({w for _, w, _ in engine._static}) == [1, 4] and not engine._prefill_steps


@pytest.mark.parametrize("all_slots", [False, True], ids=["per-slot", "all-slots"])
def test_static_real_dflash_matches_single_sequence(setup, all_slots):
    """The real DFlash drafter reads each row's captured features: it drafts what it drafts
    serving the request alone (same accepted counts at every step)."""
    loaded, dflash = setup
    reqs = _requests(5, seed=4)
    engine = EngineLoop(loaded, f"dflash:{dflash}", max_slots=3, num_draft_tokens=3, controller=False,
                        static_steps=True, all_slots_drafter=all_slots)
    assert (engine._all_slots is not None) == all_slots  # every slot drafts in one step (DFlashSlots)
    got = _serve(engine, reqs)
    for r, (toks, done) in zip(reqs, got):
        res = SpeculativeGenerator(loaded.model, make_drafter(f"dflash:{dflash}", loaded), 3).generate(
            r.prompt_ids, r.max_new_tokens)
        assert toks == res.token_ids
        assert done.stats["accepted_per_step"] == res.stats.accepted


@pytest.mark.parametrize("all_slots", [False, True], ids=["per-slot", "all-slots"])
def test_draft_vocab_served_as_alone(setup, all_slots, tmp_path):
    """With a draft vocabulary (a third of the tokens, plus each request's prompt tokens: per slot in
    DFlashSlots) every request drafts and accepts as served alone, with plain output."""
    import json

    loaded, dflash = setup
    vfile = tmp_path / "vocab.json"
    vfile.write_text(json.dumps(list(range(0, VOCAB, 3))))
    reqs = _requests(5, seed=4)
    engine = EngineLoop(loaded, f"dflash:{dflash}", max_slots=3, num_draft_tokens=3, controller=False,
                        static_steps=True, all_slots_drafter=all_slots, draft_vocab=str(vfile))
    assert (engine._all_slots is not None) == all_slots
    got = _serve(engine, reqs)
    if all_slots:  # the slots' prompt tokens off the vocabulary, written at begin
        assert (engine._all_slots.parts.ids < VOCAB).any()
    full = []
    for r, (toks, done) in zip(reqs, got):
        alone = make_drafter(f"dflash:{dflash}", loaded, draft_vocab=str(vfile))
        res = SpeculativeGenerator(loaded.model, alone, 3).generate(r.prompt_ids, r.max_new_tokens)
        assert toks == res.token_ids == _reference(loaded.model, r)
        assert done.stats["accepted_per_step"] == res.stats.accepted
        whole = SpeculativeGenerator(loaded.model, make_drafter(f"dflash:{dflash}", loaded), 3).generate(
            r.prompt_ids, r.max_new_tokens)
        full.append(whole.stats.accepted == res.stats.accepted)
    assert not all(full)  # the vocabulary changed some drafts: the check above can see a slot's part go missing


def test_all_slots_greedy_block_equals_the_proposals(setup):
    """propose_greedy (the loop's one-tensor path for greedy rows) gives each row the drafts
    propose gives it, zero past the row's own k, for rows of different k and slots in any order."""
    loaded, dflash = setup
    engine = EngineLoop(loaded, f"dflash:{dflash}", max_slots=4, num_draft_tokens=5, controller=False,
                        static_steps=True, all_slots_drafter=True)
    engine.run(_requests(4, seed=6))  # every slot holds a context
    d = engine._all_slots
    g = SamplingParams()
    rows = [(2, 7, 5, g, None), (0, 11, 2, g, None), (3, 5, 9, g, None)]  # k 9: capped at block - 1
    want = [p.tokens for p in d.propose(rows)]
    got, counts = d.propose_greedy(rows)
    assert got.shape == (3, min(9, d.block - 1)) and counts == [w.numel() for w in want]
    for i, w in enumerate(want):
        assert torch.equal(got[i, : w.numel()], w) and not got[i, w.numel():].any()
    assert len({tuple(w.tolist()) for w in want}) > 1  # the rows' drafts differ: the test can see a mix-up


def test_all_slots_drafter_runs_the_slots_bucket(setup):
    """Greedy requests only: the all-slots drafter's steps run the first 1, 2, 4, ... slots holding
    the live ones, and each run row drafts what the step over every slot drafts for it (same
    logits, fp32 rounding aside; same argmax). With a sampled request in the loop every step runs
    every slot (its drafts, hence its random stream, must not depend on the others)."""
    loaded, dflash = setup
    engine = EngineLoop(loaded, f"dflash:{dflash}", max_slots=8, num_draft_tokens=3, controller=False,
                        static_steps=True, all_slots_drafter=True)
    d = engine._all_slots
    assert d.buckets == [1, 2, 4, 8]
    ran, orig_block, orig_observe = [], d._block_run, d._observe_run

    def block(n, span):
        out = orig_block(n, span)
        full = orig_block(d.slots, span)
        live = [s for s in range(n) if d.lengths[s]]
        assert torch.allclose(out[1][live], full[1][live], atol=1e-4) and torch.equal(out[0][live], full[0][live])
        ran.append(("block", n, len(d.sampled)))
        return out
    d._block_run = block
    d._observe_run = lambda n: ran.append(("observe", n, len(d.sampled))) or orig_observe(n)
    reqs = _requests(3, seed=8)
    for r, toks in zip(reqs, engine.run(reqs)):
        assert toks == _reference(loaded.model, r)
    assert {n for _, n, _ in ran} == {4} and {k for k, _, _ in ran} == {"block", "observe"}, ran  # 3 live slots
    ran.clear()
    sampled = GenRequest(reqs[0].prompt_ids, 8, SamplingParams(temperature=1.0, seed=3))
    engine.run([reqs[1], sampled])
    assert ran and all(n == 8 for _, n, k in ran if k) and all(n <= 2 for _, n, k in ran if not k), ran
    assert any(k for _, _, k in ran)
    assert not d.sampled and not any(d.lengths)  # every request dropped at its end


def test_dflash_steps_without_drafts_defer_context_writes(setup):
    """Steps that draft nothing (k = 0) leave the committed rows pending in the DFlash drafter (a
    slot's own, or the all-slots one) until it next drafts, or, all-slots, until a slot holds a
    step's width of them. At every proposal the context cache holds each drafting slot's rows, in
    order, as computed from all of them at once (to fp32 rounding: the two paths group rows into
    other GEMM shapes, so their argmax drafts may differ at a near-tie), and every reply equals
    plain greedy decoding."""
    import itertools

    from specdec.drafters import dflash as dfm

    loaded, dflash = setup
    reqs = _requests(4, seed=5)

    def close(got, feats, model):
        pos = torch.arange(feats.shape[0])
        for (k, v), (gk, gv) in zip(model.context_kv(feats, pos), got):
            torch.testing.assert_close(gk, k, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(gv, v, rtol=1e-4, atol=1e-5)

    def run(all_slots, monkeypatch):
        engine = EngineLoop(loaded, f"dflash:{dflash}", max_slots=2, num_draft_tokens=3, static_steps=True,
                            all_slots_drafter=all_slots)
        assert engine.controller.choices == (0, 3)
        steps = itertools.count()
        engine.controller.choose = lambda alphas, caps=None: 3 if next(steps) % 6 == 5 else 0  # 5 steps of 1 row, then drafts
        flushes, checked, rows = [], [0], {}
        if all_slots:
            d = engine._all_slots
            orig_run, begin, observe, propose = d._observe_run, d.begin, d.observe, d.propose
            d._observe_run = lambda n: flushes.append(1) or orig_run(n)
            d.begin = lambda s, ids, out, **kw: rows.__setitem__(s, [out.captured]) or begin(s, ids, out, **kw)
            d.observe = lambda items: [rows[s].append(f) for s, f in items] and observe(items)

            def checked_before(fn):  # propose, or propose_greedy (greedy rows: the loop's one-tensor path)
                def wrapped(items):
                    d._flush()
                    for s, *_ in items:
                        n = d.lengths[s]
                        close([(k[s, :, :n], v[s, :, :n]) for k, v in zip(d.k, d.v)], torch.cat(rows[s])[:n], d.d.model)
                        checked[0] += 1
                    return fn(items)
                return wrapped
            d.propose, d.propose_greedy = checked_before(propose), checked_before(d.propose_greedy)
        else:
            begin, observe, propose = dfm.DFlashDrafter.begin, dfm.DFlashDrafter.observe, dfm.DFlashDrafter.propose
            monkeypatch.setattr(dfm.DFlashDrafter, "begin", lambda self, ids, out: rows.__setitem__(
                id(self), [out.captured]) or begin(self, ids, out))
            monkeypatch.setattr(dfm.DFlashDrafter, "observe", lambda self, toks, out: rows[id(self)].append(
                out.captured) or observe(self, toks, out))

            def checked_one(self, *a):
                self._flush()
                n = self.length
                close([(kv.k[:, :n], kv.v[:, :n]) for kv in self.kv], torch.cat(rows[id(self)])[:n], self.model)
                checked[0] += 1
                return propose(self, *a)
            monkeypatch.setattr(dfm.DFlashDrafter, "propose", checked_one)
        for r, (toks, done) in zip(reqs, _serve(engine, reqs)):
            assert done.kind == "done" and toks == _reference(loaded.model, r)
        return engine.metrics(), len(flushes), checked[0]
    with pytest.MonkeyPatch.context() as mp:
        m, flushes, checked = run(True, mp)
        _, _, checked_alone = run(False, mp)
    assert checked > 4 and checked_alone > 4
    assert m["k_chosen"][0] > 4 * m["k_chosen"][3] > 0, m
    # a flush per drafting step, and one whenever 4 rows (the width) wait: far fewer than the steps
    assert 0 < flushes < m["steps_total"] / 2, (flushes, m)


def test_all_slots_dflash_seeded_sampling_alone_or_shared(setup):
    """Seeded sampled requests drafted by the all-slots DFlash step: a slot's drafts depend on its
    own inputs only, so each request samples the same tokens served alone or beside others."""
    loaded, dflash = setup
    reqs = _requests(5, seed=6)
    for i, r in enumerate(reqs):
        r.params = SamplingParams(temperature=1.0, top_k=20, seed=100 + i)

    def serve(batch):
        engine = EngineLoop(loaded, f"dflash:{dflash}", max_slots=3, controller=False, static_steps=True,
                            all_slots_drafter=True)
        assert engine._all_slots is not None
        return [toks for toks, _ in _serve(engine, batch)]
    shared = serve(reqs)
    assert [serve([r])[0] for r in reqs] == shared
    assert len({tuple(t) for t in shared}) == len(reqs)


class _Recorder:
    """An n-gram drafter that records every row the loop hands it (prompt rows, then each step's
    committed rows), by prompt."""

    def __init__(self, loaded, log: dict):
        self.inner, self.log = make_drafter("ngram", loaded), log
        self.name, self.capture_layers = "recorder", ()

    def begin(self, prompt_ids, out: ForwardOut):
        self.rows = self.log.setdefault(tuple(prompt_ids.tolist()), [])
        self.rows.append((out.logits.clone(), out.hidden.clone()))
        self.inner.begin(prompt_ids, out)

    def observe(self, tokens, out: ForwardOut):
        self.rows.append((out.logits.clone(), out.hidden.clone()))
        self.inner.observe(tokens, out)

    def propose(self, last_token, k, params, gen):
        return self.inner.propose(last_token, k, params, gen)


def test_static_rows_bitwise_alone_or_shared(setup):
    """A request's verify-step logits and hidden states are bitwise the same served alone (in
    slot 0) or in slot 2 beside three other requests with other lengths and drafts."""
    loaded = setup[0]
    pat = [5, 6, 7, 8, 9]
    mine = GenRequest(pat * 3, 24, GREEDY)
    others = [GenRequest([1, 2, 1, 2, 1, 2, 1], 30, GREEDY), GenRequest([40, 41, 3], 12, GREEDY),
              GenRequest([9, 8, 7, 9, 8, 7, 9, 8, 7, 9, 8], 28, GREEDY)]
    runs = []
    for reqs in ([mine], others[:2] + [mine] + others[2:]):
        log: dict = {}
        engine = EngineLoop(loaded, lambda: _Recorder(loaded, log), max_slots=4, num_draft_tokens=3,
                            controller=False, static_steps=True)
        out = engine.run(reqs)
        runs.append((out[reqs.index(mine)], log[tuple(mine.prompt_ids)]))
        assert engine.metrics()["accepted_total"] > 0
    (alone, rows_a), (shared, rows_s) = runs
    assert alone == shared == _reference(loaded.model, mine)
    assert len(rows_a) == len(rows_s) > 3
    # the prompt rows come from the static prefill (exact, the default): bitwise too
    for j, ((la, ha), (ls, hs)) in enumerate(zip(rows_a, rows_s)):
        assert torch.equal(la, ls) and torch.equal(ha, hs), f"verify step {j}"


def test_generate_batch_static_equals_eager(setup):
    model = setup[0].model
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, VOCAB, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
               for _ in range(7)]
    eager = generate_batch(model, prompts, 12, set(), slots=3, static_steps=False)
    assert generate_batch(model, prompts, 12, set(), slots=3, static_steps=True) == eager
