"""Why the DFlash configuration of a `specdec bench` run is slower with more configurations in the process
(session of 2026-12-05 (second), H200: GSM8K 2.24x plain with 7 configurations, 1.91x with 11; its prefill 0.47 ->
0.83 s and host draft time 0.37 -> 0.62 s for 100 prompts, its verify +6 %): holding more configurations, Python's
garbage collector, or running the others between its prompts (as the bench interleaves them).

    PYTHONPATH=. python scripts/probe_gc.py [--model M] [--device cuda] [--configs 2 11] [--prompts 4] [-n 128]

With N configurations built (none, dflash first; then the bench's sweep), DFlash's generations are timed three
ways: back to back, back to back after ``gc.freeze()``, and interleaved (every other configuration generates the
same prompt before it, untimed, as in `specdec bench`). Prints, per way: live objects tracked by the collector,
collections of each generation, their time, and DFlash's tok/s with its prefill / draft / verify seconds.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from specdec.bench import bench_configs, load_prompts
from specdec.drafters.factory import make_drafter
from specdec.engine import SpeculativeGenerator
from specdec.loading import load_model
from specdec.sampling import SamplingParams

ALL = ["none", "dflash", "mtp", "ngram"]


class GcClock:
    def __init__(self):
        self.t0, self.total, self.count = 0.0, 0.0, [0, 0, 0]
        gc.callbacks.append(self)

    def __call__(self, phase, info):
        if phase == "start":
            self.t0 = time.perf_counter()
        else:
            self.total += time.perf_counter() - self.t0
            self.count[info["generation"]] += 1

    def reset(self):
        self.total, self.count = 0.0, [0, 0, 0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a target path (default: the embedded SmolLM2)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--configs", type=int, nargs="+", default=[2, 9], help="configurations built (the first 2: none, dflash)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("-n", type=int, default=128)
    a = p.parse_args()
    from specdec.api import default_model_path
    loaded = load_model(a.model or default_model_path(), a.device, None)
    tok = loaded.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t[0]}]), add_special=False)
               for t in load_prompts("gsm8k", a.prompts)]
    every = bench_configs(ALL, [1, 2, 3, 4], [16, 8])  # none, dflash bs=16 first
    clock = GcClock()
    params = SamplingParams()
    for n_cfg in a.configs:
        gens = []
        for label, spec, k, bs in every[:n_cfg]:
            d = make_drafter(spec, loaded, block_size=bs if spec.startswith("dflash") else None)
            if d is not None and getattr(d, "block_size", None):
                k = d.block_size - 1
            gens.append((label, SpeculativeGenerator(loaded.model, d, k)))
        for _, g in gens:
            g.generate(tok.encode("Hello"), 8, params, eos_ids=tok.eos_ids)
        g = gens[1][1]
        for way in ("alone", "alone+freeze", "interleaved"):
            gc.collect()
            if way == "alone+freeze":
                gc.freeze()
            tracked = len(gc.get_objects())
            clock.reset()
            wall, toks, split = 0.0, 0, [0.0, 0.0, 0.0]
            for ids in prompts:
                if way == "interleaved":
                    for _, other in gens:
                        if other is not g:
                            other.generate(ids, a.n, params, eos_ids=tok.eos_ids)
                if a.device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                st = g.generate(ids, a.n, params, eos_ids=tok.eos_ids).stats
                if a.device == "cuda":
                    torch.cuda.synchronize()
                wall += time.perf_counter() - t0
                toks += st.new_tokens
                split = [split[0] + st.prefill_s, split[1] + st.draft_s, split[2] + st.verify_s]
            gc.unfreeze()
            print(f"configs {n_cfg:2d} {way:12s} | tracked {tracked:7d} | gc gen0/1/2 {clock.count} "
                  f"{clock.total * 1e3:6.1f} ms | dflash {toks / wall:8.1f} tok/s, prefill / draft / verify "
                  f"{split[0]:.3f} / {split[1]:.3f} / {split[2]:.3f} s of {wall:.3f} s ({toks} tokens)", flush=True)
        del gens, g
        gc.collect()

if __name__ == "__main__":
    main()
