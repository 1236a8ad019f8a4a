"""SPECDEC_SHORT_SPAN (models/graphs.py, on by default): a row-exact target's static steps within the first
``split_attention.split_keys`` positions attend over those only (one split: no combine kernel on CUDA). The
split kernel gives a row the same bits at any span; here, on the CPU, its torch form stands in for it
(``split_kernel_stand_in``) and the wiring is checked: which steps take which span, the greedy chain
crossing from one span's step to the other's, and outputs equal to the steps over the whole cache."""

import pytest
import torch
from _engine_util import split_kernel_stand_in, tiny_llama

from specdec.drafters.ngram import NgramDrafter
from specdec.engine import SpeculativeGenerator
from specdec.engine import generate as engine_mod
from specdec.models import graphs, layers, split_attention
from specdec.models.graphs import GraphedTarget

SPLIT = split_attention.split_keys(8)  # tiny_llama: 32 features over 4 heads
# a prompt that ends 12 positions short of the first split's end: the outputs cross it
PROMPT = torch.randint(1, 90, (SPLIT - 12,), generator=torch.Generator().manual_seed(3)).tolist()
N = 30


@pytest.fixture
def model(monkeypatch):
    m = tiny_llama(max_pos=1024)
    monkeypatch.setattr(m, "row_exact", lambda rows=1: True, raising=False)  # CPU weights: forced
    monkeypatch.setattr(graphs, "split_kernel_attends", lambda model: True)  # its torch form stands in (below)
    return m


def generate(m, drafter=None, k=0, lookahead=False, chain=False):
    """(tokens and every verify step's logits, in order; the generator's GraphedTarget)."""
    g = SpeculativeGenerator(m, drafter, k, batch_invariant=True, lookahead=lookahead)
    rows, accept = [], engine_mod.accept_greedy
    before, engine_mod.GREEDY_CHAIN = engine_mod.GREEDY_CHAIN, chain
    engine_mod.accept_greedy = lambda drafts, logits: rows.append(logits.clone()) or accept(drafts, logits)
    try:
        return (g.generate(PROMPT, N).token_ids, rows), g._graphed
    finally:
        engine_mod.GREEDY_CHAIN, engine_mod.accept_greedy = before, accept


@pytest.mark.parametrize("case", ["plain", "ngram", "chain"])
def test_short_span_steps_give_the_whole_cache_steps_tokens(model, monkeypatch, case):
    split_kernel_stand_in(monkeypatch)
    spans = []  # (rows, keys) of each static step's attention
    monkeypatch.setattr(split_attention, "split_attention",
                        lambda q, k_, v, mask, scale, gate=None: spans.append((q.shape[2], k_.shape[2])) or
                        split_attention.split_attention_reference(q, k_, v, mask, scale, gate))
    drafter, k = (NgramDrafter(), 3) if case == "ngram" else (None, 0)
    assert graphs.SHORT_SPAN  # the default
    monkeypatch.setattr(graphs, "SPAN_BUCKETS", False)  # the first split's span alone (the buckets: below)
    monkeypatch.setattr(graphs, "SHORT_SPAN", False)
    want, ref = generate(model, drafter, k, lookahead=case == "chain", chain=case == "chain")
    assert ref.spans == (ref.cache.max_len,) and ref.short_span is None
    assert spans and {s for _, s in spans} == {ref.cache.max_len}  # every static step over the whole cache
    spans.clear()
    monkeypatch.setattr(graphs, "SHORT_SPAN", True)
    got, g = generate(model, NgramDrafter() if drafter else None, k, lookahead=case == "chain", chain=case == "chain")
    assert got[0] == want[0]  # the tokens; and each step's logits, bit for bit (the chain's argmax is inside its steps)
    assert len(got[1]) == len(want[1]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    assert (len(got[1]) == 0) == (case == "chain")
    assert g.spans == (SPLIT, g.cache.max_len) and g.cache.max_len > SPLIT
    steps = g.greedy_steps if case == "chain" else g.steps
    assert {span for (_, span) in steps} == {SPLIT, g.cache.max_len}  # both captured for each row count
    # the steps before the split's end attended over it, those past it over the whole cache
    assert {s for _, s in spans} == {SPLIT, g.cache.max_len}
    assert spans[-1][1] == g.cache.max_len and len(PROMPT) + N > SPLIT


def test_the_chain_hands_its_token_to_the_other_spans_step(model, monkeypatch):
    """Greedy-chain steps from below the split's end to past it: each token the argmax of a step over
    the whole cache from the same prefix (the other span's step gets the token the last one wrote); the
    plain steps' logits there the same bits."""
    split_kernel_stand_in(monkeypatch)
    monkeypatch.setattr(graphs, "SHORT_SPAN", True)
    m = model
    g = GraphedTarget(m, m.new_cache(SPLIT + 40, spare=16), use_graphs=False)
    assert g.short_span == SPLIT
    monkeypatch.setattr(graphs, "SHORT_SPAN", False)
    ref2 = GraphedTarget(m, m.new_cache(SPLIT + 40, spare=16), use_graphs=False)
    assert ref2.short_span is None
    for t in (g, ref2):
        with torch.inference_mode():
            m(torch.tensor(PROMPT), t.cache, logits="none", snapshots=False)
    tok = torch.tensor([PROMPT[-1]])
    got, want = [], []
    for i in range(20):
        got.append(int(g.greedy_step(tok if i == 0 else None)))
    last = PROMPT[-1]
    for _ in range(20):
        last = int(ref2(torch.tensor([last])).logits[0].argmax())
        want.append(last)
    assert got == want and g.cache.length == len(PROMPT) + 20 > SPLIT
    monkeypatch.setattr(graphs, "SHORT_SPAN", True)
    short = GraphedTarget(m, m.new_cache(SPLIT + 40, spare=16), use_graphs=False)
    with torch.inference_mode():
        m(torch.tensor(PROMPT), short.cache, logits="none", snapshots=False)
        ref2.cache.rollback(len(PROMPT))
    for tok in [PROMPT[-1]] + want:
        a, b = short(torch.tensor([tok])), ref2(torch.tensor([tok]))
        assert torch.equal(a.logits, b.logits) and torch.equal(a.hidden, b.hidden)
    assert {span for _, span in short.steps} == {SPLIT, short.cache.max_len}
    assert set(g.greedy_steps) == {(1, SPLIT), (1, g.cache.max_len)}


def test_only_row_exact_targets_over_long_caches_take_short_spans(monkeypatch):
    m = tiny_llama(max_pos=1024)
    monkeypatch.setattr(m, "row_exact", lambda rows=1: True, raising=False)
    assert not graphs.split_kernel_attends(m)  # the CPU: no split kernel, no short spans
    assert GraphedTarget(m, m.new_cache(600, spare=16), use_graphs=False).short_span is None
    monkeypatch.setattr(m, "row_exact", lambda rows=1: False, raising=False)
    monkeypatch.setattr(graphs, "split_kernel_attends", lambda model: True)
    assert GraphedTarget(m, m.new_cache(600, spare=16), use_graphs=False).short_span is None  # not row-exact
    monkeypatch.setattr(m, "row_exact", lambda rows=1: True, raising=False)
    assert GraphedTarget(m, m.new_cache(SPLIT - 20, spare=16), use_graphs=False).short_span is None  # one split
    assert GraphedTarget(m, m.new_cache(600, spare=16), use_graphs=False).short_span == SPLIT
    assert GraphedTarget(m, m.new_cache(600, spare=16), use_graphs=False, compile=True).short_span is None
    monkeypatch.setattr(graphs, "SHORT_SPAN", False)  # SPECDEC_SHORT_SPAN=0
    assert GraphedTarget(m, m.new_cache(600, spare=16), use_graphs=False).short_span is None


def test_a_narrower_mask_needs_the_split_kernel():
    q, k = torch.randn(4, 2, 8), torch.randn(2, 10, 8)
    mask = torch.ones(2, 6, dtype=torch.bool)
    with layers.live_context_attention(), pytest.raises(RuntimeError, match="split kernel"):
        layers.attend(q, k, k, mask, 0.3)


def test_span_buckets_follow_the_live_context(monkeypatch):
    """SPECDEC_SPAN_BUCKETS: past the first split a step attends over the smallest of 2, 4, ... splits' positions that
    holds its rows (the whole cache last), each row count's steps made for every span at once; every step's logits
    equal those of the steps over the whole cache, bit for bit (the split kernel's torch form stands in)."""
    m = tiny_llama(max_pos=2048)
    monkeypatch.setattr(m, "row_exact", lambda rows=1: True, raising=False)
    monkeypatch.setattr(graphs, "split_kernel_attends", lambda model: True)
    split_kernel_stand_in(monkeypatch)
    keys = []  # the span of each attention call
    monkeypatch.setattr(split_attention, "split_attention",
                        lambda q, k_, v, mask, scale, gate=None: keys.append(k_.shape[2]) or
                        split_attention.split_attention_reference(q, k_, v, mask, scale, gate))
    prompt = torch.randint(1, 90, (2 * SPLIT - 6,), generator=torch.Generator().manual_seed(5))
    made = {}
    for buckets in (False, True):
        monkeypatch.setattr(graphs, "SPAN_BUCKETS", buckets)
        made[buckets] = GraphedTarget(m, m.new_cache(4 * SPLIT + 40, spare=16), use_graphs=False)
        with torch.inference_mode():
            m(prompt, made[buckets].cache, logits="none", snapshots=False)
    g, ref = made[True], made[False]
    assert g.spans == (SPLIT, 2 * SPLIT, 4 * SPLIT, g.cache.max_len) and ref.spans == (SPLIT, ref.cache.max_len)
    last, seen = int(prompt[-1]), []
    for _ in range(12):  # positions 2 * SPLIT - 6 .. 2 * SPLIT + 5: across the second bucket's end
        keys.clear()
        a = g(torch.tensor([last]))
        seen.append(keys[0])
        b = ref(torch.tensor([last]))
        assert torch.equal(a.logits, b.logits) and torch.equal(a.hidden, b.hidden)
        last = int(b.logits[0].argmax())
    assert seen == [2 * SPLIT] * 6 + [4 * SPLIT] * 6  # a step at position p holds p + 1 positions
    assert {span for _, span in g.steps} == set(g.spans)  # the 1-row step made for every span
    rows4 = torch.tensor([last] * 4)
    keys.clear()
    g(rows4)
    assert keys[0] == 4 * SPLIT and {span for r, span in g.steps if r == 4} == set(g.spans)
