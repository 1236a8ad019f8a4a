"""``compile``: every static step compiled with torch.compile (inductor) computes what the
uncompiled static step computes, and speculative output still equals plain output.

On the CPU the compiled steps run uncaptured: the very functions that CUDA warms up (compiling
them) and captures. A new step shape takes seconds to compile, so these tests share one tiny
target and use few shapes (the 16-row batch-invariant step, one DFlash block).
"""

from __future__ import annotations

import pytest
import torch

from _engine_util import SpoiledOracle, build_llama
from specdec.engine import SpeculativeGenerator
from specdec.errors import CompileError
from specdec.models import graphs

pytestmark = pytest.mark.usefixtures("single_thread")

VOCAB = 64


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from specdec.loading import load_model

    path = build_llama(tmp_path_factory.mktemp("t") / "t", vocab=VOCAB, hidden=32, layers=4, seed=1, head_scale=4.0)
    return path, load_model(path, "cpu", "float32").model


def _compiled(fn) -> bool:
    return hasattr(fn, "__wrapped__")  # maybe_compile's wrapper (functools.wraps)


def test_compiled_steps_give_uncompiled_tokens_and_speculation_equals_plain(target):
    """The compiled 16-row step decodes the uncompiled step's greedy tokens; with it, speculative
    decoding (drafts accepted and rejected, so rollback runs) equals plain decoding."""
    m = target[1]
    prompt = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = SpeculativeGenerator(m, None, 0, batch_invariant=True).generate(prompt, 24).token_ids
    plain_gen = SpeculativeGenerator(m, None, 0, batch_invariant=True, compile=True)
    plain = plain_gen.generate(prompt, 24).token_ids
    key = (16, plain_gen._graphed.cache.max_len)  # (rows, span)
    assert sorted(plain_gen._graphed.steps) == [key] and _compiled(plain_gen._graphed.steps[key].run)
    assert plain == ref
    oracle = SpoiledOracle(prompt + plain, VOCAB, spoil=0.3, seed=2)
    spec_gen = SpeculativeGenerator(m, oracle, 4, batch_invariant=True, compile=True)
    spec = spec_gen.generate(prompt, 24)
    key = (16, spec_gen._graphed.cache.max_len)  # (rows, span)
    assert sorted(spec_gen._graphed.steps) == [key] and _compiled(spec_gen._graphed.steps[key].run)
    assert spec.token_ids == plain
    assert sum(spec.stats.accepted) > 0 and min(spec.stats.accepted) < 4  # accepted, and rolled back


def test_compiled_dflash_block_drafts_the_uncompiled_tokens(target, tmp_path):
    """With ``compile`` the DFlash drafter's static greedy block is compiled (on the CPU too, where
    it would otherwise draft eagerly) and drafts what the uncompiled drafter drafts, every step."""
    from _dflash_util import write_drafter

    from specdec.drafters.dflash import load_dflash_drafter

    path, m = target
    d_path, _ = write_drafter(tmp_path / "d", hidden=32, num_target_layers=4, n_layers=2, target_layer_ids=(1, 2),
                              block_size=6)
    d = load_dflash_drafter(d_path, m)
    assert not d.static_steps  # the CPU: only compile makes the block static here
    propose, seen = d.propose, []

    def compare(last_token, k, params, gen):
        eager = d.block_logits(last_token)[:k]  # the uncompiled drafter's logits
        prop = propose(last_token, k, params, gen)
        seen.append(_compiled(d._static.fn))
        top2 = eager.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 1e-4  # where the argmax is well defined
        assert clear.any() and torch.equal(prop.tokens[clear], eager.argmax(-1)[clear])
        return prop

    d.propose = compare
    prompt = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    gen = SpeculativeGenerator(m, d, d.block_size - 1, batch_invariant=True, compile=True)
    out = gen.generate(prompt, 16)
    assert d.compile and seen and all(seen)
    # the compiled target step returns every layer whatever the drafter reads (on the H200 a step
    # compiled per capture set gave other bf16 logits than the plain one: 5 of 10 GSM8K outputs
    # differed), so DFlash and plain decoding run one compiled function
    plain_gen = SpeculativeGenerator(m, None, 0, batch_invariant=True, compile=True)
    assert out.token_ids == plain_gen.generate(prompt, 16).token_ids


@pytest.mark.parametrize("in_step", [True, False])
def test_compiled_dflash_samples_through_the_compiled_block(target, tmp_path, monkeypatch, in_step):
    """At T > 0 with ``compile`` the DFlash drafter samples through its compiled static block (``in_step``,
    dflash.STATIC_SAMPLING: the draw inside it; off: from its logits), never from an eager block forward,
    and after the first request compiles nothing more. Seen on the H200 (bf16, --compile): sampled
    proposals fell back to the eager block (hundreds of kernel launches from Python per step) and DFlash
    at T=1 ran at 0.32x plain decoding. The reference draws alike: the uncompiled static block in the step,
    or the eager block and torch.multinomial."""
    import torch._dynamo.utils

    from _dflash_util import write_drafter

    from specdec.drafters import dflash
    from specdec.drafters.dflash import load_dflash_drafter
    from specdec.sampling import SamplingParams

    # the eager reference keeps whole sampled blocks, as the compiled (static) block does
    monkeypatch.setattr(dflash, "CPU_MIN_SAMPLED_CONFIDENCE", 0.0)
    monkeypatch.setattr(dflash, "STATIC_SAMPLING", in_step)
    path, m = target
    d_path, _ = write_drafter(tmp_path / "d", hidden=32, num_target_layers=4, n_layers=2, target_layer_ids=(1, 2),
                              block_size=6)
    prompt = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = load_dflash_drafter(d_path, m)
    ref.static_steps = in_step
    eager = SpeculativeGenerator(m, ref, 5, batch_invariant=True)
    d = load_dflash_drafter(d_path, m)
    gen = SpeculativeGenerator(m, d, 5, batch_invariant=True, compile=True)
    eager_blocks, block_logits = [], d.block_logits

    def count(last_token):
        eager_blocks.append(last_token)
        return block_logits(last_token)

    d.block_logits = count
    gen.generate(prompt, 16, SamplingParams(temperature=1.0, seed=0))  # compiles the sampled block
    assert _compiled(d._sampled.fn)
    torch._dynamo.utils.counters.clear()
    for seed in (1, 2):
        params = SamplingParams(temperature=1.0, seed=seed)
        out = gen.generate(prompt, 24, params)
        assert out.token_ids == eager.generate(prompt, 24, params).token_ids  # fp32: the same samples
    assert not eager_blocks, f"{len(eager_blocks)} proposals ran the eager block"
    assert not torch._dynamo.utils.counters["stats"]["unique_graphs"], dict(torch._dynamo.utils.counters["stats"])
    assert sum(out.stats.accepted) > 0


def test_compile_failure_is_one_specdec_error(monkeypatch):
    """A step torch.compile cannot compile is a CompileError naming --compile, not a dynamo traceback."""

    x = torch.ones(2)

    def step():
        return x + 1 if x.sum() > 0 else x  # control flow on tensor data: no single graph (fullgraph)

    with pytest.raises(CompileError, match="--compile"):
        graphs.maybe_compile(step, True)()
    assert graphs.maybe_compile(step, False) is step

    def unavailable(*a, **kw):
        raise RuntimeError("Dynamo is not supported on this Python\nmore lines")

    monkeypatch.setattr(torch, "compile", unavailable)
    with pytest.raises(CompileError, match="unavailable here: Dynamo is not supported on this Python$"):
        graphs.maybe_compile(step, True)


def test_compiled_step_is_one_graph_whatever_the_drafter_captures(target, monkeypatch):
    """Compiled, the target's step always returns every layer (inductor fuses a graph by its
    outputs: on the H200 a step returning DFlash's layers computed other bf16 logits than the
    plain step); the layers a drafter reads are picked outside the graph and equal the uncompiled
    step's capture, and the logits do not depend on the capture."""
    from specdec.models.graphs import GraphedTarget

    m = target[1]
    traced = []
    real = type(m).run_layers

    def spy(self, ids, ctx, cache, capture=(), logits="all"):
        traced.append(tuple(capture))  # runs while dynamo traces the step (and on eager calls)
        return real(self, ids, ctx, cache, capture, logits)

    monkeypatch.setattr(type(m), "run_layers", spy)
    prompt = torch.arange(1, 12)
    outs = {}
    for comp in (False, True):
        for cap in ((), (1, 2)):
            cache = m.new_cache(64, spare=16)
            m(prompt, cache, logits="last", snapshots=False)
            g = GraphedTarget(m, cache, cap, max_steps=16, pad_to=16, use_graphs=False, compile=comp)
            traced.clear()
            o = g(torch.tensor([5, 7, 9]))
            outs[comp, cap] = o
            if comp:
                assert traced and set(traced) == {tuple(range(len(m.layers)))}, traced  # every layer, always
    for cap in ((), (1, 2)):
        assert torch.allclose(outs[True, cap].logits, outs[False, cap].logits, atol=1e-5)
    assert torch.equal(outs[True, ()].logits, outs[True, (1, 2)].logits)
    assert outs[True, ()].captured is None
    assert torch.allclose(outs[True, (1, 2)].captured, outs[False, (1, 2)].captured, atol=1e-5)
