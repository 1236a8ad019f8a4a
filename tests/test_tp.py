"""Tensor parallelism on the CPU (gloo, 2 spawned ranks): logits equal the single-process ones,
speculative greedy output equals plain greedy output for every drafter, and a rank that fails
ends every rank with one error. Each test spawns its ranks once and does all its cases there
(a spawn costs seconds); every run has a deadline, so nothing can hang."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from _dense_util import prompt_ids, rel_err, save_hf, tiny_model, write_gguf
from _dflash_util import write_drafter
from _engine_util import build_llama
from _tp_util import children, crash_on_rank, generate_on_rank, load_on_rank, logits_on_rank
from gguf import GGMLQuantizationType as QT
from specdec import LLM, load_target
from specdec.cli import main
from specdec.drafters.mtp_dir import new_mtp_block, save_mtp_dir
from specdec.errors import CheckpointError
from specdec.loading import load_model
from specdec.parallel.launch import ParallelError, run_parallel

DEADLINE = 120.0
pytestmark = pytest.mark.usefixtures("single_thread")


def _no_children_left():
    left = children()
    assert not left, f"processes left running: {left}"


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """name -> checkpoint: HF Llama (GQA 4/2), its F32 and Q8_0 GGUFs, tied embeddings, Qwen3 (HF and
    GGUF), one KV head for two ranks (replicated), a vocabulary of 47 (padded to 2 x 24 rows), and
    attention and MLP biases."""
    root = tmp_path_factory.mktemp("tp")
    out = {}
    llama = tiny_model("llama", seed=3)
    out["llama"] = save_hf(llama, str(root / "llama"))
    write_gguf(llama, str(root / "llama.gguf"))
    out["llama.gguf"] = str(root / "llama.gguf")
    write_gguf(llama, str(root / "llama.q8_0.gguf"), QT.Q8_0)
    out["llama.q8_0.gguf"] = str(root / "llama.q8_0.gguf")
    out["llama_tied"] = save_hf(tiny_model("llama_tied", seed=4), str(root / "tied"))
    qwen3 = tiny_model("qwen3", seed=5)
    out["qwen3"] = save_hf(qwen3, str(root / "qwen3"))
    write_gguf(qwen3, str(root / "qwen3.gguf"))
    out["qwen3.gguf"] = str(root / "qwen3.gguf")
    out["kv1"] = save_hf(tiny_model("llama", seed=6, kv=1), str(root / "kv1"))
    out["vocab47"] = build_llama(root / "v47", vocab=47, seed=7)
    out["bias"] = save_hf(_llama_with_biases(), str(root / "bias"))
    return out


def _llama_with_biases():
    """attention_bias and mlp_bias: q/k/v/gate/up biases split with their rows, o/down biases added once."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(8)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, attention_bias=True, mlp_bias=True)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.5)
    return model.eval()


def test_logits_equal_single_process(targets):
    ids = prompt_ids(24)
    small = {"vocab47": 47, "bias": 64}
    cases = {n: (path, [i % small[n] for i in ids] if n in small else ids) for n, path in targets.items()}
    got = run_parallel(logits_on_rank, 2, list(cases.values()), deadline_s=DEADLINE)
    for (n, (path, x)), g in zip(cases.items(), got):
        ref = load_target(path, device="cpu").logits(x)
        assert g.shape == ref.shape, n
        assert rel_err(g, ref) < 1e-5, (n, rel_err(g, ref))
    _no_children_left()


@pytest.fixture(scope="module")
def spec_target(tmp_path_factory):
    """A tiny Llama with a peaky head, a random DFlash drafter and an MTP head made for it."""
    root = tmp_path_factory.mktemp("tp_spec")
    path = build_llama(root / "target", vocab=48, hidden=32, layers=2, seed=3, head_scale=4.0)
    target = load_model(path, "cpu", tokenizer=False).model
    dflash, _ = write_drafter(root / "dflash", hidden=32, num_target_layers=2, target_layer_ids=(0, 1), block_size=4,
                              mask_token_id=47, heads=4, kv_heads=2, head_dim=8)
    block = new_mtp_block(target, init_from_layer=-1, generator=torch.Generator().manual_seed(6))
    save_mtp_dir(block, target, str(root / "mtp"), steps=3, dtype=None)
    return path, ["none", "ngram", f"dflash:{dflash}", f"mtp:{root / 'mtp'}"]


def test_speculative_greedy_equals_plain(spec_target):
    path, drafts = spec_target
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(48, (9,), generator=g).tolist(), [5, 6, 7, 5, 6, 7, 5, 6]]  # repeats: n-gram hits
    plain = LLM(path, device="cpu")
    want = [plain.generate(p, 16).token_ids for p in prompts]
    refs = [p + w for p, w in zip(prompts, want)]
    got = run_parallel(generate_on_rank, 2, path, drafts, prompts, 16, refs, deadline_s=DEADLINE)
    for spec in drafts:
        assert got[spec] == want, spec
    assert got["oracle"] == want and got["oracle accepted"] > 0  # accepted drafts: sharded rollback ran
    # sampling (rejection sampling with the MTP drafter) draws the same tokens from the same seed
    # (the logits differ from one process's in the last bits only)
    assert got["seed 5"] == LLM(path, draft=drafts[-1], device="cpu", num_draft_tokens=3).generate(
        prompts[0], 16, temperature=1.0, seed=5).token_ids
    assert 1 <= len(got["no seed"]) <= 16
    _no_children_left()


def test_rank_failing_at_load_ends_every_rank(targets, tmp_path):
    bad = tmp_path / "truncated.gguf"
    with open(targets["llama.gguf"], "rb") as fh:
        bad.write_bytes(fh.read()[:-4096])
    t0 = time.monotonic()
    # rank 0 loads a good checkpoint and waits in its first all-reduce for rank 1, which fails
    with pytest.raises(CheckpointError, match=r"^rank 1: .*truncated\.gguf: truncated file"):
        run_parallel(load_on_rank, 2, [targets["llama.gguf"], str(bad)], [1, 2, 3], deadline_s=DEADLINE)
    assert time.monotonic() - t0 < 60
    _no_children_left()


def test_rank_crashing_ends_every_rank():
    with pytest.raises(ParallelError, match=r"^rank 1 failed: exited with code 3 without reporting"):
        run_parallel(crash_on_rank, 2, deadline_s=DEADLINE)
    _no_children_left()


def test_cli_generate(targets, capfd):
    args = ["generate", "--model", targets["llama.gguf"], "--device", "cpu", "--draft", "ngram", "-n", "8",
            "-p", "abc abc abc", "--json"]
    assert main(args) == 0
    want = json.loads(capfd.readouterr().out)
    assert main(args + ["--tensor-parallel", "2"]) == 0
    out, err = capfd.readouterr()
    assert json.loads(out)["token_ids"] == want["token_ids"]  # rank 0 alone printed: one JSON object
    _no_children_left()


def test_cli_errors_are_one_line(targets, tmp_path, capfd):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(open(targets["llama.gguf"], "rb").read()[:-4096])
    assert main(["generate", "--model", str(bad), "--device", "cpu", "-p", "x", "--tensor-parallel", "2"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("specdec generate: error: rank 0: ") and "truncated" in err[0], err
    assert main(["generate", "--model", str(bad), "--device", "cpu", "-p", "x", "--tensor-parallel", "0"]) == 2
    assert "--tensor-parallel must be an integer >= 1" in capfd.readouterr().err
    _no_children_left()


def test_each_rank_holds_its_slices(targets):
    """Loading needs no process group: each rank's part of the Q8_0 GGUF holds exactly its rows /
    columns of the whole model's weights, and about half of the split bytes."""
    from specdec.parallel import Shard

    full = dict(load_model(targets["llama.q8_0.gguf"], "cpu", tokenizer=False).model.named_parameters())
    parts = [dict(load_model(targets["llama.q8_0.gguf"], "cpu", tokenizer=False, shard=Shard(r, 2)).model
                  .named_parameters()) for r in range(2)]
    for name, w in full.items():
        a, b = parts[0][name], parts[1][name]
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat([a, b], 1), w), name
        elif a.shape != w.shape:
            assert torch.equal(torch.cat([a, b], 0), w), name
        else:
            assert torch.equal(a, w) and torch.equal(b, w), name  # norms: replicated
    assert sum(p.numel() for p in parts[1].values()) < 0.55 * sum(p.numel() for p in full.values())


@pytest.mark.parametrize("qtype", [QT.F16, QT.BF16, QT.Q8_0])
def test_gguf_slices_read_alone_equal_whole_reads(tmp_path, qtype):
    """Row blocks decode alone, float columns are read alone, quantized columns via the whole tensor."""
    from _dense_util import encode_tensor, write_single_tensor_gguf
    from specdec.weights.gguf_io import GGUFSource

    a = torch.randn(6, 64, generator=torch.Generator().manual_seed(0)).numpy()
    stored, q = (a.astype("float32").view("uint32") >> 16).astype("uint16"), qtype
    if qtype != QT.BF16:
        stored, q = encode_tensor(a, qtype)
    write_single_tensor_gguf(str(tmp_path / "t.gguf"), "w", stored, q if q != QT.F16 else None)
    src = GGUFSource(str(tmp_path / "t.gguf"))
    whole = src.get("w", torch.float32)
    assert torch.equal(src.get_slice("w", 0, 2, 5, torch.float32), whole[2:5])
    assert torch.equal(src.get_slice("w", 1, 32, 64, torch.float32), whole[:, 32:64])


def test_more_ranks_than_gpus_is_one_clear_error(monkeypatch):
    from specdec.errors import ConfigError
    from specdec.parallel.launch import check_world

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert check_world(2, "cuda") == "cuda"
    with pytest.raises(ConfigError, match=r"--tensor-parallel 4 needs 4 GPUs, but 2 are visible"):
        check_world(4, None)
    with pytest.raises(ConfigError, match=r"give --device cuda"):
        check_world(2, "cuda:1")
