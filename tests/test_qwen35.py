"""Qwen3.5 / Qwen3.6 hybrid targets (dense and MoE): parity with transformers, HF and GGUF
layouts, chunked vs recurrent DeltaNet, exact rollback of every cache type, snapshot memory,
and clear errors for incomplete checkpoints."""

from __future__ import annotations

import pytest
import torch

from specdec.cache import KVCache, LinearAttnCache
from specdec.errors import CheckpointError
from specdec.loading import load_model
from specdec.models import deltanet
from specdec.models.deltanet import GatedDeltaNet, chunked_gated_delta, recurrent_gated_delta
from specdec.models.moe import Experts, SparseMoeBlock
from specdec.models.qwen35 import checkpoint_view
from specdec.weights.gguf_io import GGUFSource

from _qwen35_util import (VOCAB, add_mtp_tensors, fuse_experts, hf_greedy, hf_model, hf_vl_model, our_greedy,
                           read_tensors, write_gguf, write_tensors)

KINDS = ("dense", "moe")


def _prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _load(path) -> torch.nn.Module:
    return load_model(str(path), device="cpu", dtype="float32", tokenizer=False).model


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """kind -> (transformers model, HF checkpoint dir with an MTP block)."""
    out = {}
    for kind in KINDS:
        model = hf_model(kind)
        path = tmp_path_factory.mktemp(f"q35_{kind}")
        model.save_pretrained(path)
        add_mtp_tensors(str(path), "model.layers.2.")
        out[kind] = (model, path)
    return out


@pytest.fixture(scope="module")
def loaded(ckpt):
    return {kind: _load(path) for kind, (_, path) in ckpt.items()}


# --- parity with transformers ------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_hf_parity_logits_and_greedy(ckpt, loaded, kind):
    ref_model, _ = ckpt[kind]
    model = loaded[kind]
    ids = _prompt(40)
    with torch.no_grad():
        ref = ref_model(ids[None]).logits[0]
    out = model(ids, model.new_cache(64))
    assert out.logits.shape == ref.shape
    assert _rel(out.logits, ref) < 1e-4
    assert our_greedy(model, ids, 32) == hf_greedy(ref_model, ids, 32)


@pytest.mark.parametrize("kind", KINDS)
def test_fused_deltanet_projections(loaded, kind, monkeypatch):
    """Loading fuses each Gated DeltaNet's four in-projections into one weight whose slices are the
    named parameters (no second copy), and its one GEMM gives what the four give (SPECDEC_DELTA_PROJ=0)."""
    model = loaded[kind]
    layers = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
    assert layers
    x = torch.randn(7, model.config.hidden_size)
    for m in layers:
        w = m._fused[0]
        lins = (m.in_proj_qkv, m.in_proj_z, m.in_proj_b, m.in_proj_a)
        assert w.shape[0] == sum(lin.out_features for lin in lins)
        assert all(lin.weight.untyped_storage().data_ptr() == w.untyped_storage().data_ptr() for lin in lins)
        with torch.no_grad():
            fused = m.project(x)
            monkeypatch.setattr(deltanet, "FUSED_PROJ", False)
            apart = m.project(x)
            monkeypatch.setattr(deltanet, "FUSED_PROJ", True)
        assert [tuple(t.shape) for t in fused] == [tuple(t.shape) for t in apart]
        assert all(_rel(f, a) < 1e-6 for f, a in zip(fused, apart))


def test_attention_heads_normed_later_are_the_same(loaded):
    """A q/k-normed attention's heads split without their norms (``split_qkv(..., norm=False)``, as a static step's
    fused path splits them for the RoPE kernel that norms them on CUDA, layers.NORM_ROPE) give, where that kernel
    does not run (here the CPU), the heads normed first: the same attention output, bit for bit."""
    from specdec.cache import KVCache
    model = loaded["dense"]
    layer = next(m for m in model.layers if hasattr(m, "self_attn"))
    a = layer.self_attn
    assert a.q_norm is not None and a.gated and a._fused is not None
    x = torch.randn(5, model.config.hidden_size)
    ctx = model.step_context(0, 5)
    outs = []
    with torch.no_grad():
        qkv = torch.nn.functional.linear(x, a._fused[0])
        for norm in (True, False):
            cache = KVCache(a.n_kv, a.head_dim, 16, torch.float32, "cpu")
            o = a.attend_heads(a.split_qkv(qkv, norm=norm), ctx.cos, ctx.sin, cache, 0, ctx.mask, normed=norm)
            outs.append((o, cache.k.clone(), cache.v.clone()))
    assert all(torch.equal(p, q) for p, q in zip(*outs))
    assert not torch.equal(a.split_qkv(qkv, norm=False)[0], a.split_qkv(qkv)[0])  # the norms do something here
    # an attention without q/k norms (Llama) takes normed=False as normed (the fused layers pass it for every model)
    from specdec.models.layers import Attention
    plain = Attention(32, 4, 2, 8)
    plain.fuse()
    x = torch.randn(5, 32)
    with torch.no_grad():
        heads = plain._heads(x)
        rot = model.rotary.__class__(8, 10000.0)
        cos, sin = rot.cos_sin(torch.arange(5), torch.float32)
        got = [plain.attend_heads(heads, cos, sin, KVCache(2, 8, 16, torch.float32, "cpu"), 0, ctx.mask, normed=n)
               for n in (True, False)]
    assert torch.equal(*got)


def test_checkpoint_mtp_tensors_stay_out_of_the_target(ckpt):
    _, path = ckpt["moe"]
    lm = load_model(str(path), device="cpu", dtype="float32", tokenizer=False)
    assert not any(n.startswith("mtp") for n in lm.model.state_dict())
    assert "mtp.fc.weight" in lm.source.infos()  # still readable by the MTP drafter
    assert "mtp.layers.0.mlp.experts.3.up_proj.weight" in lm.source.infos()
    view = checkpoint_view(lm.model.config, lm.source, lm.format, mtp=True)
    assert tuple(view.infos()["mtp.layers.0.mlp.experts.gate_up_proj"].shape) == (8, 64, 64)


def test_vision_language_wrapped_layout(tmp_path):
    model = hf_vl_model()
    model.save_pretrained(tmp_path)
    add_mtp_tensors(str(tmp_path), "model.language_model.layers.2.")
    names = read_tensors(str(tmp_path))
    assert any(n.startswith("model.visual.") for n in names) and any(n.startswith("mtp.") for n in names)
    ours = _load(tmp_path)
    ids = _prompt(40, seed=3)
    with torch.no_grad():
        ref = model(input_ids=ids[None]).logits[0]
    assert _rel(ours(ids, ours.new_cache(64)).logits, ref) < 1e-4


def test_fused_expert_layout(ckpt, tmp_path):
    ref_model, path = ckpt["moe"]
    write_tensors(str(tmp_path), read_tensors(str(path)))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    fuse_experts(str(tmp_path))
    assert "model.layers.0.mlp.experts.gate_up_proj" in read_tensors(str(tmp_path))
    ids = _prompt(40, seed=1)
    with torch.no_grad():
        ref = ref_model(ids[None]).logits[0]
    ours = _load(tmp_path)
    assert _rel(ours(ids, ours.new_cache(64)).logits, ref) < 1e-4


def test_moe_gather_and_grouped_paths_agree():
    torch.manual_seed(0)
    ex = Experts(6, 16, 8)
    with torch.no_grad():
        ex.gate_up_proj.normal_(), ex.down_proj.normal_()
    x = torch.randn(5, 16)
    idx = torch.stack([torch.randperm(6)[:2] for _ in range(5)])
    w = torch.rand(5, 2)
    ex.gather_max_rows = 0
    grouped = ex(x, idx, w)
    ex.gather_max_rows = 100
    static = ex(x, idx, w)  # 3 * 5 * 2 > 6 experts: every expert on every row
    assert torch.allclose(grouped, static, atol=1e-5)
    gathered = ex(x[:1], idx[:1], w[:1])  # 3 * 1 * 2 = 6: each pair's weights gathered
    assert torch.allclose(grouped[:1], gathered, atol=1e-5)


def test_moe_shared_weights_for_the_fused_kernels():
    """What models/expert_kernel.moe gets as the shared expert: the fused gate/up where the model fused it at
    load (a view, no copy), else a concatenated copy (an MTP block loaded alone) remade when either weight
    changes; and the fused form is only taken on CUDA (a CPU step keeps the torch ops)."""
    torch.manual_seed(0)
    blk = SparseMoeBlock(16, 8, 8, 6, 2)
    with torch.no_grad():
        for p in blk.parameters():
            p.normal_()
    se = blk.shared_expert
    gu, down = blk._shared_weights()
    assert torch.equal(gu, torch.cat([se.gate_proj.weight, se.up_proj.weight]))
    assert down is se.down_proj.weight
    assert blk._shared_weights()[0] is gu  # kept, not remade a step
    se.up_proj.weight = torch.nn.Parameter(torch.randn_like(se.up_proj.weight))
    assert torch.equal(blk._shared_weights()[0][8:], se.up_proj.weight)  # the up rows' change seen
    se.fuse()
    assert blk._shared_weights()[0].data_ptr() == se.gate_proj.weight.data_ptr()  # the fused weight itself
    # the router's weight: the shared gate's row last; a kept copy, then (fuse) the one weight both views share
    r = blk._router_weight()
    assert torch.equal(r, torch.cat([blk.gate.weight, blk.shared_expert_gate.weight])) and blk._router_weight() is r
    blk.shared_expert_gate.weight = torch.nn.Parameter(torch.randn_like(blk.shared_expert_gate.weight))
    assert torch.equal(blk._router_weight()[6], blk.shared_expert_gate.weight[0])  # the gate's change seen
    sd = {k: v.clone() for k, v in blk.state_dict().items()}
    blk.fuse()
    r = blk._router_weight()
    assert r.data_ptr() == blk.gate.weight.data_ptr() and r[6].data_ptr() == blk.shared_expert_gate.weight.data_ptr()
    assert all(torch.equal(v, blk.state_dict()[k]) for k, v in sd.items())  # the parameters as they were
    assert SparseMoeBlock(16, 8, 0, 6, 2)._router_weight().shape == (6, 16)  # no shared expert: the router alone
    x = torch.randn(3, 16)
    assert not blk._fused_ready(x)  # the CPU: torch ops


def _row0_varies(ex, t: int, trials: int = 8) -> int:
    """How many of ``trials`` steps of ``t`` rows give row 0 other bits when only the other rows change."""
    g = torch.Generator().manual_seed(t)
    differ = 0
    for _ in range(trials):
        x, x2 = torch.randn(t, 16, generator=g), torch.randn(t, 16, generator=g)
        idx, idx2 = (torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(t)]) for _ in range(2))
        w, w2 = torch.rand(t, 2, generator=g), torch.rand(t, 2, generator=g)
        x2[0], idx2[0], w2[0] = x[0], idx[0], w[0]  # row 0 alike, the others not
        differ += not torch.equal(ex(x, idx, w)[0], ex(x2, idx2, w2)[0])
    return differ


def test_moe_static_step_rows_are_independent():
    """In a fixed-shape step (the static forms), a row's output is bitwise the same whatever the
    other rows hold and route to: the property batch-invariant decoding rests on. (The grouped
    (prefill) form, whose per-expert matmuls have as many rows as route there, may fail it: whether
    it does depends on the CPU's BLAS, so it is not asserted; the check's power is shown on a step
    whose row 0 does depend on the other rows.)"""
    torch.manual_seed(1)
    ex = Experts(8, 16, 8)
    with torch.no_grad():
        ex.gate_up_proj.normal_(), ex.down_proj.normal_()
    assert _row0_varies(ex, 1) == 0  # the gather form (1 x 2 pairs)
    assert _row0_varies(ex, 16) == 0  # the dense form (16 x 2 pairs > 8 experts / 3)
    assert _row0_varies(lambda x, idx, w: ex(x, idx, w) + 1e-3 * x.mean(0), 16) == 8  # rows coupled: seen


# --- DeltaNet forms and caches ---------------------------------------------------------------

def _delta_inputs(h=3, t=23, dk=8, dv=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(h, t, dk, generator=g), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(h, t, dk, generator=g), dim=-1)
    v = torch.randn(h, t, dv, generator=g)
    gate = -torch.rand(h, t, generator=g) * 2
    beta = torch.rand(h, t, generator=g)
    s0 = torch.randn(h, dk, dv, generator=g)
    return q, k, v, gate, beta, s0


@pytest.mark.parametrize("chunk,segment", [(4, 4096), (7, 4096), (64, 4096), (4, 8)])
def test_chunked_delta_rule_matches_recurrent(chunk, segment, monkeypatch):
    monkeypatch.setattr(deltanet, "SEGMENT_TOKENS", segment)  # 8: three segments of two chunks
    q, k, v, g, beta, s0 = _delta_inputs()
    pm = [x.transpose(0, 1).contiguous() for x in (q, k, v, g, beta)]  # the recurrent form is position-major
    o_ref, states_ref = recurrent_gated_delta(*pm, s0)
    o_ref = o_ref.transpose(0, 1)
    o, states = chunked_gated_delta(q, k, v, g, beta, s0, chunk_size=chunk, all_states=True)
    assert torch.allclose(o, o_ref, atol=1e-5)
    assert torch.allclose(states, states_ref, atol=1e-5)
    o2, final = chunked_gated_delta(q, k, v, g, beta, s0, chunk_size=chunk)
    assert torch.allclose(o2, o_ref, atol=1e-5) and torch.allclose(final[0], states_ref[-1], atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_prefill_then_decode_matches_one_prefill(loaded, kind, monkeypatch):
    monkeypatch.setattr(GatedDeltaNet, "chunk_size", 64)
    model = loaded[kind]
    ids = _prompt(100, seed=5)
    full = model(ids, model.new_cache(128)).logits
    cache = model.new_cache(128)
    parts = [model(ids[:70], cache).logits]  # 70 > 64: two chunks, no per-position snapshots
    parts += [model(ids[i:i + 1], cache).logits for i in range(70, 100)]
    assert _rel(torch.cat(parts), full) < 1e-4


@pytest.mark.parametrize("kind", KINDS)
def test_rollback_restores_every_cache_exactly(loaded, kind):
    model = loaded[kind]
    prompt, drafts, nxt = _prompt(20, seed=7), _prompt(6, seed=8), _prompt(4, seed=9)
    cache = model.new_cache(64)
    model(prompt, cache)
    model(drafts, cache)  # verify 6 positions
    assert {type(c) for c in cache.layers} == {KVCache, LinearAttnCache}
    cache.rollback(len(prompt) + 3)
    cache.rollback(len(prompt) + 3)  # to the current length: a no-op
    after = model(nxt, cache).logits

    ref_cache = model.new_cache(64)
    model(prompt, ref_cache)
    model(drafts[:3], ref_cache)
    ref = model(nxt, ref_cache).logits
    assert cache.length == ref_cache.length
    assert _rel(after, ref) < 1e-5
    for c, rc in zip(cache.layers, ref_cache.layers):
        if isinstance(c, LinearAttnCache):
            assert torch.allclose(c.state(), rc.state(), atol=1e-5)
            assert torch.allclose(c.conv_window(), rc.conv_window(), atol=1e-6)

    # rolling back to the start of the last forward (no draft accepted) works as well
    cache.rollback(cache.length - len(nxt))
    again = model(nxt, cache).logits
    assert torch.allclose(again, after, atol=1e-6)


def test_rollback_outside_the_last_forward_is_an_error(loaded):
    model = loaded["dense"]
    cache = model.new_cache(128)
    model(_prompt(40), cache)  # > snapshot_tokens: final state only
    with pytest.raises(ValueError, match="cannot roll back to 39"):
        cache.rollback(39)
    model(_prompt(5, seed=2), cache)
    cache.rollback(42)
    with pytest.raises(ValueError, match="linear-attention cache cannot roll back to 39"):
        cache.rollback(39)


def test_linear_cache_rings_keep_every_length_a_rollback_may_restore(monkeypatch):
    """``LinearAttnCache``'s rings keyed by position: a forward's writes never land on the rows of the lengths it may
    be rolled back to (its start's window and state), across many wraps of the rings; growing the rings
    (``reserve_rows``) keeps them; a rollback writes nothing on the device (plain decoding's padded steps commit 16
    rows and keep 1, every step)."""
    k1, heads = 3, 2
    c = LinearAttnCache(4, k1 + 1, heads, 2, 2, torch.float32, "cpu", snapshot_tokens=16)
    state_of = lambda n: torch.full((heads, 2, 2), float(n))  # noqa: E731 - the state after n positions: n
    conv_of = lambda p: torch.full((4,), float(p + 1))  # noqa: E731 - position p's conv input: p + 1 (0 before 0)

    def forward(t: int, snapshots: bool = True) -> None:  # the writes of a forward of t positions at c.length
        s = c.length
        window = torch.stack([conv_of(p) if p >= 0 else torch.zeros(4) for p in range(s - k1, s)])
        assert torch.equal(c.conv_window(), window) and torch.equal(c.state(), state_of(s))
        inputs = torch.cat([window, torch.stack([conv_of(p) for p in range(s, s + t)])])
        states = torch.stack([state_of(s + 1 + i) for i in range(t)])
        c.write(s, inputs, states if snapshots else states[-1:], snapshots)
        c.commit(s, t, snapshots)

    c.states[0] = state_of(0)  # (a fresh cache's state is zeros: state_of(0) only names it)
    forward(7, snapshots=False)  # a prefill longer than the rings: its final state and window only
    c.reserve_rows(4)
    writes = []
    for name in ("fill_", "copy_", "zero_", "index_copy_"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _r=real, _n=name: (writes.append(_n), _r(self, *a))[1])
    for step in range(25):  # rolled back to each length of the last forward in turn, the rings wrapping many times
        t = 1 + step % 4
        forward(t)
        del writes[:]
        c.rollback(c.length - step % (t + 1))
        assert writes == []
    forward(4)
    c.reserve_rows(16)  # the rings grow: every length of the last forward still restores
    for n in range(c.base, c.length + 1):
        window = torch.stack([conv_of(p) for p in range(n - k1, n)])
        assert torch.equal(c.conv_window(n), window) and torch.equal(c.state(n), state_of(n))
    c.rollback(c.base + 1)
    forward(16)  # a step as wide as the rings allow
    c.rollback(c.base + 3)
    forward(2)
    c.reset()
    assert c.length == 0 and not c.conv.any() and not c.states.any()


def test_snapshot_memory_scales_with_draft_length_not_context(loaded):
    model = loaded["dense"]
    c = model.config
    per_position = 0
    for layer_type in c.layer_types:
        if layer_type == "linear_attention":
            conv_ch = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
            per_position += 4 * (c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim + conv_ch)
    recorded = {}
    for context in (40, 150):
        for k in (1, 3, 7):
            cache = model.new_cache(256)
            model(_prompt(context), cache)
            model(_prompt(k + 1, seed=k), cache)  # verify k drafts + the committed token
            snap = sum(x.snapshot_nbytes() for x in cache.layers if isinstance(x, LinearAttnCache))
            recorded[(context, k)] = snap
            assert snap == (k + 1) * per_position, (context, k, snap)
    print("snapshot bytes (context, k):", recorded)
    assert recorded[(40, 7)] == recorded[(150, 7)]


# --- GGUF --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind,variant", [("dense", {}), ("moe", {"recurrent_layers": True}),
                                          ("moe", {"fuse_gate_up": True, "fuse_qkv": True, "shexp_gate_1d": True})])
def test_gguf_llama_cpp_layout_matches_transformers(ckpt, loaded, kind, variant, tmp_path):
    ref_model, path = ckpt[kind]
    gpath = str(tmp_path / "model.gguf")
    write_gguf(str(path), gpath, **variant)
    src = GGUFSource(gpath)
    assert src.metadata[f"{src.architecture}.nextn_predict_layers"] == 1
    assert "blk.4.nextn.eh_proj.weight" in src.infos()
    lm = load_model(gpath, device="cpu", dtype="float32", tokenizer=False)
    assert lm.model.config.num_hidden_layers == 4
    assert lm.model.config.layer_types == ref_model.config.layer_types
    ids = _prompt(40, seed=11)
    with torch.no_grad():
        ref = ref_model(ids[None]).logits[0]
    assert _rel(lm.model(ids, lm.model.new_cache(64)).logits, ref) < 1e-4
    # greedy equals the HF-checkpoint load, itself checked against transformers above
    assert our_greedy(lm.model, ids, 16) == our_greedy(loaded[kind], ids, 16)

    # The MTP drafter's view: HF names and conventions (the +1 removed once, experts stacked).
    hf = read_tensors(str(path))
    view = checkpoint_view(lm.model.config, lm.source, "gguf", mtp=True)
    for name in ("mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.norm.weight",
                 "mtp.layers.0.input_layernorm.weight", "mtp.layers.0.self_attn.q_norm.weight",
                 "mtp.layers.0.self_attn.q_proj.weight"):
        assert torch.allclose(view.get(name, torch.float32), hf[name], atol=1e-6), name
    if kind == "moe":
        stacked = torch.stack([torch.cat([hf[f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight"],
                                          hf[f"mtp.layers.0.mlp.experts.{e}.up_proj.weight"]]) for e in range(8)])
        assert torch.equal(view.get("mtp.layers.0.mlp.experts.gate_up_proj", torch.float32), stacked)
        assert torch.equal(view.get("mtp.layers.0.mlp.shared_expert_gate.weight", torch.float32),
                           hf["mtp.layers.0.mlp.shared_expert_gate.weight"])


def test_missing_deltanet_tensor_is_named(ckpt, tmp_path):
    _, path = ckpt["dense"]
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    t = read_tensors(str(path))
    del t["model.layers.1.linear_attn.conv1d.weight"]
    write_tensors(str(hf_dir), t)
    (hf_dir / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"layers\.1\.linear_attn\.conv1d\.weight"):
        _load(hf_dir)

    gpath = str(tmp_path / "missing.gguf")
    write_gguf(str(path), gpath, drop="blk.0.ssm_a")
    assert "blk.0.ssm_a" not in GGUFSource(gpath).infos() and "blk.1.ssm_a" in GGUFSource(gpath).infos()
    with pytest.raises(CheckpointError, match=r"blk\.0\.ssm_a"):
        _load(gpath)


def test_missing_expert_tensor_is_named(ckpt, tmp_path):
    _, path = ckpt["moe"]
    t = read_tensors(str(path))
    del t["model.layers.3.mlp.experts.5.down_proj.weight"]
    write_tensors(str(tmp_path), t)
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"model\.layers\.3\.mlp\.experts\.5\.down_proj\.weight"):
        _load(tmp_path)


@pytest.mark.parametrize("kind", KINDS)
def test_speculative_greedy_equals_plain_greedy(loaded, kind):
    """The engine's verify -> accept -> rollback loop over hybrid caches changes no token."""
    from _engine_util import OracleDrafter, plain_generate
    from specdec.engine import SpeculativeGenerator

    model = loaded[kind]
    prompt = _prompt(36, seed=13).tolist()
    plain = plain_generate(model, prompt, 40).token_ids
    drafter = OracleDrafter(prompt + plain, VOCAB, corrupt=0.3, seed=1)
    spec = SpeculativeGenerator(model, drafter, 5).generate(prompt, 40)
    assert spec.token_ids == plain
    assert 0 < sum(spec.stats.accepted) < spec.stats.drafted  # both accepts and rejections happened


@pytest.mark.parametrize("kind", KINDS)
def test_static_chunked_prefill_equals_eager_prefill(loaded, kind):
    """A short prompt on static steps is prefilled as padded 16-row chunks of the captured step
    (``_prefill``): the same last logits, every row's hidden state and captured layers as the eager
    forward, and the decode after it (recurrent states carried across the chunks) the same."""
    from specdec.engine import SpeculativeGenerator

    m = loaded[kind]
    prompt = torch.randint(0, m.config.vocab_size, (37,), generator=torch.Generator().manual_seed(5))
    g = SpeculativeGenerator(m, None, 3, batch_invariant=True)
    g.static_prefill = True  # on CUDA with graphs; forced here to run the same static chunks uncaptured
    cache, graphed = g._cache_for(64, (0, 2))
    chunked = g._prefill(prompt, cache, graphed, (0, 2))
    assert cache.length == 37 and len(graphed.steps) == 1  # 16 + 16 + 5 padded: the one 16-row step
    ref_cache = m.new_cache(64)
    eager = m(prompt, ref_cache, capture=(0, 2), logits="last", snapshots=False)
    torch.testing.assert_close(chunked.logits, eager.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(chunked.hidden, eager.hidden, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(chunked.captured, eager.captured, rtol=1e-4, atol=1e-4)
    nxt = torch.tensor([int(eager.logits[-1].argmax())])
    torch.testing.assert_close(graphed(nxt).logits, m(nxt, ref_cache).logits, rtol=1e-4, atol=1e-4)


def test_static_chunked_prefill_speculation_equals_plain(loaded):
    """With the prompt prefilled in static chunks, speculative greedy output (drafts accepted and
    rejected) equals plain greedy output on a hybrid target."""
    from _engine_util import SpoiledOracle

    from specdec.engine import SpeculativeGenerator

    m = loaded["moe"]
    prompt = torch.randint(0, m.config.vocab_size, (37,), generator=torch.Generator().manual_seed(6)).tolist()
    plain = SpeculativeGenerator(m, None, 0, batch_invariant=True)
    plain.static_prefill = True
    want = plain.generate(prompt, 20).token_ids
    spec = SpeculativeGenerator(m, SpoiledOracle(prompt + want, m.config.vocab_size, spoil=0.3), 3,
                                batch_invariant=True)
    spec.static_prefill = True
    res = spec.generate(prompt, 20)
    assert res.token_ids == want and sum(res.stats.accepted) > 0 and min(res.stats.accepted) < 3
