"""The split attention's algorithm (specdec/models/split_attention.py; its Triton kernel runs on
CUDA only, where scripts/check_split_attention.py compares it with this reference): in torch ops it
equals SDPA (GQA, masks by position, a DFlash block's bidirectional rows), and a row's bits do not
change when masked keys are appended (the span buckets)."""

import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from specdec.models.split_attention import split_attention_reference, supported

sys.path.insert(0, os.path.dirname(__file__))


def _case(b, h, hkv, t, span, d, starts, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t, d, generator=g)
    k = torch.randn(b, hkv, span, d, generator=g)
    v = torch.randn(b, hkv, span, d, generator=g)
    pos = torch.tensor(starts)[:, None] + torch.arange(t)[None, :]
    mask = (torch.arange(span)[None, None, :] <= pos[:, :, None])[:, None]
    return q, k, v, mask


def _sdpa(q, k, v, mask, scale):
    g = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1),
                                          attn_mask=mask, scale=scale)


@pytest.mark.parametrize("h,hkv,t", [(6, 2, 1), (6, 2, 5), (4, 4, 3), (8, 1, 16)])
def test_reference_equals_sdpa(h, hkv, t):
    q, k, v, mask = _case(3, h, hkv, t, 700, 16, [0, 300, 680 - t])  # rows in the first, a middle and the last split
    got = split_attention_reference(q, k, v, mask, 0.25)
    assert torch.allclose(got, _sdpa(q, k, v, mask, 0.25), atol=1e-5)


def test_reference_takes_a_dflash_block_mask():
    """Context keys before each sequence's start, then its block's keys, all seen by every block row."""
    b, h, hkv, blk, span, d = 2, 4, 2, 4, 300, 8
    g = torch.Generator().manual_seed(1)
    q = torch.randn(b, h, blk, d, generator=g)
    k = torch.randn(b, hkv, span + blk, d, generator=g)
    v = torch.randn(b, hkv, span + blk, d, generator=g)
    starts = torch.tensor([5, 290])
    ctx = torch.arange(span)[None, :] < starts[:, None]
    mask = torch.cat([ctx, torch.ones(b, blk, dtype=torch.bool)], 1)[:, None, None, :].expand(b, 1, blk, span + blk)
    got = split_attention_reference(q, k, v, mask, 0.3)
    assert torch.allclose(got, _sdpa(q, k, v, mask, 0.3), atol=1e-5)


def test_reference_rows_ignore_masked_keys_appended():
    q, k, v, mask = _case(2, 6, 2, 4, 512, 16, [100, 505])
    q2, k2, v2, mask2 = _case(2, 6, 2, 4, 1536, 16, [100, 505], seed=9)
    k2[:, :, :512], v2[:, :, :512] = k, v
    assert torch.equal(split_attention_reference(q, k, v, mask, 0.25),
                       split_attention_reference(q, k2, v2, mask2, 0.25))
    k2[:, :, 700] += 1.0  # a key the rows see would change them: the comparison can fail
    mask2[:, :, :, 700] = True
    assert not torch.equal(split_attention_reference(q, k, v, mask, 0.25),
                           split_attention_reference(q, k2, v2, mask2, 0.25))


def test_reference_combines_many_splits_in_chunks():
    """Past COMBINE splits (here 18 and 36) the combine sums its chunks in order: rows in the first and
    the last chunk equal SDPA, a window's dead leading splits and appended dead ones change no bit."""
    from specdec.models.split_attention import COMBINE, split_keys
    span = split_keys(8) * (COMBINE + 2) - 100
    q, k, v, mask = _case(2, 4, 2, 3, span, 8, [span - 3, 40])
    pos = torch.tensor([span - 3, 40])[:, None] + torch.arange(3)[None, :]
    window = mask & (torch.arange(span)[None, None, :] > pos[:, :, None] - 700)[:, None]
    for m in (mask, window):
        got = split_attention_reference(q, k, v, m, 0.3)
        assert torch.allclose(got, _sdpa(q, k, v, m, 0.3), atol=1e-5)
        k2, v2 = torch.cat([k, torch.randn_like(k)], 2), torch.cat([v, torch.randn_like(v)], 2)
        m2 = torch.cat([m, torch.zeros_like(m)], -1)
        assert torch.equal(got, split_attention_reference(q, k2, v2, m2, 0.3))
        m2[1, :, :, span + 5] = True  # a key the second sequence sees would change it: the comparison can fail
        assert not torch.equal(got, split_attention_reference(q, k2, v2, m2, 0.3))


def test_cpu_tensors_keep_sdpa():
    q, k, v, mask = _case(1, 2, 1, 1, 8, 16, [3])
    assert not supported(q.bfloat16(), k.bfloat16(), mask)
    assert not math.isnan(split_attention_reference(q, k, v, mask, 0.25).sum().item())


def _reference_kernel(calls):
    """The kernel's stand-in on the CPU: the reference, recording each call's shapes."""
    def run(q, k, v, mask, scale, gate=None):
        calls.append((tuple(q.shape), tuple(mask.shape)))
        return split_attention_reference(q, k, v, mask, scale, gate)
    return run


def test_generate_static_steps_take_the_split_kernel(monkeypatch):
    """GraphedTarget's single-sequence steps (generate, bench) route attention through the split
    kernel (here its torch reference, as on CUDA where the kernel takes the inputs): q ``[1, H, T, d]``
    over the whole cache with a ``[1, 1, T, S]`` mask; speculative greedy output with accepted drafts
    equals plain greedy output, and both equal the eager (SDPA) engine's tokens."""
    from _engine_util import SpoiledOracle, tiny_llama

    from specdec.engine import SpeculativeGenerator
    from specdec.models import split_attention as sa

    m = tiny_llama(hidden=64, inter=96, max_pos=2048)
    prompt = torch.randint(0, 97, (9,)).tolist()
    eager = SpeculativeGenerator(m, None, 0, cuda_graphs=False).generate(prompt, 40).token_ids
    calls = []
    monkeypatch.setattr(sa, "supported", lambda q, k, mask: q.dim() == 4 and mask.dim() == 4 and mask.dtype == torch.bool)
    monkeypatch.setattr(sa, "split_attention", _reference_kernel(calls))
    plain = SpeculativeGenerator(m, None, 0, batch_invariant=True).generate(prompt, 40).token_ids
    assert calls and all(c == ((1, 4, 16, 16), (1, 1, 16, 1040)) for c in calls)  # 16-row steps, the whole cache (1024 + 16 spare rows)
    spec = SpeculativeGenerator(m, SpoiledOracle(prompt + plain, 97, spoil=0.3), 4, batch_invariant=True).generate(prompt, 40)
    assert sum(spec.stats.accepted) > 10 and spec.stats.tau > 2
    assert spec.token_ids == plain == eager


@pytest.mark.parametrize("in_split", [True, False])
def test_gated_attention_static_steps_take_the_gate_into_the_split_kernel(monkeypatch, in_split):
    """A Qwen3.5 target's gated attention on the split kernel (its torch reference standing in, as on CUDA): with
    layers.GATE_IN_SPLIT the kernel gets the gate ([1, T, H, d], a view of the projection) and applies it, else the
    torch ops after it do; either way static steps decode the eager engine's tokens, and speculative greedy output
    with accepted drafts equals plain greedy output."""
    from _engine_util import SpoiledOracle, qwen35_text_config

    from specdec.config import parse_config
    from specdec.engine import SpeculativeGenerator
    from specdec.models import layers
    from specdec.models import split_attention as sa
    from specdec.models.registry import by_hf_model_type

    arch = by_hf_model_type("qwen3_5_text", "test")
    torch.manual_seed(0)
    m = arch.model_cls(parse_config(arch.config_cls, qwen35_text_config(
        vocab_size=97, intermediate_size=96, num_hidden_layers=2, head_dim=16, full_attention_interval=2), source="test"))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    m.fuse_projections()
    m.eval()
    prompt = torch.randint(0, 97, (9,), generator=torch.Generator().manual_seed(2)).tolist()
    eager = SpeculativeGenerator(m, None, 0, cuda_graphs=False).generate(prompt, 24).token_ids
    gates = []

    def run(q, k, v, mask, scale, gate=None):
        gates.append(gate if gate is None else (tuple(gate.shape), gate.stride(-1)))
        return split_attention_reference(q, k, v, mask, scale, gate)
    monkeypatch.setattr(layers, "GATE_IN_SPLIT", in_split)
    monkeypatch.setattr(sa, "supported", lambda q, k, mask: q.dim() == 4 and mask.dim() == 4)
    monkeypatch.setattr(sa, "split_attention", run)
    plain = SpeculativeGenerator(m, None, 0, batch_invariant=True).generate(prompt, 24).token_ids
    assert gates and all(g == ((1, 16, 4, 16), 1) if in_split else g is None for g in gates)  # 16-row steps
    spec = SpeculativeGenerator(m, SpoiledOracle(prompt + plain, 97, spoil=0.3), 4, batch_invariant=True).generate(prompt, 24)
    assert sum(spec.stats.accepted) > 5
    assert spec.token_ids == plain == eager


def test_split_attention_under_torch_compile(monkeypatch):
    """Compiled, the kernels run as the ``specdec::split_attention`` custom op (a fake gives the
    output's shape): the result equals the eager call's."""
    from specdec.models import split_attention as sa

    calls = []
    ref = _reference_kernel(calls)
    monkeypatch.setattr(sa, "_launch", lambda q, k, v, mask, scale, gate=None: ref(q, k, v, mask, scale, gate).transpose(1, 2).contiguous())
    q, k, v, mask = _case(2, 6, 2, 3, 300, 16, [10, 280])
    want = sa.split_attention(q, k, v, mask, 0.25)
    assert want.shape == (2, 6, 3, 16) and len(calls) == 1
    torch._dynamo.reset()
    got = torch.compile(lambda *a: sa.split_attention(*a) * 2, fullgraph=True, backend="aot_eager")(q, k, v, mask, 0.25)
    assert len(calls) >= 2  # the op really ran, compiled
    assert torch.equal(got, want * 2)


def test_split_keys_by_head_size_and_from_the_environment():
    """Keys a (first) split: 128 for heads of 128 features (512 until 2026-12-04, 256 until 2026-12-06 (fifth)), 64 for
    heads of 256 and 512, 256 for the others; SPECDEC_SPLIT_KEYS
    (64, 128, 256, 512 or 1024) sets one value for every head size, raised to the tile's block of keys (128 up to
    128 features); anything else is a one-line error naming it."""
    import subprocess

    from specdec.models import split_attention

    def run(value):
        env = {**os.environ, "SPECDEC_SPLIT_KEYS": value}
        return subprocess.run([sys.executable, "-c", "from specdec.models import split_attention as s; "
                               "print(s.split_keys(64), s.split_keys(128), s.split_keys(256))"],
                              env=env, capture_output=True, text=True)
    if "SPECDEC_SPLIT_KEYS" not in os.environ:
        assert [split_attention.split_keys(d) for d in (16, 64, 128, 256, 512)] == [256, 256, 128, 64, 64]
    assert run("512").stdout.split() == ["512"] * 3
    assert run("256").stdout.split() == ["256"] * 3
    assert run("64").stdout.split() == ["128", "128", "64"]
    bad = run("300")
    assert bad.returncode != 0 and "SPECDEC_SPLIT_KEYS='300': want 64, 128, 256, 512 or 1024" in bad.stderr


def test_far_splits_past_the_first_positions():
    """split_attention.schedule: heads of 128 walk 128-key splits over the first 1,024 positions, 256-key ones to 4,096
    and 512-key ones past them (other head sizes one split size); the bounds tile the span at fixed absolute offsets,
    one program each (n_splits); SPECDEC_SPLIT_FAR=NEAR,FAR sets two tiers for every head size, 0 turns them off,
    anything else is a one-line error naming it."""
    import subprocess

    from specdec.models import split_attention as sa

    if "SPECDEC_SPLIT_FAR" not in os.environ and "SPECDEC_SPLIT_KEYS" not in os.environ:
        assert sa.schedule(128) == (128, 1024, 256, 4096, 512)
        assert sa.schedule(64) == (256, 0, 256, 0, 256) and sa.schedule(256) == (64, 0, 64, 0, 64)
        for span in (100, 200, 1024, 1025, 4096, 4097, 5000, 16384 + 128):
            bounds = sa.split_bounds(span, 128)
            assert bounds[0][0] == 0 and bounds[-1][1] == span and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
            assert len(bounds) == sa.n_splits(span, *sa.schedule(128))
            assert all(e - s == (128 if s < 1024 else 256 if s < 4096 else 512) for s, e in bounds[:-1])
        assert sa.split_bounds(5000, 128)[-2:] == [(4096, 4608), (4608, 5000)]
        assert sa.split_bounds(1300, 128)[-3:] == [(896, 1024), (1024, 1280), (1280, 1300)]
        assert sa.n_splits(5000, 128, 1024, 256, 4096, 512) == 8 + 12 + 2
    assert sa.n_splits(5000, 256, 0, 256, 0, 256) == 20  # one size: ceil(5000 / 256)
    assert sa.n_splits(5000, 256, 4096, 512, 4096, 512) == 16 + 2  # two tiers

    def run(value):
        env = {**os.environ, "SPECDEC_SPLIT_FAR": value}
        env.pop("SPECDEC_SPLIT_KEYS", None)
        return subprocess.run([sys.executable, "-c", "from specdec.models import split_attention as s; "
                               "print(s.schedule(64), s.schedule(128))"], env=env, capture_output=True, text=True)
    assert run("2048,1024").stdout.split("\n")[0] == "(256, 2048, 1024, 2048, 1024) (128, 2048, 1024, 2048, 1024)"
    assert run("0").stdout.split("\n")[0] == "(256, 0, 256, 0, 256) (128, 0, 128, 0, 128)"
    for bad in ("4096", "4000,512", "4096,300", "x,y"):
        r = run(bad)
        assert r.returncode != 0 and f"SPECDEC_SPLIT_FAR={bad!r}: want NEAR,FAR" in r.stderr.strip().splitlines()[-1]


def test_reference_with_far_splits(monkeypatch):
    """Far splits (here 256-key splits over the first 512 positions, 512-key ones to 1,536, 1,024-key ones past them)
    equal SDPA, a row's bits do not change with dead keys appended, and they are other bits than one split size (the
    schedule is used)."""
    from specdec.models import split_attention as sa

    monkeypatch.setattr(sa, "FAR", {16: (512, 512, 1536, 1024)})
    monkeypatch.setattr(sa, "_FAR_ENV", None)
    span = 2800
    q, k, v, mask = _case(2, 4, 2, 3, span, 16, [span - 3, 1500])
    got = split_attention_reference(q, k, v, mask, 0.3)
    assert torch.allclose(got, _sdpa(q, k, v, mask, 0.3), atol=1e-5)
    k2, v2 = torch.cat([k, torch.randn_like(k)], 2), torch.cat([v, torch.randn_like(v)], 2)
    assert torch.equal(got, split_attention_reference(q, k2, v2, torch.cat([mask, torch.zeros_like(mask)], -1), 0.3))
    monkeypatch.setattr(sa, "FAR", {})
    assert not torch.equal(got, split_attention_reference(q, k, v, mask, 0.3))


def test_batched_steps_keep_sdpa_past_heads_of_256(monkeypatch):
    """Batched (span-invariant) steps take the split kernel for heads of at most layers.SPLIT_BATCHED_MAX_D (256) and
    the memory-efficient SDPA for Gemma 4's 512-wide heads (by head size only, so plain and speculative serving run
    the same kernel); one sequence's steps take the kernel at 512 too."""
    from specdec.models import layers
    from specdec.models import split_attention as sa

    calls = []
    monkeypatch.setattr(sa, "supported", lambda q, k, mask: q.dim() == 4 and mask.dim() == 4 and mask.dtype == torch.bool)
    monkeypatch.setattr(sa, "split_attention", _reference_kernel(calls))
    for d, want in ((256, 1), (512, 0)):
        q, k, v, mask = _case(2, 4, 2, 3, 40, d, [10, 30])
        calls.clear()
        with layers.span_invariant_attention():
            got = layers.attend(q, k, v, mask, d ** -0.5)
        assert len(calls) == want, d
        assert torch.allclose(got, _sdpa(q, k, v, mask, d ** -0.5), atol=1e-5)
    q, k, v, mask = _case(1, 4, 2, 3, 40, 512, [30])
    calls.clear()
    with layers.live_context_attention():
        layers.attend(q[0], k[0], v[0], mask[0, 0], 512 ** -0.5)
    assert len(calls) == 1
