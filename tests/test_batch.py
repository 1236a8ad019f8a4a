"""The batched forward (many sequences per step, ragged lengths, slots refilled) against the
single-sequence forward: same greedy tokens, same hidden states and captured features."""

import pytest
import torch

from _engine_util import build_llama
from specdec.engine.batch import generate_batch
from specdec.errors import ConfigError
from specdec.loading import load_model


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = build_llama(tmp_path_factory.mktemp("llama"), vocab=64, hidden=32, layers=3, seed=3, head_scale=4.0)
    return load_model(path, "cpu", "float32", tokenizer=False).model


def _single_greedy(model, prompt, n, stop):
    cache = model.new_cache(128)
    out = model.forward(torch.tensor(prompt), cache, logits="last")
    seq = []
    for _ in range(n):
        t = int(out.logits[-1].argmax())
        seq.append(t)
        if t in stop:
            break
        out = model.forward(torch.tensor([t]), cache, logits="last")
    return seq


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


@pytest.mark.parametrize("slots", [1, 3, 16])
def test_batched_greedy_equals_single(llama, slots):
    prompts = _prompts(11)
    # a stop token that some replies hit early, so slots free up and get refilled mid-run
    ref = [_single_greedy(llama, p, 20, set()) for p in prompts]
    counts = torch.bincount(torch.tensor([t for r in ref for t in r]), minlength=64)
    stop = {int(counts.argmax())}
    ref = [_single_greedy(llama, p, 20, stop) for p in prompts]
    assert len({len(r) for r in ref}) > 1, "the stop token should end replies at different lengths"
    done = []
    got = generate_batch(llama, prompts, 20, stop, slots=slots, on_done=lambda i, r: done.append(i))
    assert got == ref
    assert sorted(done) == list(range(len(prompts)))


def test_batched_features_equal_single_forward(llama):
    prompts = _prompts(4, seed=5)
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, : len(p)] = torch.tensor(p)
    out = llama.forward_batch_train(ids, capture=(0, 2))
    for r, p in enumerate(prompts):
        single = llama.forward(torch.tensor(p), llama.new_cache(64), capture=(0, 2))
        torch.testing.assert_close(out.hidden[r, : len(p)], single.hidden, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.captured[r, : len(p)], single.captured, atol=1e-5, rtol=1e-5)


def test_batched_sampling_is_seeded(llama):
    prompts = _prompts(5, seed=7)
    a = generate_batch(llama, prompts, 10, set(), slots=4, temperature=1.0, seed=1)
    b = generate_batch(llama, prompts, 10, set(), slots=4, temperature=1.0, seed=1)
    assert a == b and all(len(r) == 10 for r in a)


def test_batched_forward_refused_for_unbatched_targets(tmp_path):
    from _gemma_util import tiny_model
    tiny_model().save_pretrained(tmp_path / "g")
    model = load_model(str(tmp_path / "g"), "cpu", "float32", tokenizer=False).model
    with pytest.raises(ConfigError, match="not supported for gemma3"):
        generate_batch(model, [[1, 2, 3]], 4, set())


def test_folded_gqa_attention_equals_expanded(llama, monkeypatch):
    """The batched-step GQA fold (query groups as rows) computes the same attention."""
    import specdec.models.layers as layers

    prompts = _prompts(5, seed=9)
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, : len(p)] = torch.tensor(p)
    ref = llama.forward_batch_train(ids, capture=(1,))
    monkeypatch.setattr(layers, "FOLD_GQA_BATCHED", True)
    got = llama.forward_batch_train(ids, capture=(1,))
    torch.testing.assert_close(got.hidden, ref.hidden, atol=1e-5, rtol=1e-5)
    assert generate_batch(llama, prompts, 12, set(), slots=3) == [_single_greedy(llama, p, 12, set()) for p in prompts]
