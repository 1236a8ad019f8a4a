"""GGUF targets: llama.cpp's names and conventions, dequantization, and parity with transformers.

The tiny HF models of ``_dense_util`` are written to GGUF the way llama.cpp's converter writes
them (arch ``llama``: q/k rows permuted per head, ``rope_freqs`` for llama3 RoPE, no
``output.weight`` when tied; arch ``qwen3``: no permutation, ``attention.key_length``).

Bounds (relative max error of the logits, max|a-b| / max|b|, on a 40-token prompt):
- F32 file vs transformers on the original weights: 1e-4 (measured 0 to 4e-7).
- Quantized file vs transformers run on the *dequantized* weights: 1e-4 (measured <= 3e-7), and
  the same 32 greedy tokens. This is the test of the reader: it must recover those exact values.
- Quantized file vs transformers on the original fp32 weights: a loose sanity bound that only
  catches a grossly wrong decode. Random weights (init std 0.1, random norm gains) amplify weight
  error a lot, so the bounds are wide. Measured over seeds 5-7 (relative max error / minimum
  per-position cosine similarity of the logit vectors): Q8_0 <= 0.034 / >= 0.999, Q6_K <= 0.19 /
  >= 0.96, Q4_K <= 0.59 / >= 0.70. Bounds: Q8_0 0.1 / 0.99, Q6_K 0.4 / 0.9, Q4_K 1.0 / 0.5.
  A Q4_K decode with the nibble order swapped scores 1.5 / -0.1, outside every bound.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

import _dense_util as U
from specdec.engine import SpeculativeGenerator
from specdec.loading import load_model
from specdec.sampling import SamplingParams
from specdec.weights.gguf_io import GGUFSource

TIGHT = 1e-4
LOOSE = {QT.Q8_0: (0.1, 0.99), QT.Q6_K: (0.4, 0.9), QT.Q4_K: (1.0, 0.5)}  # (max rel error, min cosine)
K_SIZES = dict(hidden=256, inter=512)  # K-quant rows must be multiples of 256


def logits(model, ids):
    return model(torch.tensor(ids), model.new_cache(len(ids))).logits


def greedy(model, ids, n=32):
    return SpeculativeGenerator(model).generate(ids, n, SamplingParams()).token_ids


@pytest.mark.parametrize("kind", ["llama", "llama_tied", "llama3", "qwen3"])
def test_f32_gguf_matches_transformers(kind, tmp_path):
    hf = U.tiny_model(kind)
    path = str(tmp_path / f"{kind}.gguf")
    U.write_gguf(hf, path, QT.F32)
    loaded = load_model(path, "cpu", "float32")
    assert loaded.format == "gguf"
    assert (loaded.model.lm_head is None) == hf.config.tie_word_embeddings
    ids = U.prompt_ids()
    err = U.rel_err(logits(loaded.model, ids), U.hf_logits(hf, ids))
    assert err <= TIGHT, f"{kind} F32 GGUF: relative max error {err:.3g} > {TIGHT}"
    assert greedy(loaded.model, ids) == U.hf_greedy(hf, ids, 32)


@pytest.mark.parametrize("kind,qtype,sizes", [
    ("llama", QT.Q8_0, {}),
    ("qwen3", QT.Q8_0, {}),
    ("llama", QT.Q4_K, K_SIZES),
    ("llama_tied", QT.Q6_K, K_SIZES),
    ("qwen3", QT.Q6_K, K_SIZES),
], ids=lambda v: v.name if isinstance(v, QT) else (str(v.get("hidden", 64)) if isinstance(v, dict) else v))
def test_quantized_gguf_matches_transformers_on_dequantized_weights(kind, qtype, sizes, tmp_path):
    hf = U.tiny_model(kind, seed=5, **sizes)
    path = str(tmp_path / f"{kind}.{qtype.name}.gguf")
    recovered = U.write_gguf(hf, path, qtype)
    src = GGUFSource(path)
    assert src.infos()["blk.0.ffn_down.weight"].dtype == qtype.name
    assert src.infos()["blk.0.attn_norm.weight"].dtype == "F32"
    loaded = load_model(path, "cpu", "float32")
    ids = U.prompt_ids()
    ours = logits(loaded.model, ids)
    ref = U.with_weights(hf, recovered)
    tight = U.rel_err(ours, U.hf_logits(ref, ids))
    orig = U.hf_logits(hf, ids)
    loose = U.rel_err(ours, orig)
    cos = float(torch.nn.functional.cosine_similarity(ours, orig, dim=-1).min())
    print(f"{kind} {qtype.name}: vs dequantized {tight:.3g}, vs original {loose:.3g} (cosine {cos:.4f})")
    assert tight <= TIGHT, f"{qtype.name}: relative max error {tight:.3g} vs transformers on the dequantized weights"
    max_rel, min_cos = LOOSE[qtype]
    assert loose <= max_rel and cos >= min_cos, \
        f"{qtype.name}: vs the original weights relative max error {loose:.3g}, cosine {cos:.3g}"
    assert greedy(loaded.model, ids) == U.hf_greedy(ref, ids, 32)


def test_reader_matches_gguf_package(tmp_path):
    """specdec's own GGUF parser returns what gguf.GGUFReader returns: metadata and tensors."""
    hf = U.tiny_model("llama3", seed=6)
    path = str(tmp_path / "m.gguf")
    U.write_gguf(hf, path, QT.Q8_0)
    src = GGUFSource(path)
    ref = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert src.metadata == meta
    assert len(src.infos()) == len(ref.tensors)
    for t in ref.tensors:
        info = src.infos()[t.name]
        assert info.shape == tuple(int(x) for x in reversed(t.shape.tolist())) and info.dtype == t.tensor_type.name
        want = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(info.shape)
        assert np.array_equal(src.get(t.name, torch.float32).numpy(), want), t.name


def test_gguf_byte_level_tokenizer(tmp_path):
    """The tiny files carry a byte-level vocabulary: ids are the UTF-8 bytes, and decode inverts."""
    path = str(tmp_path / "m.gguf")
    U.write_gguf(U.tiny_model("qwen3"), path)
    tok = load_model(path, "cpu", "float32").tokenizer
    text = "héllo wörld ✓ 12\n\t  x"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.eos_ids == [U.EOS]


# --- single tensors ------------------------------------------------------------------------------

def _roundtrip(tmp_path, stored, qtype):
    path = str(tmp_path / "t.gguf")
    U.write_single_tensor_gguf(path, "w", stored, qtype)
    return GGUFSource(path).get("w", torch.float32).numpy()


@pytest.fixture(scope="module")
def values():
    return np.random.default_rng(7).standard_normal((6, 512)).astype(np.float32)


def test_f16_and_bf16_tensors(values, tmp_path):
    f16 = values.astype(np.float16)
    assert np.array_equal(_roundtrip(tmp_path, f16, None), f16.astype(np.float32))
    bf16 = gguf.quants.quantize(values, QT.BF16)
    want = torch.from_numpy(values).to(torch.bfloat16).float().numpy()  # round-to-nearest-even, as gguf
    got = _roundtrip(tmp_path, bf16, QT.BF16)
    assert np.array_equal(got, want)
    assert np.abs(got - values).max() <= np.abs(values).max() * 2 ** -8


@pytest.mark.parametrize("qtype,decode,max_err", [
    # (fraction of the block's max|x|; 0.55 rather than 0.5 of a step allows for the fp16 scale)
    (QT.Q4_0, U.q4_0_decode, 1 / 8 * 1.01),  # step amax/8, levels -8..7: the side opposite the max clips by a step
    (QT.Q4_1, U.q4_1_decode, 2 / 15 * 0.55),  # step (max - min)/15 <= 2 amax/15, half a step
    (QT.Q8_0, None, 1 / 127 * 0.55),  # step amax/127, half a step
])
def test_legacy_quant_tensors(values, tmp_path, qtype, decode, max_err):
    stored = gguf.quants.quantize(values, qtype)
    got = _roundtrip(tmp_path, stored, qtype)
    assert np.array_equal(got, gguf.quants.dequantize(stored, qtype))
    if decode is not None:  # an independent decoder written from ggml's block layout
        assert np.allclose(got, decode(stored), rtol=0, atol=1e-6)
    amax = np.abs(values.reshape(-1, 32)).max(-1, keepdims=True)
    err = np.abs(got - values).reshape(-1, 32) / amax
    assert err.max() <= max_err, f"{qtype.name}: error {err.max():.3g} of the block's max"


@pytest.mark.parametrize("qtype,block_bytes,decode", [
    (QT.Q4_K, 144, U.q4_k_decode), (QT.Q5_K, 176, U.q5_k_decode), (QT.Q6_K, 210, U.q6_k_decode)])
def test_k_quant_tensors_random_blocks(tmp_path, qtype, block_bytes, decode):
    """Every bit pattern decodes as ggml says (own decoders written from ggml's block structs)."""
    stored = U.random_k_blocks(4, 512, block_bytes, seed=int(qtype))
    if qtype == QT.Q6_K:  # Q6_K keeps its fp16 d at the end of the block
        blocks = stored.reshape(-1, block_bytes)
        blocks[:, -2:] = blocks[:, :2]
    got = _roundtrip(tmp_path, stored, qtype)
    assert got.shape == (4, 512)
    assert np.allclose(got, decode(stored), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("qtype,encode,max_err", [(QT.Q4_K, U.q4_k_encode, 0.08), (QT.Q6_K, U.q6_k_encode, 0.02)])
def test_k_quant_tensors_close_to_original(values, tmp_path, qtype, encode, max_err):
    got = _roundtrip(tmp_path, encode(values), qtype)
    err = np.abs(got - values).max() / np.abs(values).max()
    assert err <= max_err, f"{qtype.name}: error {err:.3g} of the tensor's max"
