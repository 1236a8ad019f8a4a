"""Bad checkpoints and bad requests raise specdec errors whose message names the culprit."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import _dense_util as U
from specdec.api import LLM
from specdec.engine import SpeculativeGenerator
from specdec.errors import CheckpointError, ConfigError, ContextOverflowError, RequestError
from specdec.loading import load_model
from specdec.sampling import SamplingParams


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A valid tiny Llama checkpoint (max_position_embeddings=512); tests copy it before damaging it."""
    return U.save_hf(U.tiny_model("llama"), str(tmp_path_factory.mktemp("ok") / "llama"))


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ok") / "llama.gguf")
    U.write_gguf(U.tiny_model("llama"), path)
    return path


def copy_dir(src: str, dst) -> str:
    shutil.copytree(src, str(dst))
    return str(dst)


def rewrite_weights(path: str, change) -> str:
    """Load model.safetensors, let ``change(state)`` edit it, save it back; returns the file."""
    f = os.path.join(path, "model.safetensors")
    state = load_file(f)
    change(state)
    save_file(state, f, metadata={"format": "pt"})
    return f


# --- GGUF -----------------------------------------------------------------------------------

def test_truncated_gguf(gguf_file, tmp_path):
    bad = tmp_path / "half.gguf"
    data = open(gguf_file, "rb").read()
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated") as e:
        load_model(str(bad), "cpu", "float32")
    assert str(bad) in str(e.value)


def test_truncated_gguf_inside_metadata(gguf_file, tmp_path):
    bad = tmp_path / "head.gguf"
    bad.write_bytes(open(gguf_file, "rb").read()[:300])
    with pytest.raises(CheckpointError, match=r"truncated or corrupt GGUF.*metadata key") as e:
        load_model(str(bad), "cpu", "float32")
    assert str(bad) in str(e.value)


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a model at all" * 10)
    with pytest.raises(CheckpointError, match="not a GGUF file or an HF checkpoint directory"):
        load_model(str(bad), "cpu", "float32")


def test_gguf_type_without_block_size(tmp_path, monkeypatch):
    """A GGML type the installed gguf package has no size entry for is an error naming the file,
    the tensor and the type, listing the types specdec reads (not a bare KeyError)."""
    import gguf
    from gguf import GGMLQuantizationType as QT

    from specdec.weights.gguf_io import GGUFSource

    path = str(tmp_path / "q8.gguf")
    values = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
    U.write_single_tensor_gguf(path, "w", gguf.quants.quantize(values, QT.Q8_0), QT.Q8_0)
    sizes = {k: v for k, v in gguf.GGML_QUANT_SIZES.items() if k != QT.Q8_0}
    monkeypatch.setattr(gguf, "GGML_QUANT_SIZES", sizes)
    with pytest.raises(CheckpointError) as e:
        GGUFSource(path)
    msg = str(e.value)
    assert path in msg and "'w'" in msg and f"id {int(QT.Q8_0)}" in msg and "Q8_0" in msg
    assert "supported types: F32, F16" in msg


def test_gguf_missing_tensor(tmp_path):
    path = str(tmp_path / "m.gguf")
    U.write_gguf(U.tiny_model("llama"), path, skip=("blk.1.ffn_down.weight",))
    with pytest.raises(CheckpointError, match="missing") as e:
        load_model(path, "cpu", "float32")
    assert "blk.1.ffn_down.weight" in str(e.value) and path in str(e.value)


def test_gguf_unexpected_tensor(tmp_path):
    path = str(tmp_path / "m.gguf")
    U.write_gguf(U.tiny_model("llama"), path, extra={"blk.0.mystery.weight": np.zeros((4, 4), np.float32)})
    with pytest.raises(CheckpointError, match="unexpected") as e:
        load_model(path, "cpu", "float32")
    assert "blk.0.mystery.weight" in str(e.value)


def test_gguf_missing_metadata_field(tmp_path):
    import gguf

    path = str(tmp_path / "m.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_embedding_length(64)  # no llama.block_count, no llama.attention.head_count
    w.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="llama.attention.head_count|llama.block_count"):
        load_model(path, "cpu", "float32")


def test_gguf_unknown_architecture(tmp_path):
    import gguf

    path = str(tmp_path / "m.gguf")
    w = gguf.GGUFWriter(path, "mamba9")
    w.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match="mamba9") as e:
        load_model(path, "cpu", "float32")
    assert "llama" in str(e.value) and "qwen3" in str(e.value)


# --- safetensors --------------------------------------------------------------------------------

def test_safetensors_wrong_shape(hf_dir, tmp_path):
    path = copy_dir(hf_dir, tmp_path / "m")
    name = "model.layers.0.self_attn.q_proj.weight"
    f = rewrite_weights(path, lambda s: s.__setitem__(name, s[name][:-4].contiguous()))
    with pytest.raises(CheckpointError, match="shape") as e:
        load_model(path, "cpu", "float32")
    assert name in str(e.value) and f in str(e.value) and "[60, 64]" in str(e.value)


def test_safetensors_int_weight(hf_dir, tmp_path):
    path = copy_dir(hf_dir, tmp_path / "m")
    name = "model.layers.1.mlp.up_proj.weight"
    rewrite_weights(path, lambda s: s.__setitem__(name, s[name].to(torch.int32)))
    with pytest.raises(CheckpointError, match="I32") as e:
        load_model(path, "cpu", "float32")
    assert name in str(e.value)


def test_safetensors_missing_and_unexpected(hf_dir, tmp_path):
    path = copy_dir(hf_dir, tmp_path / "m")
    rewrite_weights(path, lambda s: s.pop("model.layers.1.post_attention_layernorm.weight"))
    with pytest.raises(CheckpointError, match="missing") as e:
        load_model(path, "cpu", "float32")
    assert "layers.1.post_attention_layernorm.weight" in str(e.value)
    path2 = copy_dir(hf_dir, tmp_path / "m2")
    rewrite_weights(path2, lambda s: s.__setitem__("model.layers.0.extra.weight", torch.zeros(3)))
    with pytest.raises(CheckpointError, match="unexpected.*model.layers.0.extra.weight"):
        load_model(path2, "cpu", "float32")


def test_truncated_safetensors(hf_dir, tmp_path):
    path = copy_dir(hf_dir, tmp_path / "m")
    f = os.path.join(path, "model.safetensors")
    data = open(f, "rb").read()
    open(f, "wb").write(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated") as e:
        load_model(path, "cpu", "float32")
    assert f in str(e.value)


def test_corrupt_safetensors_header(hf_dir, tmp_path):
    path = copy_dir(hf_dir, tmp_path / "m")
    f = os.path.join(path, "model.safetensors")
    data = bytearray(open(f, "rb").read())
    data[8:16] = b"\xff\xfe{oops!"  # the JSON header starts at byte 8
    open(f, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt safetensors header") as e:
        load_model(path, "cpu", "float32")
    assert f in str(e.value)


def test_missing_shard(hf_dir, tmp_path):
    path = str(tmp_path / "sharded")
    U.save_hf(U.tiny_model("llama"), path, max_shard_size="100KB")
    shard = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[-1]
    os.remove(os.path.join(path, shard))
    with pytest.raises(CheckpointError, match="missing") as e:
        load_model(path, "cpu", "float32")
    assert shard in str(e.value)


# --- config.json ----------------------------------------------------------------------------------

def edit_config(path: str, change) -> str:
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    change(cfg)
    json.dump(cfg, open(cfg_path, "w"))
    return cfg_path


def test_unknown_model_type(hf_dir, tmp_path):
    path = copy_dir(hf_dir, tmp_path / "m")
    cfg_path = edit_config(path, lambda c: c.__setitem__("model_type", "gpt_neox_x"))
    with pytest.raises(ConfigError, match="gpt_neox_x") as e:
        load_model(path, "cpu", "float32")
    msg = str(e.value)
    assert cfg_path in msg and "supported" in msg and "llama" in msg and "qwen3" in msg


def test_config_missing_required_field(hf_dir, tmp_path):
    path = copy_dir(hf_dir, tmp_path / "m")
    cfg_path = edit_config(path, lambda c: c.pop("num_hidden_layers"))
    with pytest.raises(ConfigError, match="num_hidden_layers") as e:
        load_model(path, "cpu", "float32")
    assert cfg_path in str(e.value)


def test_config_zero_head_dim_is_named(hf_dir, tmp_path):
    """Found by the fuzz run: fewer hidden units than heads gave head_dim 0 and a raw
    ZeroDivisionError in the attention scale."""
    path = copy_dir(hf_dir, tmp_path / "m")
    edit_config(path, lambda c: (c.pop("head_dim", None), c.__setitem__("num_attention_heads", c["hidden_size"] * 2),
                                 c.__setitem__("num_key_value_heads", c["hidden_size"] * 2)))
    with pytest.raises(ConfigError, match="head_dim"):
        load_model(path, "cpu", "float32")


def test_config_unsupported_option(hf_dir, tmp_path):
    path = copy_dir(hf_dir, tmp_path / "m")
    edit_config(path, lambda c: c.__setitem__("hidden_act", "gelu"))
    with pytest.raises(ConfigError, match="hidden_act 'gelu'"):
        load_model(path, "cpu", "float32")


def test_config_not_json(hf_dir, tmp_path):
    path = copy_dir(hf_dir, tmp_path / "m")
    with open(os.path.join(path, "config.json"), "w") as fh:
        fh.write("{ not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_model(path, "cpu", "float32")


def test_no_such_path(tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        load_model(str(tmp_path / "nothing-here"), "cpu", "float32")


# --- requests ---------------------------------------------------------------------------------------

def test_prompt_longer_than_context(hf_dir):
    llm = LLM(hf_dir, device="cpu", dtype="float32")
    ctx = llm.model.max_context
    assert ctx == 512
    with pytest.raises(ContextOverflowError, match="512") as e:
        llm.generate([5] * (ctx + 1), max_new_tokens=1)
    assert "prompt" in str(e.value)
    with pytest.raises(ContextOverflowError, match="max_new_tokens"):  # fits alone, not with the request
        llm.generate([5] * (ctx - 4), max_new_tokens=8)
    with pytest.raises(ContextOverflowError):
        SpeculativeGenerator(llm.model).generate([5] * (ctx + 10), 4)


@pytest.mark.parametrize("kwargs,field", [
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_p": float("nan")}, "top_p"),
    ({"top_k": True}, "top_k"),
    ({"seed": 2**64}, "seed"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(RequestError, match=field):
        SamplingParams(**kwargs)


def test_bad_request_through_api(hf_dir):
    llm = LLM(hf_dir, device="cpu", dtype="float32")
    with pytest.raises(RequestError, match="temperature"):
        llm.generate([1, 2, 3], max_new_tokens=4, temperature=-1.0)
    with pytest.raises(RequestError, match="top_p"):
        llm.generate([1, 2, 3], max_new_tokens=4, temperature=0.7, top_p=0.0)
    with pytest.raises(RequestError, match="max_new_tokens"):
        llm.generate([1, 2, 3], max_new_tokens=0)
    with pytest.raises(RequestError, match="token ids"):
        llm.generate([1, 2, U.VOCAB + 7], max_new_tokens=2)
    with pytest.raises(RequestError, match="empty"):
        llm.generate([], max_new_tokens=2)


def test_safetensors_overlapping_tensors(hf_dir, tmp_path):
    """A header whose byte ranges overlap (shapes still consistent) is rejected naming both tensors."""
    import struct

    path = copy_dir(hf_dir, tmp_path / "m")
    f = os.path.join(path, "model.safetensors")
    data = open(f, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    a, b = "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"
    header[b]["data_offsets"] = header[a]["data_offsets"]  # same size: both 64 fp32 values
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    open(f, "wb").write(struct.pack("<Q", len(raw)) + raw + data[8 + n:])
    with pytest.raises(CheckpointError, match="overlap") as e:
        load_model(path, "cpu", "float32")
    assert a in str(e.value) and b in str(e.value)
