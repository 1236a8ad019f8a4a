"""DFlash on the CPU with its blocks cut at several confidence floors (``dflash.CPU_MIN_CONFIDENCE``, or
``CPU_MIN_SAMPLED_CONFIDENCE`` with ``-t`` above 0), plain decoding and the MTP head beside them, in one process:
every prompt runs each configuration in turn.

    PYTHONPATH=. python scripts/ab_dflash_confidence.py --num-prompts 10 -n 128 --floors 0 0.2 0.3 0.4 [--dataset gsm8k] [-t 1]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from specdec.api import LLM
from specdec.bench import load_prompts
from specdec.drafters import dflash


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--floors", type=float, nargs="+", default=[0.0, 0.3])
    p.add_argument("-k", type=int, default=3, help="MTP's drafts a step")
    p.add_argument("--dataset", default="gsm8k")
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("-n", "--max-new-tokens", type=int, default=128)
    p.add_argument("-t", "--temperature", type=float, default=0.0,
                   help="above 0: sampled blocks, the floors set dflash.CPU_MIN_SAMPLED_CONFIDENCE; seed = prompt index")
    p.add_argument("--json")
    a = p.parse_args()
    prompts = [turns[0] for turns in load_prompts(a.dataset, a.num_prompts)]
    plain, dfl, mtp_llm = (LLM(draft=d, device="cpu", num_draft_tokens=a.k) for d in (None, "dflash", "mtp"))
    runs = [("none", plain, None), (f"mtp k={a.k}", mtp_llm, None)] + [(f"dflash floor={f}", dfl, f) for f in a.floors]
    stats = {name: {"tokens": 0, "seconds": 0.0, "steps": 0, "accepted": 0, "outputs": []} for name, _, _ in runs}
    for i, prompt in enumerate(prompts):
        for name, llm, floor in runs if i % 2 == 0 else runs[::-1]:
            if floor is not None:
                setattr(dflash, "CPU_MIN_SAMPLED_CONFIDENCE" if a.temperature > 0 else "CPU_MIN_CONFIDENCE", floor)
            t0 = time.perf_counter()
            r = llm.generate(prompt, a.max_new_tokens, chat=True, temperature=a.temperature, seed=i)
            s = stats[name]
            s["seconds"] += time.perf_counter() - t0
            s["tokens"] += len(r.token_ids)
            s["steps"] += len(r.stats.accepted)
            s["accepted"] += sum(r.stats.accepted)
            s["outputs"].append(list(r.token_ids))
        print(f"prompt {i + 1}/{len(prompts)} done", flush=True)
    base = stats["none"]["tokens"] / stats["none"]["seconds"]
    rows = []
    for name, s in stats.items():
        tps = s["tokens"] / s["seconds"]
        rows.append({"config": name, "tokens_per_s": round(tps, 2), "x_plain": round(tps / base, 3),
                     "tau": round((s["accepted"] + s["steps"]) / s["steps"], 3) if s["steps"] else 1.0,
                     "outputs_differing_from_plain": None if a.temperature > 0 else sum(x != y for x, y in zip(s["outputs"], stats["none"]["outputs"]))})
    print(f"{torch.get_num_threads()} threads, torch {torch.__version__} | {a.dataset} x{len(prompts)} | "
          f"max_new_tokens {a.max_new_tokens} | T={a.temperature} | fp32 cpu")
    print("| config | tok/s | x plain | tau | outputs differing from plain |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['tokens_per_s']} | {r['x_plain']} | {r['tau']} | {'n/a (sampled)' if r['outputs_differing_from_plain'] is None else r['outputs_differing_from_plain']} |")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"dataset": a.dataset, "temperature": a.temperature, "num_prompts": len(prompts), "max_new_tokens": a.max_new_tokens,
                       "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
