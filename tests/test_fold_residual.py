"""base.FOLD_RESIDUAL: each Llama/Qwen3 and Qwen3.5 (dense and MoE) layer's last residual add folded into
the next layer's input norm. On the CPU it runs the same ops, so every output must be bitwise what the unfolded layers give:
one sequence's forward (logits, hidden, captured layers), a batched forward, the static steps of
speculative decoding with accepted drafts, and batched generation."""

import pytest
import torch

from _dense_util import save_hf, tiny_model
from _engine_util import SpoiledOracle, plain_generate
from _qwen35_util import hf_model
from specdec.engine import SpeculativeGenerator
from specdec.engine.batch import generate_batch
from specdec.models import base, llama, qwen35
from specdec.sampling import SamplingParams
from specdec.loading import load_model

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen3.5", "qwen3.5-moe"])
def target(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    if request.param.startswith("qwen3.5"):  # a hybrid: DeltaNet and full-attention layers
        hf_model("moe" if request.param.endswith("moe") else "dense", seed=5).save_pretrained(path)
    else:
        save_hf(tiny_model(request.param, seed=5, layers=4), path)
    return load_model(path, "cpu", tokenizer=False).model


@pytest.fixture
def folded_calls(monkeypatch):
    """Counts forward_folded calls, so a test sees that the folded path really ran."""
    calls = []
    real = llama.DenseDecoderLayer.forward_folded

    def spy(self, *a, **kw):
        calls.append(1)
        return real(self, *a, **kw)

    monkeypatch.setattr(llama.DenseDecoderLayer, "forward_folded", spy)
    real35 = qwen35._HybridLayer.forward_folded

    def spy35(self, *a, **kw):
        calls.append(1)
        return real35(self, *a, **kw)

    monkeypatch.setattr(qwen35._HybridLayer, "forward_folded", spy35)
    return calls


def _both(monkeypatch, fn):
    out = []
    for fold in (False, True):
        monkeypatch.setattr(base, "FOLD_RESIDUAL", fold)
        out.append(fn())
    return out


def test_forward_and_batched_forward_bitwise(target, monkeypatch, folded_calls):
    ids = torch.randint(target.config.vocab_size, (11,), generator=torch.Generator().manual_seed(1))
    cap = (0, 2, len(target.layers) - 1)

    def one():
        return target.forward(ids, target.new_cache(32), capture=cap)

    def batched():
        rows = torch.stack([ids, ids.flip(0)])
        return target.forward_batch_train(rows, capture=cap)

    for plain, folded in (_both(monkeypatch, one), _both(monkeypatch, batched)):
        assert torch.equal(plain.hidden, folded.hidden) and torch.equal(plain.captured, folded.captured)
        if plain.logits is not None:
            assert torch.equal(plain.logits, folded.logits)
    assert len(folded_calls) == 2 * len(target.layers)  # one folded forward and one batched forward


def test_speculative_and_batched_generation_unchanged(target, monkeypatch, folded_calls):
    prompt = torch.randint(target.config.vocab_size, (7,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = plain_generate(target, prompt, 24).token_ids

    def spec():
        drafter = SpoiledOracle(prompt + ref, target.config.vocab_size, spoil=0.3, seed=3)
        gen = SpeculativeGenerator(target, drafter, 4, batch_invariant=True)  # the padded static steps
        res = gen.generate(prompt, 24, SamplingParams())
        assert sum(res.stats.accepted) > 0  # drafts were accepted and rolled back
        return res.token_ids

    def batch():
        return generate_batch(target, [prompt, prompt[:4]], 16, set(), slots=2)

    specs = _both(monkeypatch, spec)
    for a, b in (specs, _both(monkeypatch, batch)):
        assert a == b
    assert specs[1] == ref
    assert folded_calls
