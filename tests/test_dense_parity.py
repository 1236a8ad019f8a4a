"""Dense targets loaded from HF safetensors checkpoints match transformers.

Tiny random Llama (untied; tied like SmolLM2; llama3 RoPE scaling) and Qwen3 (head_dim !=
hidden/heads, q/k norms) models are written with ``save_pretrained`` and loaded with
``specdec.loading.load_model``. Logits on a 40-token prompt must match transformers' to a
relative max error of 1e-4 (max|a-b| / max|b|), and 32 greedy tokens from specdec's engine must
equal transformers' greedy ``generate``.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from _dense_util import hf_greedy, hf_logits, prompt_ids, rel_err, save_hf, tiny_model
from specdec.engine import SpeculativeGenerator
from specdec.loading import load_model
from specdec.sampling import SamplingParams
from specdec.weights.safetensors_io import SafetensorsSource

TOL = 1e-4
KINDS = ["llama", "llama_tied", "llama3", "qwen3"]


def specdec_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor(ids), model.new_cache(len(ids))).logits


def specdec_greedy(model, ids: list[int], n: int) -> list[int]:
    out = SpeculativeGenerator(model).generate(ids, n, SamplingParams())  # no eos: exactly n tokens
    return out.token_ids


def check_parity(loaded, hf) -> None:
    ids = prompt_ids()
    err = rel_err(specdec_logits(loaded.model, ids), hf_logits(hf, ids))
    assert err <= TOL, f"logits differ from transformers: relative max error {err:.3g} > {TOL}"
    ours, theirs = specdec_greedy(loaded.model, ids, 32), hf_greedy(hf, ids, 32)
    assert ours == theirs, f"greedy continuations differ:\nspecdec      {ours}\ntransformers {theirs}"


@pytest.mark.parametrize("kind", KINDS)
def test_hf_checkpoint_matches_transformers(kind, tmp_path):
    hf = tiny_model(kind)
    path = save_hf(hf, str(tmp_path / kind))
    loaded = load_model(path, "cpu", "float32")
    assert loaded.format == "hf" and loaded.arch.name == ("qwen3" if kind == "qwen3" else "llama")
    assert (loaded.model.lm_head is None) == hf.config.tie_word_embeddings
    check_parity(loaded, hf)


def test_sharded_checkpoint(tmp_path):
    hf = tiny_model("qwen3", seed=3)
    path = save_hf(hf, str(tmp_path / "sharded"), max_shard_size="100KB")
    shards = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    assert len(shards) > 1 and os.path.exists(os.path.join(path, "model.safetensors.index.json")), shards
    check_parity(load_model(path, "cpu", "float32"), hf)


def test_bf16_checkpoint_loads_as_exact_fp32(tmp_path):
    """A bf16 checkpoint widens exactly to fp32 (compare with transformers on the same values)."""
    hf = tiny_model("llama", seed=4)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.to(torch.bfloat16).float())  # the values the bf16 file will hold
    # save a bf16 copy; keep `hf` in fp32 (a round trip would also round its rotary buffers)
    path = save_hf(copy.deepcopy(hf).to(torch.bfloat16), str(tmp_path / "bf16"))
    assert "BF16" in {i.dtype for i in SafetensorsSource(path).infos().values()}
    loaded = load_model(path, "cpu", "float32")
    assert loaded.model.dtype == torch.float32
    for name, p in hf.state_dict().items():
        ours = loaded.model.state_dict()[name.removeprefix("model.")]
        assert torch.equal(ours, p), f"{name} changed in bf16 -> fp32 loading"
    check_parity(loaded, hf)


def test_captured_layers_match_hf_hidden_states(tmp_path):
    """DFlash context features: capturing layer ``l`` gives HF's ``hidden_states[l + 1]``: the raw
    decoder-layer output, except the last layer's, which HF (and DFlash training) take after the
    final norm."""
    hf = tiny_model("llama", seed=5)
    model = load_model(save_hf(hf, str(tmp_path / "m")), "cpu", "float32").model
    ids = prompt_ids(12)
    n = len(model.layers)
    with torch.no_grad():
        hs = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    for layer in (0, n - 2, n - 1):
        got = model(torch.tensor(ids), model.new_cache(len(ids)), capture=(layer,)).captured
        want = hs[layer + 1][0]
        assert rel_err(got, want) < TOL, f"captured layer {layer} differs from HF hidden_states[{layer + 1}]"
