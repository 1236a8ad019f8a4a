"""scripts/check_fused_layer.py (a GPU check and sweep) on the CPU: the weights it takes from a shape's model (the
Gated DeltaNet's and the gated attention's too; a small Gemma 4's KV-shared q and per-layer inputs), --list, and bad
--only in one line."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import check_fused_layer  # noqa: E402


def test_weight_shapes_of_a_hybrid_and_a_llama_shape():
    s = check_fused_layer.weight_shapes("qwen3.5-35b-a3b")
    # in-projections: q, k (16 x 128 each), v (32 x 128), z (32 x 128), b and a (32 each); out_proj; the gated
    # attention's q + gate (16 x 256 x 2), k, v (2 x 256 each); no SwiGLU (the MoE block's kernels take its FFN)
    assert s["delta_in"] == (12352, 2048, False) and s["delta_out"] == (2048, 4096, False)
    assert s["qkv"] == (9216, 2048, False) and "gate_up+silu" not in s and s["head"] == (248320, 2048, False)
    assert check_fused_layer.weight_shapes("smollm2-135m") == {
        "qkv": (960, 576, False), "o": (576, 576, False), "gate_up+silu": (3072, 576, True), "down": (576, 1536, False),
        "head": (49152, 576, False)}


def test_weight_shapes_of_a_small_gemma4():
    s = check_fused_layer.weight_shapes("gemma4-e2b")
    # the KV-shared layers' q alone (8 heads of 256 or 512), their double-wide MLPs named by shape, the per-layer
    # inputs' gate and projection (256 a layer) and the embeddings' projection to every layer's (35 x 256)
    assert s["q_shared_256"] == (2048, 1536, False) and s["q_shared_512"] == (4096, 1536, False)
    assert s["gate_up+silu"] == (12288, 1536, True) and s["gate_up+silu_24576x1536"] == (24576, 1536, True)
    assert s["down"] == (1536, 6144, False) and s["down_1536x12288"] == (1536, 12288, False)
    assert s["per_layer_gate"] == (256, 1536, False) and s["per_layer_proj"] == (1536, 256, False)
    assert s["per_layer_model"] == (8960, 1536, False)


def test_list_and_bad_only(capsys):
    assert check_fused_layer.main(["--shape", "qwen3.5-9b", "--list"]) == 0
    assert "delta_in: 12352 x 4096" in capsys.readouterr().out
    assert check_fused_layer.main(["--shape", "qwen3.5-9b", "--only", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--only nope" in err and "delta_in" in err
    assert check_fused_layer.main(["--shape", "no-such"]) == 2
    assert "no-such" in capsys.readouterr().err
