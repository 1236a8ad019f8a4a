"""MTP drafter directories (``--draft mtp:PATH``): a head saved with ``save_mtp_dir`` for a
Llama-family (or Qwen3.5) target drafts losslessly, greedy token for token (eager and static
proposals) and sampled in distribution; bad directories end in one line naming the file and the
tensor or field."""

from __future__ import annotations

import json
import os

import pytest
import torch

import specdec.engine.generate as engine_generate
from _engine_util import build_llama, check_accept_accounting, plain_generate, pooled_chi2, resample_from_p_broken
from specdec import LLM
from specdec.cli import main
from specdec.drafters.factory import check_spec
from specdec.drafters.mtp_dir import load_mtp_dir, mtp_config, new_mtp_block, save_mtp_dir
from specdec.engine import SpeculativeGenerator
from specdec.errors import CheckpointError, ConfigError
from specdec.loading import load_model
from specdec.sampling import SamplingParams, probs_from_logits
from specdec.weights.safetensors_io import SafetensorsSource

NEW = 40
VOCAB = 16

pytestmark = pytest.mark.usefixtures("single_thread")


def _build_qwen3(path) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(5)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         max_position_embeddings=512, tie_word_embeddings=False))
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # peaky logits: random heads then agree with the target at times
    model.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    """kind -> (target path, head directory): a tiny random target and a random head saved for it."""
    out = {}
    for kind in ("llama", "qwen3"):
        root = tmp_path_factory.mktemp(f"mtpdir_{kind}")
        if kind == "llama":
            path = build_llama(root / "target", vocab=VOCAB, hidden=32, layers=2, seed=3, head_scale=4.0)
        else:
            path = _build_qwen3(root / "target")
        target = load_model(path, "cpu", tokenizer=False).model
        block = new_mtp_block(target, init_from_layer=-1, generator=torch.Generator().manual_seed(6))
        save_mtp_dir(block, target, str(root / "head"), steps=4, dtype=None)
        out[kind] = (path, str(root / "head"))
    return out


def _prompt(n: int, seed: int, vocab: int = VOCAB) -> list[int]:
    return torch.randint(vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# --- lossless -------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("static", [False, True])
def test_greedy_lossless(heads, kind, static):
    """``LLM(path, draft="mtp:DIR")`` gives plain greedy output at K = 1..4; ``static`` runs the
    greedy proposals as the static step CUDA captures (eagerly here)."""
    path, head = heads[kind]
    lm = LLM(path, draft=f"mtp:{head}", num_draft_tokens=2, device="cpu")
    lm.drafter.static_steps = static
    accepted = 0
    for k, n in ((1, 7), (2, 1), (3, 12), (4, 5)):
        prompt = _prompt(n, n)
        want = plain_generate(lm.model, prompt, NEW).token_ids
        res = SpeculativeGenerator(lm.model, lm.drafter, k).generate(prompt, NEW, trace=True)
        assert res.token_ids == want, f"{kind}, K={k}, prompt of {n}: mtp:PATH output differs from plain greedy"
        check_accept_accounting(prompt, prompt + want, res)
        accepted += sum(res.stats.accepted)
    assert accepted > 0, "no draft was ever accepted: the accept path went untested"


@pytest.mark.parametrize("static", [False, True])
def test_a_reused_drafter_drafts_as_a_fresh_one(heads, static):
    """The drafter keeps its KV cache (and with it the captured propose) from one generation to the
    next: rows of the earlier reply left past the new length are masked, never read. The second
    generation's drafts equal those of a fresh drafter, step for step."""
    path, head = heads["llama"]
    lm, fresh = (LLM(path, draft=f"mtp:{head}", device="cpu") for _ in range(2))
    for d in (lm.drafter, fresh.drafter):
        d.static_steps = static
    SpeculativeGenerator(lm.model, lm.drafter, 3).generate(_prompt(30, 1), 60)  # fills ~90 cache rows
    cache, steps = lm.drafter.cache, dict(lm.drafter._static)
    prompt = _prompt(4, 2)
    a = SpeculativeGenerator(lm.model, lm.drafter, 3).generate(prompt, 20, trace=True)
    b = SpeculativeGenerator(fresh.model, fresh.drafter, 3).generate(prompt, 20, trace=True)
    assert a.stats.trace == b.stats.trace and a.token_ids == b.token_ids
    assert lm.drafter.cache is cache  # kept: no new cache, no new capture
    assert all(lm.drafter._static.get(k) is v for k, v in steps.items())


def test_llm_generate_api(heads):
    path, head = heads["llama"]
    lm = LLM(path, draft=f"mtp:{head}", num_draft_tokens=3, device="cpu")
    prompt = _prompt(9, 2)
    res = lm.generate(prompt, max_new_tokens=20)
    assert res.token_ids == plain_generate(lm.model, prompt, 20).token_ids and res.stats.drafted > 0


def test_qwen35_target(tmp_path):
    """A trained head for a Qwen3.5 target uses the zero-centred Qwen3.5 block, same format."""
    from _mtp_util import build_qwen35

    path = build_qwen35(tmp_path / "q35", moe=False, mtp=False, seed=2)
    target = load_model(path, "cpu", tokenizer=False).model
    save_mtp_dir(new_mtp_block(target, init_from_layer=2), target, str(tmp_path / "head"), steps=2)
    lm = LLM(path, draft=f"mtp:{tmp_path / 'head'}", num_draft_tokens=3, device="cpu")
    assert lm.drafter.block.norm.zero_centered
    prompt = _prompt(6, 1, target.config.vocab_size)
    assert lm.generate(prompt, max_new_tokens=12).token_ids == plain_generate(target, prompt, 12).token_ids


# --- sampling ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    v = 6
    root = tmp_path_factory.mktemp("mtpdir_v6")
    loaded = load_model(build_llama(root / "t", vocab=v, hidden=32, layers=2, seed=2, head_scale=6.0), "cpu",
                        tokenizer=False)
    block = new_mtp_block(loaded.model, init_from_layer=1, generator=torch.Generator().manual_seed(1))
    save_mtp_dir(block, loaded.model, str(root / "head"), dtype=None)
    return loaded, str(root / "head"), v


def _joint(model, drafter, prompt, params, n: int, v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts of the 2nd and 3rd sampled tokens (one verify step with k = 2) and their exact joint."""
    counts = torch.zeros(v, v)
    eng = SpeculativeGenerator(model, drafter, 2)
    for seed in range(n):
        toks = eng.generate(prompt, 3, SamplingParams(temperature=params.temperature, top_k=params.top_k,
                                                      seed=seed)).token_ids
        counts[toks[1], toks[2]] += 1

    def nxt(seq):
        return probs_from_logits(model(torch.tensor(seq), model.new_cache(len(seq)), logits="last").logits[-1], params)

    exact = torch.zeros(v, v, dtype=torch.float64)
    p1 = nxt(prompt)
    for x1 in range(v):
        if p1[x1] > 0:
            p2 = nxt(prompt + [x1])
            for x2 in range(v):
                if p2[x2] > 0:
                    exact[x2] += p1[x1] * p2[x2] * nxt(prompt + [x1, x2]).double()
    return counts, exact


@pytest.mark.parametrize("broken", [False, True])
def test_sampling_follows_target(small_vocab, broken, monkeypatch):
    """Sampled drafts (with their probabilities): the chi-square p-value of the joint of tokens
    2-3 stays above 1e-3; a wrong residual rule fails the same check (the test has power)."""
    loaded, head, v = small_vocab
    if broken:
        monkeypatch.setattr(engine_generate, "accept_sampled", resample_from_p_broken)
    params = SamplingParams(temperature=0.9, top_k=5)
    counts, exact = _joint(loaded.model, load_mtp_dir(head, loaded), [1, 4, 2], params, 500, v)
    stat, df, pval = pooled_chi2(counts, exact)
    if broken:
        assert pval < 1e-6, f"the broken rule went unnoticed (p={pval:.2e})"
    else:
        assert pval > 1e-3, f"chi2={stat:.1f} df={df} p={pval:.2e}"


# --- the directory format ---------------------------------------------------------------------------

def test_round_trip_sharded(heads, tmp_path):
    """Saved tensors come back exactly, from one file or from shards with an index; the config
    records what fits the target."""
    path, _ = heads["qwen3"]
    target = load_model(path, "cpu", tokenizer=False).model
    block = new_mtp_block(target, generator=torch.Generator().manual_seed(0))
    save_mtp_dir(block, target, str(tmp_path / "h"), steps=3, dtype=None, max_shard_bytes=8192,
                 extra_files={"NOTE.md": "random\n"})
    assert os.path.exists(tmp_path / "h" / "model.safetensors.index.json")
    with open(tmp_path / "h" / "config.json") as fh:
        cfg = json.load(fh)
    assert cfg == json.loads(json.dumps(mtp_config(target, 3)))
    assert cfg["target_model_type"] == "qwen3" and cfg["num_draft_steps_trained"] == 3
    loaded = load_mtp_dir(str(tmp_path / "h"), target)
    for name, t in block.state_dict().items():
        assert torch.equal(loaded.block.state_dict()[name], t), name
    assert not block.norm.zero_centered and block.layers[0].self_attn.q_norm is not None


def test_init_from_layer(heads):
    target = load_model(heads["llama"][0], "cpu", tokenizer=False).model
    block = new_mtp_block(target, init_from_layer=1)
    for name, t in target.layers[1].state_dict().items():
        assert torch.equal(block.layers[0].state_dict()[name], t), name
    with pytest.raises(ConfigError, match=r"init_from_layer=2 is not a layer of the target \(-2\.\.1\)"):
        new_mtp_block(target, init_from_layer=2)


def _copy_head(heads, tmp_path, kind="llama") -> str:
    import shutil
    dst = str(tmp_path / "bad")
    shutil.copytree(heads[kind][1], dst)
    return dst


def _edit_tensors(path: str, fn) -> None:
    from safetensors.torch import save_file
    src = SafetensorsSource(path)
    t = {n: src.get(n, torch.float32) for n in src.infos()}
    fn(t)
    save_file(t, os.path.join(path, "model.safetensors"))


def _edit_config(path: str, **fields) -> None:
    p = os.path.join(path, "config.json")
    with open(p) as fh:
        d = json.load(fh)
    d.update(fields)
    for k in [k for k, v in fields.items() if v is None]:
        del d[k]
    with open(p, "w") as fh:
        json.dump(d, fh)


def _one_line_error(exc, path, *parts):
    msg = str(exc.value)
    assert "\n" not in msg and path in msg, msg
    for p in parts:
        assert p in msg, msg


@pytest.mark.parametrize("case", ["missing", "shape", "unexpected", "integer"])
def test_bad_tensors_are_named(heads, tmp_path, case):
    path = _copy_head(heads, tmp_path)

    def edit(t):
        if case == "missing":
            del t["layers.0.mlp.up_proj.weight"]
        elif case == "shape":
            t["fc.weight"] = t["fc.weight"][:, :-1].contiguous()
        elif case == "unexpected":
            t["layers.1.mlp.up_proj.weight"] = torch.zeros(2, 2)
        else:
            t["norm.weight"] = t["norm.weight"].long()
    _edit_tensors(path, edit)
    loaded = load_model(heads["llama"][0], "cpu", tokenizer=False)
    with pytest.raises(CheckpointError) as e:
        load_mtp_dir(path, loaded)
    name = {"missing": "layers.0.mlp.up_proj.weight", "shape": "fc.weight", "unexpected": "layers.1.mlp.up_proj.weight",
            "integer": "norm.weight"}[case]
    _one_line_error(e, path, name)


@pytest.mark.parametrize("field, value", [("hidden_size", 64), ("vocab_size", 999), ("num_target_layers", 7),
                                          ("target_model_type", "qwen3"), ("model_type", "llama"),
                                          ("num_key_value_heads", None), ("num_draft_steps_trained", "four")])
def test_head_for_another_target_is_refused(heads, tmp_path, field, value):
    path = _copy_head(heads, tmp_path)
    _edit_config(path, **{field: value})
    with pytest.raises(ConfigError) as e:
        LLM(heads["llama"][0], draft=f"mtp:{path}", device="cpu")
    _one_line_error(e, os.path.join(path, "config.json"), f"'{field}'")


def test_qwen3_head_on_llama_target(heads):
    """Same width and vocabulary, another kind of layer (q/k norms): refused by the config."""
    with pytest.raises(ConfigError) as e:
        load_mtp_dir(heads["qwen3"][1], load_model(heads["llama"][0], "cpu", tokenizer=False))
    _one_line_error(e, "config.json", "'target_model_type'='qwen3'", "'llama'")


def test_missing_config_and_directory(heads, tmp_path):
    path = _copy_head(heads, tmp_path)
    os.remove(os.path.join(path, "config.json"))
    loaded = load_model(heads["llama"][0], "cpu", tokenizer=False)
    with pytest.raises(ConfigError) as e:
        load_mtp_dir(path, loaded)
    _one_line_error(e, os.path.join(path, "config.json"), "file not found")
    with pytest.raises(CheckpointError) as e:
        load_mtp_dir(str(tmp_path / "nowhere"), loaded)
    _one_line_error(e, str(tmp_path / "nowhere"), "directory")


def test_spec_and_cli(capsys):
    check_spec("mtp:/some/dir")
    with pytest.raises(ConfigError, match="mtp:PATH"):
        check_spec("mtp:  ")
    with pytest.raises(ConfigError, match="block_size applies to DFlash drafters only, not 'mtp:/d'"):
        check_spec("mtp:/d", block_size=4)
    rc = main(["generate", "-m", "/nonexistent/model.gguf", "-p", "x", "--draft", "mtp:"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("specdec generate: error: ") and err.count("\n") == 1, err
    assert "draft 'mtp:' needs a path: mtp:PATH" in err and "/nonexistent" not in err, err


def test_gemma3_target_is_refused(heads, tmp_path):
    """Gemma 3 has no MTP head format yet: one line naming the target and the families that fit; ``fits`` (what bench
    --shape and ab_flags ask before timing an MTP block) says no there and yes for the families that fit."""
    from _gemma_util import tiny_model as gemma_model
    from _mtp_util import build_qwen35
    from specdec.drafters.mtp_dir import fits

    path = str(tmp_path / "gemma")
    gemma_model().save_pretrained(path)
    assert not fits(load_model(path, "cpu", tokenizer=False).model)
    for kind in ("llama", "qwen3"):
        assert fits(load_model(heads[kind][0], "cpu", tokenizer=False).model)
    for moe in (False, True):
        q35 = build_qwen35(tmp_path / f"q35_{moe}", moe=moe, mtp=False, seed=2)
        assert fits(load_model(q35, "cpu", tokenizer=False).model)
    with pytest.raises(ConfigError) as e:
        LLM(path, draft=f"mtp:{heads['llama'][1]}", device="cpu")
    _one_line_error(e, path, "llama, qwen3, qwen3_5, qwen3_5_moe", "gemma3")


def test_info_describes_a_head(heads, capsys):
    rc = main(["info", heads["qwen3"][1], "--json"])
    d = json.loads(capsys.readouterr().out)
    assert rc == 0 and d["kind"] == "MTP drafter (use as --draft mtp:PATH)", d
    assert d["target_model_type"] == "qwen3" and d["num_draft_steps_trained"] == 4 and d["tensors"] == 15, d
