"""Tensor parallelism on the CPU (gloo, 2 spawned ranks): logits equal the single-process ones,
speculative greedy output equals plain greedy output for every drafter, and a rank that fails
ends every rank with one error. Each test spawns its ranks once and does all its cases there
(a spawn costs seconds); every run has a deadline, so nothing can hang."""

from __future__ import annotations

import json
import time

import pytest
import torch

from _dense_util import prompt_ids, rel_err, save_hf, tiny_model, write_gguf
from _dflash_util import write_drafter
from _engine_util import build_llama
from _tp_util import (assert_logits_equal_single_process, compiled_generate_on_rank, crash_on_rank, generate_on_rank,
                      load_on_rank, moe_on_rank, no_children_left)
from gguf import GGMLQuantizationType as QT
from specdec import LLM
from specdec.cli import main
from specdec.drafters.mtp_dir import new_mtp_block, save_mtp_dir
from specdec.errors import CheckpointError
from specdec.loading import load_model
from specdec.parallel.launch import ParallelError, run_parallel

DEADLINE = 120.0
pytestmark = pytest.mark.usefixtures("single_thread")



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
    assert_logits_equal_single_process(cases, DEADLINE)


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
    no_children_left()


def test_compiled_steps_under_tp_equal_plain(spec_target):
    """``compile`` under tensor parallelism: torch.compile traces the ranks' all-reduces and
    all-gathers into the compiled static steps; greedy output (plain and with DFlash, whose
    captured layers come from the compiled step) equals one process's plain decoding."""
    path, drafts = spec_target
    g = torch.Generator().manual_seed(13)
    prompts = [torch.randint(48, (9,), generator=g).tolist()]
    want = [LLM(path, device="cpu").generate(p, 12).token_ids for p in prompts]
    refs = [p + w for p, w in zip(prompts, want)]
    got = run_parallel(compiled_generate_on_rank, 2, path, ["none", drafts[2]], prompts, 12, refs,
                       deadline_s=4 * DEADLINE)
    assert got["none"] == want and got[drafts[2]] == want
    assert got["oracle"] == want and got["oracle accepted"] > 0  # compiled verify steps, accepted and rolled back
    assert got["none compiled"] and got[drafts[2] + " compiled"]
    no_children_left()


def test_rank_failing_at_load_ends_every_rank(targets, tmp_path):
    bad = tmp_path / "truncated.gguf"
    with open(targets["llama.gguf"], "rb") as fh:
        bad.write_bytes(fh.read()[:-4096])
    t0 = time.monotonic()
    # rank 0 loads a good checkpoint and waits in its first all-reduce for rank 1, which fails
    with pytest.raises(CheckpointError, match=r"^rank 1: .*truncated\.gguf: truncated file"):
        run_parallel(load_on_rank, 2, [targets["llama.gguf"], str(bad)], [1, 2, 3], deadline_s=DEADLINE)
    assert time.monotonic() - t0 < 60
    no_children_left()


def test_rank_crashing_ends_every_rank():
    with pytest.raises(ParallelError, match=r"^rank 1 failed: exited with code 3 without reporting"):
        run_parallel(crash_on_rank, 2, deadline_s=DEADLINE)
    no_children_left()


def test_cli_generate(targets, capfd):
    args = ["generate", "--model", targets["llama.gguf"], "--device", "cpu", "--draft", "ngram", "-n", "8",
            "-p", "abc abc abc", "--json"]
    assert main(args) == 0
    want = json.loads(capfd.readouterr().out)
    assert main(args + ["--tensor-parallel", "2"]) == 0
    out, err = capfd.readouterr()
    assert json.loads(out)["token_ids"] == want["token_ids"]  # rank 0 alone printed: one JSON object
    no_children_left()


def test_cli_errors_are_one_line(targets, tmp_path, capfd):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(open(targets["llama.gguf"], "rb").read()[:-4096])
    assert main(["generate", "--model", str(bad), "--device", "cpu", "-p", "x", "--tensor-parallel", "2"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("specdec generate: error: rank 0: ") and "truncated" in err[0], err
    assert main(["generate", "--model", str(bad), "--device", "cpu", "-p", "x", "--tensor-parallel", "0"]) == 2
    assert "--tensor-parallel must be an integer >= 1" in capfd.readouterr().err
    no_children_left()


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


# --- expert parallelism (MoE) ----------------------------------------------------------------

def test_moe_block_equals_single_process():
    """Experts split across 2 ranks (7 experts: 3 and 4), router replicated, one all-reduce: the
    output equals one process's, on the gather path (T <= 16) and the grouped path, with and
    without a shared expert (split column/row-parallel)."""
    from _tp_util import moe_block
    from specdec.models.moe import Experts

    cases = [(seed, shared, t) for seed, (shared, t) in enumerate([(0, 5), (0, 40), (24, 3), (24, 33)])]
    assert cases[0][2] <= Experts.gather_max_rows < cases[1][2]
    got = run_parallel(moe_on_rank, 2, cases, deadline_s=DEADLINE)
    for (seed, shared, t), (g, g_experts) in zip(cases, got):
        x = torch.randn(t, 32, generator=torch.Generator().manual_seed(seed + 100))
        block = moe_block(seed, shared)
        with torch.no_grad():
            ref, ref_experts = block(x), block.experts(x, *block.route(x))
        assert rel_err(g, ref) < 1e-5, (seed, shared, t, rel_err(g, ref))
        assert rel_err(g_experts, ref_experts) < 1e-5, (seed, shared, t)
    no_children_left()


def test_moe_fewer_experts_than_ranks_is_one_error():
    from specdec.errors import ConfigError
    from specdec.models.moe import SparseMoeBlock
    from specdec.parallel import Shard

    with pytest.raises(ConfigError, match=r"^num_experts=1 cannot be split across 2 tensor-parallel ranks$"):
        SparseMoeBlock(8, 4, 0, 1, 1, shard=Shard(0, 2))


class _Reads:
    """A tensor source that records which tensors were read, whole or in part."""

    def __init__(self, base):
        self.base, self.path, self.metadata = base, base.path, getattr(base, "metadata", None)
        self.whole, self.parts = [], []

    def infos(self):
        return self.base.infos()

    def get(self, name, dtype):
        self.whole.append(name)
        return self.base.get(name, dtype)

    def get_slice(self, name, dim, start, stop, dtype):
        self.parts.append(name)
        return self.base.get_slice(name, dim, start, stop, dtype)


@pytest.fixture(scope="module")
def qwen35_moe(tmp_path_factory):
    """A tiny Qwen3.5-MoE (8 experts) as HF per-expert and fused tensors, and GGUF with separate
    and fused gate/up expert tensors."""
    from _qwen35_util import fuse_experts, hf_model
    from _qwen35_util import write_gguf as write_qwen35_gguf

    root = tmp_path_factory.mktemp("tp_moe")
    hf_model("moe", seed=2).save_pretrained(root / "hf")
    out = {"hf": str(root / "hf")}
    hf_model("moe", seed=2).save_pretrained(root / "fused")
    fuse_experts(str(root / "fused"))
    out["fused"] = str(root / "fused")
    for fuse in (False, True):
        name = f"gguf{'_fused' if fuse else ''}"
        write_qwen35_gguf(out["hf"], str(root / f"{name}.gguf"), fuse_gate_up=fuse)
        out[name] = str(root / f"{name}.gguf")
    return out


@pytest.mark.parametrize("kind", ["hf", "fused", "gguf", "gguf_fused"])
def test_moe_each_rank_reads_its_experts(qwen35_moe, kind):
    """A rank's MoE block loads its experts' rows of the whole block's weights (and its block of
    the shared expert), reading only its experts' tensors (HF per-expert) or rows (stacked)."""
    from specdec.loading import read_model_config
    from specdec.models.moe import SparseMoeBlock
    from specdec.models.qwen35 import checkpoint_view
    from specdec.parallel import Shard
    from specdec.parallel.tp import param_slices
    from specdec.weights.loader import load_into
    from specdec.weights.safetensors_io import SafetensorsSource

    path = qwen35_moe[kind]
    _, c, gsrc = read_model_config(path)
    fmt = "gguf" if gsrc is not None else "hf"
    prefix = "layers.1.mlp." if fmt == "gguf" else "model.layers.1.mlp."

    def load(shard):
        src = _Reads(gsrc if gsrc is not None else SafetensorsSource(path))
        view = checkpoint_view(c, src, fmt).without(lambda n: not n.startswith(prefix))
        with torch.device("meta"):
            block = SparseMoeBlock(c.hidden_size, c.moe_intermediate_size, c.shared_expert_intermediate_size,
                                   c.num_experts, c.num_experts_per_tok, shard=shard)
        load_into(block, view, {n: n[len(prefix):] for n in view.infos()}, dtype=torch.float32, device="cpu",
                  slices=param_slices(block) if shard else None)
        return block, src

    full = dict(load(None)[0].named_parameters())
    for r in range(2):
        block, src = load(Shard(r, 2))
        part, slices = dict(block.named_parameters()), param_slices(block)
        assert set(slices) >= {"experts.gate_up_proj", "experts.down_proj", "shared_expert.down_proj.weight"}
        for name, w in full.items():
            s = slices.get(name)
            assert torch.equal(part[name], w if s is None else w.narrow(s.dim, s.start, s.stop - s.start)), name
        assert part["experts.gate_up_proj"].shape[0] == 4
        read_experts = [n for n in src.whole + src.parts if "exps" in n or ".experts." in n]
        if kind == "hf":  # per-expert tensors: exactly this rank's
            assert sorted({int(n.split(".experts.")[1].split(".")[0]) for n in read_experts}) == list(range(4 * r, 4 * r + 4))
        else:  # stacked: rows of this rank only
            assert read_experts and not [n for n in src.whole if n in read_experts], src.whole


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_K])
def test_gguf_expert_rows_decode_alone(tmp_path, qtype):
    """A block of experts of a quantized stacked tensor ``[E, I, H]`` decodes alone, equal to the
    whole tensor's rows."""
    from _dense_util import encode_tensor, write_single_tensor_gguf
    from specdec.weights.gguf_io import GGUFSource

    a = torch.randn(5, 3, 256, generator=torch.Generator().manual_seed(0)).numpy()
    stored, q = encode_tensor(a.reshape(15, 256), qtype)
    write_single_tensor_gguf(str(tmp_path / "e.gguf"), "blk.0.ffn_down_exps.weight", stored.reshape(5, 3, -1), q)
    src = GGUFSource(str(tmp_path / "e.gguf"))
    whole = src.get("blk.0.ffn_down_exps.weight", torch.float32)
    assert whole.shape == (5, 3, 256)
    assert torch.equal(src.get_slice("blk.0.ffn_down_exps.weight", 0, 2, 5, torch.float32), whole[2:5])


def test_symmetric_memory_all_reduce_is_cuda_only():
    """The one-shot all-reduce over symmetric memory is set up for CUDA ranks only: a CPU rank
    keeps gloo (its all-reduce is the one the tests above exercise), with nothing registered."""
    from specdec.parallel import tp

    assert tp.enable_symmetric_memory(tp.Shard(0, 2, "cpu"), torch.bfloat16) is False
    assert "cpu" not in tp._SYMM
