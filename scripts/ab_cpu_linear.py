"""The CPU's linear layers on oneDNN (``specdec.cpu_linear``, the default) against MKL's ``F.linear``, in one process;
``--compare pack``: oneDNN with packed weights (the default) against the plain layout.

The embedded SmolLM2-135M-Instruct target and each drafter configuration are loaded once; every prompt
runs each configuration with ``cpu_linear.ENABLED`` on and off in turn (interleaved, so drift on a shared
machine falls on both alike). Reports per configuration and backend: tok/s, tau, the ratio to plain
decoding on the same backend, oneDNN's speed-up over MKL, and how many outputs differ between the two
backends (fp32 rounding may move a near-tie; greedy output is still checked equal to plain decoding on
each backend).

    PYTHONPATH=. python scripts/ab_cpu_linear.py --num-prompts 10 -n 128 [--drafts none mtp dflash] [--compare mkl|pack]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from specdec import cpu_linear
from specdec.api import LLM
from specdec.bench import load_prompts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafts", nargs="+", default=["none", "mtp", "dflash"])
    p.add_argument("--dataset", default="gsm8k")
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("-n", "--max-new-tokens", type=int, default=128)
    p.add_argument("--compare", choices=("mkl", "pack"), default="mkl")
    p.add_argument("--json")
    a = p.parse_args()
    prompts = [turns[0] for turns in load_prompts(a.dataset, a.num_prompts)]
    llms = {d: LLM(draft=None if d == "none" else d, device="cpu", num_draft_tokens=3 if d.startswith("mtp") else 4)
            for d in a.drafts}
    new, old = ("onednn", "mkl") if a.compare == "mkl" else ("packed", "unpacked")
    backends = {new: True, old: False}

    def switch(on: bool) -> None:
        if a.compare == "mkl":
            cpu_linear.ENABLED = on
        else:
            cpu_linear.PACK = on
    stats = {(d, b): {"tokens": 0, "seconds": 0.0, "steps": 0, "accepted": 0} for d in a.drafts for b in backends}
    outs: dict[tuple[str, str], list[list[int]]] = {k: [] for k in stats}
    for i, prompt in enumerate(prompts):
        for d, llm in llms.items():
            for b, on in (backends.items() if i % 2 == 0 else reversed(backends.items())):
                switch(on)
                t0 = time.perf_counter()
                r = llm.generate(prompt, a.max_new_tokens, chat=True)
                dt = time.perf_counter() - t0
                s = stats[(d, b)]
                s["tokens"] += len(r.token_ids)
                s["seconds"] += dt
                s["steps"] += len(r.stats.accepted)
                s["accepted"] += sum(r.stats.accepted)
                outs[(d, b)].append(list(r.token_ids))
        print(f"prompt {i + 1}/{len(prompts)} done", flush=True)
    switch(True)
    rows = []
    for d in a.drafts:
        for b in backends:
            s = stats[(d, b)]
            tps = s["tokens"] / s["seconds"]
            base = stats[("none", b)]["tokens"] / stats[("none", b)]["seconds"] if "none" in a.drafts else float("nan")
            differ_plain = sum(x != y for x, y in zip(outs[(d, b)], outs[("none", b)])) if "none" in a.drafts else None
            rows.append({"draft": d, "backend": b, "tokens_per_s": round(tps, 2),
                         "x_plain_same_backend": round(tps / base, 3),
                         "tau": round((s["accepted"] + s["steps"]) / s["steps"], 3) if s["steps"] else None,
                         "outputs_differing_from_plain": differ_plain})
        on, off = stats[(d, new)], stats[(d, old)]
        rows[-2][f"x_{old}"] = round((on["tokens"] / on["seconds"]) / (off["tokens"] / off["seconds"]), 3)
        rows[-2][f"outputs_differing_{new}_vs_{old}"] = sum(x != y for x, y in zip(outs[(d, new)], outs[(d, old)]))
    print(f"machine: {torch.get_num_threads()} threads, torch {torch.__version__} | {a.dataset} x{len(prompts)} | "
          f"max_new_tokens {a.max_new_tokens} | T=0 | fp32 cpu")
    keys = ["draft", "backend", "tokens_per_s", "x_plain_same_backend", "tau", f"x_{old}",
            "outputs_differing_from_plain", f"outputs_differing_{new}_vs_{old}"]
    print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(str(r.get(k, "")) for k in keys) + " |")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"compare": a.compare, "dataset": a.dataset, "num_prompts": len(prompts), "max_new_tokens": a.max_new_tokens,
                       "torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
