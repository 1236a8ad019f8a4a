"""The fused RoPE + KV-cache write (specdec/models/rope_write.py) runs on CUDA in bf16/fp16 only;
scripts/check_rope_write.py compares it with the eager ops bitwise on the GPU. Here: turned on,
a CPU step falls back to the eager ops (same logits and cache), and the split of
``Attention.project`` into ``_heads`` + RoPE kept its results."""

import torch

import specdec.models.layers as layers
from _engine_util import build_llama
from specdec.cache import BatchKVCache, BatchWrite
from specdec.loading import load_model
from specdec.models.rope_write import supported


def test_cpu_steps_fall_back_to_the_eager_ops(tmp_path, monkeypatch):
    lm = load_model(build_llama(tmp_path / "t", vocab=64, hidden=32, layers=2, seed=3), "cpu", "float32", tokenizer=False)
    ids = torch.randint(0, 64, (3, 4), generator=torch.Generator().manual_seed(0))
    outs = []
    for flag in (False, True):
        monkeypatch.setattr(layers, "FUSED_ROPE_WRITE", flag)
        cache = lm.model.new_batch_cache(3, 16, spare=4)
        o = lm.model.forward_batch(ids, cache, torch.tensor([0, 2, 5]), logits="all")
        outs.append((o.logits, cache.layers[1].k.clone()))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_supported_only_on_cuda_half_precision():
    q = torch.zeros(1, 1, 2, 16, dtype=torch.bfloat16)
    cos = torch.zeros(1, 16, dtype=torch.bfloat16)
    cache = BatchKVCache(2, 1, 16, 8, torch.bfloat16, "cpu")
    w = BatchWrite(range(1), torch.zeros(1, 1, dtype=torch.long), 8)
    assert not supported(q, q[:, :, :1], cos, cache, w)  # a CPU tensor
