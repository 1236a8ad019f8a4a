"""Gemma 4 GGUF (llama.cpp's ``gemma4`` layout): ``specdec convert`` of tiny random HF checkpoints,
dense and MoE, loaded back by specdec and compared with transformers on the HF checkpoint.

- ``dense``: per-layer embeddings, two KV-shared layers with double-wide MLPs (per-layer
  ``feed_forward_length``), full layers with a larger head and proportional RoPE with a frequency
  factor (``rope_freqs`` divisors 2, then 1e30), soft-capped logits, tied embeddings, and a
  Gemma-style SentencePiece vocabulary;
- ``moe``: routed experts (router scale and per-expert scale as ``ffn_gate_inp.scale`` /
  ``ffn_down_exps.scale``), ``attention_k_eq_v`` full layers with one KV head (per-layer
  ``head_count_kv``, no ``attn_v``), an untied LM head; written without a vocabulary, and again
  with the ``gemma4`` vocabulary llama.cpp's converter writes for Gemma 4 (SentencePiece-style BPE).

F32 logits agree within 1e-4 relative max error and 16 greedy tokens are transformers'. A file
less one tensor or one required metadata key is refused in one line naming it.
"""

from __future__ import annotations

import gguf
import pytest
import torch

from _dense_util import hf_greedy, hf_logits, prompt_ids, rel_err, save_hf
from test_convert_gemma import gemma_tokenizer
from test_gemma4 import COMMON, F, S, randomise
from test_tokenizer import gemma4_meta
from specdec.convert import build_plan, convert
from specdec.convert.quantize import parse_type
from specdec.convert.writer import write_plan
from specdec.errors import CheckpointError
from specdec.info import describe
from specdec.loading import load_model

pytestmark = pytest.mark.usefixtures("single_thread")

TOL = 1e-4


def tiny_config(kind: str):
    from transformers import Gemma4TextConfig

    if kind == "dense":
        return Gemma4TextConfig(**COMMON, num_hidden_layers=5, layer_types=[S, S, F, S, F], num_kv_shared_layers=2,
                                use_double_wide_mlp=True, hidden_size_per_layer_input=8,
                                vocab_size_per_layer_input=COMMON["vocab_size"], final_logit_softcapping=5.0,
                                rope_parameters={S: {"rope_type": "default", "rope_theta": 10000.0},
                                                 F: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                     "rope_theta": 1e6, "factor": 2.0}})
    return Gemma4TextConfig(**COMMON, num_hidden_layers=4, layer_types=[S, F, S, F], attention_k_eq_v=True,
                            tie_word_embeddings=False, num_global_key_value_heads=1, hidden_size_per_layer_input=0,
                            enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32,
                            final_logit_softcapping=30.0)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{kind: (HF directory, transformers model, GGUF path)}."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("gemma4_gguf")
    out = {}
    for seed, kind in enumerate(("dense", "moe")):
        torch.manual_seed(10 + seed)
        hf = randomise(AutoModelForCausalLM.from_config(tiny_config(kind), dtype=torch.float32))
        path = save_hf(hf, str(root / kind))
        if kind == "dense":
            gemma_tokenizer(path)
        gguf_path = str(root / f"{kind}.gguf")
        convert(path, gguf_path, "f32", vocab=kind == "dense")
        out[kind] = path, hf, gguf_path
    return out


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_gguf_matches_transformers(files, kind):
    path, hf, gguf_path = files[kind]
    names = {t.name for t in gguf.GGUFReader(gguf_path).tensors}
    assert "rope_freqs.weight" in names and ("output.weight" in names) == (kind == "moe")
    if kind == "moe":
        assert {"blk.0.ffn_gate_up_exps.weight", "blk.0.ffn_gate_inp.scale", "blk.0.ffn_down_exps.scale"} <= names
        assert "blk.1.attn_v.weight" not in names and "blk.0.attn_v.weight" in names
    loaded = load_model(gguf_path, "cpu", "float32")
    assert loaded.arch.name == "gemma4" and loaded.format == "gguf"
    assert (loaded.tokenizer is not None) == (kind == "dense")
    mine, ref = loaded.model.config, load_model(path, "cpu", "float32", tokenizer=False).model.config
    for field in ("layer_types", "attention_dims", "rope", "kv_source", "use_double_wide_mlp", "attention_k_eq_v",
                  "hidden_size_per_layer_input", "final_logit_softcapping", "num_experts", "top_k_experts",
                  "moe_intermediate_size", "tie_word_embeddings", "sliding_window"):
        assert getattr(mine, field) == getattr(ref, field), field
    model, ids = loaded.model, prompt_ids(40, 1)  # no token 0: generate would mask it as padding
    with torch.no_grad():
        err = rel_err(model(torch.tensor(ids), model.new_cache(len(ids))).logits, hf_logits(hf, ids))
    assert err <= TOL, f"logits differ from transformers: relative max error {err:.3g} > {TOL}"
    from specdec.engine import SpeculativeGenerator
    from specdec.sampling import SamplingParams

    got = SpeculativeGenerator(model, None, 0).generate(ids, 16, SamplingParams()).token_ids
    assert got == hf_greedy(hf, ids, 16)


def test_info_reads_the_gguf(files):
    info = describe(files["moe"][2])
    assert info["architecture"] == "gemma4" and info["layers"] == 4 and info["num_experts"] == 8
    assert info["attention_dims"] == {S: "16x2kv", F: "32x1kv"}


def test_gemma4_vocabulary_loads(files, tmp_path, capsys):
    """A Gemma 4 GGUF whose vocabulary is ``tokenizer.ggml.model = "gemma4"``: ``specdec info``
    describes it and the model loads with a tokenizer that round-trips text."""
    from specdec.cli import main

    plan = build_plan(files["moe"][0], vocab=False)
    for key, value in gemma4_meta(COMMON["vocab_size"]).items():
        if isinstance(value, list):
            plan.array(key, value)
        elif isinstance(value, bool):
            plan.boolean(key, value)
        elif isinstance(value, int):
            plan.u32(key, value)
        else:
            plan.string(key, value)
    out = str(tmp_path / "gemma4-vocab.gguf")
    write_plan(plan, out, parse_type("f32"), progress=lambda total, desc: None)
    assert main(["info", out, "--json"]) == 0
    assert '"model": "gemma4"' in capsys.readouterr().out
    tok = load_model(out, "cpu", "float32").tokenizer
    assert tok is not None and tok.encode("ab a") == [2, tok.tok.vocab["ab"], tok.tok.vocab["▁a"]]
    assert tok.decode(tok.encode("abab\n\n\né", add_special=False)) == "abab\n\n\né"


def _write_without(path: str, tmp_path, tensor: str | None = None, key: str | None = None) -> str:
    plan = build_plan(path, vocab=False)
    if tensor:
        plan.tensors = [t for t in plan.tensors if t.name != tensor]
    if key:
        del plan.metadata[key]
    out = str(tmp_path / "broken.gguf")
    write_plan(plan, out, parse_type("f32"), progress=lambda total, desc: None)
    return out


@pytest.mark.parametrize("tensor, key, message", [
    ("blk.2.attn_q_norm.weight", None, r"missing tensor\(s\) \['blk.2.attn_q_norm.weight"),
    ("per_layer_proj_norm.weight", None, r"missing tensor\(s\) \['per_layer_proj_norm.weight"),
    ("rope_freqs.weight", None, "tensor 'rope_freqs.weight' is missing"),
    (None, "gemma4.attention.sliding_window_pattern", "'gemma4.attention.sliding_window_pattern' is missing"),
    (None, "gemma4.embedding_length_per_layer_input", "'gemma4.embedding_length_per_layer_input' is missing"),
    (None, "gemma4.attention.key_length_swa", "'gemma4.attention.key_length_swa' is missing"),
])
def test_missing_tensor_or_key_is_named(files, tmp_path, tensor, key, message):
    out = _write_without(files["dense"][0], tmp_path, tensor, key)
    with pytest.raises(CheckpointError, match=message) as e:
        load_model(out, "cpu", "float32")
    assert "\n" not in str(e.value)
