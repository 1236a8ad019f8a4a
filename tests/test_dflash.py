"""The DFlash drafter: strict checkpoint loading, fit to the target, parity with an independent
reference, and lossless decoding (greedy token for token; sampling in distribution).

Targets are tiny random models saved with transformers (Llama, Qwen3 and, once
``specdec.models.qwen35`` is registered, a Qwen3.5 hybrid); drafters are random z-lab style
checkpoints written by ``_dflash_util``.
"""

from __future__ import annotations

import re

import pytest
import torch

import specdec.engine.generate as engine_generate
from _dflash_util import Steered, drafter_tensors, reference_block_logits, write_drafter
from _engine_util import build_llama, plain_generate, pooled_chi2, split_kernel_stand_in
from specdec import env
from specdec.drafters import dflash
from specdec.drafters.dflash import confident_prefix, load_dflash_drafter
from specdec.drafters.dflash_model import DFlashConfig, default_target_layer_ids
from specdec.engine import SpeculativeGenerator
from specdec.errors import CheckpointError, ConfigError
from specdec.loading import load_model
from specdec.sampling import SamplingParams, probs_from_logits

NEW = 64
HIDDEN, LAYERS, VOCAB = 32, 6, 64


pytestmark = pytest.mark.usefixtures("single_thread", "whole_blocks")


@pytest.fixture
def whole_blocks(monkeypatch):
    """CPU blocks uncut (dflash.CPU_MIN_CONFIDENCE and CPU_MIN_SAMPLED_CONFIDENCE 0): these tests drive whole
    blocks, most with random drafters whose probabilities are all low; the cut itself is tested in
    test_cpu_blocks_cut_lossless and test_sampling_with_cut_blocks_follows_target_distribution."""
    monkeypatch.setattr(dflash, "CPU_MIN_CONFIDENCE", 0.0)
    monkeypatch.setattr(dflash, "CPU_MIN_SAMPLED_CONFIDENCE", 0.0)



def _build(kind: str, path: str):
    """Save a tiny random target of family ``kind``; return the transformers model (fp32, eval)."""
    if kind == "llama":
        from transformers import LlamaForCausalLM
        build_llama(path, vocab=VOCAB, hidden=HIDDEN, layers=LAYERS, seed=3)
        return LlamaForCausalLM.from_pretrained(path).eval()
    if kind == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM
        torch.manual_seed(4)
        model = Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64,
                                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                             head_dim=8, max_position_embeddings=512))
    else:
        from _qwen35_util import hf_model
        model = hf_model("dense", seed=4)  # Gated DeltaNet + gated full attention, random norms
    model.save_pretrained(path)
    return model.eval()


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """``get(kind) -> (path, LoadedModel, transformers model)``, each family built once per module."""
    built: dict = {}

    def get(kind: str):
        if kind not in built:
            path = str(tmp_path_factory.mktemp(kind))
            hf = _build(kind, path)
            built[kind] = (path, load_model(path, "cpu", tokenizer=False), hf)
        return built[kind]
    return get


@pytest.fixture(scope="module")
def llama(targets):
    return targets("llama")[:2]


def _write(tmp_path, name="d", **kw):
    kw.setdefault("hidden", HIDDEN)
    kw.setdefault("num_target_layers", LAYERS)
    kw.setdefault("mask_token_id", VOCAB - 1)
    return write_drafter(tmp_path / name, **kw)


def _prompt(n: int, vocab: int = VOCAB, seed: int = 0) -> list[int]:
    return torch.randint(vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# --- manifest and config ---------------------------------------------------------------------------------

def _bad_manifest(kind: str, sd: dict) -> tuple[dict, str]:
    sd = dict(sd)
    if kind == "missing":
        del sd["layers.1.mlp.up_proj.weight"]
        return sd, "layers.1.mlp.up_proj.weight"
    if kind == "extra":
        sd["lm_head.weight"] = torch.zeros(VOCAB, HIDDEN)
        return sd, "lm_head.weight"
    if kind == "shape":
        sd["layers.0.self_attn.k_proj.weight"] = torch.zeros(8, HIDDEN)
        return sd, "layers.0.self_attn.k_proj.weight"
    if kind == "fc_shape":  # fc must read len(target_layer_ids) * hidden features
        sd["fc.weight"] = torch.zeros(HIDDEN, 3 * HIDDEN)
        return sd, "fc.weight"
    if kind == "int_dtype":
        sd["layers.0.self_attn.k_norm.weight"] = torch.ones(8, dtype=torch.int32)
        return sd, "layers.0.self_attn.k_norm.weight"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["missing", "extra", "shape", "fc_shape", "int_dtype"])
def test_bad_manifest_names_the_tensor(tmp_path, llama, kind):
    sd, name = _bad_manifest(kind, drafter_tensors(HIDDEN, 2, 2))
    path, _ = _write(tmp_path, tensors=sd)
    with pytest.raises(CheckpointError, match=re.escape(name)):
        load_dflash_drafter(path, llama[1])


def test_truncated_file_names_a_tensor(tmp_path, llama):
    sd = drafter_tensors(HIDDEN, 2, 2)
    path, _ = _write(tmp_path, tensors=sd)
    f = tmp_path / "d" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-64])
    with pytest.raises(CheckpointError, match="truncated") as e:
        load_dflash_drafter(path, llama[1])
    named = re.search(r"tensor '([^']+)'", str(e.value))
    assert named and named.group(1) in sd, str(e.value)


def test_good_checkpoint_loads_and_accounts_bytes(tmp_path, llama):
    sd = drafter_tensors(HIDDEN, 2, 2)
    path, _ = _write(tmp_path, tensors=sd)
    dr = load_dflash_drafter(path, llama[1])
    assert dr.capture_layers == (1, 2) and dr.block_size == 8
    weights = sum(t.numel() * 4 for t in sd.values())
    assert dr.weight_bytes() == weights and dr.resident_bytes() == weights  # no cache before begin
    state = dr.model.state_dict()
    assert set(state) == set(sd) and all(torch.equal(state[n], sd[n]) for n in sd)
    SpeculativeGenerator(llama[1].model, dr, 7).generate(_prompt(5), 4)
    info = dr.info()
    assert info["cache_bytes"] > 0 and info["resident_bytes"] == weights + info["cache_bytes"]
    assert info["target_layer_ids"] == [1, 2] and info["drafts_per_step"] == 7


def test_norm_weights_are_converted_not_reinterpreted(tmp_path, llama):
    """A bf16 checkpoint: every norm weight equals its stored bf16 value, in fp32 and in bf16 runs."""
    sd = drafter_tensors(HIDDEN, 2, 2, seed=5)
    path, _ = _write(tmp_path, tensors=sd, dtype=torch.bfloat16)
    stored = {n: t.to(torch.bfloat16) for n, t in sd.items()}
    norms = [n for n in sd if n.endswith("norm.weight")]
    assert len(norms) == 2 + 4 * 2
    fp32 = load_dflash_drafter(path, llama[1]).model.state_dict()
    target_bf16 = load_model(llama[0], "cpu", "bfloat16", tokenizer=False)
    bf16 = load_dflash_drafter(path, target_bf16).model.state_dict()
    for n in sd:
        assert fp32[n].dtype == torch.float32 and torch.equal(fp32[n], stored[n].float()), n
        assert bf16[n].dtype == torch.bfloat16 and torch.equal(bf16[n], stored[n]), n
    # and a bf16 run stays lossless
    prompt = _prompt(6)
    res = SpeculativeGenerator(target_bf16.model, load_dflash_drafter(path, target_bf16), 7).generate(prompt, 16)
    assert res.token_ids == plain_generate(target_bf16.model, prompt, 16).token_ids


@pytest.mark.parametrize("bad", ["hidden", "layer_count", "layer_id", "mask_token"])
def test_drafter_for_another_target_is_rejected(tmp_path, llama, bad):
    kw, field = {
        "hidden": ({"hidden": 48}, "hidden_size"),
        "layer_count": ({"num_target_layers": LAYERS + 1}, "num_target_layers"),
        "layer_id": ({"target_layer_ids": (1, LAYERS)}, "target_layer_ids"),
        "mask_token": ({"mask_token_id": VOCAB}, "mask_token_id"),
    }[bad]
    path, _ = _write(tmp_path, **kw)
    with pytest.raises(ConfigError, match=field):
        load_dflash_drafter(path, llama[1])


@pytest.mark.parametrize("cfg, field", [
    ({"architectures": ["DFlash2DraftModel"]}, "DFlash2"),
    ({"layer_types": ["full_attention", "sliding_attention"], "sliding_window": None}, "sliding_window"),
    ({"rope_parameters": None}, "rope_theta"),
    ({"attention_bias": True}, "attention_bias"),
    ({"block_size": 1}, "block_size"),
    ({"rope_parameters": {"rope_theta": 1e4, "rope_type": "yarn", "factor": 4.0}}, "config.json: rope_type 'yarn'"),
    ({"dflash_config": {"mask_token_id": 0, "target_layer_ids": [1, 2], "use_swa": True}}, "use_swa"),
])
def test_unsupported_config_is_refused(tmp_path, llama, cfg, field):
    path, _ = _write(tmp_path, config=cfg)
    with pytest.raises(ConfigError, match=field):
        load_dflash_drafter(path, llama[1])


def test_published_config_layouts():
    """Field layouts of published checkpoints: DFlash fields under ``dflash_config`` with
    ``block_size`` and ``rope_theta`` at the top (z-lab Qwen3 drafters), or all at the top with
    ``rope_parameters`` and sliding layers; unrelated fields are ignored."""
    common = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "attention_bias": False,
              "attention_dropout": 0.0, "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "bos_token_id": 151643,
              "dtype": "bfloat16", "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2560,
              "initializer_range": 0.02, "intermediate_size": 9728, "max_position_embeddings": 40960,
              "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "vocab_size": 151936}
    a = DFlashConfig.from_dict(dict(common, block_size=16, num_hidden_layers=5, num_target_layers=36,
                                    dflash_config={"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
                                    layer_types=["full_attention"] * 5, max_window_layers=5, rope_scaling=None,
                                    rope_theta=1000000, sliding_window=None, use_sliding_window=False,
                                    tie_word_embeddings=True))
    assert (a.block_size, a.mask_token_id, a.target_layer_ids, a.rope_theta) == (16, 151669, (1, 9, 17, 25, 33), 1e6)
    assert a.windows == (None,) * 5 and a.causal == (False,) * 5 and a.num_key_value_heads == 8
    b = DFlashConfig.from_dict(dict(common, block_size=16, mask_token_id=7, num_hidden_layers=2,
                                    target_layer_ids=[1, 13], sliding_window=2048,
                                    layer_types=["sliding_attention", "full_attention"],
                                    rope_parameters={"rope_theta": 500000.0, "rope_type": "default"}))
    assert b.target_layer_ids == (1, 13) and b.rope_theta == 5e5 and b.mask_token_id == 7
    assert b.windows == (2048, None) and b.causal == (True, False)
    c = DFlashConfig.from_dict(dict(common, block_size=8, num_hidden_layers=2, num_target_layers=36, is_causal=True,
                                    dflash_config={"mask_token_id": 3}, rope_theta=1e6))
    assert c.target_layer_ids == (1, 33) and c.target_layer_ids_default and c.causal == (True, True)


def test_runtime_block_size(tmp_path, llama):
    path, _ = _write(tmp_path, block_size=8)
    assert load_dflash_drafter(path, llama[1], block_size=4).block_size == 4
    for bad in (1, 9):
        with pytest.raises(ConfigError, match="block_size"):
            load_dflash_drafter(path, llama[1], block_size=bad)
    from specdec.api import LLM
    assert LLM(llama[0], draft=f"dflash:{path}", device="cpu").engine.k == 7
    assert LLM(llama[0], draft=f"dflash:{path}", device="cpu", block_size=3).engine.k == 2


def test_static_block_rebuilt_when_context_buffers_are_reallocated(tmp_path, llama, monkeypatch):
    """The greedy static block (a CUDA graph on CUDA, compiled with --compile) is reused while the
    drafter's context buffers stay the same, also by the next request whose context fits them (its
    stale positions are masked), and rebuilt when they are reallocated (a longer prompt, a cache
    growth), even when
    the new buffers' ``id()`` values equal the old ones' (CPython reuses the ids of freed objects;
    a graph replayed over freed buffers reads freed memory). On the CPU the step runs uncaptured."""
    import specdec.drafters.dflash as dflash

    monkeypatch.setattr(dflash, "id", lambda obj: 0, raising=False)  # every id collides
    path, _ = _write(tmp_path, block_size=4)
    dr = load_dflash_drafter(path, llama[1])
    dr.static_steps = True
    dr.min_capacity = 256  # below the tiny target's 512 positions, so that the buffers can grow here
    steps, propose = [], dr.propose

    def spy(last_token, k, params, gen):
        eager = dr.block_logits(last_token)[:k]
        prop = propose(last_token, k, params, gen)
        assert dr._static.reads(dr.kv), "the static block reads buffers the drafter no longer uses"
        top2 = eager.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 1e-4  # where the argmax is well defined
        assert torch.equal(prop.tokens[clear], eager.argmax(-1)[clear])
        steps.append(dr._static)
        return prop

    dr.propose = spy
    gen = SpeculativeGenerator(llama[1].model, dr, 3)

    def run(prompt, new):
        steps.clear()
        gen.generate(prompt, new)
        return list(dict.fromkeys(steps))  # the distinct static blocks, in order of use

    plain = SpeculativeGenerator(llama[1].model, None, 0)
    first = run(_prompt(5), 12)
    assert len(first) == 1 and len(steps) > 2  # built once, then reused every step
    second = run(_prompt(6, seed=1), 12)
    assert second == first  # the next request fits the same buffers: no rebuild (no new graph or compile)
    assert gen.generate(_prompt(6, seed=1), 12).token_ids == plain.generate(_prompt(6, seed=1), 12).token_ids
    cap = dr.kv[0].k.shape[1]
    grown = run(_prompt(5, seed=2), cap)  # runs past the context capacity: the buffers grow
    assert dr.kv[0].k.shape[1] > cap and len(grown) == 2 and grown[0] is first[0]
    longer = run(_prompt(cap + 44, seed=3), 4)  # a prompt beyond the grown buffers' bucket: new buffers
    assert len(longer) == 1 and longer[0] is not grown[1] and dr.kv[0].k.shape[1] > 2 * cap
    assert run(_prompt(5, seed=4), 4) == longer  # buffers never shrink: a short request after it reuses them


def test_observe_defers_context_writes(tmp_path, llama, monkeypatch):
    """``observe`` only keeps the committed rows' captured features; the next proposal writes
    all pending rows' context K/V at once (a serving step with k = 0 costs the drafter no
    forward). The context then holds what writing after every observe holds, and the block's
    logits agree."""
    from specdec.models.base import ForwardOut

    path, _ = _write(tmp_path, block_size=4)
    model = llama[1].model
    base = load_dflash_drafter(path, llama[1])
    ids = torch.tensor(_prompt(20, seed=5))
    cache = model.new_cache(64)
    out = model.forward(ids, cache, capture=base.capture_layers)
    rows = [ForwardOut(out.logits[a:b], out.hidden[a:b], out.captured[a:b])
            for a, b in ((0, 8), (8, 11), (11, 12), (12, 20))]
    each, deferred = base.spawn(), base.spawn()
    for d in (each, deferred):
        d.begin(ids[:8], rows[0])
    calls = []
    orig = type(base.model).context_kv
    monkeypatch.setattr(type(base.model), "context_kv", lambda self, f, p: calls.append(f.shape[0]) or orig(self, f, p))
    for r in rows[1:]:
        each.observe(ids[:r.hidden.shape[0]], r)
        each.block_logits(0)
    assert calls == [3, 1, 8]
    calls.clear()
    for r in rows[1:]:
        deferred.observe(ids[:r.hidden.shape[0]], r)
    assert calls == [] and deferred.length == 20 and deferred._written == 8
    got = deferred.block_logits(0)
    assert calls == [12] and deferred._written == 20
    torch.testing.assert_close(got, each.block_logits(0), rtol=1e-5, atol=1e-5)
    with torch.inference_mode():  # the context of all 20 positions, computed in one go
        ref = orig(base.model, out.captured, torch.arange(20))
    for (k, v), a, b in zip(ref, each.kv, deferred.kv):
        for d in (a, b):
            torch.testing.assert_close(d.k[:, :20], k, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(d.v[:, :20], v, rtol=1e-5, atol=1e-5)


def test_static_flush_writes_what_the_eager_flush_writes(tmp_path, llama, monkeypatch):
    """The context write as a static step (``block_size`` rows, padded with stale ones, at a device
    start position; uncaptured on the CPU): a generation runs it at every proposal after the prompt,
    its drafter context holds what the eager writes hold at every written position, and the output
    still equals plain decoding's. A prompt or rows piling up past the block, or a context too
    close to its buffers' end, takes the eager write."""
    import specdec.drafters.dflash as dflash

    path, _ = _write(tmp_path, block_size=4)
    target = llama[1]
    prompt = _prompt(9, seed=3)
    want = plain_generate(target.model, prompt, 24)
    runs, calls = {}, []
    orig = dflash._StaticFlush.__call__
    monkeypatch.setattr(dflash._StaticFlush, "__call__", lambda self, f, start: calls.append((f.shape[0], start)) or orig(self, f, start))
    for static in (False, True):
        dr = load_dflash_drafter(path, target)
        dr.static_steps, dr.static_flush = True, static
        out = SpeculativeGenerator(target.model, dr, 3).generate(prompt, 24, SamplingParams())
        assert out.token_ids == want.token_ids
        runs[static] = (dr._written, [(s.k[:, :dr._written].clone(), s.v[:, :dr._written].clone()) for s in dr.kv])
    assert runs[True][0] == runs[False][0]
    assert len(calls) > 5 and all(1 <= n <= 4 for n, _ in calls)  # every proposal's rows: 1 .. k + 1
    assert calls[0][1] == len(prompt)  # the prompt itself went the eager way
    for (k0, v0), (k1, v1) in zip(runs[False][1], runs[True][1]):
        torch.testing.assert_close(k1, k0, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v1, v0, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("in_step", [True, False])
def test_static_block_samples_from_the_eager_distributions(tmp_path, llama, monkeypatch, in_step):
    """Sampled proposals with static steps come from the static block (the greedy one built once, a
    sampled one per set of sampling params, each reused while its params last) and carry the eager
    block's filtered distributions. ``in_step`` (STATIC_SAMPLING, on by default): the drafts are drawn
    inside the step, by inverse CDF from uniforms the request's generator gave the step; off, the step
    returns its logits and torch.multinomial draws outside it."""
    from specdec.drafters import dflash as dflash_mod
    from specdec.sampling import sample_inverse_cdf
    monkeypatch.setattr(dflash_mod, "STATIC_SAMPLING", in_step)
    path, _ = _write(tmp_path, block_size=5)
    dr = load_dflash_drafter(path, llama[1])
    dr.static_steps = True
    propose, seen = dr.propose, []

    def spy(last_token, k, params, gen):
        eager = dr.block_logits(last_token)[:k]
        before = gen.get_state() if gen is not None else None
        prop = propose(last_token, k, params, gen)
        if params.greedy:
            assert prop.probs is None
        else:
            assert torch.allclose(prop.probs, probs_from_logits(eager, params), atol=1e-5)
            assert bool((prop.probs.gather(1, prop.tokens[:, None]) > 0).all())  # drawn from those probs
            if in_step:  # the block's uniforms came from the generator: 4 of them, one a row
                u = torch.rand(4, generator=torch.Generator().set_state(before))
                assert torch.equal(dr._sampled.u, u) and torch.equal(prop.tokens, sample_inverse_cdf(prop.probs, u[:k]))
        seen.append((dr._static, dr._sampled))
        return prop

    dr.propose = spy
    gen = SpeculativeGenerator(llama[1].model, dr, 4)
    a, b = SamplingParams(temperature=0.8, top_p=0.9, seed=1), SamplingParams(temperature=1.3, top_k=7, seed=2)
    for params in (a, SamplingParams(), a, b):
        gen.generate(_prompt(7), 12, params)
    greedy = {id(g) for g, _ in seen if g is not None}
    sampled = {id(s) for _, s in seen if s is not None}
    # each built once, then reused (``seen`` keeps them alive); in the step, other params build another
    assert len(greedy) == 1 and len(sampled) == (2 if in_step else 1)


def test_default_target_layer_ids():
    # published z-lab configs: Qwen3-8B (36 layers, 5 drafter layers), Qwen3.5-122B-A10B (48, 8)
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(48, 8) == [1, 7, 14, 20, 26, 32, 39, 45]
    assert default_target_layer_ids(28, 1) == [14] and default_target_layer_ids(5, 1) == [2]
    assert default_target_layer_ids(9, 5) == [1, 2, 4, 5, 6]  # 3.5 rounds half to even, like Python round
    for n_target in (8, 24, 40, 64):
        for n_draft in (2, 3, 5):
            ids = default_target_layer_ids(n_target, n_draft)
            assert ids[0] == 1 and ids[-1] == n_target - 3 and ids == sorted(ids)
            step = (n_target - 4) / (n_draft - 1)
            assert all(abs(ids[i] - (1 + i * step)) <= 0.5 for i in range(n_draft))


def test_default_ids_used_when_config_has_none(tmp_path, llama):
    path, _ = _write(tmp_path, n_layers=3, target_layer_ids=None)
    dr = load_dflash_drafter(path, llama[1])
    assert dr.capture_layers == tuple(default_target_layer_ids(LAYERS, 3)) == (1, 2, 3)
    assert dr.info()["target_layer_ids_default"] is True


# --- parity with the independent reference -------------------------------------------------------------

@pytest.mark.parametrize("kind", ["llama", "qwen35"])
def test_block_logits_match_reference(tmp_path, targets, kind):
    """Over several steps with partial acceptance (so the cache append path sees 1..B rows), the
    drafter's block logits equal a from-scratch recompute on transformers' hidden states. The
    first layer is sliding (causal, window 5 < context; first so that every block row it
    outputs matters), the second full attention (bidirectional)."""
    _, loaded, hf = targets(kind)
    model, c = loaded.model, loaded.model.config
    n = len(model.layers)
    ids = (n - 2, 1)  # out of order on purpose: features concatenate in target_layer_ids order
    path, cfg = write_drafter(tmp_path / "d", hidden=c.hidden_size, num_target_layers=n, target_layer_ids=ids,
                              block_size=4, mask_token_id=c.vocab_size - 1, sliding_window=5, seed=11,
                              layer_types=["sliding_attention", "full_attention"])
    sd = drafter_tensors(c.hidden_size, 2, 2, seed=11)
    prompt = _prompt(7, c.vocab_size, seed=1)
    ref = prompt + plain_generate(model, prompt, 30).token_ids
    spy = Steered(load_dflash_drafter(path, loaded), reference=ref, corrupt=0.35, vocab=c.vocab_size, record=True,
                  seed=2)
    res = SpeculativeGenerator(model, spy, 3).generate(prompt, 24)
    assert res.token_ids == ref[len(prompt):len(prompt) + 24]
    assert len(set(res.stats.accepted)) >= 3, res.stats.accepted  # several different acceptance lengths
    assert max(len(h) for h, _, _ in spy.records) > 5 + 4  # context longer than the window
    for committed, last, got in spy.records:
        want = reference_block_logits(hf, sd, cfg, committed, last, 4)
        torch.testing.assert_close(got.double(), want, atol=2e-4, rtol=1e-4)


# --- lossless greedy -------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen35"])
def target(request, tmp_path_factory, targets):
    """(loaded target, drafter path, prompt, prompt + greedy continuation) for each family."""
    loaded = targets(request.param)[1]
    c = loaded.model.config
    n = len(loaded.model.layers)
    dpath, _ = write_drafter(tmp_path_factory.mktemp("drafter"), hidden=c.hidden_size, num_target_layers=n,
                             target_layer_ids=(1, n - 2), block_size=8, mask_token_id=c.vocab_size - 1,
                             layer_types=["full_attention", "sliding_attention"], sliding_window=16, seed=7)
    prompt = _prompt(11, c.vocab_size, seed=5)
    ref = prompt + plain_generate(loaded.model, prompt, NEW + 8).token_ids
    return loaded, dpath, prompt, ref


@pytest.mark.parametrize("block_size", [2, 5, 8])
def test_greedy_lossless_random_drafter(target, block_size):
    loaded, dpath, prompt, ref = target
    dr = load_dflash_drafter(dpath, loaded, block_size=block_size)
    spy = Steered(dr)
    res = SpeculativeGenerator(loaded.model, spy, block_size - 1).generate(prompt, NEW)
    assert res.token_ids == ref[len(prompt):len(prompt) + NEW]
    _check_cache_length(dr, spy, prompt)


def test_confident_prefix():
    sure, unsure = [9.0, 0.0, 0.0], [0.0, 0.0, 0.0]  # max probabilities ~1.0 and 1/3
    logits = torch.tensor([unsure, sure, unsure, sure])
    assert confident_prefix(logits, 0.5) == 2  # the first draft always stays; cut before the next unsure one
    assert confident_prefix(logits, 0.3) == 4 and confident_prefix(logits, 0.0) == 4
    assert confident_prefix(logits[:1], 0.9) == 1 and confident_prefix(logits[:0], 0.9) == 0
    assert confident_prefix(torch.tensor([sure, sure, sure]), 0.99) == 3


@pytest.mark.parametrize("name", ["SPECDEC_DFLASH_CPU_CONFIDENCE", "SPECDEC_DFLASH_CPU_SAMPLED_CONFIDENCE"])
@pytest.mark.parametrize("raw", ["abc", "-0.1", "1.5", "nan"])
def test_cpu_confidence_env_is_checked(raw, name, monkeypatch):
    """Checked by env.check, which the CLI runs first: a bad value fails even where no DFlash drafter is used."""
    monkeypatch.setenv(name, raw)
    with pytest.raises(ConfigError, match=f"{name}.*probability in 0..1"):
        env.check()
    monkeypatch.setenv(name, "0.25")
    assert env.probability(name) == 0.25
    monkeypatch.delenv(name)
    assert env.probability(name) == env.PROBABILITIES[name][0]


def test_cpu_blocks_cut_lossless(target, monkeypatch):
    """On the CPU a greedy block is cut before its first unconfident draft after the first: each proposal is as
    long as confident_prefix says of the block's logits, the lengths vary, and with the target's own
    continuation proposed (partly spoiled) the output is still plain decoding's."""
    loaded, dpath, prompt, ref = target
    dr = load_dflash_drafter(dpath, loaded, block_size=8)
    probe = Steered(dr, record=True)
    SpeculativeGenerator(loaded.model, probe, 7).generate(prompt, 16)
    sure = torch.cat([torch.softmax(got, -1).amax(-1)[1:] for _, _, got in probe.records])
    floor = float(sure.median())  # a floor that cuts some blocks and not others, whatever the random drafter
    monkeypatch.setattr(dflash, "CPU_MIN_CONFIDENCE", floor)
    spy = Steered(dr, reference=ref, corrupt=0.2, vocab=loaded.model.config.vocab_size, record=True, seed=4)
    res = SpeculativeGenerator(loaded.model, spy, 7).generate(prompt, NEW, trace=True)
    assert res.token_ids == ref[len(prompt):len(prompt) + NEW]
    lengths = [len(s["draft"]) for s in res.stats.trace]
    emitted, want = 1, []  # the prefill's token, then each step's accepted drafts and its own token
    for (_, _, got), acc in zip(spy.records, res.stats.accepted):
        want.append(confident_prefix(got[:min(7, NEW - emitted)], floor))  # the engine drafts no more than is left
        emitted += acc + 1
    assert lengths == want
    assert min(lengths) < 7 and len(set(lengths)) >= 2, lengths
    assert sum(res.stats.accepted) > len(lengths)  # drafts accepted, several a step on average
    _check_cache_length(dr, spy, prompt)
    # the serving loop's drafters (spawn) keep whole blocks: its controller counts acceptance per draft asked for
    whole = Steered(dr.spawn(), reference=ref, vocab=loaded.model.config.vocab_size)
    res = SpeculativeGenerator(loaded.model, whole, 7).generate(prompt, 16, trace=True)
    assert [len(s["draft"]) for s in res.stats.trace][:2] == [7, 7]


def _check_cache_length(dr, spy, prompt):
    """The drafter cached every committed position and nothing else (the last emitted token is
    in the target cache only when it was an accepted draft, not a bonus token)."""
    assert dr.length == len(spy.history) and len(prompt) + NEW - 1 <= dr.length <= len(prompt) + NEW


@pytest.mark.parametrize("block_size", [3, 8])
def test_greedy_lossless_full_acceptance(target, block_size):
    loaded, dpath, prompt, ref = target
    dr = load_dflash_drafter(dpath, loaded, block_size=block_size)
    spy = Steered(dr, reference=ref, vocab=loaded.model.config.vocab_size)
    res = SpeculativeGenerator(loaded.model, spy, block_size - 1).generate(prompt, NEW, trace=True)
    assert res.token_ids == ref[len(prompt):len(prompt) + NEW]
    assert all(s["accepted"] == len(s["draft"]) for s in res.stats.trace)
    assert res.stats.accepted[0] == block_size - 1
    _check_cache_length(dr, spy, prompt)


def test_greedy_lossless_partial_acceptance(target):
    loaded, dpath, prompt, ref = target
    dr = load_dflash_drafter(dpath, loaded, block_size=6)
    spy = Steered(dr, reference=ref, corrupt=0.3, vocab=loaded.model.config.vocab_size, seed=3)
    res = SpeculativeGenerator(loaded.model, spy, 5).generate(prompt, NEW)
    assert res.token_ids == ref[len(prompt):len(prompt) + NEW]
    assert 0 < sum(res.stats.accepted) < 5 * len(res.stats.accepted)


# --- lossless sampling -----------------------------------------------------------------------------------

# Under a correct sampler the chi-square p-value is uniform, so each check below fails for an unlucky
# seed with probability ALPHA (seeds are fixed: a given run is deterministic).
ALPHA = 1e-3


def _joint_counts(model, drafter, prompt, params, n: int, v: int) -> torch.Tensor:
    """Counts ``[V, V]`` of the 2nd and 3rd sampled tokens: both come from one verify step with
    k = 2 (accept / reject-and-resample of the drafter's sampled drafts, or the bonus token)."""
    counts = torch.zeros(v, v)
    eng = SpeculativeGenerator(model, drafter, 2)
    for seed in range(n):
        toks = eng.generate(prompt, 3, SamplingParams(temperature=params.temperature, top_k=params.top_k,
                                                      top_p=params.top_p, seed=seed)).token_ids
        counts[toks[1], toks[2]] += 1
    return counts


def _exact_joint(model, prompt, params, v: int) -> torch.Tensor:
    """p(x2, x3) = sum over x1 of p(x1) p(x2 | x1) p(x3 | x1, x2), from the target's logits."""
    def nxt(seq):
        return probs_from_logits(model(torch.tensor(seq), model.new_cache(len(seq)), logits="last").logits[-1], params)

    joint = torch.zeros(v, v, dtype=torch.float64)
    p1 = nxt(prompt)
    for x1 in range(v):
        if p1[x1] == 0:
            continue
        p2 = nxt(prompt + [x1])
        for x2 in range(v):
            if p2[x2] > 0:
                joint[x2] += p1[x1] * p2[x2] * nxt(prompt + [x1, x2]).double()
    return joint


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    v = 6
    path = build_llama(tmp_path_factory.mktemp("v6"), vocab=v, hidden=HIDDEN, layers=4, seed=2, head_scale=8.0)
    loaded = load_model(path, "cpu", tokenizer=False)
    dpath, _ = write_drafter(tmp_path_factory.mktemp("d6"), hidden=HIDDEN, num_target_layers=4, block_size=3,
                             mask_token_id=v - 1, seed=9)
    return loaded, dpath, v


# Temperature and top-k both act (top-k removes one of the six tokens), on the target's
# distribution and on the drafter's, whose filtered samples and probabilities are the drafts.
PARAMS = SamplingParams(temperature=0.9, top_k=5)
PROMPT = [1, 4, 2]


@pytest.mark.parametrize("static, vocab, in_step", [(False, None, False), (True, None, False), (True, None, True),
                                                    (True, [0, 2, 3], False), (True, [0, 2, 3], True)])
def test_sampling_follows_target_distribution(small_vocab, static, vocab, in_step, monkeypatch):
    """``static``: drafts sampled from the static block (as on CUDA; uncaptured here): from its logits, or
    ``in_step`` (dflash.STATIC_SAMPLING) drawn inside it. ``vocab``: drafts from a draft vocabulary of 3 of
    the 6 tokens (q is 0 off it)."""
    from specdec.drafters import dflash as dflash_mod
    monkeypatch.setattr(dflash_mod, "STATIC_SAMPLING", in_step)
    loaded, dpath, v = small_vocab
    exact = _exact_joint(loaded.model, PROMPT, PARAMS, v)
    drafter = load_dflash_drafter(dpath, loaded)
    drafter.static_steps = static
    if vocab is not None:
        drafter.use_draft_vocab(vocab)
    counts = _joint_counts(loaded.model, drafter, PROMPT, PARAMS, 800, v)
    stat, df, pval = pooled_chi2(counts, exact)
    assert pval > ALPHA, f"chi2={stat:.1f} df={df} p={pval:.2e}"


def test_sampling_with_cut_blocks_follows_target_distribution(small_vocab, monkeypatch):
    """Sampled CPU blocks cut at their first unconfident row (CPU_MIN_SAMPLED_CONFIDENCE, at a floor that cuts
    about half of them here): proposals of 1 and of 2 drafts, and the sampled tokens still follow the target."""
    loaded, dpath, v = small_vocab
    drafter = load_dflash_drafter(dpath, loaded)
    lengths, second = [], []
    propose = drafter.propose

    def spy(last_token, k, params, gen):
        p = propose(last_token, k, params, gen)
        if k == 2:  # the step that samples the 2nd and 3rd tokens (later ones are asked for fewer)
            lengths.append(int(p.tokens.numel()))
            if p.tokens.numel() > 1:
                second.append(float(p.probs[1].max()))
        return p

    drafter.propose = spy
    _joint_counts(loaded.model, drafter, PROMPT, PARAMS, 40, v)  # uncut (the fixture): the second rows' confidence
    assert set(lengths) == {2}
    monkeypatch.setattr(dflash, "CPU_MIN_SAMPLED_CONFIDENCE", float(torch.tensor(second).median()))
    lengths.clear()
    exact = _exact_joint(loaded.model, PROMPT, PARAMS, v)
    counts = _joint_counts(loaded.model, drafter, PROMPT, PARAMS, 800, v)
    assert lengths.count(1) > 100 and lengths.count(2) > 100, (lengths.count(1), lengths.count(2))
    stat, df, pval = pooled_chi2(counts, exact)
    assert pval > ALPHA, f"chi2={stat:.1f} df={df} p={pval:.2e}"
    # what keeps it lossless: the cut reads the distributions only, never the tokens sampled from them (a cut at an
    # unlikely *sampled* draft would skew the drafts); so at one context every seed gets the same length
    for last in range(v - 1):
        lengths.clear()
        for seed in range(30):
            spy(last, 2, PARAMS, torch.Generator().manual_seed(seed))
        assert len(set(lengths)) == 1, (last, lengths)


def test_sampling_check_detects_broken_acceptance(small_vocab, monkeypatch):
    """The same check, at half the samples, rejects the classic bug of resampling from ``p``
    instead of the residual ``max(0, p - q)`` after a rejection: the test above can fail."""
    loaded, dpath, v = small_vocab

    def resample_from_p(draft, draft_probs, target_probs, gen):
        k, p = draft.shape[0], target_probs.float()
        rows = torch.arange(k)
        u = torch.rand(k, generator=gen)
        n = (u * draft_probs[rows, draft] < p[rows, draft]).long().cumprod(0).sum().reshape(1)
        fallback = torch.multinomial(p, 1, generator=gen).squeeze(1)
        out = torch.where(torch.arange(k + 1) < n, torch.cat([draft, fallback[k:]]), fallback)
        return torch.cat([n, out])

    monkeypatch.setattr(engine_generate, "accept_sampled", resample_from_p)
    exact = _exact_joint(loaded.model, PROMPT, PARAMS, v)
    counts = _joint_counts(loaded.model, load_dflash_drafter(dpath, loaded), PROMPT, PARAMS, 400, v)
    stat, df, pval = pooled_chi2(counts, exact)
    assert pval < ALPHA, f"a broken sampler passed: chi2={stat:.1f} df={df} p={pval:.2e}"


@pytest.mark.parametrize("split", [False, True])
def test_static_block_with_the_split_attention(tmp_path, llama, monkeypatch, split):
    """SPECDEC_DRAFTER_SPLIT=1: the static blocks' attention (every layer, over the whole context
    buffer, masked) takes the split kernel (here its torch form); sampled proposals carry the eager
    block's distributions and greedy output still equals plain decoding."""
    path, _ = _write(tmp_path, block_size=4)
    target, prompt = llama[1], _prompt(9, seed=5)
    dr = load_dflash_drafter(path, target)
    dr.static_steps = True
    calls = split_kernel_stand_in(monkeypatch) if split else []
    propose = dr.propose

    def spy(last_token, k, params, gen):
        eager = dr.block_logits(last_token)[:k]
        prop = propose(last_token, k, params, gen)
        if not params.greedy:
            assert torch.allclose(prop.probs, probs_from_logits(eager, params), atol=1e-5)
        return prop

    dr.propose = spy
    gen = SpeculativeGenerator(target.model, dr, 3)
    out = gen.generate(prompt, 24, SamplingParams())
    assert out.token_ids == plain_generate(target.model, prompt, 24).token_ids
    gen.generate(prompt, 12, SamplingParams(temperature=0.8, seed=1))
    # every static block ran its layers' attention through the kernel (none without the flag)
    layers = dr.model.config.num_hidden_layers
    assert (len(calls) > 0) == split and len(calls) % layers == 0, (len(calls), layers)


def test_fast_steps_take_wide_drafters_with_the_wide_kernels(monkeypatch):
    """drafters/dflash_fast.eligible: a drafter wider than fused_layer.MAX_HIDDEN (the qwen3-8b shape's 4096) takes the
    fused kernels when fused_layer.WIDE is on and a block fits WIDE_ROWS rows (the fast steps run a block or its
    committed rows, never a prompt); not with WIDE off or a block wider than WIDE_ROWS."""
    from specdec.drafters import dflash_fast
    from specdec.models import fused_layer
    from specdec.shapes import build_shape
    from specdec.train.dflash_batch import new_dflash_config, new_dflash_model

    model = build_shape("tiny", torch.device("cpu"), torch.float32)
    drafter = new_dflash_model(model, new_dflash_config(model, 1, 8, mask_token_id=model.config.vocab_size - 1),
                               init="random")
    assert dflash_fast.eligible(drafter)  # within MAX_HIDDEN
    monkeypatch.setattr(fused_layer, "MAX_HIDDEN", drafter.config.hidden_size // 2)  # now wider than MAX_HIDDEN
    for wide, rows, want in ((True, 32, True), (False, 32, False), (True, 4, False)):
        monkeypatch.setattr(fused_layer, "WIDE", wide)
        monkeypatch.setattr(fused_layer, "WIDE_ROWS", rows)
        assert dflash_fast.eligible(drafter) is want, (wide, rows)
