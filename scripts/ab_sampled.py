"""Sampled decoding (temperature > 0) with its acceptance and DFlash's draw inside captured steps, against the
eager forms, in one process: the same prompts, seeds and drafters, interleaved prompt by prompt.

    PYTHONPATH=. python scripts/ab_sampled.py --model M.gguf [--dataset mt_bench] [--num-prompts 80] [-n 128]
        [-t 1] [--drafts none ngram mtp dflash] [-k 3] [--json out.json]
    PYTHONPATH=. python scripts/ab_sampled.py --shape smollm2-135m [--num-prompts 8]   # random weights and drafters

Variants (each a generator and drafter of its own, so nothing is recaptured between them):
- ``eager``: acceptance by ~40 eager kernels a step (SPECDEC_STATIC_ACCEPT=0), DFlash's block returning its logits
  and torch.multinomial drawing outside it (SPECDEC_DFLASH_STATIC_SAMPLING=0);
- ``accept``: acceptance on its captured step (engine/acceptance.py StaticAcceptance), DFlash as in ``eager``;
- ``both``: ``accept`` and DFlash's draw inside its block (DFlash configurations only): the defaults since
  2026-12-06 (H100 results in BENCHMARKS.md);
- ``eager+scan``, ``accept+scan``, ``both+scan``: the same with sampling's sums by the blocked scan
  (sampling.BLOCKED_SCAN, on by default since 2026-12-06 (third)): other draws, so compared with each other (``accept+scan``'s ``differ``
  counts against ``eager+scan``).
The script sets each variant's switches itself, whatever the environment says.
``eager`` and ``accept`` draw the same uniforms from the same generators, so every configuration's tokens must be
equal between them (counted: ``differ``); ``both`` draws DFlash's drafts another way (inverse CDF), so its DFlash
outputs differ, not its distribution (tests/test_dflash.py). Prints one row per configuration and variant: tok/s,
the ratio to the configuration's ``eager``, to plain decoding's ``eager``, tau, and ms a step (draft, verify).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from specdec.bench import load_prompts
from specdec import sampling as sampling_mod
from specdec.drafters import dflash as dflash_mod
from specdec.drafters.factory import make_drafter
from specdec.engine import SpeculativeGenerator
from specdec.sampling import SamplingParams

# name -> (static accept, DFlash's draw in its step, the blocked scan); a variant's ``differ`` counts its outputs that
# differ from those of the variant with the eager acceptance and the same draws (eager, eager+scan)
VARIANTS = {"eager": (False, False, False), "accept": (True, False, False), "both": (True, True, False),
            "eager+scan": (False, False, True), "accept+scan": (True, False, True), "both+scan": (True, True, True)}
SAME_DRAWS = {"accept": "eager", "accept+scan": "eager+scan"}


def random_drafter(spec: str, model):
    """A random drafter of the published shape for ``--shape`` (bench --shape's): DFlash 5 layers, block 16;
    an MTP head (Qwen3.5: its block) drafting sampled tokens. Rarely accepted: the steps' costs are what count."""
    from specdec.bench_shape import _dflash
    from specdec.drafters.mtp import MTPDrafter
    from specdec.drafters.mtp_dir import new_mtp_block
    torch.manual_seed(0)  # every variant's drafter the same random weights (their tokens are compared)
    if spec == "dflash":
        return _dflash(model)[0]
    if spec == "mtp":
        return MTPDrafter(new_mtp_block(model).to(model.dtype).eval(), model)
    raise SystemExit(f"--shape: drafters none, ngram, mtp and dflash, not {spec!r}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a checkpoint (HF dir or GGUF) with its tokenizer")
    src.add_argument("--shape", help="a published shape, random weights (bench --shape names them): random prompts")
    ap.add_argument("--dataset", default="mt_bench")
    ap.add_argument("--num-prompts", type=int, default=80)
    ap.add_argument("-n", "--new-tokens", type=int, default=128)
    ap.add_argument("-t", "--temperature", type=float, default=1.0)
    ap.add_argument("--drafts", nargs="+", default=["none", "ngram", "mtp", "dflash"])
    ap.add_argument("-k", type=int, default=3, help="drafts a step for ngram and mtp (DFlash: its block - 1)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.temperature <= 0:
        ap.error("-t must be > 0: the variants differ in sampled decoding only")
    dev = torch.device(a.device)
    if a.shape:
        from specdec.shapes import build_shape
        model = build_shape(a.shape, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)
        loaded, eos = model, ()
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, model.config.vocab_size, (100,), generator=g).tolist() for _ in range(a.num_prompts)]
    else:
        from specdec.loading import load_model
        loaded = load_model(a.model, a.device)
        model, tok = loaded.model, loaded.tokenizer
        eos = tok.eos_ids
        prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t[0]}]), add_special=False)
                   for t in load_prompts(a.dataset, a.num_prompts)]
    gens = {}
    for spec in a.drafts:
        for v in a.variants:
            if v.startswith("both") and not spec.startswith("dflash"):
                continue  # the same as ``accept`` but for DFlash
            d = make_drafter(spec, loaded) if (spec in ("none", "ngram") or not a.shape) else random_drafter(spec, model)
            k = (d.block_size - 1) if getattr(d, "block_size", None) else (a.k if d is not None else 0)
            gens[(spec, v)] = SpeculativeGenerator(model, d, k)
            gens[(spec, v)].static_accept = VARIANTS[v][0]

    def run(key, ids, seed):
        g = gens[key]
        dflash_mod.STATIC_SAMPLING = VARIANTS[key[1]][1]
        sampling_mod.BLOCKED_SCAN = VARIANTS[key[1]][2]
        p = SamplingParams(temperature=a.temperature, seed=seed)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        r = g.generate(ids, a.new_tokens, p, eos_ids=eos)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return r, time.perf_counter() - t0

    switches = dflash_mod.STATIC_SAMPLING, sampling_mod.BLOCKED_SCAN  # given back after the runs
    for key in gens:  # warm-up: every step captured before the timed prompts
        run(key, prompts[0], 0)
    stats = {key: {"s": 0.0, "tokens": 0, "steps": 0, "accepted": 0, "draft_s": 0.0, "verify_s": 0.0, "outs": []}
             for key in gens}
    for i, ids in enumerate(prompts):
        for key in gens:
            r, s = run(key, ids, 1000 + i)
            st = stats[key]
            st["s"] += s
            st["tokens"] += r.stats.new_tokens
            st["steps"] += r.stats.steps
            st["accepted"] += sum(r.stats.accepted)
            st["draft_s"] += r.stats.draft_s
            st["verify_s"] += r.stats.verify_s
            st["outs"].append(r.token_ids)
    dflash_mod.STATIC_SAMPLING, sampling_mod.BLOCKED_SCAN = switches
    rows = []
    plain = stats.get(("none", "eager"))
    for (spec, v), st in stats.items():
        ref = stats.get((spec, "eager"))
        same = stats.get((spec, SAME_DRAWS.get(v)))
        tps = st["tokens"] / st["s"]
        steps = max(st["steps"], 1)
        row = {"drafter": spec, "variant": v, "tok_s": round(tps, 1), "tau": round((st["accepted"] + st["steps"]) / steps, 3),
               "x_eager": round(tps / (ref["tokens"] / ref["s"]), 3) if ref else None,
               "x_plain": round(tps / (plain["tokens"] / plain["s"]), 3) if plain else None,
               "draft_ms": round(1e3 * st["draft_s"] / steps, 3), "verify_ms": round(1e3 * st["verify_s"] / steps, 3),
               "differ": sum(x != y for x, y in zip(st["outs"], same["outs"])) if same else None}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if a.json:
        meta = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
                "model": a.model or a.shape, "dataset": None if a.shape else a.dataset, "prompts": len(prompts),
                "new_tokens": a.new_tokens, "temperature": a.temperature, "k": a.k}
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
