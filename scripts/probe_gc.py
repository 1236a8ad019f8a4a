"""How much of a generation's host time Python's garbage collector takes, with one drafter configuration
built in the process and with many (as `specdec bench` builds them), and after ``gc.freeze()``.

    PYTHONPATH=. python scripts/probe_gc.py [--device cuda] [--configs 1 9] [--prompts 4] [-n 128]

Prints, per setting: live objects tracked by the collector, collections of each generation during the timed
generations, their total time, and that time per generated token.
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
    every = bench_configs(ALL, [1, 2, 3, 4], [16, 8])
    every = [every[0], every[1]] + every[2:]  # none, dflash bs=16 first
    clock = GcClock()
    params = SamplingParams()
    for n_cfg in a.configs:
        for freeze in (False, True):
            gens = []
            for label, spec, k, bs in every[:n_cfg]:
                d = make_drafter(spec, loaded, block_size=bs if spec.startswith("dflash") else None)
                if d is not None and getattr(d, "block_size", None):
                    k = d.block_size - 1
                gens.append((label, SpeculativeGenerator(loaded.model, d, k)))
            for _, g in gens:
                g.generate(tok.encode("Hello"), 8, params, eos_ids=tok.eos_ids)
            gc.collect()
            if freeze:
                gc.freeze()
            tracked = len(gc.get_objects())
            g = gens[1][1]
            clock.reset()
            t0, toks = time.perf_counter(), 0
            for ids in prompts:
                toks += len(g.generate(ids, a.n, params, eos_ids=tok.eos_ids).token_ids)
            if a.device == "cuda":
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            print(f"configs {n_cfg:2d} freeze {freeze!s:5} | tracked objects {tracked:8d} | collections gen0/1/2 "
                  f"{clock.count} | gc {clock.total * 1e3:8.1f} ms of {wall * 1e3:8.1f} ms "
                  f"({clock.total / max(toks, 1) * 1e6:6.1f} us a token, {toks} tokens)", flush=True)
            gc.unfreeze()
            del gens, g
            gc.collect()


if __name__ == "__main__":
    main()
