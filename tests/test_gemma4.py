"""Gemma 4 text targets: tiny random models against transformers, speculative decoding (n-gram and
an accepted oracle drafter) in eager and static steps, the multimodal wrapper, refused options.

Two tiny configs cover every option the model implements:

- ``dense`` (E2B-like): per-layer embeddings, the last two layers reuse earlier layers' keys and
  values (with double-wide MLPs), full layers with a larger head and proportional RoPE (with a
  frequency factor), soft-capped logits;
- ``moe`` (26B-A4B-like): routed experts beside the dense MLP, ``attention_k_eq_v`` full layers
  with one KV head, no per-layer embeddings; attention biases and an untied LM head besides.

Norm weights, router scales and layer scalars are randomised, so a mis-mapped one shows. Logits
agree within 1e-4 relative max error with transformers' eager attention, and 32 greedy tokens
equal transformers' ``generate``; the sliding window is 8 positions, so a 40-token prompt and its
continuation exercise it.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from _dense_util import hf_greedy, hf_logits, prompt_ids, rel_err, save_hf
from _engine_util import SpoiledOracle
from _gemma_util import randomise_gemma4 as randomise
from specdec.drafters import NgramDrafter
from specdec.drafters.factory import make_drafter
from specdec.engine import SpeculativeGenerator
from specdec.engine import generate as engine_mod
from specdec.errors import ConfigError
from specdec.info import describe
from specdec.loading import load_model
from specdec.sampling import SamplingParams

TOL = 1e-4
VOCAB = 320
S, F = "sliding_attention", "full_attention"
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, global_head_dim=32, rms_norm_eps=1e-6, max_position_embeddings=512, sliding_window=8,
              bos_token_id=2, eos_token_id=1, pad_token_id=0, initializer_range=0.1, attn_implementation="eager")


def tiny_config(kind: str):
    from transformers import Gemma4TextConfig

    if kind == "dense":
        return Gemma4TextConfig(**COMMON, num_hidden_layers=5, layer_types=[S, S, F, S, F], num_kv_shared_layers=2,
                                use_double_wide_mlp=True, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
                                final_logit_softcapping=5.0,
                                rope_parameters={S: {"rope_type": "default", "rope_theta": 10000.0},
                                                 F: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                     "rope_theta": 1e6, "factor": 2.0}})
    if kind == "moe":
        return Gemma4TextConfig(**COMMON, num_hidden_layers=4, layer_types=[S, F, S, F], attention_k_eq_v=True,
                                attention_bias=True, tie_word_embeddings=False,
                                num_global_key_value_heads=1, hidden_size_per_layer_input=0, enable_moe_block=True,
                                num_experts=8, top_k_experts=2, moe_intermediate_size=32, final_logit_softcapping=30.0)
    raise ValueError(kind)


def tiny_model(kind: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return randomise(AutoModelForCausalLM.from_config(tiny_config(kind), dtype=torch.float32))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{kind: (transformers model, specdec LoadedModel)}, built once."""
    root = tmp_path_factory.mktemp("gemma4")
    out = {}
    for seed, kind in enumerate(("dense", "moe")):
        hf = tiny_model(kind, seed)
        out[kind] = hf, load_model(save_hf(hf, str(root / kind)), "cpu", "float32")
    return out


def _greedy(model, ids, n, drafter=None, k=0, **kw):
    return SpeculativeGenerator(model, drafter, k, **kw).generate(ids, n, SamplingParams()).token_ids


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_hf_checkpoint_matches_transformers(tiny, kind):
    hf, loaded = tiny[kind]
    model = loaded.model
    assert loaded.arch.name == "gemma4" and (model.lm_head is None) == (kind == "dense")
    if kind == "dense":  # layers 3 and 4 read the caches of layers 1 (sliding) and 2 (full)
        assert model.config.kv_source == [None, None, None, 1, 2]
        cache = model.new_cache(16)
        assert cache.layers[3].k is cache.layers[1].k and cache.layers[4].v is cache.layers[2].v
    ids = prompt_ids(40, 1)
    err = rel_err(model(torch.tensor(ids), model.new_cache(len(ids))).logits, hf_logits(hf, ids))
    assert err <= TOL, f"logits differ from transformers: relative max error {err:.3g} > {TOL}"
    mine, theirs = _greedy(model, ids, 32), hf_greedy(hf, ids, 32)
    assert mine == theirs, f"greedy continuations differ:\nspecdec      {mine}\ntransformers {theirs}"


def _record(model, drafter, k, prompt, n, batch_invariant, monkeypatch):
    """Greedy tokens, and the logits of every committed position in order."""
    rows, accept = [], engine_mod.accept_greedy

    def recording(drafts, logits):
        packed = accept(drafts, logits)
        rows.append(logits[: int(packed[0]) + 1].clone())
        return packed

    monkeypatch.setattr(engine_mod, "accept_greedy", recording)
    res = SpeculativeGenerator(model, drafter, k, batch_invariant=batch_invariant).generate(prompt, n)
    monkeypatch.undo()
    return res.token_ids, torch.cat(rows), res.stats


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_speculative_greedy_equals_plain(tiny, kind, monkeypatch):
    """n-gram and an accepted (partly spoiled) oracle drafter give plain greedy's tokens, in eager
    steps and in the static (CUDA-graph) steps; in static steps the committed logits are bitwise
    plain decoding's (per-position invariance: sliding masks by position, gathered experts)."""
    model = tiny[kind][1].model
    prompt = prompt_ids(10, 5) * 2  # a repeat for the n-gram drafter to find
    n = 40
    plain = _greedy(model, prompt, n)
    assert _greedy(model, prompt, n, NgramDrafter(), 4) == plain
    static_plain, static_rows, _ = _record(model, None, 0, prompt, n, True, monkeypatch)
    assert static_plain == plain
    for batch_invariant in (False, True):
        oracle = SpoiledOracle(prompt + plain, VOCAB, spoil=0.3)
        toks, rows, stats = _record(model, oracle, 4, prompt, n, batch_invariant, monkeypatch)
        assert toks == plain, f"batch_invariant={batch_invariant}: speculative tokens differ from plain greedy"
        assert sum(stats.accepted) >= 10 and any(a < 4 for a in stats.accepted), stats.accepted
        if batch_invariant:
            m = min(len(rows), len(static_rows))
            assert torch.equal(rows[:m], static_rows[:m]), "static-step logits depend on the row"
    assert _greedy(model, prompt, n, NgramDrafter(), 4, batch_invariant=True) == plain


def test_multimodal_checkpoint_loads_its_language_model(tmp_path):
    """A ``gemma4`` (vision-language) checkpoint: ``model.language_model.*`` is the target, the
    vision tower and its embedder are left out; text-only logits equal the whole model's."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4TextConfig, Gemma4VisionConfig

    text = Gemma4TextConfig(**COMMON, num_hidden_layers=2, layer_types=[S, F], hidden_size_per_layer_input=8,
                            vocab_size_per_layer_input=VOCAB)
    vision = Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=16)
    cfg = Gemma4Config(text_config=text.to_dict(), vision_config=vision.to_dict(), audio_config=None,
                       image_token_id=300, boi_token_id=301, eoi_token_id=302, video_token_id=303, boa_token_id=304,
                       eoa_token_index=305, audio_token_id=306)
    torch.manual_seed(6)
    hf = randomise(Gemma4ForConditionalGeneration(cfg))
    path = save_hf(hf, str(tmp_path / "mm"))
    loaded = load_model(path, "cpu", "float32")
    assert loaded.arch.name == "gemma4" and loaded.model.config.model_type == "gemma4_text"
    ids = [i % 300 for i in prompt_ids(40, 7)]  # no image tokens
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([ids])).logits[0]
    err = rel_err(loaded.model(torch.tensor(ids), loaded.model.new_cache(len(ids))).logits, want)
    assert err <= TOL, f"relative max error {err:.3g} > {TOL}"


def test_info_names_the_drafters(tiny):
    loaded = tiny["moe"][1]
    info = describe(loaded.path)
    assert info["architecture"] == "gemma4" and info["model_type"] == "gemma4_text" and info["layers"] == 4
    assert info["layer_types"] == {S: 2, F: 2} and info["num_experts"] == 8 and info["top_k_experts"] == 2
    assert info["attention_dims"] == {S: "16x2kv", F: "32x1kv"}
    assert info["drafters"] == ["ngram", "dflash:PATH (a DFlash checkpoint trained for this target)"]
    # the target's own folder is no DFlash checkpoint: refused in one line, naming its config
    with pytest.raises(ConfigError, match="config.json"):
        make_drafter(f"dflash:{loaded.path}", loaded)


def test_hub_style_config_without_per_layer_config(tiny, tmp_path):
    """Configs written before transformers' ``per_layer_config`` name the full layers' sizes by
    ``global_head_dim`` / ``num_global_key_value_heads``: the same model loads from them."""
    hf, loaded = tiny["moe"]
    folder = tmp_path / "hub"
    folder.mkdir()
    for name in os.listdir(loaded.path):
        os.symlink(os.path.join(loaded.path, name), folder / name)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("per_layer_config")
    cfg.update(global_head_dim=32, num_global_key_value_heads=1)
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps(cfg))
    model = load_model(str(folder), "cpu", "float32").model
    ids = prompt_ids(12, 2)
    assert torch.equal(model(torch.tensor(ids), model.new_cache(12)).logits,
                       loaded.model(torch.tensor(ids), loaded.model.new_cache(12)).logits)


_BASE = {"model_type": "gemma4_text", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
         "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
         "sliding_window": 4, "layer_types": [S, F], "hidden_size_per_layer_input": 0}


@pytest.mark.parametrize("change, message", [
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention='all' is not supported"),
    ({"hidden_activation": "silu"}, "hidden_activation 'silu' is not supported"),
    ({"layer_types": [S, "chunked_attention"]}, r"layer_types \['chunked_attention'\] not supported"),
    ({"rope_parameters": {S: {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0},
                          F: {"rope_type": "default", "rope_theta": 1e6}}}, "sliding_attention rope_type 'yarn'"),
    ({"rope_parameters": {S: {"rope_type": "default", "rope_theta": 1e4},
                          F: {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}}},
     r"rope_parameters\['full_attention'\] fields \['partial_rotary_factor'\] are not supported"),
    ({"rope_parameters": {F: {"rope_type": "default", "rope_theta": 1e6}}}, "'sliding_attention' has none"),
    ({"rope_scaling": {"rope_type": "proportional", "factor": 2.0}}, "rope_scaling is not read for Gemma 4"),
    ({"num_kv_shared_layers": 2}, "num_kv_shared_layers=2 must be below num_hidden_layers=2"),
    ({"num_hidden_layers": 3, "layer_types": [F, S, F], "num_kv_shared_layers": 2},
     r"leaves no earlier layer of type\(s\) \['sliding_attention'\]"),
    ({"per_layer_config": {"1": {"sliding_window": 2}}}, r"per_layer_config overrides \['sliding_window'\]"),
    ({"num_hidden_layers": 3, "layer_types": [F, S, F], "per_layer_config": {"0": {"head_dim": 16}}},
     "must agree within a layer type"),
    ({"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2}, "needs a positive 'moe_intermediate_size'"),
    ({"hidden_size_per_layer_input": 4, "vocab_size_per_layer_input": 16}, "vocab_size_per_layer_input=16 is smaller"),
])
def test_bad_config_is_named(change, message):
    from specdec.config import parse_config
    from specdec.models.gemma4_config import Gemma4Config

    d = dict(_BASE, **change)
    with pytest.raises(ConfigError, match=message) as e:
        parse_config(Gemma4Config, d)
    assert "\n" not in str(e.value)


def test_last_layer_is_made_full_attention_as_transformers_does():
    from specdec.config import parse_config
    from specdec.models.gemma4_config import Gemma4Config

    with pytest.warns(UserWarning, match="the last layer is made full_attention"):
        cfg = parse_config(Gemma4Config, dict(_BASE, layer_types=[S, S]))
    assert cfg.layer_types == [S, F]
