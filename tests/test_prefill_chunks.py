"""The static prefill's wide chunks (engine/generate.py PREFILL_ROWS; the fixture sets the default, 128,
whatever SPECDEC_PREFILL_ROWS says): on CUDA a prompt of a target
without recurrent caches is prefilled as padded chunks of one wider static step (and a remainder of
at most 16 tokens by the decode step), up to STATIC_PREFILL_TOKENS; longer prompts by one eager forward;
hybrid targets keep the 16-row chunks. On the CPU the same static steps run uncaptured (static_prefill
forced on, as tests/test_qwen35.py does): the chunked prefill gives the eager forward's rows (fp32),
the cache holds the prompt, and speculative output (an accepted oracle) equals plain output after it."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from _engine_util import SpoiledOracle  # noqa: E402
from specdec.engine import SpeculativeGenerator  # noqa: E402
from specdec.engine import generate as engine_mod  # noqa: E402


@pytest.fixture(autouse=True)
def wide(monkeypatch):
    monkeypatch.setattr(engine_mod, "PREFILL_ROWS", 128)


@pytest.fixture(scope="module")
def llama(tmp_path_factory, single_thread):
    from _engine_util import build_llama

    from specdec.loading import load_model
    path = build_llama(tmp_path_factory.mktemp("pre") / "llama", vocab=97, hidden=48, layers=3, seed=5)
    return load_model(path, "cpu", "float32").model


def static_gen(model, drafter=None, k=0):
    g = SpeculativeGenerator(model, drafter, k, batch_invariant=True)
    g.static_prefill = True  # on CUDA with graphs; forced here to run the same static chunks uncaptured
    return g


@pytest.mark.parametrize("n, steps", [(5, {16}), (16, {16}), (17, {128}), (128, {128}), (140, {16, 128}),
                                      (300, {128}), (500, {128})])
def test_chunks_equal_the_eager_forward(llama, n, steps):
    prompt = torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(n))
    g = static_gen(llama)
    assert g.prefill_rows == engine_mod.PREFILL_ROWS == 128
    cache, graphed = g._cache_for(n + 8, (0, 2))
    out = g._prefill(prompt, cache, graphed, (0, 2))
    assert cache.length == n and {rows for rows, _ in graphed.steps} == steps  # 300 = 128 + 128 + 44 (a wide remainder)
    ref_cache = llama.new_cache(n + 8)
    ref = llama(prompt, ref_cache, capture=(0, 2), logits="last", snapshots=False)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.hidden, ref.hidden, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.captured, ref.captured, rtol=1e-4, atol=1e-4)
    nxt = torch.tensor([int(ref.logits[-1].argmax())])
    torch.testing.assert_close(graphed(nxt).logits, llama(nxt, ref_cache).logits, rtol=1e-4, atol=1e-4)


def test_long_prompts_take_the_eager_forward(llama, monkeypatch):
    assert engine_mod.STATIC_PREFILL_TOKENS == 512
    monkeypatch.setattr(engine_mod, "STATIC_PREFILL_TOKENS", 40)
    g = static_gen(llama)
    cache, graphed = g._cache_for(60, ())
    g._prefill(torch.arange(41) % 97, cache, graphed, ())
    assert cache.length == 41 and not graphed.steps  # no static step ran


@pytest.mark.parametrize("n", [30, 200])
def test_speculation_equals_plain_after_wide_chunks(llama, n):
    prompt = torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(7)).tolist()
    want = static_gen(llama).generate(prompt, 24).token_ids
    spec = static_gen(llama, SpoiledOracle(prompt + want, 97, spoil=0.3), 3)
    res = spec.generate(prompt, 24)
    assert res.token_ids == want and sum(res.stats.accepted) > 0 and min(res.stats.accepted) < 3


def test_where_wide_chunks_apply(llama, tmp_path, monkeypatch):
    from _qwen35_util import hf_model

    from specdec.loading import load_model
    hf_model("dense", seed=1).save_pretrained(tmp_path / "q")
    hybrid = load_model(str(tmp_path / "q"), "cpu", "float32").model
    assert static_gen(hybrid).prefill_rows == 16  # recurrent caches: one snapshot per row
    assert SpeculativeGenerator(llama, batch_invariant=False).prefill_rows is None  # no static steps
    monkeypatch.setattr(engine_mod, "PREFILL_ROWS", 16)
    assert static_gen(llama).prefill_rows == 16  # SPECDEC_PREFILL_ROWS=16: the narrow chunks


def test_a_step_refuses_more_tokens_than_rows(llama):
    g = static_gen(llama)
    cache, graphed = g._cache_for(64, ())
    with pytest.raises(ValueError, match="16 rows cannot take 17 tokens"):
        graphed(torch.arange(17), rows=16)


def test_a_wide_remainder_at_the_end_of_the_context(single_thread):
    """The cache keeps spare rows for a padded wide chunk that starts near the model's last position."""
    from _engine_util import tiny_llama
    m = tiny_llama(max_pos=150)
    prompt = (torch.arange(145) * 7 % 97).tolist()  # 128 + a 17-token remainder: a 128-row step at 128
    res = static_gen(m).generate(prompt, 5)
    ref = SpeculativeGenerator(m, batch_invariant=True).generate(prompt, 5)  # the eager prefill
    assert len(res.token_ids) == 5 and res.token_ids == ref.token_ids


@pytest.mark.parametrize("kind", ["gemma3", "gemma4-dense", "gemma4-moe"])
def test_sliding_window_layers_in_a_wide_chunk(tmp_path, single_thread, kind):
    """Gemma 3 and Gemma 4 (window 8, far narrower than a 128-row chunk; Gemma 4's KV sharing and
    per-layer inputs): the chunks give the eager forward's rows, and speculation equals plain after them."""
    from specdec.loading import load_model
    if kind == "gemma3":
        from _gemma_util import tiny_model
        hf = tiny_model("base", seed=3)
    else:
        from test_gemma4 import tiny_model
        hf = tiny_model(kind.split("-")[1], seed=3)
    hf.save_pretrained(tmp_path / "g")
    m = load_model(str(tmp_path / "g"), "cpu", "float32").model
    prompt = torch.randint(0, m.config.vocab_size, (150,), generator=torch.Generator().manual_seed(2))
    g = static_gen(m)
    cache, graphed = g._cache_for(160, ())
    out = g._prefill(prompt, cache, graphed, ())
    assert {rows for rows, _ in graphed.steps} == {128}
    ref_cache = m.new_cache(160)
    ref = m(prompt, ref_cache, logits="last", snapshots=False)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.hidden, ref.hidden, rtol=1e-4, atol=1e-4)
    nxt = torch.tensor([int(ref.logits[-1].argmax())])
    torch.testing.assert_close(graphed(nxt).logits, m(nxt, ref_cache).logits, rtol=1e-4, atol=1e-4)
    # and an accepted oracle's output equals plain output after the wide chunks
    ids = prompt.tolist()
    want = static_gen(m).generate(ids, 16).token_ids
    res = static_gen(m, SpoiledOracle(ids + want, m.config.vocab_size, spoil=0.3), 3).generate(ids, 16)
    assert res.token_ids == want and sum(res.stats.accepted) > 0 and min(res.stats.accepted) < 3
