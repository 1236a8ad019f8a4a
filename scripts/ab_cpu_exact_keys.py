"""``--batch-invariant`` on the CPU with the exact attention's key counts rounded up to ``cpu_exact.KEY_BLOCK``
and without (each row's own count, at least ``MIN_KEYS``), in one process: every prompt runs each setting in turn,
plain decoding and the drafters named. The first prompt of each setting is reported apart, since it carries
oneDNN's first-sight cost of each new matmul shape; its outputs are checked equal across the settings.

    PYTHONPATH=. python scripts/ab_cpu_exact_keys.py --num-prompts 6 -n 128 --drafts none mtp dflash [--blocks 1 64]
"""

from __future__ import annotations

import argparse
import time

from specdec import cpu_exact
from specdec.api import LLM
from specdec.bench import load_prompts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, nargs="+", default=[1, 64], help="KEY_BLOCK values (1: no rounding)")
    p.add_argument("--drafts", nargs="+", default=["none", "mtp", "dflash"])
    p.add_argument("--dataset", default="gsm8k")
    p.add_argument("--num-prompts", type=int, default=6)
    p.add_argument("-n", "--max-new-tokens", type=int, default=128)
    a = p.parse_args()
    prompts = [t[0] for t in load_prompts(a.dataset, a.num_prompts)]
    spec = [d for d in a.drafts if d != "none"]
    llms = {d: LLM(draft=d, batch_invariant=True, num_draft_tokens=3) for d in spec or ["ngram"]}
    if "none" in a.drafts:  # plain decoding: a drafter's LLM with speculation off
        llms = {"none": next(iter(llms.values())), **({d: llms[d] for d in spec})}
    cells = {(d, b): [0.0, 0, 0.0, 0] for d in a.drafts for b in a.blocks}  # first prompt s, tokens; the rest
    outs: dict = {}
    for i, text in enumerate(prompts):
        for d, llm in llms.items():
            for b in a.blocks:
                cpu_exact.KEY_BLOCK = b
                t0 = time.perf_counter()
                r = llm.generate(text, a.max_new_tokens, chat=True, speculative=d != "none")
                dt = time.perf_counter() - t0
                c = cells[(d, b)]
                c[0 if i == 0 else 2] += dt
                c[1 if i == 0 else 3] += len(r.token_ids)
                outs.setdefault(i, set()).add(tuple(r.token_ids))
    print(f"{'draft':8s} {'KEY_BLOCK':>9s} | first prompt tok/s | other prompts tok/s")
    for (d, b), (f_s, f_n, r_s, r_n) in cells.items():
        print(f"{d:8s} {b:9d} | {f_n / f_s:18.2f} | {r_n / r_s if r_s else 0:19.2f}")
    print(f"prompts whose outputs differ between settings or drafters: {sum(len(v) > 1 for v in outs.values())} "
          f"of {len(prompts)}")


if __name__ == "__main__":
    main()
