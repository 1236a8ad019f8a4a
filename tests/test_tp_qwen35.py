"""Tensor parallelism for Qwen3.5 dense (hybrid) targets on the CPU (gloo, 2 spawned ranks): gated
attention split by heads, Gated DeltaNet split by key heads with their value heads, SwiGLU split by
intermediate block. Logits equal the single-process ones (HF and GGUF checkpoints), speculative
greedy output equals plain greedy output with accepted drafts (so the sharded DeltaNet snapshots
are rolled back) and with the checkpoint's own MTP block, and each rank reads only its slices.
One spawn per test, each with a deadline (see test_tp.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from _dflash_util import write_drafter
from _qwen35_util import build_tp_dense as _build, build_tp_moe as _build_moe, write_gguf
from _tp_util import assert_logits_equal_single_process, generate_on_rank, no_children_left
from specdec import LLM
from specdec.errors import ConfigError
from specdec.loading import load_model, read_model_config
from specdec.parallel import Shard
from specdec.parallel.launch import run_parallel

DEADLINE = 120.0
pytestmark = pytest.mark.usefixtures("single_thread")

@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """name -> checkpoint: HF (KV heads split), its GGUF, its GGUF with fused attention q/k/v, and
    HF with one KV head (replicated on both ranks)."""
    root = tmp_path_factory.mktemp("tp35")
    out = {"hf": _build(root / "hf", seed=3)}
    write_gguf(out["hf"], str(root / "q.gguf"))
    out["gguf"] = str(root / "q.gguf")
    write_gguf(out["hf"], str(root / "fused.gguf"), fuse_qkv=True)
    out["gguf fused qkv"] = str(root / "fused.gguf")
    out["hf kv1"] = _build(root / "kv1", seed=4, num_key_value_heads=1)
    out["hf moe"] = _build_moe(root / "moe", seed=6)
    write_gguf(out["hf moe"], str(root / "moe.gguf"))
    out["gguf moe"] = str(root / "moe.gguf")
    return out



def test_logits_equal_single_process(ckpts):
    g = torch.Generator().manual_seed(1)
    # 40 tokens run the chunked form (no snapshots), 20 the recurrent one
    cases = {(n, t): (path, torch.randint(256, (t,), generator=g).tolist())
             for n, path in ckpts.items() for t in (40, 20)}
    assert_logits_equal_single_process(cases, DEADLINE)


def test_speculative_greedy_equals_plain(ckpts, tmp_path):
    path = ckpts["gguf"]
    dflash, _ = write_drafter(tmp_path / "dflash", hidden=64, num_target_layers=4, target_layer_ids=(1, 2),
                              block_size=4, mask_token_id=255)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(256, (9,), generator=g).tolist(), [5, 6, 7, 5, 6, 7, 5, 6]]  # repeats: n-gram hits
    plain = LLM(path, device="cpu")
    want = [plain.generate(p, 16).token_ids for p in prompts]
    refs = [p + w for p, w in zip(prompts, want)]
    drafts = ["none", "ngram", f"dflash:{dflash}", "mtp"]  # the checkpoint's own MTP block, replicated
    got = run_parallel(generate_on_rank, 2, path, drafts, prompts, 16, refs, deadline_s=DEADLINE)
    assert got["none"] == want  # plain decoding under TP equals one process
    for spec in drafts[1:]:
        assert got[spec] == got["none"], spec
    # a spoiled oracle: most drafts accepted, so verify forwards commit part of their rows and the
    # sharded conv / recurrent snapshots are rolled back inside them
    assert got["oracle"] == got["none"] and got["oracle accepted"] > 0
    # sampling with the MTP drafter draws the same tokens from the same seed as one process
    assert got["seed 5"] == LLM(path, draft="mtp", device="cpu", num_draft_tokens=3).generate(
        prompts[0], 16, temperature=1.0, seed=5).token_ids
    no_children_left()


def test_moe_speculative_greedy_equals_plain(ckpts):
    """Qwen3.5 MoE under TP=2 (experts split, router replicated): plain decoding equals one
    process, and a spoiled oracle (drafts accepted, verify rows rolled back) and n-gram equal it."""
    path = ckpts["gguf moe"]
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(256, (9,), generator=g).tolist(), [5, 6, 7, 5, 6, 7, 5, 6]]
    plain = LLM(path, device="cpu")
    want = [plain.generate(p, 16).token_ids for p in prompts]
    refs = [p + w for p, w in zip(prompts, want)]
    got = run_parallel(generate_on_rank, 2, path, ["none", "ngram"], prompts, 16, refs, deadline_s=DEADLINE)
    assert got["none"] == want
    assert got["ngram"] == want
    assert got["oracle"] == want and got["oracle accepted"] > 0
    no_children_left()


def test_each_rank_reads_only_its_slices(ckpts, monkeypatch):
    """No process group needed: a rank's parameters from HF and from GGUF are the same slices,
    about half the split bytes, and the split tensors are never read whole."""
    from specdec.weights.gguf_io import GGUFSource
    from specdec.weights.safetensors_io import SafetensorsSource

    whole: list[str] = []
    for cls in (GGUFSource, SafetensorsSource):
        get = cls.get
        monkeypatch.setattr(cls, "get", lambda self, name, dtype, get=get: whole.append(name) or get(self, name, dtype))
    full = dict(load_model(ckpts["hf"], "cpu", tokenizer=False).model.named_parameters())
    whole.clear()
    for r in range(2):
        hf = dict(load_model(ckpts["hf"], "cpu", tokenizer=False, shard=Shard(r, 2)).model.named_parameters())
        gg = dict(load_model(ckpts["gguf"], "cpu", tokenizer=False, shard=Shard(r, 2)).model.named_parameters())
        for name, w in hf.items():
            assert torch.allclose(w, gg[name], rtol=0, atol=1e-6), name
        assert sum(w.numel() for w in hf.values()) < 0.55 * sum(w.numel() for w in full.values())
    split = [n for n in whole if any(s in n for s in ("proj", "attn_qkv", "attn_gate", "ssm_out", "ssm_conv", "ssm_a",
                                                       "ssm_alpha", "ssm_beta", "ffn_", "attn_q.", "attn_output",
                                                       "embd", "embed", "A_log", "dt_"))]
    assert not split, f"split tensors read whole: {sorted(set(split))[:8]}"
    assert any("norm" in n for n in whole)  # replicated tensors are read whole (the spy works)


@pytest.mark.parametrize("field, value", [("linear_num_key_heads", 3), ("num_attention_heads", 3)])
def test_heads_not_dividing_the_ranks_is_one_clear_error(ckpts, field, value):
    arch, cfg, _ = read_model_config(ckpts["hf"])
    over = {"linear_num_key_heads": 3, "linear_num_value_heads": 6} if field == "linear_num_key_heads" else \
        {"num_attention_heads": 3, "num_key_value_heads": 1}
    cfg = dataclasses.replace(cfg, **over)
    with pytest.raises(ConfigError, match=rf"^{field}={value} is not divisible by the 2 tensor-parallel ranks$"):
        with torch.device("meta"):
            arch.model_cls(cfg, shard=Shard(0, 2))
