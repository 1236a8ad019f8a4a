"""models/moe.py's ``Experts._grouped_bmm`` (SPECDEC_MOE_GROUPED_BMM, on by default since the H200 checked it: a long
eager forward's experts as two batched GEMMs) against the per-expert loop it replaces: the same values (fp32; not the same bits: other GEMM shapes),
with experts that get no pair, in chunks of GROUPED_TOKENS tokens, with routing too skewed to pad (the loop then), under
expert parallelism (this rank's experts only), and in a Qwen3.5 MoE target's prefill with speculative decoding equal to
plain decoding."""

import types

import pytest
import torch

from specdec.models import moe
from specdec.models.moe import Experts

pytestmark = pytest.mark.usefixtures("single_thread")


def _experts(e=8, h=32, i=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    ex = Experts(e, h, i)
    with torch.no_grad():
        ex.gate_up_proj.copy_(torch.randn(ex.gate_up_proj.shape, generator=g) * h ** -0.5)
        ex.down_proj.copy_(torch.randn(ex.down_proj.shape, generator=g) * i ** -0.5)
    return ex


def _route(t, e, k, seed=1, skip=()):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=g)
    logits[:, list(skip)] = -1e9  # experts no pair routes to
    w, idx = torch.softmax(logits, -1).topk(k, -1)
    return idx, w / w.sum(-1, keepdim=True)


@pytest.mark.parametrize("t, skip", [(40, ()), (37, (0, 5))])
def test_grouped_equals_the_loop(t, skip, monkeypatch):
    ex = _experts()
    x = torch.randn(t, 32, generator=torch.Generator().manual_seed(2))
    idx, w = _route(t, 8, 2, skip=skip)
    with torch.no_grad():
        monkeypatch.setattr(moe, "GROUPED_BMM", False)
        want = ex.partial(x, idx, w)
        monkeypatch.setattr(moe, "GROUPED_BMM", True)
        got = ex.partial(x, idx, w)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


def test_grouped_in_chunks_and_skewed_routing_by_the_loop(monkeypatch):
    """A forward longer than GROUPED_TOKENS is grouped a chunk at a time; a chunk whose busiest expert would pad the
    others past GROUPED_WASTE times its pairs runs the loop. Both equal the loop's values."""
    ex = _experts()
    x = torch.randn(50, 32, generator=torch.Generator().manual_seed(4))
    idx, w = _route(50, 8, 2)
    skewed = idx.clone()
    skewed[:, 0] = 3  # every token's first pair on expert 3: 8 experts x 50 rows padded against 100 pairs
    calls = {"grouped": 0, "loop": 0}
    real_g, real_l = Experts._grouped_bmm, Experts._loop
    monkeypatch.setattr(Experts, "_grouped_bmm", lambda self, *a: calls.__setitem__("grouped", calls["grouped"] + 1) or real_g(self, *a))
    monkeypatch.setattr(Experts, "_loop", lambda self, *a: calls.__setitem__("loop", calls["loop"] + 1) or real_l(self, *a))
    with torch.no_grad():
        monkeypatch.setattr(moe, "GROUPED_BMM", False)
        want, want_skewed = ex.partial(x, idx, w), ex.partial(x, skewed, w)
        monkeypatch.setattr(moe, "GROUPED_BMM", True)
        monkeypatch.setattr(moe, "GROUPED_TOKENS", 16)
        calls.update(grouped=0, loop=0)
        got = ex.partial(x, idx, w)
        assert calls == {"grouped": 4, "loop": 0}  # 16 + 16 + 16 + 2 tokens
        monkeypatch.setattr(moe, "GROUPED_TOKENS", 1024)
        monkeypatch.setattr(moe, "GROUPED_WASTE", 3)  # 8 experts x 50+ rows padded > 3 x 100 pairs
        got_skewed = ex.partial(x, skewed, w)
        assert calls == {"grouped": 5, "loop": 1}
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    assert torch.allclose(got_skewed, want_skewed, atol=1e-5, rtol=1e-5)


def test_grouped_under_expert_parallelism(monkeypatch):
    """A rank holding experts 2..5: its share (pairs of other experts add nothing) equals the loop's."""
    whole = _experts()
    ex = _experts()
    with torch.no_grad():
        ex.gate_up_proj = torch.nn.Parameter(whole.gate_up_proj[2:6].clone())
        ex.down_proj = torch.nn.Parameter(whole.down_proj[2:6].clone())
    ex.rows = types.SimpleNamespace(start=2, size=4, stop=6)
    x = torch.randn(30, 32, generator=torch.Generator().manual_seed(3))
    idx, w = _route(30, 8, 2)
    with torch.no_grad():
        monkeypatch.setattr(moe, "GROUPED_BMM", False)
        want = ex.partial(x, idx, w)
        monkeypatch.setattr(moe, "GROUPED_BMM", True)
        got = ex.partial(x, idx, w)
        none = ex.partial(x, torch.zeros_like(idx), w)  # every pair another rank's
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5) and want.abs().sum() > 0 and not none.any()


def test_a_moe_target_decodes_alike_with_it(tmp_path, monkeypatch):
    """A Qwen3.5 MoE target whose prompt prefill takes the grouped form: speculative decoding with accepted oracle
    drafts equals plain decoding."""
    from _engine_util import SpoiledOracle, plain_generate
    from _qwen35_util import hf_model
    from specdec.engine import SpeculativeGenerator
    from specdec.loading import load_model
    from specdec.sampling import SamplingParams
    monkeypatch.setattr(moe, "GROUPED_BMM", True)
    hf_model("moe", seed=4).save_pretrained(str(tmp_path))
    m = load_model(str(tmp_path), "cpu", tokenizer=False).model
    calls = []
    real = Experts._grouped_bmm
    monkeypatch.setattr(Experts, "_grouped_bmm", lambda self, *a: calls.append(1) or real(self, *a))
    prompt = torch.randint(m.config.vocab_size, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    ref = plain_generate(m, prompt, 20).token_ids
    assert calls  # the 24-token prefill ran the grouped form
    drafter = SpoiledOracle(prompt + ref, m.config.vocab_size, spoil=0.3, seed=3)
    res = SpeculativeGenerator(m, drafter, 4).generate(prompt, 20, SamplingParams())
    assert sum(res.stats.accepted) > 0 and res.token_ids == ref


def test_grouped_never_accumulates_into_a_repeated_row(monkeypatch):
    """No index_add_ (or accumulating index_put_) over repeated rows: on CUDA those are atomics that add in any
    order, and the same prompt's prefill then had other bits run to run (the H200 saw speculative decoding differ
    from plain on 2 of 4 prompts of a random Qwen3.5 MoE target). A token's k pairs are summed in pair order."""
    ex = _experts()
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(2))
    idx, w = _route(40, 8, 2)
    seen = []
    real_add, real_put = torch.Tensor.index_add_, torch.Tensor.index_put_

    def add(self, dim, index, source, **kw):
        seen.append(index.unique().numel() != index.numel())
        return real_add(self, dim, index, source, **kw)

    def put(self, indices, values, accumulate=False):
        if accumulate:
            flat = torch.stack([i.expand(torch.broadcast_shapes(*(j.shape for j in indices))).reshape(-1)
                                for i in indices], 1)
            seen.append(flat.unique(dim=0).shape[0] != flat.shape[0])
        return real_put(self, indices, values, accumulate)
    monkeypatch.setattr(torch.Tensor, "index_add_", add)
    monkeypatch.setattr(torch.Tensor, "index_put_", put)
    monkeypatch.setattr(moe, "GROUPED_BMM", True)
    with torch.no_grad():
        got = ex.partial(x, idx, w)
    assert not any(seen), "an accumulation over repeated rows"
    ref = torch.stack([sum(w[t, j] * _one(ex, x[t], int(idx[t, j])) for j in range(2)) for t in range(40)])
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5)


def _one(ex, xt, e):
    gate, up = (ex.gate_up_proj[e] @ xt).chunk(2)
    return ex.down_proj[e] @ (torch.nn.functional.silu(gate) * up)


def test_a_static_step_takes_the_static_forms_captured_or_not(monkeypatch):
    """A static step (``live`` given: a padded decode step, or a static prefill chunk of more than 16 rows) takes the
    static forms whether it is captured or not, so that ``--no-cuda-graphs`` computes what the graphs compute; an eager
    forward of as many rows (a prefill, no ``live``) groups by expert. The same values (not the same bits)."""
    ex = _experts()
    t = 40
    x = torch.randn(t, 32, generator=torch.Generator().manual_seed(3))
    idx, w = _route(t, 8, 2)
    calls = []
    grouped = Experts._grouped_bmm
    monkeypatch.setattr(Experts, "_grouped_bmm", lambda self, *a: calls.append("grouped") or grouped(self, *a))
    with torch.no_grad():
        static = ex.partial(x, idx, w, torch.tensor(t))
        assert calls == []
        eager = ex.partial(x, idx, w)
        assert calls == ["grouped"]
    assert torch.allclose(static, eager, atol=1e-5, rtol=1e-5)
