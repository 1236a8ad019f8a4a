"""DFlash drafters for Gemma targets (Gemma 3, Gemma 4 dense and MoE).

The drafter has the layout of z-lab's drafter for gemma-4-26B-A4B-it, scaled down: 5 layers
(4 sliding-window, then 1 full), 6 target layers including the last one (taken after the
final norm), mask token 4, final logit soft-capping 30 and an ``input_embedding_scale`` of
sqrt(hidden): 5 x 11 + 3 = 58 tensors. What a Gemma target changes
for the drafter, each pinned here against the independent reference of ``_dflash_util``:

- the block is embedded with the target's *raw* table times the drafter's own scale (Gemma's
  sqrt(hidden) in the target's ``embed`` must not be applied on top);
- the target's LM head without its soft cap, then the drafter's soft cap, once;
- captured rows are decoder-layer outputs (Gemma 4: after per-layer embeddings and
  ``layer_scalar``, KV-shared layers included), HF's ``hidden_states[l + 1]``.
"""

from __future__ import annotations

import re

import pytest
import torch

from _dense_util import save_hf
from _dflash_util import Steered, drafter_tensors, reference_block_logits, write_drafter
from _engine_util import plain_generate
from specdec.drafters.dflash import load_dflash_drafter
from specdec.engine import SpeculativeGenerator
from specdec.errors import CheckpointError
from specdec.info import describe
from specdec.loading import load_model

pytestmark = pytest.mark.usefixtures("single_thread")

S, F = "sliding_attention", "full_attention"
VOCAB, HIDDEN, LAYERS = 320, 64, 8
DRAFT_TYPES = [S, S, S, S, F]  # the order of the seed's config
MASK, SOFTCAP, WINDOW, BLOCK = 4, 30.0, 6, 5
# 6 of 8 like the seed's [1, 6, 11, 17, 22, 27] of 30, but with the last layer (after the final norm)
# and, on Gemma 4 dense, the two KV-shared layers; out of order: features concatenate in this order
IDS = (1, 2, 4, 7, 5, 6)


def _gemma4(kind: str):
    from transformers import AutoModelForCausalLM, Gemma4TextConfig
    from test_gemma4 import COMMON, randomise

    types = [S, S, F, S, S, F, S, F]
    if kind == "gemma4_dense":  # per-layer embeddings, the last two layers share KV
        cfg = Gemma4TextConfig(**COMMON, num_hidden_layers=LAYERS, layer_types=types, num_kv_shared_layers=2,
                               use_double_wide_mlp=True, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
                               final_logit_softcapping=5.0,
                               rope_parameters={S: {"rope_type": "default", "rope_theta": 10000.0},
                                                F: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                    "rope_theta": 1e6, "factor": 2.0}})
    else:
        cfg = Gemma4TextConfig(**COMMON, num_hidden_layers=LAYERS, layer_types=types, attention_k_eq_v=True,
                               num_global_key_value_heads=1, hidden_size_per_layer_input=0, enable_moe_block=True,
                               num_experts=8, top_k_experts=2, moe_intermediate_size=32, final_logit_softcapping=30.0)
    torch.manual_seed(5)
    return randomise(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32))


def _gemma3():
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, max_position_embeddings=512,
                           sliding_window=8, bos_token_id=2, eos_token_id=1, pad_token_id=0, initializer_range=0.1,
                           attn_implementation="eager", num_hidden_layers=LAYERS, query_pre_attn_scalar=24,
                           final_logit_softcapping=3.0, layer_types=[S, S, F, S, S, S, F, S],
                           rope_parameters={F: {"rope_type": "default", "rope_theta": 1e6},
                                            S: {"rope_type": "default", "rope_theta": 10000.0}})
    torch.manual_seed(6)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.3 * torch.randn_like(p))  # Gemma 3 norms are 1 + w
    return model.eval()


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """``get(kind) -> (LoadedModel, transformers model)``, each built once per module."""
    built: dict = {}

    def get(kind: str):
        if kind not in built:
            hf = _gemma3() if kind == "gemma3" else _gemma4(kind)
            path = save_hf(hf, str(tmp_path_factory.mktemp(kind)))
            built[kind] = (load_model(path, "cpu", "float32", tokenizer=False), hf)
        return built[kind]
    return get


def _write(path, seed: int = 11, tensors=None):
    """The seed drafter's layout, scaled down (58 tensors)."""
    return write_drafter(path, hidden=HIDDEN, num_target_layers=LAYERS, n_layers=5, target_layer_ids=IDS,
                         block_size=BLOCK, mask_token_id=MASK, layer_types=DRAFT_TYPES, sliding_window=WINDOW,
                         seed=seed, tensors=tensors,
                         config={"dflash_config": {"mask_token_id": MASK, "target_layer_ids": list(IDS),
                                                   "input_embedding_scale": HIDDEN ** 0.5,
                                                   "final_logit_softcapping": SOFTCAP}})


def test_seed_layout_loads_for_every_gemma_target(tmp_path, targets):
    path, _ = _write(tmp_path / "d")
    assert len(drafter_tensors(HIDDEN, 5, len(IDS))) == 5 * 11 + 3
    for kind in ("gemma4_dense", "gemma4_moe", "gemma3"):
        loaded = targets(kind)[0]
        info = load_dflash_drafter(path, loaded).info()
        assert info["layer_types"] == DRAFT_TYPES and info["target_layer_ids"] == list(IDS)
        assert info["mask_token_id"] == MASK and info["drafts_per_step"] == BLOCK - 1
        assert "dflash:PATH (a DFlash checkpoint trained for this target)" in describe(loaded.path)["drafters"]


@pytest.mark.parametrize("bad", ["missing", "int_dtype"])
def test_bad_tensor_is_named(tmp_path, targets, bad):
    sd = drafter_tensors(HIDDEN, 5, len(IDS), seed=11)
    name = "layers.4.self_attn.o_proj.weight" if bad == "missing" else "layers.2.self_attn.q_norm.weight"
    if bad == "missing":
        del sd[name]
    else:
        sd[name] = torch.ones(8, dtype=torch.int32)
    path, _ = _write(tmp_path / "d", tensors=sd)
    with pytest.raises(CheckpointError, match=re.escape(name)) as e:
        load_dflash_drafter(path, targets("gemma4_moe")[0])
    assert "\n" not in str(e.value)


class _StaticChecked(Steered):
    """Also runs the static block (the CUDA-graph step, eager on the CPU) on every proposal and
    checks it drafts the argmax of the eager block logits."""

    def propose(self, last_token, k, params, gen):
        self.inner.static_steps = True
        static = self.inner.propose(last_token, k, params, gen).tokens
        self.inner.static_steps = False
        eager = self.inner.block_logits(last_token)[: static.shape[0]].argmax(-1)
        assert torch.equal(static, eager), (static, eager)
        return super().propose(last_token, k, params, gen)


@pytest.mark.parametrize("kind", ["gemma4_dense", "gemma4_moe", "gemma3"])
def test_drafts_match_reference_and_decoding_is_lossless(tmp_path, targets, kind):
    """Steered by the target's own continuation with a third of the drafts spoiled (so some blocks
    are accepted in full, some in part, and rollback runs), the real drafter runs every step: its
    block logits equal the from-scratch reference at every context length (the context outgrows
    the drafter's window of 6 and the target's of 8), and the output equals plain greedy decoding."""
    loaded, hf = targets(kind)
    path, cfg = _write(tmp_path / "d")
    sd = drafter_tensors(HIDDEN, 5, len(IDS), seed=11)
    prompt = torch.randint(VOCAB, (4,), generator=torch.Generator().manual_seed(1)).tolist()
    new = 24
    ref = prompt + plain_generate(loaded.model, prompt, new + BLOCK).token_ids
    spy = _StaticChecked(load_dflash_drafter(path, loaded), reference=ref, corrupt=0.3, vocab=VOCAB, record=True,
                         seed=2)
    res = SpeculativeGenerator(loaded.model, spy, BLOCK - 1).generate(prompt, new)
    assert res.token_ids == ref[len(prompt):len(prompt) + new]
    acc = res.stats.accepted
    assert sum(acc) > 0 and min(acc) < BLOCK - 1, acc  # drafts accepted, and some rejected (rollback)
    lengths = sorted({len(h) for h, _, _ in spy.records})
    assert lengths[0] < WINDOW and lengths[-1] > WINDOW + BLOCK and len(lengths) >= 4, lengths
    for committed, last, got in spy.records[:: max(1, len(spy.records) // 4)] + spy.records[-1:]:
        want = reference_block_logits(hf, sd, cfg, committed, last, BLOCK)
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
