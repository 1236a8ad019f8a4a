"""What a prompt's prefill costs, by prompt length, three ways, in one process (variants interleaved):
``eager`` (one forward), ``narrow`` (16-row chunks of the decode step, the default) and ``wide``
(chunks of a ``--rows``-row static step, SPECDEC_PREFILL_ROWS; engine/generate.py). Timed: ``generate``
with one new token (prefill + the first token), median over ``--reps`` after a warm-up that captures
the steps. A random target of a published shape, or real weights on random ids.

    PYTHONPATH=. python scripts/ab_prefill.py --shape qwen3-8b --lengths 64 128 300 600 1000
    PYTHONPATH=. python scripts/ab_prefill.py --model M.gguf --lengths 100 300
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ab_lookahead import load_target  # noqa: E402  (the same target, real or of a shape)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="HF directory or GGUF file")
    src.add_argument("--shape", help="a published shape (specdec bench --shape names them)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 300, 600, 1000])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--rows", type=int, default=128, help="the wide chunks' rows (default 128)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.reps < 1 or min(a.lengths) < 1 or a.rows <= 16:
        print("error: --reps and --lengths must be >= 1, --rows > 16", file=sys.stderr)
        return 2

    from specdec.bench import _sync, machine_description
    from specdec.engine import SpeculativeGenerator
    from specdec.engine import generate as engine_mod
    from specdec.errors import SpecdecError

    try:
        model = load_target(a.model, a.shape, a.device)[0]
    except SpecdecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if max(a.lengths) + 2 > model.max_context:
        print(f"error: --lengths: {max(a.lengths)} exceeds the model's context of {model.max_context}", file=sys.stderr)
        return 2
    dev = model.device
    saved = engine_mod.PREFILL_ROWS
    gens = {}
    for name, rows in (("eager", engine_mod.STEP_ROWS), ("narrow", engine_mod.STEP_ROWS), ("wide", a.rows)):
        engine_mod.PREFILL_ROWS = rows
        gens[name] = SpeculativeGenerator(model)
        engine_mod.PREFILL_ROWS = saved
    gens["eager"].static_prefill = False
    g = torch.Generator().manual_seed(0)
    rows = []
    for n in a.lengths:
        prompt = torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()
        times = {v: [] for v in gens}
        for v, gen in gens.items():
            gen.generate(prompt, 1)  # warm-up: capture, allocator
        for _ in range(a.reps):
            for v, gen in gens.items():
                _sync(dev)
                t0 = time.perf_counter()
                gen.generate(prompt, 1)
                _sync(dev)
                times[v].append(time.perf_counter() - t0)
        row = {"prompt_tokens": n, **{f"{v}_ms": round(1000 * statistics.median(t), 3) for v, t in times.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    rep = {"machine": machine_description(dev), "source": a.model or a.shape,
           "wide_rows": a.rows, "static_prefill_tokens": engine_mod.STATIC_PREFILL_TOKENS, "rows": rows}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rep, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
