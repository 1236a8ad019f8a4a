"""Run every target/drafter path once on a device: greedy lossless check, tau and speed.

    python scripts/device_check.py --device cuda [--dtypes bfloat16 float32] [--out report.json]

Builds mid-size random checkpoints with transformers (Llama; Qwen3.5 dense and MoE with an MTP
block) and random DFlash drafters for them, then for each dtype compares every drafter's greedy
output with plain greedy decoding of the same target and times both. Random weights make the
drafts mostly wrong, so tau is near 1 here: this checks that paths run and stay lossless.
"""

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from specdec.drafters.factory import make_drafter  # noqa: E402
from specdec.engine import SpeculativeGenerator  # noqa: E402
from specdec.loading import load_model  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402


def build(root: str) -> dict:
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM,
                              Qwen3_5MoeTextConfig, Qwen3_5TextConfig)
    from _dflash_util import write_drafter
    from _qwen35_util import read_tensors, write_tensors

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

    torch.manual_seed(0)
    h, vocab = (int(os.environ.get("DC_HIDDEN", 1024)), 32000)
    out = {}
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=h, intermediate_size=2816, num_hidden_layers=12,
                                         num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096))
    out["llama"] = (os.path.join(root, "llama"), 12)
    llama.save_pretrained(out["llama"][0])
    text = dict(vocab_size=vocab, hidden_size=h, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                head_dim=128, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                linear_num_key_heads=8, linear_num_value_heads=16, max_position_embeddings=4096,
                full_attention_interval=4,
                rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                 "mrope_section": [11, 11, 10], "mrope_interleaved": True})
    dense = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text, intermediate_size=2816))
    moe = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**text, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                                                    num_experts=32, num_experts_per_tok=4))
    for name, m in (("qwen35", dense), ("qwen35moe", moe)):
        p = os.path.join(root, name)
        m.save_pretrained(p)
        add_mtp_tensors(p, "model.layers.3.", seed=1)  # layer 3 is a full-attention layer: same shapes as the MTP layer
        cfg = json.load(open(os.path.join(p, "config.json")))
        cfg["mtp_num_hidden_layers"] = 1
        json.dump(cfg, open(os.path.join(p, "config.json"), "w"))
        out[name] = (p, 8)
    drafters = {}
    for name, (p, n_layers) in out.items():
        d = os.path.join(root, name + "-dflash")
        write_drafter(d, hidden=h, num_target_layers=n_layers, n_layers=2, target_layer_ids=(1, n_layers // 2, n_layers - 2),
                      block_size=16, heads=16, kv_heads=4, head_dim=64, inter=2816, dtype=torch.bfloat16)
        drafters[name] = d
    return {k: (v[0], drafters[k]) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as root:
        models = build(root)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 32000, (n,), generator=g).tolist() for n in (17, 70)]
        for dtype in a.dtypes:
            for name, (path, dflash) in models.items():
                loaded = load_model(path, a.device, dtype)
                specs = ["ngram", f"dflash:{dflash}"] + (["mtp"] if name.startswith("qwen35") else [])
                configs = {"none": SpeculativeGenerator(loaded.model, None, 0)}
                for s in specs:
                    d = make_drafter(s, loaded)
                    k = d.block_size - 1 if getattr(d, "block_size", None) else 3
                    configs[s.split(":")[0]] = SpeculativeGenerator(loaded.model, d, k)
                base = None
                for label, gen in configs.items():
                    gen.generate(prompts[1], a.new_tokens)  # warm-up (graph capture, clocks)
                    t_all, toks, same, steps, acc, d_s, v_s = 0.0, 0, 0, 0, 0, 0.0, 0.0
                    outs = []
                    for p in prompts:
                        if a.device.startswith("cuda"):
                            torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        r = gen.generate(p, a.new_tokens, SamplingParams())
                        if a.device.startswith("cuda"):
                            torch.cuda.synchronize()
                        t_all += time.perf_counter() - t0
                        toks += r.stats.new_tokens
                        steps += r.stats.steps
                        acc += sum(r.stats.accepted)
                        d_s += r.stats.draft_s
                        v_s += r.stats.verify_s
                        outs.append(r.token_ids)
                    if base is None:
                        base = outs
                    first_diff = []
                    for o, b in zip(outs, base):
                        same += o == b
                        first_diff.append(next((i for i, (x, y) in enumerate(zip(o, b)) if x != y), None))
                    if os.environ.get("DC_PROFILE") == label and name == "llama":
                        from torch.profiler import ProfilerActivity, profile
                        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                            gen.generate(prompts[0], 16, SamplingParams())
                        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
                    # sampling path smoke test
                    s = gen.generate(prompts[0], 16, SamplingParams(temperature=0.8, top_p=0.95, seed=1))
                    row = {"target": name, "dtype": dtype, "draft": label, "tok_per_s": round(toks / t_all, 1),
                           "tau": round((acc + steps) / max(steps, 1), 3), "greedy_equal": f"{same}/{len(prompts)}",
                           "draft_ms_per_step": round(1e3 * d_s / max(steps, 1), 2),
                           "verify_ms_per_step": round(1e3 * v_s / max(steps, 1), 2),
                           "first_divergence": first_diff, "sampled_tokens": s.stats.new_tokens}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
                del loaded, configs
                torch.cuda.empty_cache() if a.device.startswith("cuda") else None
    if a.out:
        json.dump(rows, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
