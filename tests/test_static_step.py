"""The CUDA-graph step's math (static shapes, attention over the whole cache masked by position)
equals the eager step. The graph capture itself needs CUDA and runs in the device checks."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from _engine_util import tiny_llama as _tiny_llama  # noqa: E402


def test_static_context_matches_eager():
    m = _tiny_llama()
    prompt = torch.randint(0, 97, (11,))
    eager, static = m.new_cache(64), m.new_cache(64)
    m(prompt, eager)
    m(prompt, static)
    for t in (1, 4, 3):
        ids = torch.randint(0, 97, (t,))
        a = m(ids, eager, capture=(0, 1))
        start = static.reserve(t)
        ctx = m.static_context(torch.tensor(start), t, static.max_len)
        with torch.inference_mode():
            b = m.run_layers(ids, ctx, static, (0, 1))
        torch.testing.assert_close(b.logits, a.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b.captured, a.captured, rtol=1e-5, atol=1e-5)
        # rolling back and overwriting keeps the two paths equal
        eager.rollback(eager.length - 1)
        static.rollback(static.length - 1)


def test_padded_static_steps_make_plain_and_speculative_identical():
    """Batch-invariant mode: every decode/verify step runs as the same padded 16-row static step
    (off CUDA without graph capture); speculative greedy output still equals plain greedy output,
    and both equal the eager engine's."""
    from _engine_util import RandomDrafter

    from specdec.engine import SpeculativeGenerator

    m = _tiny_llama()
    prompt = torch.randint(0, 97, (9,)).tolist()
    eager = SpeculativeGenerator(m, None, 0, cuda_graphs=False).generate(prompt, 40).token_ids
    plain_gen = SpeculativeGenerator(m, None, 0, batch_invariant=True)
    plain = plain_gen.generate(prompt, 40).token_ids
    assert sorted(plain_gen._graphed.steps) == [(16, plain_gen._graphed.cache.max_len)]  # one step shape for every decode step
    spec_gen = SpeculativeGenerator(m, RandomDrafter(97, seed=3), 3, batch_invariant=True)
    spec = spec_gen.generate(prompt, 40)
    assert sorted(spec_gen._graphed.steps) == [(16, spec_gen._graphed.cache.max_len)]
    assert plain == eager
    assert spec.token_ids == eager
    assert spec.stats.drafted > 0


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_padded_steps_on_hybrid_targets(tmp_path, kind):
    """Hybrid (linear-attention) targets: in batch-invariant mode every step is the fixed-row static
    (graph-ready) step whose live recurrent state is selected on the device; the padding rows are
    rolled back from the recurrent snapshots. The cache and its steps are reused across requests."""
    from _engine_util import RandomDrafter
    from _qwen35_util import hf_model

    from specdec.engine import SpeculativeGenerator
    from specdec.loading import load_model

    path = tmp_path / kind
    hf_model(kind).save_pretrained(path)
    m = load_model(str(path), "cpu", "float32").model
    # 13 tokens: a short prefill (recurrent form, no snapshots); 40: a chunked prefill
    prompt = torch.randint(0, 256, ({"dense": 13, "moe": 40}[kind],)).tolist()
    eager = SpeculativeGenerator(m, None, 0, batch_invariant=False).generate(prompt, 24).token_ids
    plain_gen = SpeculativeGenerator(m, None, 0, batch_invariant=True)
    plain = plain_gen.generate(prompt, 24).token_ids
    spec_gen = SpeculativeGenerator(m, RandomDrafter(256, seed=5), 3, batch_invariant=True)
    spec = spec_gen.generate(prompt, 24)
    key = (16, spec_gen._graphed.cache.max_len)  # (rows, span)
    assert spec_gen._graphed is not None and sorted(spec_gen._graphed.steps) == [key]
    steps = spec_gen._graphed.steps[key]
    again = spec_gen.generate(prompt, 24)  # the cache (and its steps) are reused: reset in place
    assert again.token_ids == spec.token_ids and spec_gen._graphed.steps[key] is steps
    longer = torch.randint(0, 256, (20,)).tolist()
    ref = SpeculativeGenerator(m, None, 0, batch_invariant=False).generate(longer, 8).token_ids
    assert spec_gen.generate(longer, 8).token_ids == ref
    assert spec_gen.generate(prompt, 24).token_ids == eager
    assert plain == eager, kind
    assert spec.token_ids == eager, kind
    assert spec.stats.drafted > 0


def test_static_steps_recapture_after_buffer_growth(tmp_path):
    """A linear-attention cache that reallocates its buffers (an eager forward of more rows) bumps
    its version, and the static steps are rebuilt instead of replaying over freed buffers."""
    from _qwen35_util import hf_model

    from specdec.loading import load_model
    from specdec.models.graphs import GraphedTarget

    hf_model("dense").save_pretrained(tmp_path / "d")
    m = load_model(str(tmp_path / "d"), "cpu", "float32").model
    cache = m.new_cache(64, spare=16)
    g = GraphedTarget(m, cache, max_steps=4, pad_to=None, use_graphs=False)
    m(torch.randint(0, 256, (5,)), cache, snapshots=False)
    g(torch.tensor([1, 2]))
    first = g.steps[(2, cache.max_len)]
    m(torch.randint(0, 256, (9,)), cache)  # 9 rows > the 4 reserved: the buffers grow
    g(torch.tensor([3, 4]))
    assert g.steps[(2, cache.max_len)] is not first


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_static_mtp_proposals_equal_eager(tmp_path, moe):
    """The MTP drafter's static (CUDA-graph-ready) greedy proposal, run eagerly on the CPU, drafts
    exactly what the eager chain drafts, step after step, including the cache catch-up."""
    from _mtp_util import build_qwen35

    from specdec import LLM
    from specdec.engine import SpeculativeGenerator

    path = build_qwen35(tmp_path / "m", moe=moe)
    llm = LLM(path, draft="mtp", device="cpu", num_draft_tokens=3)
    prompt = torch.randint(0, 256, (11,)).tolist()
    d, logged = llm.drafter, []
    propose = d.propose

    def logging_propose(*a, **kw):  # keep every step's draft logits, not just the argmax
        p = propose(*a, **kw)
        logged.append(d.last_logits.clone())
        return p

    d.propose = logging_propose
    eager = llm.generate(prompt, max_new_tokens=40, trace=True)
    eager_logits, logged[:] = list(logged), []
    d.static_steps = True
    static = llm.generate(prompt, max_new_tokens=40, trace=True)
    assert d._static, "the static proposal path did not run"
    assert static.token_ids == eager.token_ids
    assert static.stats.trace == eager.stats.trace  # same drafts, same acceptance, every step
    assert len(logged) == len(eager_logits)
    for a, b in zip(logged, eager_logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    plain = SpeculativeGenerator(llm.model, None, 0).generate(prompt, 40).token_ids
    assert static.token_ids == plain


def test_static_dflash_blocks_equal_eager(tmp_path):
    """The DFlash drafter's static (CUDA-graph-ready) greedy block, run eagerly on the CPU, drafts
    what the eager drafter drafts (wherever its argmax is well defined) at every step of a whole
    generation, across a context-cache growth, with full-attention and sliding-window layers."""
    from _dflash_util import write_drafter
    from _engine_util import build_llama

    from specdec import LLM
    from specdec.drafters.dflash import DFlashDrafter

    target = build_llama(tmp_path / "t", vocab=64, hidden=32, layers=4)
    d_path, _ = write_drafter(tmp_path / "d", hidden=32, num_target_layers=4, n_layers=2, target_layer_ids=(1, 2),
                              block_size=6, layer_types=["sliding_attention", "full_attention"], sliding_window=5)
    llm = LLM(target, draft=f"dflash:{d_path}", device="cpu")
    d: DFlashDrafter = llm.drafter
    seen = []
    block_logits = d.block_logits

    def compare(last_token, k, params, gen):  # every step: static drafts == eager argmax
        eager = block_logits(last_token)
        d.static_steps = True
        static = DFlashDrafter.propose(d, last_token, k, params, gen).tokens
        d.static_steps = False
        seen.append(d._static is not None)
        top2 = eager.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 1e-4  # argmax is well defined
        assert torch.equal(static[clear[:k]], eager[:k].argmax(-1)[clear[:k]])
        return DFlashDrafter.propose(d, last_token, k, params, gen)

    d.propose = compare
    prompt = torch.randint(0, 64, (120,)).tolist()  # capacity 256: 150 new tokens make the cache grow
    out = llm.generate(prompt, max_new_tokens=150)
    assert all(seen) and len(seen) > 5
    assert d.kv[0].k.shape[1] > 256
    from specdec.engine import SpeculativeGenerator
    assert out.token_ids == SpeculativeGenerator(llm.model, None, 0).generate(prompt, 150).token_ids


def test_fused_projections_compute_the_same_and_keep_the_parameters():
    """``fuse_projections``: q/k/v and gate/up as one GEMM each; the logits stay those of the
    separate projections (fp32), the state dict is unchanged, and the named parameters are views
    of the fused weight (no second copy in memory)."""
    import copy

    m = _tiny_llama()
    f = copy.deepcopy(m)
    f.fuse_projections()
    att, mlp = f.layers[0].self_attn, f.layers[0].mlp
    assert att._fused is not None and mlp._fused is not None
    assert att.k_proj.weight.data_ptr() == att._fused[0][att.q_proj.out_features:].data_ptr()
    assert mlp.up_proj.weight.data_ptr() == mlp._fused[0][mlp.gate_proj.out_features:].data_ptr()
    sd, fsd = m.state_dict(), f.state_dict()
    assert sd.keys() == fsd.keys() and all(torch.equal(sd[k], fsd[k]) for k in sd)
    prompt = torch.randint(0, 97, (9,))
    a, b = m(prompt, m.new_cache(32)), f(prompt, f.new_cache(32))
    torch.testing.assert_close(b.logits, a.logits, rtol=1e-5, atol=1e-5)


def test_captures_hold_the_garbage_collector_off():
    """A collection during a CUDA-graph capture may reset an old graph, which invalidates the
    capture (seen on the H200 in `specdec train`'s held-out tau): ``capture`` runs inside no_gc."""
    import gc

    from specdec.models.graphs import no_gc

    assert gc.isenabled()
    with no_gc():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ValueError):
        with no_gc():
            raise ValueError("inside")
    assert gc.isenabled()
    gc.disable()
    try:
        with no_gc():
            pass
        assert not gc.isenabled()  # a collector the caller turned off stays off
    finally:
        gc.enable()


def test_static_steps_tell_the_layers_their_real_rows():
    """StepContext.live (what the DeltaNet recurrence and the expert kernel skip padding rows by) holds
    each replay's real rows: 1 for a plain padded step and the greedy chain, k + 1 for a verify; eager
    forwards carry none."""
    from specdec.models.graphs import GraphedTarget

    m = _tiny_llama()
    seen = []
    real_run = m.run_layers

    def spy(ids, ctx, *a, **kw):
        seen.append(None if ctx.live is None else (int(ctx.live), ids.shape[0]))
        return real_run(ids, ctx, *a, **kw)
    m.run_layers = spy
    cache = m.new_cache(64, spare=16)
    m(torch.randint(0, 97, (9,)), cache)
    assert seen == [None]
    steps = GraphedTarget(m, cache, pad_to=16, use_graphs=False)
    steps(torch.tensor([5]))
    steps(torch.tensor([5, 6, 7, 8]))
    steps.greedy_step(torch.tensor([3]))
    steps.greedy_step()
    assert seen[1:] == [(1, 16), (4, 16), (1, 16), (1, 16)]
