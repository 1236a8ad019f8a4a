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
