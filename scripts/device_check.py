"""Device check: speculative output equals plain output, bit for bit, with drafters that are accepted.

    python scripts/device_check.py build DIR                      # random checkpoints + drafters
    python scripts/device_check.py run DIR --target T --mode graphs|eager --out F.json
    python scripts/device_check.py compare F1.json F2.json ... [--out report.json]
    python scripts/device_check.py time-forms DIR --out F.json    # cost of the recurrent verify form

Targets (random, transformers 5.x, hidden 1024): Llama (12 layers), Qwen3.5 dense and Qwen3.5 MoE
(8 layers, every 4th full attention, 64 experts top-4 + shared (16-row steps take the fused MoE kernels); both with a random MTP block),
each with a random 2-layer DFlash drafter of block 16, Gemma 3 (12 layers, window 64) and Gemma 4 MoE (8 layers,
window 64, 128 experts top 8 beside the dense MLP, keys as values in its full layers). Drafters: ``ngram``, ``mtp`` (K=3;
``mtp-vocab``, ``dflash-vocab``: over a draft vocabulary of every other token id and the prompt's),
``dflash`` (block 16) and ``oracle``: the target's own plain greedy continuation with each draft
spoiled (a wrong id) with probability 0.3, so most drafts are accepted and every spoiled one
forces a rollback. Random drafters are almost never accepted (tau ~1) and would leave rollback
unexercised; the oracle is what makes this a check of exactness. Random weights also make logits
nearly flat, so near-ties are everywhere: any bit that depends on a position's row flips tokens.

``run`` decodes every prompt plainly, then with each drafter, and records the token ids;
``compare`` checks, per target, that every drafter's output equals plain output in the same mode
and that the graphs and eager modes agree, and prints the table for BENCHMARKS.md.
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from _engine_util import SpoiledOracle, chunked_verify_form  # noqa: E402
from specdec.drafters.factory import make_drafter  # noqa: E402
from specdec.engine import SpeculativeGenerator  # noqa: E402
from specdec.loading import load_model  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402

VOCAB = 32000
TARGETS = {"llama": 12, "qwen3": 12, "qwen35": 8, "qwen35moe": 8, "gemma3": 12, "gemma4": 8, "gemma4e": 10}


def build(root: str) -> None:
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM,
                              Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM)
    from _dflash_util import write_drafter
    from _qwen35_util import read_tensors, write_tensors

    h = 1024
    torch.manual_seed(0)

    def add_mtp_tensors(path, layer_prefix, seed):
        t = read_tensors(path)
        gen = torch.Generator().manual_seed(seed)
        t["mtp.fc.weight"] = torch.randn(h, 2 * h, generator=gen) * 0.02
        for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            t[f"mtp.{n}.weight"] = torch.randn(h, generator=gen) * 0.1
        for name, v in list(t.items()):
            if name.startswith(layer_prefix):
                t["mtp.layers.0." + name[len(layer_prefix):]] = v.clone()
        write_tensors(path, t)

    LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=h, intermediate_size=2816, num_hidden_layers=12,
                                 num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096)
                     ).save_pretrained(os.path.join(root, "llama"))
    # Qwen3 (q/k norms, heads of 128): its layers take cuBLAS and the residual fold, not the fused layer
    Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, hidden_size=h, intermediate_size=2816, num_hidden_layers=12,
                                 num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                                 max_position_embeddings=4096)).save_pretrained(os.path.join(root, "qwen3"))
    text = dict(vocab_size=VOCAB, hidden_size=h, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                head_dim=128, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                linear_num_key_heads=8, linear_num_value_heads=16, max_position_embeddings=4096,
                full_attention_interval=4,
                rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                 "mrope_section": [11, 11, 10], "mrope_interleaved": True})
    dense = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text, intermediate_size=2816))
    moe = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**text, moe_intermediate_size=512,
                                                    shared_expert_intermediate_size=512, num_experts=64,
                                                    num_experts_per_tok=4))
    for name, m in (("qwen35", dense), ("qwen35moe", moe)):
        p = os.path.join(root, name)
        m.save_pretrained(p)
        add_mtp_tensors(p, "model.layers.3.", seed=1)  # layer 3 is full attention: the MTP layer's shapes
        cfg = json.load(open(os.path.join(p, "config.json")))
        cfg["mtp_num_hidden_layers"] = 1
        json.dump(cfg, open(os.path.join(p, "config.json"), "w"))
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    # Gemma 3: 5 sliding-window layers (window 64, so prompts of 70-300 tokens cross it) per global one. Its head is
    # untied: tied, a random Gemma 3's greedy output repeats one token (1-4 distinct of 128 in the H200's and the H100's
    # runs checked, to 2026-12-06 (tenth): its sqrt(hidden)-scaled embedding outweighs the random layers, so the token
    # in is the token out), whose wide margins no row's last bit can flip; untied, 83-102 distinct of 128 (H100)
    Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=h, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=8,
        num_key_value_heads=4, head_dim=128, query_pre_attn_scalar=128, sliding_window=64, tie_word_embeddings=False,
        max_position_embeddings=4096, rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                       "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    ).save_pretrained(os.path.join(root, "gemma3"))
    # Gemma 4 MoE (the 26b-a4b shape's layout, smaller): 3 sliding layers (window 64) per full one whose keys are its
    # values (one KV head of 256), 128 experts top 8 (so a padded 16-row step's 128 pairs take the expert kernels)
    # beside the dense GELU MLP, untied head; norm weights, router scales and layer scalars randomised (as
    # tests/test_gemma4.py does) so that a mis-wired one shows
    try:
        from transformers import Gemma4ForCausalLM, Gemma4TextConfig
    except ImportError:  # a transformers before Gemma 4: the other targets still get built
        print("device_check build: this transformers has no Gemma 4; gemma4 not built", flush=True)
        Gemma4ForCausalLM = None
    if Gemma4ForCausalLM is not None:
        _build_gemma4(root, Gemma4ForCausalLM, Gemma4TextConfig, h)
    for name, n_layers in TARGETS.items():
        if name.startswith("gemma"):
            continue  # DFlash drafters for Gemma targets are not supported yet
        write_drafter(os.path.join(root, name + "-dflash"), hidden=h, num_target_layers=n_layers, n_layers=2,
                      target_layer_ids=(1, n_layers // 2, n_layers - 1), block_size=16, heads=16, kv_heads=4,
                      head_dim=64, inter=2816, dtype=torch.bfloat16)


def _build_gemma4(root: str, model_cls, config_cls, h: int) -> None:
    """The random Gemma 4 targets: the MoE and the small one (see build)."""
    s, f = "sliding_attention", "full_attention"
    g4 = model_cls(config_cls(
        vocab_size=VOCAB, hidden_size=h, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, head_dim=128, global_head_dim=256, num_global_key_value_heads=1, attention_k_eq_v=True,
        enable_moe_block=True, num_experts=128, top_k_experts=8, moe_intermediate_size=128,
        hidden_size_per_layer_input=0, num_kv_shared_layers=0, sliding_window=64, layer_types=[s, s, s, f] * 2,
        tie_word_embeddings=False, final_logit_softcapping=30.0, max_position_embeddings=4096,
        rope_parameters={f: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
                         s: {"rope_type": "default", "rope_theta": 1e4}}))
    from _gemma_util import randomise_gemma4
    randomise_gemma4(g4).save_pretrained(os.path.join(root, "gemma4"))
    # a small Gemma 4 (E2B's layout, smaller): four sliding layers (window 64, one KV head of 128) per full one (one
    # of 256), the last five reusing the keys and values of the last earlier layer of their type, with MLPs twice as
    # wide; a 64-wide per-layer input into every layer; an untied head (a tied random one repeats a token)
    g4e = model_cls(config_cls(
        vocab_size=VOCAB, hidden_size=h, intermediate_size=1536, num_hidden_layers=10, num_attention_heads=8,
        num_key_value_heads=1, head_dim=128, global_head_dim=256, attention_k_eq_v=False, enable_moe_block=False,
        hidden_size_per_layer_input=64, vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=5,
        use_double_wide_mlp=True, sliding_window=64, layer_types=[s, s, s, s, f] * 2, tie_word_embeddings=False,
        final_logit_softcapping=30.0, max_position_embeddings=4096,
        rope_parameters={f: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
                         s: {"rope_type": "default", "rope_theta": 1e4}}))
    randomise_gemma4(g4e).save_pretrained(os.path.join(root, "gemma4e"))


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    lengths = [17, 70, 150, 300, 40, 220][:n]
    return [torch.randint(0, VOCAB, (m,), generator=g).tolist() for m in lengths]


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(gen, prompt, n):
    _sync()
    t0 = time.perf_counter()
    r = gen.generate(prompt, n, SamplingParams())
    _sync()
    return r, time.perf_counter() - t0


def chat_prompts(loaded, path: str, n: int) -> list[list[int]]:
    """The first ``n`` gsm8k questions as chat prompts (real weights)."""
    tok = loaded.tokenizer
    qs = [json.loads(line)["question"] for line in open(path)][:n]
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special=False) for q in qs]


def mutate(kind: str) -> None:
    """Bring back a known row dependence, to show that this check fails on it."""
    if kind == "chunked":
        from specdec.models import deltanet
        deltanet.use_fused_kernel = False
        deltanet.recurrent_gated_delta = chunked_verify_form
    elif kind == "grouped":
        from specdec.models import moe
        moe.Experts.static_form = lambda self, t, live, x: False


def run(a) -> None:
    if a.mutate:
        mutate(a.mutate)
    loaded = load_model(a.model or os.path.join(a.dir, a.target), a.device, a.dtype)
    graphs = a.mode == "graphs"
    ps = chat_prompts(loaded, a.gsm8k, a.prompts) if a.gsm8k else prompts(a.prompts)
    rows = []

    def record(label, gen, make=None):
        gen.generate(ps[0][:8], 16)  # warm-up: graph capture, clocks
        for i, p in enumerate(ps):
            if make is not None:
                gen.drafter = make(i)
            r, dt = _timed(gen, p, a.new_tokens)
            s = r.stats
            rows.append({"target": a.target, "mode": a.mode, "draft": label, "prompt": i, "tokens": r.token_ids,
                         "tok_per_s": round(len(r.token_ids) / dt, 1), "tau": round(s.tau, 3), "steps": s.steps,
                         "verify_ms": round(1e3 * s.verify_s / max(s.steps, 1), 3),
                         "draft_ms": round(1e3 * s.draft_s / max(s.steps, 1), 3)})
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "tokens"}), flush=True)
        json.dump(rows, open(a.out, "w"))  # what finished survives a time-out

    record("none", SpeculativeGenerator(loaded.model, None, 0, cuda_graphs=graphs))
    plain = [r["tokens"] for r in rows]
    for spec in a.drafters:
        if spec == "oracle":
            gen = SpeculativeGenerator(loaded.model, SpoiledOracle([], loaded.model.config.vocab_size), 3, cuda_graphs=graphs)
            record("oracle", gen, lambda i: SpoiledOracle(ps[i] + plain[i], loaded.model.config.vocab_size, seed=i))
            continue
        kind = spec.removesuffix("-vocab")  # X-vocab: drafter X over a draft vocabulary of every other token id
        if kind == "dflash" and (a.model or a.target.startswith("gemma")):
            continue
        if kind == "mtp" and not a.model and not a.target.startswith("qwen35"):
            continue
        d = make_drafter(f"dflash:{os.path.join(a.dir, a.target + '-dflash')}" if kind == "dflash" else kind, loaded)
        if spec.endswith("-vocab"):
            d.use_draft_vocab(range(0, loaded.model.config.vocab_size, 2))
        k = d.block_size - 1 if getattr(d, "block_size", None) else 3
        record(spec, SpeculativeGenerator(loaded.model, d, k, cuda_graphs=graphs))
    json.dump(rows, open(a.out, "w"))


def compare(a) -> None:
    rows = [r for f in a.files for r in json.load(open(f))]
    plain = {(r["target"], r["mode"], r["prompt"]): r["tokens"] for r in rows if r["draft"] == "none"}
    table, failures = {}, 0
    for r in rows:
        ref = plain[(r["target"], r["mode"], r["prompt"])]
        other = plain.get((r["target"], "eager" if r["mode"] == "graphs" else "graphs", r["prompt"]))
        same = r["tokens"] == ref
        first = next((i for i, (x, y) in enumerate(zip(r["tokens"], ref)) if x != y), None)
        t = table.setdefault((r["target"], r["draft"], r["mode"]), {"n": 0, "same": 0, "vs_other_mode": 0, "first": [],
                                                                     "tau": [], "verify_ms": [], "draft_ms": [], "tok_s": []})
        t["n"] += 1
        t["same"] += same
        t["vs_other_mode"] += other is not None and r["tokens"] == other
        t["other_n"] = t.get("other_n", 0) + (other is not None)
        t["first"].append(first)
        for key, col in (("tau", "tau"), ("verify_ms", "verify_ms"), ("draft_ms", "draft_ms"), ("tok_s", "tok_per_s")):
            t[key].append(r[col])
        failures += not same
    # a target whose plain output repeats a few tokens has wide margins: no drafter's rows can flip them, and the
    # check then sees little (the tied random Gemma 3 before 2026-12-06 (tenth)): its distinct tokens are printed
    distinct = {}
    for (target, mode, _), tokens in plain.items():
        distinct.setdefault((target, mode), []).append(len(set(tokens)))
    print("| target | drafter | mode | equal to plain | plain equal across modes | tau | verify ms/step | "
          "draft ms/step | tok/s | distinct tokens in plain outputs |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    report = []
    for (target, draft, mode), t in sorted(table.items()):
        mean = lambda xs: round(sum(xs) / len(xs), 2)  # noqa: E731
        print(f"| {target} | {draft} | {mode} | {t['same']}/{t['n']} | {t['vs_other_mode']}/{t['other_n']} | {mean(t['tau'])} "
              f"| {mean(t['verify_ms'])} | {mean(t['draft_ms'])} | {mean(t['tok_s'])} | {distinct[(target, mode)]} |")
        report.append({"target": target, "draft": draft, "mode": mode, "plain_distinct": distinct[(target, mode)],
                       **{k: v for k, v in t.items()}})
    weak = sorted({target for (target, _), d in distinct.items() if min(d) < 8})
    if weak:
        print(f"WARNING: plain outputs of {', '.join(weak)} repeat fewer than 8 distinct tokens: a weak check there")
    print(f"outputs differing from plain decoding: {failures}")
    if a.out:
        json.dump(report, open(a.out, "w"), indent=1)


def time_forms(a) -> None:
    """ms per plain decode step (16-row graphed static step) with the recurrent verify form (now)
    and the chunked one (before), on the hybrid targets."""
    from specdec.models import deltanet

    recurrent, chunked = deltanet.recurrent_gated_delta, chunked_verify_form
    forms = (("fused", True, recurrent), ("torch-recurrent", False, recurrent), ("chunked", False, chunked),
             ("fused", True, recurrent))
    out = []
    for target in ("qwen35", "qwen35moe"):
        loaded = load_model(os.path.join(a.dir, target), "cuda", "bfloat16")
        for form, fused, fn in forms:
            deltanet.use_fused_kernel = fused
            deltanet.recurrent_gated_delta = fn
            gen = SpeculativeGenerator(loaded.model, None, 0)
            gen.generate(prompts(1)[0], 16)
            r, dt = _timed(gen, prompts(2)[1], 256)
            row = {"target": target, "form": form, "ms_per_step": round(1e3 * r.stats.verify_s / r.stats.steps, 3)}
            print(json.dumps(row), flush=True)
            out.append(row)
        deltanet.recurrent_gated_delta, deltanet.use_fused_kernel = recurrent, True
    json.dump(out, open(a.out, "w"))


def kernel_check(a) -> None:
    """The fused DeltaNet kernel against the torch recurrence (close), and its row invariance
    (bitwise): position i of a 16-row call equals the 1-row call from the state before i."""
    from specdec.models import delta_kernel, deltanet

    g = torch.Generator(device="cuda").manual_seed(0)
    t, h, dk, dv = 16, 16, 128, 128
    q = torch.nn.functional.normalize(torch.randn(t, h, dk, device="cuda", generator=g), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(t, h, dk, device="cuda", generator=g), dim=-1)
    v = torch.randn(t, h, dv, device="cuda", generator=g)
    gate = -torch.rand(t, h, device="cuda", generator=g) * 2
    beta = torch.rand(t, h, device="cuda", generator=g)
    s0 = torch.randn(h, dk, dv, device="cuda", generator=g)
    o, st = delta_kernel.recurrent_gated_delta_fused(q, k, v, gate, beta, s0)
    o_ref, st_ref = deltanet.recurrent_gated_delta(q, k, v, gate, beta, s0)
    err = max(float((o - o_ref).abs().max()), float((st - st_ref).abs().max()))
    bitwise = 0
    for i in range(t):
        prev = s0 if i == 0 else st[i - 1]
        o1, st1 = delta_kernel.recurrent_gated_delta_fused(q[i:i + 1], k[i:i + 1], v[i:i + 1], gate[i:i + 1],
                                                           beta[i:i + 1], prev)
        bitwise += bool(torch.equal(o1[0], o[i]) and torch.equal(st1[0], st[i]))
    print(json.dumps({"kernel_vs_torch_max_abs": err, "rows_bitwise_equal_to_1row_calls": f"{bitwise}/{t}"}))
    if err > 1e-4 or bitwise != t:
        raise SystemExit("fused DeltaNet kernel check failed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("dir")
    r = sub.add_parser("run")
    r.add_argument("dir")
    r.add_argument("--target", required=True, help=f"{', '.join(TARGETS)} in DIR, or a label for --model")
    r.add_argument("--model", default=None, help="real weights (HF dir or GGUF) instead of DIR/TARGET")
    r.add_argument("--gsm8k", default=None, help="gsm8k .jsonl: chat prompts instead of random ids")
    r.add_argument("--mode", choices=["graphs", "eager"], required=True)
    r.add_argument("--drafters", nargs="+", default=["oracle", "ngram", "mtp", "dflash"],
                   help="also mtp-vocab, dflash-vocab: over a draft vocabulary (every other id, and the prompt's)")
    r.add_argument("--prompts", type=int, default=4)
    r.add_argument("--new-tokens", type=int, default=256)
    r.add_argument("--out", required=True)
    r.add_argument("--device", default="cuda")
    r.add_argument("--mutate", choices=["chunked", "grouped"], default=None,
                   help="bring back a known row dependence (chunked verify form, grouped MoE) to see the check fail")
    r.add_argument("--dtype", default="bfloat16")
    c = sub.add_parser("compare")
    c.add_argument("files", nargs="+")
    c.add_argument("--out", default=None)
    t = sub.add_parser("time-forms")
    t.add_argument("dir")
    t.add_argument("--out", required=True)
    sub.add_parser("kernel-check")
    a = ap.parse_args()
    {"build": lambda: build(a.dir), "run": lambda: run(a), "compare": lambda: compare(a),
     "time-forms": lambda: time_forms(a), "kernel-check": lambda: kernel_check(a)}[a.cmd]()


if __name__ == "__main__":
    main()
