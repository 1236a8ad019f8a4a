"""specdec.cpu_linear: fp32 linear layers on oneDNN on the CPU, F.linear wherever a gradient is needed."""

import platform

import pytest
import torch
import torch.nn.functional as F

from specdec import cpu_linear
from specdec.engine import SpeculativeGenerator
from specdec.cpu_linear import Linear, linear

from _engine_util import SpoiledOracle, plain_generate, tiny_llama


@pytest.fixture
def calls(monkeypatch):
    """Counts oneDNN calls (the op is wrapped, so a call that silently fell back to F.linear shows); the
    tests' small weights take it too (MIN_WEIGHT 0). The build's probe runs first, uncounted (a test run alone
    would otherwise count the probe's own call)."""
    cpu_linear._probe()
    monkeypatch.setattr(cpu_linear, "MIN_WEIGHT", 0)
    n = {"onednn": 0, "packed": 0, "packs": 0}
    real, reorder = torch.ops.mkldnn._linear_pointwise, torch.ops.mkldnn._reorder_linear_weight

    class Ops:
        @staticmethod
        def _linear_pointwise(*args):
            n["onednn"] += 1
            n["packed"] += args[1].is_mkldnn
            return real(*args)

        @staticmethod
        def _reorder_linear_weight(*args):
            n["packs"] += 1
            return reorder(*args)

    monkeypatch.setattr(cpu_linear.torch.ops, "mkldnn", Ops, raising=False)
    return n


def test_onednn_is_taken_on_this_cpu():
    # the suite's machines are x86-64 builds with oneDNN: the fast path must not be off by accident
    if platform.machine() in ("x86_64", "AMD64"):
        assert torch.backends.mkldnn.is_available() and cpu_linear._probe()
    w = torch.randn(cpu_linear.MIN_WEIGHT // 4, 4)
    with torch.no_grad():
        assert cpu_linear.usable(torch.randn(2, 4), w) == cpu_linear.active() == cpu_linear._probe()
    from specdec.bench import machine_description
    assert machine_description(torch.device("cpu")).endswith("oneDNN linears" if cpu_linear.active() else "MKL linears")


@pytest.mark.parametrize("shape", [(4,), (1, 4), (3, 4), (2, 5, 4), (0, 4)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(shape, bias, calls):
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(*shape, generator=g), torch.randn(24, 4, generator=g)
    b = torch.randn(24, generator=g) if bias else None
    with torch.inference_mode():
        y = linear(x, w, b)
    assert y.shape == (*shape[:-1], 24)
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert calls["onednn"] == (1 if cpu_linear._probe() else 0)


def test_small_weights_stay_on_f_linear(calls, monkeypatch):
    monkeypatch.setattr(cpu_linear, "MIN_WEIGHT", 24 * 40)
    x = torch.randn(3, 40)
    with torch.no_grad():
        w = torch.randn(23, 40)
        assert torch.equal(linear(x, w), F.linear(x, w))  # one row short of the threshold: bitwise F.linear
        assert calls["onednn"] == 0
        linear(x, torch.randn(24, 40))
    assert calls["onednn"] == (1 if cpu_linear._probe() else 0)


def test_strided_input(monkeypatch):
    monkeypatch.setattr(cpu_linear, "MIN_WEIGHT", 0)
    x = torch.randn(16, 9)[:, 2:6]  # a column slice: not contiguous
    w = torch.randn(7, 4)
    with torch.no_grad():
        torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_gradients_go_through_f_linear(calls):
    lin = Linear(4, 3)
    x = torch.randn(5, 4, requires_grad=True)
    lin(x).sum().backward()  # oneDNN's op has no autograd formula: the path must be F.linear's
    assert calls["onednn"] == 0
    assert x.grad is not None and lin.weight.grad is not None
    torch.testing.assert_close(lin.weight.grad, torch.ones(3, 5) @ x.detach())


def test_off_switch_and_other_dtypes_are_f_linear_bitwise(monkeypatch, calls):
    x, w = torch.randn(6, 32), torch.randn(40, 32)
    monkeypatch.setattr(cpu_linear, "ENABLED", False)
    with torch.no_grad():
        assert torch.equal(linear(x, w), F.linear(x, w))
    monkeypatch.setattr(cpu_linear, "ENABLED", True)
    with torch.no_grad():
        xb, wb = x.bfloat16(), w.bfloat16()
        assert torch.equal(linear(xb, wb), F.linear(xb, wb))
    assert calls["onednn"] == 0


def test_linear_module_keeps_nn_linear_names():
    lin = Linear(4, 3, bias=True)
    assert isinstance(lin, torch.nn.Linear) and set(lin.state_dict()) == {"weight", "bias"}


def test_greedy_speculative_equals_plain_on_both_backends(monkeypatch, calls):
    # the backends round differently (not bitwise), so each is checked against its own plain decoding,
    # with a drafter whose proposals are mostly accepted (multi-row verify logits decide the tokens);
    # `calls` puts the tiny model's weights on oneDNN too and counts its calls
    model = tiny_llama()
    model.fuse_projections()
    prompt = torch.tensor([5, 9, 13, 5, 9, 13, 5, 9])
    used = {}
    for on in (True, False):
        monkeypatch.setattr(cpu_linear, "ENABLED", on)
        before = calls["onednn"]
        plain = plain_generate(model, prompt, 40).token_ids
        spec = SpeculativeGenerator(model, SpoiledOracle(prompt.tolist() + plain, 97, spoil=0.3), 4).generate(prompt, 40)
        assert spec.token_ids == plain
        assert sum(spec.stats.accepted) >= 20 and len(spec.stats.accepted) < 25
        used[on] = calls["onednn"] - before
    assert used[False] == 0 and (used[True] > 100 or not cpu_linear._probe())


def _family_model(kind: str):
    if kind in ("llama_tied", "qwen3"):
        from _dense_util import tiny_model
        return tiny_model(kind, seed=2)
    if kind.startswith("qwen35"):
        from _qwen35_util import hf_model
        return hf_model(kind.split("_")[1], seed=2)
    from _gemma_util import tiny_model
    return tiny_model("base", seed=2)


@pytest.mark.parametrize("kind", ["llama_tied", "qwen3", "qwen35_dense", "qwen35_moe", "gemma3"])
def test_every_family_lossless_on_onednn(kind, tmp_path, calls):
    """Each target family with every linear on oneDNN (`calls` lowers MIN_WEIGHT to 0 and counts): greedy speculative
    output with mostly accepted drafts (the target's own continuation, partly spoiled) equals plain output."""
    from _dense_util import save_hf
    from specdec.loading import load_model

    model = load_model(save_hf(_family_model(kind), str(tmp_path)), "cpu", "float32", tokenizer=False).model
    vocab = model.config.vocab_size
    prompt = torch.randint(3, vocab, (9,), generator=torch.Generator().manual_seed(3))
    plain = plain_generate(model, prompt, 32).token_ids
    spec = SpeculativeGenerator(model, SpoiledOracle(prompt.tolist() + plain, vocab, spoil=0.3), 4).generate(prompt, 32)
    assert spec.token_ids == plain
    assert sum(spec.stats.accepted) >= 12 and len(spec.stats.accepted) < 24, spec.stats.accepted
    assert calls["onednn"] > 100 or not cpu_linear._probe()
    assert calls["packed"] > 0.8 * calls["onednn"]  # all but the first use of each weight on packed copies


def test_packed_weights(calls):
    """A weight is packed at its second use and reused; it gives the plain layout's bits at 2 rows or more
    (the same kernel) and F.linear's values at 1 row; a change of the weight (in place, or a new storage)
    is seen; a view made anew at each call is never packed."""
    g = torch.Generator().manual_seed(4)
    w, b = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    with torch.no_grad():
        first = linear(torch.randn(3, 64, generator=g), w, b)
        assert calls["packs"] == 0 and calls["packed"] == 0 and first.shape == (3, 96)
        for m in (1, 2, 5, 16, 33):
            x = torch.randn(m, 64, generator=g)
            y = linear(x, w, b)
            assert calls["packed"] > 0
            plain = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
            if m >= 2:
                assert torch.equal(y, plain), m
            torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        assert calls["packs"] == 1 and cpu_linear.packed_bytes() >= 96 * 64 * 4
        x = torch.randn(4, 64, generator=g)
        w.mul_(2)  # in place: the version moves, the packed copy is dropped
        torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        w.data = torch.randn(96, 64, generator=g)  # a new storage under the same tensor
        for _ in range(2):
            torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        assert calls["packs"] == 3
        big = torch.randn(2, 96, 64, generator=g)
        for _ in range(3):
            linear(x, big[1])  # a view made anew at each call: never packed
        assert calls["packs"] == 3


def test_packing_off_switch(monkeypatch, calls):
    monkeypatch.setattr(cpu_linear, "PACK", False)
    w, x = torch.randn(40, 32), torch.randn(5, 32)
    with torch.no_grad():
        for _ in range(3):
            linear(x, w)
    assert calls["onednn"] == (3 if cpu_linear._probe() else 0) and calls["packs"] == calls["packed"] == 0
