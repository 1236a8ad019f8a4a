"""``specdec bench --shape``: random targets of published shapes (issue 10). The tiny shape runs end
to end on the CPU; the big ones are checked on the meta device only (no memory)."""

import importlib.util
import json

import pytest
import torch

from specdec.bench_shape import MAX_K, end_to_end, oracle_spoil
from specdec.cli import main
from specdec.errors import ConfigError
from specdec.shapes import SHAPES, build_shape, meta_model, param_count


def _run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_tiny_writes_every_field(tmp_path, capsys, single_thread):
    path = tmp_path / "shape.json"
    rc, out, err = _run(capsys, "bench", "--shape", "tiny", "--device", "cpu", "--context", "32", "--reps", "3",
                        "-n", "160", "--oracle-tau", "4", "--draft-vocab", "100", "--json", str(path))
    assert rc == 0, err
    assert "ORACLE" in out
    r = json.loads(path.read_text())
    for key in ("shape", "machine", "commit", "dtype", "device", "params", "weight_bytes", "context", "decode_ms",
                "verify_ms", "plain_step_ms", "batch_invariant", "bandwidth_bytes_per_s", "decode_bytes_per_token",
                "kv_bytes_at_context", "bound_tokens_per_s", "drafter_ms", "oracle_e2e"):
        assert key in r, key
    assert (r["shape"], r["dtype"], r["device"]) == ("tiny", "float32", "cpu") and r["commit"]
    assert r["decode_ms"] > 0 and r["bandwidth_bytes_per_s"] > 0 and r["bound_tokens_per_s"] > 0
    assert list(r["verify_ms"]) == [str(k) for k in range(1, MAX_K + 1)] and all(v > 0 for v in r["verify_ms"].values())
    embed = 512 * 64 * 4  # tiny's untied embedding table (fp32): a decode step reads one row of it
    assert r["kv_bytes_at_context"] > 0
    assert r["decode_bytes_per_token"] == r["weight_bytes"] - embed + r["kv_bytes_at_context"]
    assert r["drafter_ms"]["dflash (5 layers, block 16)"]["ms"] > 0
    assert r["drafter_ms"]["dflash (5 layers, block 16)"]["step_ms"] > 0  # the proposal after 16 committed rows
    assert r["drafter_ms"]["mtp (1 layer)"]["ms"] > 0  # tiny is a Qwen3 shape: a specdec-trained head's
    for label in ("dflash (5 layers, block 16)", "mtp (1 layer)"):  # each again over 100 vocabulary rows
        whole, part = r["drafter_ms"][label], r["drafter_ms"][f"{label}, draft vocab 100"]
        assert part["ms"] > 0 and part["k"] == whole["k"]
        for d in (whole, part):  # (verify of k + propose) / decode
            want = (r["verify_ms"][str(d["k"])] + d.get("step_ms", d["ms"])) / r["decode_ms"]
            assert abs(d["step_ratio"] - want) < 2e-3 and f"= {d['step_ratio']}x a decode step" in out
    e = r["oracle_e2e"]
    assert "ORACLE" in e["drafter"] and e["output_equals_plain"] and e["new_tokens"] == 160
    assert abs(e["measured_tau"] - 4) < 1.2, e
    assert e["plain_tokens_per_s"] > 0 and e["oracle_tokens_per_s"] > 0
    # decode-only rates leave the prefill out: the tokens after the first over less than the whole
    # time (whether they beat the overall rate depends on the timings: it was a flaky comparison)
    n = e["new_tokens"]
    assert 0 < e["plain_prefill_s"] and 0 < e["oracle_prefill_s"]
    for kind in ("plain", "oracle"):
        assert e[f"{kind}_decode_tokens_per_s"] >= 0.999 * e[f"{kind}_tokens_per_s"] * (n - 1) / n, (kind, e)


def test_wide_rows_are_timed_beside_the_verify_steps(tmp_path, capsys, single_thread, monkeypatch):
    """``--wide-rows``: steps of more rows than a verify (a tree of drafts), timed at the context in the same
    cache, reported apart from ``verify_ms``."""
    from specdec.models import graphs

    seen = []
    call = graphs.GraphedTarget.__call__
    monkeypatch.setattr(graphs.GraphedTarget, "__call__", lambda self, ids, *a, **kw: seen.append(ids.numel())
                        or call(self, ids, *a, **kw))
    path = tmp_path / "shape.json"
    rc, out, err = _run(capsys, "bench", "--shape", "tiny", "--device", "cpu", "--context", "32", "--wide-rows",
                        "48,32", "--reps", "2", "-n", "20", "--json", str(path))
    assert rc == 0, err
    r = json.loads(path.read_text())
    assert list(r["wide_ms"]) == ["32", "48"] and all(v > 0 for v in r["wide_ms"].values())
    assert list(r["verify_ms"]) == [str(k) for k in range(1, MAX_K + 1)]
    assert {32, 48} <= set(seen)  # steps of those many rows really ran
    assert f"wide steps ms by rows: 32:{r['wide_ms']['32']} 48:{r['wide_ms']['48']}" in out


def test_context_sweep_shares_one_cache(tmp_path, capsys, single_thread, monkeypatch):
    """``--contexts``: the decode and plain decoding's steps at each context, timed in one cache
    sized for the largest as decoding sizes its cache, with the bound counted with the KV bytes live at each point."""
    from specdec import bench_shape
    from specdec.models import base

    sizes = []
    new_cache = base.CausalLM.new_cache
    monkeypatch.setattr(base.CausalLM, "new_cache",
                        lambda self, n, *a, **kw: sizes.append(n) or new_cache(self, n, *a, **kw))
    path = tmp_path / "shape.json"
    rc, out, err = _run(capsys, "bench", "--shape", "tiny", "--device", "cpu", "--context", "32", "--contexts",
                        "300,64", "--reps", "2", "-n", "20", "--json", str(path))
    assert rc == 0, err
    r = json.loads(path.read_text())
    from specdec.engine.generate import cache_positions
    assert sizes[0] == cache_positions(300 + MAX_K + 2, 1 << 20) == 1024  # the step costs' one cache, for every point
    pts = r["contexts"]
    assert [p["context"] for p in pts] == [64, 300]
    model = build_shape("tiny", torch.device("cpu"), torch.float32)
    for p in pts:
        assert p["decode_ms"] > 0 and p["step_16_rows_ms"] > 0 and p["plain_step_ms"] == p["decode_ms"]  # not padded on CPU
        _, per_token, kv = bench_shape.decode_bytes(model, p["context"])
        assert (p["kv_bytes"], p["decode_bytes_per_token"]) == (kv, per_token)
        assert p["bound_tokens_per_s"] == pytest.approx(r["bandwidth_bytes_per_s"] / per_token, rel=1e-3)
        assert p["fraction_of_bound"] == pytest.approx(1e3 / p["plain_step_ms"] / p["bound_tokens_per_s"], abs=1e-4)
        assert f"context {p['context']}: decode {p['decode_ms']} ms" in out
    assert pts[1]["kv_bytes"] == pts[0]["kv_bytes"] * 300 // 64


def test_oracle_is_lossless_and_tracks_tau(single_thread):
    model = build_shape("tiny", torch.device("cpu"), torch.float32, seed=3)
    taus = []
    for tau in (1.5, 3.0, 8.0):
        e = end_to_end(model, 16, 240, tau, 15, cuda_graphs=False, batch_invariant=None, seed=1)
        assert e["output_equals_plain"], tau  # the oracle's drafts never change the output
        taus.append(e["measured_tau"])
    assert taus == sorted(taus), taus
    # (independent spoils needed 0.4 / 0.8 / 2.5 here; the low-discrepancy cuts gave 1.53 / 3.04 / 8.54)
    assert abs(taus[0] - 1.5) < 0.2 and abs(taus[1] - 3.0) < 0.4 and abs(taus[2] - 8.0) < 1.2, taus


def test_oracle_cut_follows_the_spoil_law():
    """The oracle's cut (accepted drafts a step): P(cut >= j) = q^j (q = 1 - spoil), at most k, over many steps; its
    low-discrepancy draws realize the asked tau within 1 over 20 steps (independent draws: sd 1.1 at tau 6.5), and a
    generation's start draws the same cuts again."""
    from types import SimpleNamespace

    from specdec.bench_shape import OracleDrafter
    out = SimpleNamespace(hidden=torch.zeros(1))
    for tau in (1.5, 6.5, 12.0):
        q = 1 - oracle_spoil(tau, 15)
        o = OracleDrafter(list(range(50)), 100, 1 - q, seed=0)
        o.begin(torch.zeros(3), out)
        cuts = [o.cut(15) for _ in range(4000)]
        assert min(cuts) >= 0 and max(cuts) <= 15
        for j in range(16):
            assert sum(c >= j for c in cuts) / len(cuts) == pytest.approx(q ** j, abs=0.01), (tau, j)
        for seed in range(10):
            o = OracleDrafter(list(range(50)), 100, 1 - q, seed=seed)
            o.begin(torch.zeros(3), out)
            first = [o.cut(15) for _ in range(20)]
            assert abs(1 + sum(first) / 20 - tau) < 1.0, (tau, seed, first)
            o.begin(torch.zeros(3), out)
            assert [o.cut(15) for _ in range(20)] == first
    o = OracleDrafter(list(range(50)), 100, 1.0, seed=0)
    o.begin(torch.zeros(3), out)
    assert {o.cut(15) for _ in range(50)} == {0}
    o = OracleDrafter(list(range(50)), 100, 0.0, seed=0)
    o.begin(torch.zeros(3), out)
    assert {o.cut(15) for _ in range(50)} == {15}


def test_oracle_spoil_probability():
    assert oracle_spoil(1.0, 15) == pytest.approx(1.0, abs=1e-9)
    assert oracle_spoil(16.0, 15) == pytest.approx(0.0, abs=1e-9)
    q = 1 - oracle_spoil(6.5, 15)
    assert 1 + sum(q ** i for i in range(1, 16)) == pytest.approx(6.5, abs=1e-6)
    with pytest.raises(ConfigError, match="oracle-tau"):
        oracle_spoil(17.0, 15)


# parameters including embeddings (and the untied LM head): the published sizes' orders of magnitude
@pytest.mark.parametrize("name, params", [("qwen3-8b", 8.19e9), ("qwen3.5-9b", 8.95e9), ("qwen3.5-35b-a3b", 34.7e9),
                                          ("gemma4-26b-a4b", 25.2e9), ("gemma4-e2b", 4.63e9), ("gemma4-e4b", 7.46e9),
                                          ("gemma3-270m", 2.68e8),
                                          ("smollm2-135m", 1.35e8),
                                          ("tiny", 2.1e5)])
def test_shapes_build_on_meta(name, params):
    m = meta_model(name)
    assert m.embed_tokens.weight.is_meta
    assert param_count(m) == pytest.approx(params, rel=0.02)


def test_every_shape_is_tested():
    assert set(SHAPES) == {"qwen3-8b", "qwen3.5-9b", "qwen3.5-35b-a3b", "gemma4-26b-a4b", "gemma4-e2b", "gemma4-e4b",
                           "gemma3-270m", "smollm2-135m", "tiny"}


def test_gemma4_moe_shape_runs_scaled_down(monkeypatch, single_thread):
    """The gemma4-26b-a4b shape's structure (dense MLP beside top-k experts, 5 sliding : 1 full with
    k = v, soft cap, tied embeddings, the layer_scalar buffer) scaled down: it builds with finite
    logits, its decode bytes count top_k_experts of the experts, and the oracle run equals plain."""
    from specdec import shapes
    from specdec.bench_shape import decode_bytes, run_shape_bench

    small = dict(shapes.GEMMA4_26B_A4B, vocab_size=512, hidden_size=64, intermediate_size=48, num_hidden_layers=6,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                 num_global_key_value_heads=1, num_experts=8, top_k_experts=2, moe_intermediate_size=16,
                 sliding_window=8, max_position_embeddings=4096, layer_types=["sliding_attention"] * 5 + ["full_attention"])
    monkeypatch.setitem(SHAPES, "gemma4-small", small)
    model = build_shape("gemma4-small", torch.device("cpu"), torch.float32)
    assert all(float(layer.layer_scalar) == 1.0 for layer in model.layers)
    logits = model(torch.arange(20), model.new_cache(32)).logits
    assert torch.isfinite(logits).all() and logits.abs().max() <= 30.0  # soft-capped
    total, per_token, _ = decode_bytes(model, 0)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n) * 4
    assert total - per_token == experts * 6 // 8  # 6 of 8 experts not read per token
    r = run_shape_bench("gemma4-small", device="cpu", context=24, reps=2, new_tokens=48, oracle_tau=4)
    e = r["oracle_e2e"]
    assert e["output_equals_plain"] and e["measured_tau"] > 2, e
    assert r["drafter_ms"]["dflash (5 layers, block 16)"]["ms"] > 0


def test_gemma4_small_shape_runs_scaled_down(monkeypatch, single_thread):
    """The gemma4-e2b shape's structure (KV-shared last layers with double-wide MLPs, a per-layer input into every
    layer, tied embeddings) scaled down: it builds with finite logits, its decode bytes leave out the per-layer
    embedding table but one row of it (a lookup) and count the tied table (the head), and the oracle run equals plain."""
    from specdec import shapes
    from specdec.bench_shape import decode_bytes, run_shape_bench

    small = dict(shapes.GEMMA4_E2B, vocab_size=512, vocab_size_per_layer_input=512, hidden_size=64, intermediate_size=48,
                 num_hidden_layers=5, num_attention_heads=4, head_dim=16, global_head_dim=32,
                 hidden_size_per_layer_input=8, num_kv_shared_layers=2, sliding_window=8, max_position_embeddings=4096,
                 layer_types=["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention", "full_attention"])
    monkeypatch.setitem(SHAPES, "gemma4-e2b-small", small)
    model = build_shape("gemma4-e2b-small", torch.device("cpu"), torch.float32)
    assert [layer.self_attn.shared for layer in model.layers] == [False] * 3 + [True] * 2
    logits = model(torch.arange(20), model.new_cache(32)).logits
    assert torch.isfinite(logits).all() and logits.abs().max() <= 30.0  # soft-capped
    total, per_token, _ = decode_bytes(model, 0)
    assert total - per_token == model.embed_tokens_per_layer.weight.numel() * 4 == 512 * 5 * 8 * 4
    r = run_shape_bench("gemma4-e2b-small", device="cpu", context=24, reps=2, new_tokens=48, oracle_tau=4)
    e = r["oracle_e2e"]
    assert e["output_equals_plain"] and e["measured_tau"] > 2, e


def test_too_big_is_refused_before_allocating():
    with pytest.raises(ConfigError, match=r"shape qwen3-8b: 16\.4 GB of bfloat16 weights do not fit"):
        build_shape("qwen3-8b", torch.device("cpu"), torch.bfloat16, free=10 ** 9)


@pytest.mark.parametrize("argv, culprit", [
    (["--shape", "tiny", "--model", "/nonexistent/m.gguf"], "--model cannot be used with it"),
    (["--shape", "tiny", "--drafts", "none", "ngram"], "--drafts cannot be used with it"),
    (["--shape", "tiny", "--dataset", "humaneval"], "--dataset cannot be used with it"),
    (["--shape", "gpt-5"], "unknown shape 'gpt-5' (known: qwen3-8b,"),
    (["--shape", "tiny", "--context", "5000"], "exceeds shape tiny's 4096 positions"),
    (["--shape", "tiny", "--oracle-tau", "20"], "--oracle-tau 20.0 must lie in [1, 16]"),
    (["--shape", "qwen3.5-35b-a3b", "--device", "cpu", "--dtype", "float32"], "do not fit"),
    (["--model", "/nonexistent/m.gguf", "--oracle-tau", "3"], "--oracle-tau belongs to --shape runs"),
    (["--shape", "tiny", "--contexts", "64,5000"], "--contexts: 5000 must lie in 1..4078"),
    (["--shape", "tiny", "--wide-rows", "32,17"], "--wide-rows: 17 must lie in 18..256"),
    (["--shape", "tiny", "--wide-rows", "300"], "--wide-rows: 300 must lie in 18..256"),
    (["--shape", "tiny", "--context", "4000", "--wide-rows", "128"], "--wide-rows 128 exceeds shape tiny's 4096"),
    (["--shape", "tiny", "--wide-rows", "32", "--compile"], "--wide-rows cannot be used with --compile"),
    (["--model", "/nonexistent/m.gguf", "--wide-rows", "32"], "--wide-rows belongs to --shape runs"),
    (["--shape", "tiny", "--draft-vocab", "hot.json"], "--draft-vocab with --shape is a number of vocabulary rows"),
    (["--shape", "tiny", "--draft-vocab", "513"], "--draft-vocab: 513 must lie in 1..512"),
])
def test_one_line_errors(capsys, argv, culprit):
    rc, out, err = _run(capsys, "bench", *argv)
    assert rc == 2 and err.count("\n") == 1 and culprit in err, err


@pytest.mark.parametrize("value", [",,", "128,x"])
def test_contexts_not_integers_is_a_usage_error(capsys, value):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--shape", "tiny", "--contexts", value])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err.strip().splitlines()[-1].endswith(f"argument --contexts: expected integers separated by commas, got '{value}'")


def test_plot_png_or_one_line_refusal(capsys, tmp_path):
    """--plot writes a PNG where matplotlib is installed, and is refused in one line where not."""
    if importlib.util.find_spec("matplotlib") is None:
        rc, out, err = _run(capsys, "bench", "--shape", "tiny", "--plot", str(tmp_path / "v.png"))
        assert rc == 2 and err.count("\n") == 1 and "--plot needs matplotlib" in err, err
        return
    from specdec.bench_shape import plot_verify

    r = {"shape": "tiny", "dtype": "float32", "device": "cpu", "context": 32, "decode_ms": 1.0,
         "verify_ms": {str(k): 1.0 + k / 10 for k in range(1, MAX_K + 1)},
         "contexts": [{"context": c, "decode_ms": 1.0, "step_16_rows_ms": 1.2, "bound_tokens_per_s": 900.0}
                      for c in (128, 4096)]}
    plot_verify(r, str(tmp_path / "v.png"))
    assert (tmp_path / "v.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("base", ["qwen3.5-9b", "qwen3.5-35b-a3b"])
def test_hybrid_shapes_run_scaled_down(monkeypatch, base, single_thread):
    """The Qwen3.5 shapes' code paths (DeltaNet steps, MoE, the MTP drafter) on a scaled-down copy."""
    from specdec import shapes
    from specdec.bench_shape import run_shape_bench

    small = dict(SHAPES[base], vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16,
                 linear_num_key_heads=2, linear_num_value_heads=4)
    small.update(intermediate_size=128) if "intermediate_size" in small else small.update(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    monkeypatch.setitem(shapes.SHAPES, "small", small)
    r = run_shape_bench("small", device="cpu", context=24, reps=2, new_tokens=64, oracle_tau=3.0,
                        copy_bytes=1 << 20, contexts=(40, 8))  # the recurrent caches filled 8 -> 24 -> 40
    assert [p["context"] for p in r["contexts"]] == [8, 40] and r["contexts"][0]["kv_bytes"] < r["contexts"][1]["kv_bytes"]
    assert set(r["drafter_ms"]) == {"dflash (5 layers, block 16)", "mtp (1 layer)"}
    assert r["oracle_e2e"]["output_equals_plain"] and len(r["verify_ms"]) == MAX_K
    if base == "qwen3.5-35b-a3b":  # a decode step reads the routed experts only
        assert r["decode_bytes_per_token"] < r["weight_bytes"]



def test_compiled_shape_bench_times_the_decoding_steps():
    """``--compile``: only the 1-row and the padded 16-row steps (those decoding runs) are compiled
    and timed, and the compiled oracle run still equals compiled plain decoding."""
    from specdec.bench_shape import run_shape_bench

    r = run_shape_bench("tiny", device="cpu", reps=1, context=16, new_tokens=8, compile=True, batch_invariant=True)
    assert r["compile"] is True and list(r["verify_ms"]) == ["15"] and r["drafter_ms"] == {}
    assert r["oracle_e2e"]["output_equals_plain"] is True


def test_plain_step_rows_follow_the_padding(monkeypatch):
    """The plain step the report names is the one generate runs: 16 rows of which one is real when
    batch-invariant steps are padded, 1 row for a row-exact target (SPECDEC_ROW_EXACT) or without the padding."""
    import specdec.bench_shape as bs
    real = bs.build_shape
    exact = [False]

    def build(*a, **kw):
        m = real(*a, **kw)
        m.row_exact = lambda rows=1: exact[0]
        return m
    monkeypatch.setattr(bs, "build_shape", build)
    kw = dict(device="cpu", reps=1, context=16, new_tokens=4, drafters=False)
    for invariant, row_exact, rows in ((True, False, 16), (True, True, 1), (False, False, 1)):
        exact[0] = row_exact
        r = bs.run_shape_bench("tiny", batch_invariant=invariant, contexts=(24,), **kw)
        assert r["plain_step_rows"] == rows
        assert r["plain_step_ms"] == (r["decode_ms"] if rows == 1 else r["padded_one_real_ms"])
        p = r["contexts"][0]
        assert p["plain_step_ms"] == (p["decode_ms"] if rows == 1 else p["padded_one_real_ms"])


def test_step_floors_count_what_bench_counts():
    """scripts/step_floors.py (issue 10's floors) counts a decode step's bytes as bench's bound does
    (``decode_bytes`` on the same meta model), and its drafter and verify ratios are ordered as they must be."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    import step_floors

    from specdec.bench_shape import decode_bytes
    for name in ("qwen3-8b", "qwen3.5-35b-a3b"):
        f = step_floors.floors(name)
        assert f["decode"] * step_floors.BYTES == decode_bytes(meta_model(name, None).to(torch.bfloat16), 0)[1]
    d = step_floors.floors("qwen3-8b")
    assert d["dflash_propose_151936"] > d["dflash_propose_32768"] > d["dflash_propose_16384"] > 0.1
    m = step_floors.floors("qwen3.5-35b-a3b")
    assert 1 < m["verify_2"] < m["verify_4"] < m["verify_5"] < m["verify_16"] < 16
    assert m["mtp_k3_248320"] > m["mtp_k3_32768"] > m["verify_4"]


class _Seen(Exception):
    pass


def test_default_new_tokens(monkeypatch):
    """-n's default: 512 tokens for --shape (its oracle realizes the asked tau over them), 128 a reply for a prompt
    set; a given -n is kept."""
    import specdec.bench
    import specdec.bench_shape
    import specdec.cli

    seen = []

    def shape_run(shape, **kw):
        seen.append(kw["new_tokens"])
        raise _Seen

    def set_run(model, drafts, dataset, num_prompts, new_tokens, **kw):
        seen.append(new_tokens)
        raise _Seen

    monkeypatch.setattr(specdec.bench_shape, "run_shape_bench", shape_run)
    monkeypatch.setattr(specdec.bench, "run_bench", set_run)
    monkeypatch.setattr(specdec.cli, "_check_model_args", lambda args, drafts: None)
    for argv in (["--shape", "tiny"], ["--shape", "tiny", "-n", "40"], ["--model", "m.gguf"], ["--model", "m.gguf", "-n", "9"]):
        with pytest.raises(_Seen):
            main(["bench", *argv, "--device", "cpu"])
    assert seen == [512, 40, 128, 9]
