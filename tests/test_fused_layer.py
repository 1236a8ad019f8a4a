"""models/fused_layer.py's wiring on the CPU: which layers take the fused path, and that the path
(``DenseDecoderLayer.forward_fused``, routed by ``CausalLM.run_layers``) computes the layer. The kernel
is CUDA-only; here its torch reference (``fused_layer.reference``) stands in for it, so the test sees
the layer's plumbing (the q/k/v split, RoPE and the cache write, attention, the SwiGLU epilogue, the
residual add moved into the next layer's norm, the captured layers) against the unfused path, in one sequence's forward, a
batched forward, and speculative decoding with accepted drafts. The kernel itself runs in Triton's
interpreter (tests/test_triton_interpret.py) and on the GPU (scripts/check_fused_layer.py)."""

import pytest
import torch

from _dense_util import save_hf, tiny_model
from _engine_util import SpoiledOracle, plain_generate
from specdec.engine import SpeculativeGenerator
from specdec.engine.batch import generate_batch
from specdec.loading import load_model
from specdec.models import fused_layer
from specdec.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = save_hf(tiny_model("llama_tied", seed=5, layers=4), str(tmp_path_factory.mktemp("llama")))
    return load_model(path, "cpu", tokenizer=False).model


@pytest.fixture
def fused_on(monkeypatch):
    """The fused path taken on the CPU, its kernel stood in for by the reference; counts the calls."""
    calls = []
    monkeypatch.setattr(fused_layer, "usable", lambda x: not torch.is_grad_enabled())
    monkeypatch.setattr(fused_layer, "linear", lambda x, w, silu=False, gelu=False: calls.append(silu or gelu)
                        or fused_layer.reference(x, w, silu, gelu))
    return calls


@pytest.mark.parametrize("kind, wide, want", [("llama", True, True), ("llama_tied", True, True), ("qwen3", True, True),
                                              ("llama", False, True), ("qwen3", False, False)])
def test_which_layers_take_it(kind, wide, want, tmp_path, monkeypatch):
    """Llama-family layers; Qwen3's q/k-normed ones with fused_layer.WIDE (SPECDEC_FUSED_LAYER_WIDE, on by default)."""
    monkeypatch.setattr(fused_layer, "WIDE", wide)
    m = load_model(save_hf(tiny_model(kind, seed=1), str(tmp_path)), "cpu", tokenizer=False).model
    assert [layer.fused_path for layer in m.layers] == [want] * len(m.layers)


def test_a_biased_layer_does_not(tmp_path):
    from transformers import AutoModelForCausalLM
    from _dense_util import tiny_config
    cfg = tiny_config("llama")
    cfg.attention_bias = True
    m = load_model(save_hf(AutoModelForCausalLM.from_config(cfg), str(tmp_path)), "cpu", tokenizer=False).model
    assert not any(layer.fused_path for layer in m.layers)


def unfused_and_fused(m, n: int):
    """``m``'s forward of ``n`` random ids and a batched forward of them and their reverse (layers 0, 2 and the last
    captured), with the fused path off, then on: ``[(one, batched), (one, batched)]``."""
    ids = torch.randint(m.config.vocab_size, (n,), generator=torch.Generator().manual_seed(1))
    cap = (0, 2, len(m.layers) - 1)
    outs = []
    for on in (False, True):
        with pytest.MonkeyPatch.context() as mp:
            if not on:
                mp.setattr(fused_layer, "usable", lambda x: False)
            one = m.forward(ids, m.new_cache(32), capture=cap)
            batched = m.forward_batch_train(torch.stack([ids, ids.flip(0)]), capture=cap)
            outs.append((one, batched))
    return outs


def test_forward_and_batched_forward(target, fused_on):
    (a, ab), (b, bb) = unfused_and_fused(target, 11)
    assert len(fused_on) == 2 * 4 * len(target.layers)  # 4 GEMMs a layer, two forwards
    assert fused_on.count(True) == 2 * len(target.layers)  # one with the SwiGLU epilogue a layer
    # in fp32 the reference's GEMM is F.linear's, and the moved residual add rounds alike: the same bits
    for x, y in ((a.logits, b.logits), (a.hidden, b.hidden), (a.captured, b.captured),
                 (ab.hidden, bb.hidden), (ab.captured, bb.captured)):
        assert torch.equal(x, y), (x - y).abs().max()


def test_speculative_equals_plain_on_the_fused_path(target, fused_on):
    prompt = torch.randint(target.config.vocab_size, (7,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = plain_generate(target, prompt, 24).token_ids
    drafter = SpoiledOracle(prompt + ref, target.config.vocab_size, spoil=0.3, seed=3)
    res = SpeculativeGenerator(target, drafter, 4, batch_invariant=True).generate(prompt, 24, SamplingParams())
    assert sum(res.stats.accepted) > 0  # drafts were accepted and rolled back
    assert res.token_ids == ref
    assert generate_batch(target, [prompt, prompt[:4]], 16, set(), slots=2)[0] == ref[:16]
    assert fused_on


def test_a_wider_layer_without_wide_does_not(tmp_path, monkeypatch):
    monkeypatch.setattr(fused_layer, "MAX_HIDDEN", 32)  # the tiny model is 64 wide
    monkeypatch.setattr(fused_layer, "WIDE", False)
    m = load_model(save_hf(tiny_model("llama", seed=1), str(tmp_path)), "cpu", tokenizer=False).model
    assert not any(layer.fused_path for layer in m.layers)


def test_a_wider_layer_prefills_long_prompts_unfused(tmp_path, monkeypatch):
    """Past MAX_HIDDEN (WIDE) a layer runs the kernels in forwards of at most WIDE_ROWS rows a sequence (steps,
    short prefill chunks) and cuBLAS in longer ones (a long prefill); up to MAX_HIDDEN in every forward. Plain and
    speculative decoding prefill alike, so with accepted drafts their outputs stay equal."""
    monkeypatch.setattr(fused_layer, "MAX_HIDDEN", 32)  # the tiny model is 64 wide
    m = load_model(save_hf(tiny_model("llama", seed=1), str(tmp_path)), "cpu", tokenizer=False).model
    assert all(layer.fused_path for layer in m.layers)
    calls = []
    monkeypatch.setattr(fused_layer, "usable", lambda x: not torch.is_grad_enabled())
    monkeypatch.setattr(fused_layer, "linear", lambda x, w, silu=False: calls.append(x.shape[0])
                        or fused_layer.reference(x, w, silu))
    layer = m.layers[0]
    assert fused_layer.runs(layer, fused_layer.WIDE_ROWS) and not fused_layer.runs(layer, fused_layer.WIDE_ROWS + 1)
    monkeypatch.setattr(fused_layer, "MAX_HIDDEN", 64)
    assert fused_layer.runs(layer, fused_layer.WIDE_ROWS + 1)  # up to MAX_HIDDEN: every forward
    monkeypatch.setattr(fused_layer, "MAX_HIDDEN", 32)
    n = fused_layer.WIDE_ROWS + 5
    ids = torch.randint(m.config.vocab_size, (n,), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        m.forward(ids, m.new_cache(64), logits="last", snapshots=False)
        assert not calls  # the long prefill: no layer on the kernels
        m.forward(ids[:3], m.new_cache(64), logits="last")
    assert calls and set(calls) == {3}  # a short forward: every layer's four GEMMs
    assert len(calls) == 4 * len(m.layers)
    prompt = ids.tolist()
    ref = plain_generate(m, prompt, 20).token_ids
    drafter = SpoiledOracle(prompt + ref, m.config.vocab_size, spoil=0.3, seed=3)
    res = SpeculativeGenerator(m, drafter, 4, batch_invariant=True).generate(prompt, 20, SamplingParams())
    assert sum(res.stats.accepted) > 0 and res.token_ids == ref
    assert 1 in calls and any(1 < c <= 5 for c in calls)  # 1-row plain steps and verify steps on the kernels


def test_bad_tiles_setting_is_one_line(monkeypatch):
    from specdec.errors import ConfigError
    monkeypatch.setattr(fused_layer, "_FORCED", None)
    monkeypatch.setenv("SPECDEC_FUSED_LAYER_TILES", '{"576,576": [16, 128]}')
    with pytest.raises(ConfigError, match="SPECDEC_FUSED_LAYER_TILES"):
        fused_layer.tile_for(576, 576, False)
    monkeypatch.setattr(fused_layer, "_FORCED", None)
    monkeypatch.setenv("SPECDEC_FUSED_LAYER_TILES", '{"576,576,0": [32, 64, 4, 3]}')
    assert fused_layer.tile_for(576, 576, False) == (32, 64, 4, 3)
    assert fused_layer.tile_for(960, 576, False) == fused_layer.TILES[(960, 576, False)]
    monkeypatch.setattr(fused_layer, "_FORCED", None)
    # "*": every weight the table does not name, with split K
    monkeypatch.setenv("SPECDEC_FUSED_LAYER_TILES", '{"*": [16, 128, 2, 4, 2]}')
    assert fused_layer.tile_for(100, 300, True) == (16, 128, 2, 4, 2)
    assert fused_layer.tile_for(960, 576, False) == fused_layer.TILES[(960, 576, False)]
    monkeypatch.setattr(fused_layer, "_FORCED", None)
    monkeypatch.setenv("SPECDEC_FUSED_LAYER_TILES", '{"*": [16, 128, 2, 4, 2, 1]}')
    with pytest.raises(ConfigError, match="SPECDEC_FUSED_LAYER_TILES"):
        fused_layer.tile_for(100, 300, True)
    monkeypatch.setattr(fused_layer, "_FORCED", None)


def test_default_tilings(monkeypatch):
    """tile_for without a table entry: TILE; the wide tiling with K split filling WIDE_PROGRAMS from 2,048 outputs and
    inputs on; a narrow weight over a long K keeps TILE."""
    monkeypatch.setattr(fused_layer, "_FORCED", {})
    assert fused_layer.tile_for(1000, 900, False) == fused_layer.TILE
    assert fused_layer.tile_for(2048, 3000, False) == fused_layer.TILE_WIDE[False] + (4,)  # 32 tiles of 64
    assert fused_layer.tile_for(4096, 3000, False) == fused_layer.TILE_WIDE[False] + (2,)
    assert fused_layer.tile_for(576, 2880, False) == fused_layer.TILE
    assert fused_layer.tile_for(576, 1536, False) == fused_layer.TILES[(576, 1536, False)]  # the table first


def test_pdl_launch_options(monkeypatch):
    """models/pdl.py: never on off CUDA (the kernels' USE_GDC stays off there), on by default or not."""
    from specdec.models import pdl
    x = torch.zeros(2)
    assert pdl.options(x) == {"USE_GDC": False}
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert pdl.options(x) == {"USE_GDC": False}



@pytest.fixture(scope="module")
def hybrids(tmp_path_factory):
    """Tiny random Qwen3.5 targets (dense, MoE; "moe-wide-shared": a shared expert wider than the routed ones, which
    the MoE kernels do not take), loaded from HF checkpoints."""
    from _qwen35_util import hf_model
    out = {}
    for kind, over in (("dense", {}), ("moe", {"shared_expert_intermediate_size": 32}), ("moe-wide-shared", {})):
        path = str(tmp_path_factory.mktemp(f"q35_{kind}"))
        hf_model(kind.split("-")[0], seed=6, **over).save_pretrained(path)
        out[kind] = load_model(path, "cpu", tokenizer=False).model
    return out


def test_hybrid_layers_take_it(hybrids, monkeypatch):
    """Qwen3.5's layers (Gated DeltaNet and gated attention, dense or MoE) take the fused path; a MoE target is
    row-exact in steps of at most its blocks' fused_rows (the MoE kernels' shape limit: 8 experts top 2 -> 4 rows)."""
    dense, moe = hybrids["dense"], hybrids["moe"]
    assert all(layer.fused_path for layer in dense.layers) and all(layer.fused_path for layer in moe.layers)
    assert not any(layer.fused_path for layer in hybrids["moe-wide-shared"].layers)
    from specdec.models import base, qwen35
    monkeypatch.setattr(base, "ROW_EXACT", True)
    monkeypatch.setattr(fused_layer, "on_device", lambda w: True)  # CUDA weights and Triton, as far as it asks
    monkeypatch.setattr(fused_layer, "triton", fused_layer.triton or object())
    assert dense.row_exact(17) and moe.row_exact(4) and not moe.row_exact(5)
    monkeypatch.setattr(qwen35, "HYBRID_FUSED", False)
    assert not any(fused_layer.eligible(layer) for layer in dense.layers + moe.layers)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_hybrid_forward_on_the_fused_path(hybrids, fused_on, kind):
    """Each layer's GEMMs (q/k/v + gate or the DeltaNet's in-projections, o_proj or out_proj, gate/up with SwiGLU,
    down_proj; a MoE block its own) on the kernel: a forward, a batched one and a captured layer's bits as the
    unfused path's."""
    m = hybrids[kind]
    (a, ab), (b, bb) = unfused_and_fused(m, 9)
    gemms = 4 if kind == "dense" else 2  # the MoE block: the router's GEMM is fused_layer's only where its kernels run
    assert len(fused_on) == 2 * gemms * len(m.layers) and fused_on.count(True) == (2 * len(m.layers) if kind == "dense" else 0)
    for x, y in ((a.logits, b.logits), (a.hidden, b.hidden), (a.captured, b.captured),
                 (ab.hidden, bb.hidden), (ab.captured, bb.captured)):
        assert torch.equal(x, y), (x - y).abs().max()


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_hybrid_speculative_equals_plain_on_the_fused_path(hybrids, fused_on, monkeypatch, kind):
    """Accepted and rolled-back oracle drafts on the fused path: the output is plain decoding's; the target says it
    is row-exact there, so the generator's plain steps are 1-row (no padding)."""
    m = hybrids[kind]
    monkeypatch.setattr(type(m), "row_exact", lambda self, rows=1: all(fused_layer.runs(layer, rows) for layer in self.layers))
    prompt = torch.randint(m.config.vocab_size, (7,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = plain_generate(m, prompt, 24).token_ids
    drafter = SpoiledOracle(prompt + ref, m.config.vocab_size, spoil=0.3, seed=3)
    gen = SpeculativeGenerator(m, drafter, 4, batch_invariant=True)
    assert gen.row_exact and gen.pad_to == 5  # verify steps of k + 1 rows; plain steps of 1 row:
    assert SpeculativeGenerator(m, None, 0, batch_invariant=True).pad_to is None
    res = gen.generate(prompt, 24, SamplingParams())
    assert sum(res.stats.accepted) > 0 and res.token_ids == ref
    assert generate_batch(m, [prompt, prompt[:4]], 16, set(), slots=2)[0] == ref[:16]  # the batched steps (serving)
    assert fused_on


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """A tiny random Gemma 3 (window 8, sliding and global layers, query_pre_attn_scalar != head_dim, norms' w
    random, an untied head: varied greedy output), loaded from its HF checkpoint."""
    from _dense_util import save_hf as save
    from _gemma_util import tiny_model as tiny_gemma
    return load_model(save(tiny_gemma("base", seed=4, tied=False), str(tmp_path_factory.mktemp("gemma3"))), "cpu",
                      tokenizer=False).model


def test_gemma3_layers_take_it(gemma, monkeypatch):
    """Gemma 3's sandwich-normed GELU layers take the fused path (fused_eligible); the target is row-exact where every
    layer runs the kernels (CUDA weights, ROW_EXACT), at any step width for a layer of at most MAX_HIDDEN."""
    assert all(layer.fused_path for layer in gemma.layers) and {layer.sliding for layer in gemma.layers} == {True, False}
    from specdec.models import base
    monkeypatch.setattr(base, "ROW_EXACT", True)
    assert not gemma.row_exact()  # CPU weights
    monkeypatch.setattr(fused_layer, "on_device", lambda w: True)
    monkeypatch.setattr(fused_layer, "triton", fused_layer.triton or object())
    assert gemma.row_exact(17) and gemma.row_exact(64)
    monkeypatch.setattr(base, "ROW_EXACT", False)
    assert not gemma.row_exact()


def test_gemma3_forward_on_the_fused_path(gemma, fused_on):
    """The fused path (q/k/v, o_proj, gate/up with the GELU-tanh product, down_proj on the kernel; the sandwich norms
    with the residual add moved into the next layer's input norm) gives the unfused forward's bits in fp32, past the
    window, captured layers included."""
    ids = torch.randint(gemma.config.vocab_size, (13,), generator=torch.Generator().manual_seed(1))
    cap = (0, 2, len(gemma.layers) - 1)
    outs = []
    for on in (False, True):
        with pytest.MonkeyPatch.context() as mp:
            if not on:
                mp.setattr(fused_layer, "usable", lambda x: False)
            cache = gemma.new_cache(32)
            outs.append([gemma.forward(ids, cache, capture=cap), gemma.forward(ids[:3], cache, capture=cap)])
    assert len(fused_on) == 2 * 4 * len(gemma.layers) and fused_on.count(True) == 2 * len(gemma.layers)
    for a, b in zip(*outs):
        for x, y in ((a.logits, b.logits), (a.hidden, b.hidden), (a.captured, b.captured)):
            assert torch.equal(x, y), (x - y).abs().max()


def test_gemma3_speculative_equals_plain_on_the_fused_path(gemma, fused_on, monkeypatch):
    """Accepted and rolled-back oracle drafts on the fused path, prompts past the window: plain decoding's output,
    with 1-row plain steps and (k+1)-row verify steps (the target row-exact)."""
    monkeypatch.setattr(type(gemma), "row_exact", lambda self, rows=1: all(fused_layer.runs(la, rows) for la in self.layers))
    prompt = torch.randint(gemma.config.vocab_size, (11,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = plain_generate(gemma, prompt, 24).token_ids
    assert len(set(ref)) >= 8  # varied output: near-ties a wrong bit could flip
    drafter = SpoiledOracle(prompt + ref, gemma.config.vocab_size, spoil=0.3, seed=3)
    gen = SpeculativeGenerator(gemma, drafter, 4, batch_invariant=True)
    assert gen.row_exact and gen.pad_to == 5
    res = gen.generate(prompt, 24, SamplingParams())
    assert sum(res.stats.accepted) > 0 and res.token_ids == ref
    assert fused_on


def test_int8_rows():
    """fused_layer.Int8Rows (a DFlash drafter's --draft-int8): a weight's rows within half a step of their int8 values,
    each row's largest magnitude at +-127, an all-zero row zero; the reference (the CPU equivalent the interpreter
    checks the kernel against) equals the product with the dequantized rows; the int8 tilings (TILES_INT8, else
    TILE_INT8 split to fill two waves of programs)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 40, generator=g)
    w[5] = 0.0
    q = fused_layer.Int8Rows.of(w.to(torch.bfloat16))
    assert q.q.dtype == torch.int8 and q.scale.dtype == torch.float32 and q.shape == (24, 40)
    assert ((q.dequantized() - w.to(torch.bfloat16).float()).abs() <= q.scale[:, None] / 2 + 1e-6).all()
    assert (q.q.abs().amax(1)[torch.arange(24) != 5] == 127).all() and not q.q[5].any()
    assert q.nbytes() == 24 * 40 + 24 * 4
    x = torch.randn(3, 40, generator=g)
    assert torch.allclose(fused_layer.reference(x, q), x @ q.dequantized().T, atol=1e-5)
    both = fused_layer.reference(x, q, silu=True)  # 12 gate rows, then 12 up rows
    gate, up = x @ q.dequantized()[:12].T, x @ q.dequantized()[12:].T
    assert torch.allclose(both, torch.nn.functional.silu(gate) * up, atol=1e-5)
    assert fused_layer.tile_for(6144, 4096, False, int8=True) == fused_layer.TILES_INT8[(6144, 4096, False)]
    assert fused_layer.tile_for(4096, 4096, False) != fused_layer.tile_for(4096, 4096, False, int8=True)
    assert fused_layer.tile_for(2048, 1024, False, int8=True) == fused_layer.TILE_INT8 + (4,)  # 64 tiles
    assert fused_layer.tile_for(16384, 1024, False, int8=True) == fused_layer.TILE_INT8 + (1,)  # 512 tiles
    # int8_values_: a module's linear weights as their int8 rows' values (the eager references' form), norms untouched
    lin, norm = torch.nn.Linear(40, 24, bias=False), torch.nn.LayerNorm(40)
    lin.weight.data = w.clone()
    before = norm.weight.detach().clone()
    fused_layer.int8_values_(torch.nn.Sequential(norm, lin))
    assert torch.equal(lin.weight, fused_layer.Int8Rows.of(w).dequantized()) and not torch.equal(lin.weight, w)
    assert torch.equal(norm.weight, before)


def test_int8_drafter_needs_cuda():
    """--draft-int8 off CUDA: a one-line error naming the flag, the drafter left as it was."""
    from specdec.drafters.dflash import DFlashDrafter
    from specdec.errors import ConfigError
    from specdec.shapes import build_shape
    from specdec.train.dflash_batch import new_dflash_config, new_dflash_model
    model = build_shape("tiny", torch.device("cpu"), torch.float32)
    cfg = new_dflash_config(model, 1, 4, mask_token_id=model.config.vocab_size - 1)
    d = DFlashDrafter(new_dflash_model(model, cfg, init="random").eval(), model)
    with pytest.raises(ConfigError, match="^--draft-int8: the int8 DFlash drafter needs CUDA"):
        d.use_int8_weights()
    assert not d.int8_weights and d.fast_weights() is None


def test_int8_drafter_taken_with_gradients_on(monkeypatch):
    """use_int8_weights runs where drafters are made (make_drafter, gradients on): it asks whether the fast steps
    take the drafter as they run, without gradients (a check that asked with gradients on refused every drafter on
    the GPU). dflash_fast.usable is stood in for by its gradient condition (the CPU has no fast steps)."""
    from specdec.drafters import dflash_fast
    from specdec.drafters.dflash import DFlashDrafter
    from specdec.shapes import build_shape
    from specdec.train.dflash_batch import new_dflash_config, new_dflash_model
    model = build_shape("tiny", torch.device("cpu"), torch.float32)
    cfg = new_dflash_config(model, 1, 4, mask_token_id=model.config.vocab_size - 1)
    d = DFlashDrafter(new_dflash_model(model, cfg, init="random").eval(), model)
    monkeypatch.setattr(dflash_fast, "usable", lambda m, x: not torch.is_grad_enabled())
    assert torch.is_grad_enabled()
    d.use_int8_weights()
    assert d.int8_weights and torch.is_grad_enabled()
