"""A wide DFlash drafter's static steps on the fused kernels (drafters/dflash_fast.py) on the GPU, against its eager
block: a random drafter of ``specdec bench --shape``'s layout (5 layers, block 16) on a random target of a published
shape; along a greedy generation with its drafts, each block's logits from the fast static block against the eager
``block_logits`` of the same context (relative max difference, argmax agreement), the generation against plain
decoding, and the drafter's propose time with the fast steps on and off (SPECDEC_DFLASH_FAST's module switch).
With --int8 the checked drafter's fast steps run on int8 weights (``use_int8_weights``), against an eager copy of it on
the int8 rows' values over the same context, and the timings add the int8 fast steps.

    python scripts/check_dflash_fast.py [--shape qwen3-8b] [--context 300] [-n 64] [--int8] [--json F]
"""
from __future__ import annotations

import argparse
import copy
import json
import time

import torch

from specdec.bench_shape import _dflash
from specdec.drafters import dflash_fast
from specdec.drafters.dflash import DFlashDrafter
from specdec.models.fused_layer import int8_values_
from specdec.engine import SpeculativeGenerator
from specdec.sampling import SamplingParams
from specdec.shapes import build_shape


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--json", default=None)
    ap.add_argument("--int8", action="store_true")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("check_dflash_fast: needs CUDA (tests/_interpret_kernels.py dflash-fast checks the path on the CPU)")
    dev = torch.device("cuda")
    model = build_shape(a.shape, dev, torch.bfloat16)
    drafter, k, _ = _dflash(model)
    rep = {"shape": a.shape, "device": torch.cuda.get_device_name(), "eligible": dflash_fast.eligible(drafter.model),
           "int8": a.int8}
    eager = drafter
    if a.int8:
        drafter.use_int8_weights()
        eager = DFlashDrafter(int8_values_(copy.deepcopy(drafter.model)), model)
    prompt = torch.randint(0, min(1000, model.config.vocab_size), (a.context,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    diffs, agree, fast = [], [], []
    propose = drafter.propose

    def checked(last, kk, params, gen):
        drafter.catch_up()
        if eager is not drafter:  # the same context buffers, the eager block on the int8 rows' values
            eager.kv, eager.length, eager._written = drafter.kv, drafter.length, drafter._written
        want = eager.block_logits(last)  # the eager block over the same context
        out = propose(last, kk, params, gen)  # the greedy static block
        st = drafter._static_block(SamplingParams(temperature=1.0), logits=True)
        got = st(last, drafter.length)
        fast.append(st.fast is not None)
        diffs.append(((got - want).abs().max() / want.abs().max().clamp(min=1.0)).item())
        agree.append((got.argmax(-1) == want.argmax(-1)).float().mean().item())
        return out
    drafter.propose = checked
    spec = SpeculativeGenerator(model, drafter, k).generate(prompt, a.n)
    drafter.propose = propose
    plain = SpeculativeGenerator(model, None, 0).generate(prompt, a.n)
    rep.update(blocks=len(diffs), fast_blocks=sum(fast), max_rel_diff=max(diffs), min_argmax_agreement=min(agree),
               mean_argmax_agreement=sum(agree) / len(agree), output_equals_plain=spec.token_ids == plain.token_ids)
    runs = (("on", True, False), ("off", False, False)) + ((("int8", True, True),) if a.int8 else ())
    for name, on, int8 in runs:  # the propose's time with the fast steps on and off (new static steps each)
        dflash_fast.ENABLED = on
        d2, _, _ = _dflash(model)
        if int8:
            d2.use_int8_weights()
        gen = SpeculativeGenerator(model, d2, k)
        gen.generate(prompt, a.n)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        r = gen.generate(prompt, a.n)
        torch.cuda.synchronize()
        rep[f"fast_{name}"] = {"draft_ms_per_step": round(1e3 * r.stats.draft_s / r.stats.steps, 3),
                                                 "verify_ms_per_step": round(1e3 * r.stats.verify_s / r.stats.steps, 3),
                                                 "tok_per_s": round(len(r.token_ids) / (time.perf_counter() - t0), 1),
                                                 "fast_weights": d2._fast_w is not None}
    dflash_fast.ENABLED = True
    print(json.dumps(rep, indent=1))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump(rep, fh, indent=1)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
