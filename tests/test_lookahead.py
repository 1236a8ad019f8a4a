"""Plain decoding with lookahead (``SpeculativeGenerator(lookahead=True)``, the CUDA default): each
static step is queued before the previous step's token is read back. It must give what the plain
loop gives: the same tokens, the same logits bit for bit, the same stops (EOS, stop strings,
max tokens), the same streamed chunks, the same sampled draws, and a cache left at the same length
(the step queued past the end dropped). On the CPU the static steps run eagerly, the same steps
CUDA captures, so the loop itself is what is compared here; the GPU check is
scripts/device_check.py (plain output equal to every accepted drafter's output)."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from specdec import hostcopy  # noqa: E402
from specdec.engine import SpeculativeGenerator  # noqa: E402
from specdec.engine import generate as engine_mod  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402

N = 24


@pytest.fixture(scope="module")
def targets(tmp_path_factory, single_thread):
    from _engine_util import build_llama
    from _qwen35_util import hf_model

    from specdec.loading import load_model

    root = tmp_path_factory.mktemp("ahead")
    paths = {"llama": build_llama(root / "llama", vocab=97, hidden=48, layers=3, seed=3)}
    hf_model("dense", seed=4).save_pretrained(root / "qwen35")  # linear-attention caches: rollback of the extra step
    paths["qwen35"] = str(root / "qwen35")
    return {name: load_model(p, "cpu", "float32").model for name, p in paths.items()}


PROMPT = [5, 17, 3, 42, 8, 11, 29]


def run(model, lookahead, n=N, params=SamplingParams(), monkeypatch=None, chain=False, **kw):
    """Generate; return (result, logits of every step run in order, cache length after, streamed chunks).
    ``chain``: greedy lookahead on the greedy-chain steps (SPECDEC_GREEDY_CHAIN, the default; off, the plain
    steps, whose logits accept_greedy sees)."""
    rows, chunks = [], []
    accept = engine_mod.accept_greedy

    def recording(drafts, logits):
        rows.append(logits.clone())
        return accept(drafts, logits)

    if monkeypatch is not None:
        monkeypatch.setattr(engine_mod, "accept_greedy", recording)
    g = SpeculativeGenerator(model, batch_invariant=True, lookahead=lookahead)
    assert g.lookahead is lookahead
    before, engine_mod.GREEDY_CHAIN = engine_mod.GREEDY_CHAIN, chain
    try:
        res = g.generate(PROMPT, n, params, on_tokens=chunks.append, **kw)
    finally:
        engine_mod.GREEDY_CHAIN = before
    if monkeypatch is not None:
        monkeypatch.setattr(engine_mod, "accept_greedy", accept)
    return res, rows, g._graphed.cache.length, chunks


@pytest.mark.parametrize("name", ["llama", "qwen35"])
def test_same_tokens_bits_and_cache(targets, name, monkeypatch):
    ref, ref_rows, ref_len, ref_chunks = run(targets[name], False, monkeypatch=monkeypatch)
    got, rows, length, chunks = run(targets[name], True, monkeypatch=monkeypatch)
    assert got.token_ids == ref.token_ids and len(got.token_ids) == N
    assert got.finish_reason == ref.finish_reason == "length"
    assert len(rows) == len(ref_rows) == N - 1  # max tokens known ahead: no step past the end
    assert all(torch.equal(a, b) for a, b in zip(rows, ref_rows))
    assert length == ref_len == len(PROMPT) + N - 1
    assert [t for c in chunks for t in c] == got.token_ids and len(chunks) == len(ref_chunks)
    assert got.stats.steps == ref.stats.steps and got.stats.tau == 1.0


@pytest.mark.parametrize("name", ["llama", "qwen35"])
def test_stops_drop_the_extra_step(targets, name, monkeypatch):
    plain = run(targets[name], False)[0].token_ids
    eos = plain[6]
    first = plain.index(eos)  # the EOS ends output at its first occurrence
    ref, _, ref_len, _ = run(targets[name], False, eos_ids=[eos])
    got, rows, length, chunks = run(targets[name], True, eos_ids=[eos], monkeypatch=monkeypatch)
    assert got.token_ids == ref.token_ids == plain[: first + 1] and got.finish_reason == ref.finish_reason == "stop"
    assert len(rows) == first + 1  # one step queued beyond the EOS ...
    assert length == ref_len == len(PROMPT) + first  # ... and dropped from the cache

    def decode(ids):
        return "".join(f"<{i}>" for i in ids)

    stop = [f"<{plain[9]}>"]
    ref = run(targets[name], False, decode=decode, stop=stop)[0]
    got = run(targets[name], True, decode=decode, stop=stop)[0]
    assert got.token_ids == ref.token_ids and got.text == ref.text and got.finish_reason == "stop"
    assert len(got.token_ids) <= 10


@pytest.mark.parametrize("n", [1, 2, 3])
def test_short_outputs(targets, n):
    ref, _, ref_len, _ = run(targets["llama"], False, n=n)
    got, _, length, _ = run(targets["llama"], True, n=n)
    assert got.token_ids == ref.token_ids and len(got.token_ids) == n and length == ref_len


def test_sampled_same_draws(targets):
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=7)
    for name in ("llama", "qwen35"):
        ref = run(targets[name], False, params=params)[0]
        got = run(targets[name], True, params=params)[0]
        assert got.token_ids == ref.token_ids
    other = run(targets["llama"], True, params=SamplingParams(temperature=1.0, top_p=0.95, seed=8))[0]
    assert other.token_ids != ref.token_ids  # the seed is what makes them equal


def test_reused_generator_after_an_early_stop(targets):
    m = targets["qwen35"]
    plain = run(m, False)[0].token_ids
    g = SpeculativeGenerator(m, batch_invariant=True, lookahead=True)
    assert g.generate(PROMPT, N, eos_ids=[plain[4]]).finish_reason == "stop"
    assert g.generate(PROMPT, N).token_ids == plain  # the cache it reuses was left consistent


def test_default_and_where_it_applies(targets, monkeypatch):
    m = targets["llama"]
    assert SpeculativeGenerator(m).lookahead is False  # CUDA only by default
    assert SpeculativeGenerator(m, batch_invariant=False, lookahead=True).lookahead is False  # no static steps
    from specdec.drafters.ngram import NgramDrafter
    assert SpeculativeGenerator(m, NgramDrafter(), 3, batch_invariant=True, lookahead=True).lookahead is False


def test_host_reader_slots():
    r = hostcopy.HostReader("cpu", 4, slots=2)
    a = r.stage(torch.tensor([1, 2, 3]))
    b = r.stage(torch.tensor([[7, 8]]))
    assert a.read() == [1, 2, 3] and b.read() == [7, 8]
    c = r.stage(torch.tensor([9]))  # back to the first buffer
    assert c.read() == [9] and c.buf.data_ptr() == a.buf.data_ptr()


@pytest.mark.parametrize("name", ["llama", "qwen35"])
def test_greedy_chain_same_tokens_and_stops(targets, name, monkeypatch):
    """SPECDEC_GREEDY_CHAIN: the argmax, the next input and the position move inside the step; the
    tokens, the stops and the cache left behind are the plain loop's."""
    plain = run(targets[name], False)[0].token_ids
    assert engine_mod.GREEDY_CHAIN  # the default
    calls = []
    graphs_mod = sys.modules["specdec.models.graphs"]
    real = graphs_mod.GraphedTarget.greedy_step
    monkeypatch.setattr(graphs_mod.GraphedTarget, "greedy_step", lambda self, seed=None: calls.append(seed) or real(self, seed))
    got, _, length, chunks = run(targets[name], True, chain=True)
    assert got.token_ids == plain and length == len(PROMPT) + N - 1
    assert [t for c in chunks for t in c] == plain
    assert len(calls) == N - 1 and calls[0] is not None and all(c is None for c in calls[1:])  # one chain
    eos = plain[6]
    ref, _, ref_len, _ = run(targets[name], False, eos_ids=[eos])
    got, _, length, _ = run(targets[name], True, eos_ids=[eos], chain=True)
    assert got.token_ids == ref.token_ids and got.finish_reason == "stop" and length == ref_len
    sampled = SamplingParams(temperature=1.0, seed=7)
    n = len(calls)
    assert (run(targets[name], True, params=sampled, chain=True)[0].token_ids
            == run(targets[name], False, params=sampled)[0].token_ids)
    assert len(calls) == n  # sampled decoding keeps the plain steps


def test_greedy_chain_needs_a_seed_after_other_steps(targets):
    from specdec.models.graphs import GraphedTarget
    m = targets["llama"]
    g = GraphedTarget(m, m.new_cache(64, spare=16), pad_to=16, use_graphs=False)
    g(torch.tensor(PROMPT[:3]))
    with pytest.raises(RuntimeError, match="must follow a greedy step"):
        g.greedy_step()
    tok = g.greedy_step(torch.tensor([4]))
    assert g.cache.length == 4 and int(g.start) == 4  # the step moved its own start on
    ref = GraphedTarget(m, m.new_cache(64, spare=16), pad_to=16, use_graphs=False)
    ref(torch.tensor(PROMPT[:3]))
    assert int(tok) == int(ref(torch.tensor([4])).logits[0].argmax())
    nxt = int(g.greedy_step())
    assert nxt == int(ref(torch.tensor([int(tok)])).logits[0].argmax()) and g.cache.length == 5
    g(torch.tensor([nxt]))
    with pytest.raises(RuntimeError, match="must follow a greedy step"):
        g.greedy_step()
