"""The CUDA-graph step's math (static shapes, attention over the whole cache masked by position)
equals the eager step. The graph capture itself needs CUDA and runs in the device checks."""

import torch

from specdec.models.llama import LlamaConfig, LlamaForCausalLM


def _tiny_llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(model_type="llama", vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    m = LlamaForCausalLM(cfg)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return m.eval()


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
