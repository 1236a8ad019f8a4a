"""The split attention's algorithm (specdec/models/split_attention.py; its Triton kernel runs on
CUDA only, where scripts/check_split_attention.py compares it with this reference): in torch ops it
equals SDPA (GQA, masks by position, a DFlash block's bidirectional rows), and a row's bits do not
change when masked keys are appended (the span buckets)."""

import math

import pytest
import torch
import torch.nn.functional as F

from specdec.models.split_attention import split_attention_reference, supported


def _case(b, h, hkv, t, span, d, starts, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t, d, generator=g)
    k = torch.randn(b, hkv, span, d, generator=g)
    v = torch.randn(b, hkv, span, d, generator=g)
    pos = torch.tensor(starts)[:, None] + torch.arange(t)[None, :]
    mask = (torch.arange(span)[None, None, :] <= pos[:, :, None])[:, None]
    return q, k, v, mask


def _sdpa(q, k, v, mask, scale):
    g = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1),
                                          attn_mask=mask, scale=scale)


@pytest.mark.parametrize("h,hkv,t", [(6, 2, 1), (6, 2, 5), (4, 4, 3), (8, 1, 16)])
def test_reference_equals_sdpa(h, hkv, t):
    q, k, v, mask = _case(3, h, hkv, t, 700, 16, [0, 300, 680 - t])  # rows in the first, a middle and the last split
    got = split_attention_reference(q, k, v, mask, 0.25)
    assert torch.allclose(got, _sdpa(q, k, v, mask, 0.25), atol=1e-5)


def test_reference_takes_a_dflash_block_mask():
    """Context keys before each sequence's start, then its block's keys, all seen by every block row."""
    b, h, hkv, blk, span, d = 2, 4, 2, 4, 300, 8
    g = torch.Generator().manual_seed(1)
    q = torch.randn(b, h, blk, d, generator=g)
    k = torch.randn(b, hkv, span + blk, d, generator=g)
    v = torch.randn(b, hkv, span + blk, d, generator=g)
    starts = torch.tensor([5, 290])
    ctx = torch.arange(span)[None, :] < starts[:, None]
    mask = torch.cat([ctx, torch.ones(b, blk, dtype=torch.bool)], 1)[:, None, None, :].expand(b, 1, blk, span + blk)
    got = split_attention_reference(q, k, v, mask, 0.3)
    assert torch.allclose(got, _sdpa(q, k, v, mask, 0.3), atol=1e-5)


def test_reference_rows_ignore_masked_keys_appended():
    q, k, v, mask = _case(2, 6, 2, 4, 512, 16, [100, 505])
    q2, k2, v2, mask2 = _case(2, 6, 2, 4, 1536, 16, [100, 505], seed=9)
    k2[:, :, :512], v2[:, :, :512] = k, v
    assert torch.equal(split_attention_reference(q, k, v, mask, 0.25),
                       split_attention_reference(q, k2, v2, mask2, 0.25))
    k2[:, :, 700] += 1.0  # a key the rows see would change them: the comparison can fail
    mask2[:, :, :, 700] = True
    assert not torch.equal(split_attention_reference(q, k, v, mask, 0.25),
                           split_attention_reference(q, k2, v2, mask2, 0.25))


def test_cpu_tensors_keep_sdpa():
    q, k, v, mask = _case(1, 2, 1, 1, 8, 16, [3])
    assert not supported(q.bfloat16(), k.bfloat16(), mask)
    assert not math.isnan(split_attention_reference(q, k, v, mask, 0.25).sum().item())
