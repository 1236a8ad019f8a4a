"""Fewer kernels a step, the same bits (issue 10). RMSNorm without gradients (decoding) rounds the
scaled product straight into the input dtype and keeps its fp32 scale per weight version: a changed
weight (in place, or a new tensor) is seen; with gradients the plain differentiable form runs.
RoPE takes a sin whose first half is negated, and swaps halves instead of negating one: the bits
of the textbook rotate-half form."""

import pytest
import torch
import torch.nn.functional as F

from specdec.models.layers import RMSNorm, RotaryEmbedding, _rms, apply_rope


def _plain(n: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    w = n.weight.detach().float()
    return (_rms(x.float(), n.eps) * (1.0 + w if n.zero_centered else w)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_decode_form_has_the_plain_bits(dtype, zero_centered):
    torch.manual_seed(0)
    n = RMSNorm(64, 1e-6, zero_centered).to(dtype)
    with torch.no_grad():
        n.weight.copy_(torch.randn(64))
        x = torch.randn(5, 7, 64).to(dtype)
        xt = torch.randn(3, 64, 9).to(dtype).transpose(1, 2)  # not contiguous
        assert torch.equal(n(x), _plain(n, x)) and torch.equal(n(xt), _plain(n, xt))
        assert n(xt).stride() == xt.stride() or n(xt).is_contiguous()
        n.weight.mul_(2.0)  # in place: a new version
        assert torch.equal(n(x), _plain(n, x))
        n.weight = torch.nn.Parameter(torch.randn(64).to(dtype))  # another tensor
        assert torch.equal(n(x), _plain(n, x))
    with torch.inference_mode():
        assert torch.equal(n(x), _plain(n, x))


def test_training_keeps_gradients():
    n = RMSNorm(16, 1e-6)
    with torch.no_grad():
        n.weight.fill_(1.5)
    x = torch.randn(4, 16, requires_grad=True)
    n(x).sum().backward()
    assert x.grad is not None and n.weight.grad is not None and n.weight.grad.abs().sum() > 0


def _textbook_rope(x, cos, sin):
    r = cos.shape[-1]
    xr, xp = x[..., :r], x[..., r:]
    x1, x2 = xr[..., : r // 2], xr[..., r // 2:]
    out = xr * cos + torch.cat([-x2, x1], dim=-1) * sin
    return torch.cat([out, xp], dim=-1) if xp.shape[-1] else out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("partial", [1.0, 0.25])
def test_rope_has_the_textbook_bits(dtype, partial):
    rot = RotaryEmbedding(64, 1e6, partial_factor=partial)
    pos = torch.arange(500)
    cos, sin_folded = rot.cos_sin(pos, dtype)
    emb = pos.float()[:, None] * rot.inv_freq(pos.device)[None, :]
    emb = torch.cat([emb, emb], dim=-1)
    assert torch.equal(cos, emb.cos().to(dtype))
    x = torch.randn(9, 500, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    assert torch.equal(apply_rope(x, cos, sin_folded), _textbook_rope(x, cos, emb.sin().to(dtype)))


def test_eager_cuda_attention_leaves_cudnn_out():
    """cuDNN's SDPA builds a plan per new sequence length (~43 ms on the H200): eager CUDA attention
    runs without it. The flags are process-wide, so the context is checked here; its result on the
    GPU is checked by the benchmarks (BENCHMARKS.md)."""
    from specdec.models.layers import sdpa_backends
    was = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        with sdpa_backends():
            assert not torch.backends.cuda.cudnn_sdp_enabled()
            assert torch.backends.cuda.mem_efficient_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()
        assert torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)


@pytest.mark.parametrize("masked", [True, False])
def test_the_cuda_attention_form_equals_sdpa(masked):
    """``_sdpa_cuda`` (keys and values expanded for a masked GQA call) computes what plain SDPA does."""
    from specdec.models.layers import _sdpa_cuda
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 6, 5, 8, generator=g), torch.randn(1, 2, 9, 8, generator=g), torch.randn(1, 2, 9, 8, generator=g)
    mask = (torch.arange(9)[None, :] <= torch.arange(4, 9)[:, None]) if masked else None
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), attn_mask=mask, scale=0.3)
    torch.testing.assert_close(_sdpa_cuda(q, k, v, mask, 0.3, 3), want)


def test_norm_add_is_the_add_then_the_norm():
    """``RMSNorm.add(x, d)`` (one kernel on CUDA) returns ``x + d`` and its norm; off CUDA the torch
    ops, bitwise; with gradients it stays differentiable."""
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(24, 1e-6)
    norm.weight.data = torch.randn(24, generator=g)
    x, d = torch.randn(5, 24, generator=g), torch.randn(5, 24, generator=g)
    with torch.no_grad():
        s, y = norm.add(x, d)
        assert torch.equal(s, x + d) and torch.equal(y, norm(x + d))
    xg = x.clone().requires_grad_()
    s, y = norm.add(xg, d)
    y.sum().backward()
    assert xg.grad is not None and torch.isfinite(xg.grad).all()


ROTARIES = {
    "default": dict(head_dim=64, theta=10000.0),
    "qwen3.5 partial": dict(head_dim=256, theta=10_000_000.0, partial_factor=0.25),
    "llama3": dict(head_dim=64, theta=500000.0, scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "linear": dict(head_dim=32, theta=10000.0, scaling={"rope_type": "linear", "factor": 4.0}),
}


def _gemma4_rotary():
    from specdec.models.gemma4 import Gemma4Rotary
    return Gemma4Rotary(128, 1_000_000.0, fraction=0.25)


@pytest.mark.parametrize("kind", list(ROTARIES) + ["gemma4 proportional"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_table_has_the_computed_bits(kind, dtype, monkeypatch):
    """SPECDEC_ROPE_TABLE (CUDA's path, run on the CPU): a static step's cos/sin looked up in a table of every position (grown by doubling, the old
    tables kept) hold the bits :meth:`cos_sin` computes for the step's positions; a padding row past ``limit`` reads
    the last row; off, the values are computed."""
    from specdec.models import layers
    r = _gemma4_rotary() if kind.startswith("gemma4") else RotaryEmbedding(**ROTARIES[kind])
    monkeypatch.setattr(layers, "ROPE_TABLE", True)
    monkeypatch.setattr(layers, "TABLE_OFF_CUDA", True)  # CUDA's path, on the CPU
    for start, t, limit in ((0, 1, 300), (5, 16, 300), (1023, 4, 1100), (1500, 3, 1600), (4000, 16, 9000), (8990, 16, 9000)):
        pos = torch.arange(start, start + t)
        cos, sin = layers.static_cos_sin(r, pos, dtype, limit)
        want_cos, want_sin = r.cos_sin(pos.clamp(max=limit - 1), dtype)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin), (kind, start, t)
    sizes = [c.shape[0] for c, _ in r._rope_tables[(torch.device("cpu"), dtype)]]
    assert sizes == [1024, 2048, 9000], sizes  # never replaced: captured steps keep reading the old ones
    assert (cos[-6:] == cos[-7]).all()  # rows 8,990 + 10 .. are past the limit: row 8,999's values
    monkeypatch.setattr(layers, "ROPE_TABLE", False)
    r2 = _gemma4_rotary() if kind.startswith("gemma4") else RotaryEmbedding(**ROTARIES[kind])
    assert torch.equal(layers.static_cos_sin(r2, pos, dtype, 9000)[0], r2.cos_sin(pos, dtype)[0])
    assert not r2.__dict__.get("_rope_tables")


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_rope_table_static_steps_keep_their_bits(family, tmp_path, monkeypatch):
    """A tiny Llama's and a Gemma 3's static steps (batch-invariant, as CUDA runs them; eager here) with the table on
    and off: the same logits, bit for bit, and so the same greedy output (Gemma 3: its sliding layers' cos/sin and
    window mask too, past the window)."""
    from _engine_util import build_llama
    from specdec.engine import SpeculativeGenerator
    from specdec.loading import load_model
    import specdec.engine.generate as engine_generate
    from specdec.models import layers

    monkeypatch.setattr(engine_generate, "CPU_EXACT", False)  # padded static steps, as on CUDA
    monkeypatch.setattr(layers, "TABLE_OFF_CUDA", True)  # the table's path, on the CPU
    if family == "gemma3":
        from _dense_util import save_hf
        from _gemma_util import tiny_model as tiny_gemma
        path = save_hf(tiny_gemma("base", seed=2), str(tmp_path / "g"))
    else:
        path = build_llama(tmp_path / "m", vocab=64, hidden=64, layers=2, heads=4, kv_heads=2)
    model = load_model(path, "cpu", tokenizer=False).model
    prompt = torch.randint(64, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    outs = {}
    for on in (False, True):
        monkeypatch.setattr(layers, "ROPE_TABLE", on)
        cache = model.new_cache(256)
        model(torch.tensor(prompt), cache, logits="none", snapshots=False)
        start = torch.tensor(cache.length)
        with torch.inference_mode():
            ctx = model.static_context(start, 4, 256)
            logits = model.run_layers(torch.tensor([3, 5, 7, 9]), ctx, cache, (), "all").logits
        gen = SpeculativeGenerator(model, None, 0, batch_invariant=True).generate(prompt, 24)
        outs[on] = (ctx.cos, ctx.sin, ctx.mask, logits, gen.token_ids)
        if family == "gemma3":
            outs[on] += (ctx.local_cos, ctx.local_sin, ctx.local_mask)
            assert not ctx.local_mask[:, :30].any() and ctx.local_mask[:, 30:41].any()  # the window of 8, by position
    for a, b in zip(outs[False], outs[True]):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    assert 16 in model.__dict__.get("_aranges", {}), "the generation's 16-row static steps did not take the table"


def test_embedding_lookup_is_f_embeddings(monkeypatch):
    """layers.embedding: CUDA's form without gradients (indexing) gives F.embedding's rows; with a gradient to the table
    the lookup stays F.embedding's and the gradient arrives. The RoPE tables' lookups give the same rows by indexing
    (INDEX_LOOKUPS, the default) and by index_select."""
    from specdec.models import layers
    monkeypatch.setattr(layers, "ROPE_TABLE", True)
    monkeypatch.setattr(layers, "TABLE_OFF_CUDA", True)  # CUDA's path, on the CPU
    r, pos = RotaryEmbedding(**ROTARIES[next(iter(ROTARIES))]), torch.tensor([7, 0, 299, 7])
    both = []
    for on in (True, False):
        monkeypatch.setattr(layers, "INDEX_LOOKUPS", on)
        both.append(layers.static_cos_sin(r, pos, torch.bfloat16, 300))
    assert all(torch.equal(a, b) for a, b in zip(*both)) and torch.equal(both[0][0], r.cos_sin(pos, torch.bfloat16)[0])
    w = torch.randn(50, 8)
    ids = torch.tensor([3, 0, 49, 3])
    assert torch.equal(w[ids], F.embedding(ids, w))  # the CUDA form
    e = layers.Embedding(50, 8)
    with torch.no_grad():
        e.weight.copy_(w)
        assert torch.equal(e(ids), F.embedding(ids, w))
    e(ids).sum().backward()
    assert e.weight.grad[3].eq(2).all() and e.weight.grad[0].eq(1).all() and e.weight.grad[1].eq(0).all()

