"""What ``--compile`` buys per step: the target's static step (1 and 16 rows) and, with ``--dflash``,
the DFlash drafter's greedy propose, each with and without torch.compile.

    python scripts/profile_compile.py --model M [--device cuda] [--dflash DIR] [--json out.json]

Each step is built as the engine builds it (``GraphedTarget``; on CUDA captured as a CUDA graph,
elsewhere run uncaptured) at a context of ``--context`` tokens. Reported: the median ms of
``--reps`` calls after warm-up (each call synchronized), the first call's seconds (compilation,
warm-up and capture: the start-up cost of ``--compile``), and how far the compiled step's logits
lie from the uncompiled one's. Inductor keeps compiled kernels on disk: ``--fresh`` disables that
cache so the first call shows the full compile time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specdec.bench import git_commit, machine_description
from specdec.loading import load_model
from specdec.models.graphs import GraphedTarget
from specdec.sampling import SamplingParams

ROWS = (1, 16)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timed(fn, dev: torch.device) -> float:
    _sync(dev)
    t0 = time.perf_counter()
    fn()
    _sync(dev)
    return time.perf_counter() - t0


def _median_ms(fn, dev: torch.device, reps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    return round(1e3 * statistics.median(_timed(fn, dev) for _ in range(reps)), 4)


@torch.inference_mode()
def target_step(model, rows: int, compile: bool, context: int, reps: int) -> dict:
    """One static step of ``rows`` rows at position ``context``: first-call s, median ms, logits."""
    dev = model.device
    g = torch.Generator().manual_seed(0)
    cache = model.new_cache(context + rows + 1, spare=max(ROWS))
    model(torch.randint(0, model.config.vocab_size, (context,), generator=g).to(dev), cache, logits="last")
    steps = GraphedTarget(model, cache, (), max_steps=max(ROWS), use_graphs=dev.type == "cuda", compile=compile)
    ids = torch.randint(0, model.config.vocab_size, (rows,), generator=g).to(dev)
    out = {}

    def first():
        out["logits"] = steps(ids).logits.float().clone()
        cache.rollback(context)

    first_s = _timed(first, dev)
    step = steps.steps[rows]
    steps.start.fill_(context)  # replays rewrite the same positions context .. context + rows - 1
    ms = _median_ms(step.replay, dev, reps)
    return {"first_call_s": round(first_s, 3), "ms": ms, "logits": out["logits"]}


@torch.inference_mode()
def dflash_propose(loaded, path: str, compile: bool, context: int, reps: int) -> dict:
    """The DFlash drafter's greedy propose (its static block) after ``context`` tokens."""
    from specdec.drafters.dflash import load_dflash_drafter

    model, dev = loaded.model, loaded.model.device
    d = load_dflash_drafter(path, loaded)
    d.static_steps, d.compile = True, compile  # the static block also off CUDA, as the engine runs it
    ids = torch.randint(0, model.config.vocab_size, (context,), generator=torch.Generator().manual_seed(1)).to(dev)
    cache = model.new_cache(context)
    d.begin(ids, model(ids, cache, capture=d.capture_layers, logits="last"))
    k, last, params = d.block_size - 1, int(ids[-1]), SamplingParams()
    out = {}

    def propose():
        out["tokens"] = d.propose(last, k, params, None).tokens

    first_s = _timed(propose, dev)
    return {"k": k, "first_call_s": round(first_s, 3), "ms": _median_ms(propose, dev, reps), "tokens": out["tokens"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="HF checkpoint directory or .gguf file")
    ap.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when available)")
    ap.add_argument("--dtype", default=None, help="default: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--dflash", default=None, metavar="DIR", help="also time this DFlash drafter's propose")
    ap.add_argument("--context", type=int, default=512, help="context tokens before the step (default 512)")
    ap.add_argument("--reps", type=int, default=50, help="timed calls per step (median; default 50)")
    ap.add_argument("--threads", type=int, default=None, help="CPU intra-op threads (tiny models on the CPU: 1)")
    ap.add_argument("--fresh", action="store_true", help="disable inductor's on-disk cache (full compile times)")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON to FILE")
    a = ap.parse_args()
    if a.fresh:
        import torch._inductor.config as inductor_config
        inductor_config.force_disable_caches = True
    if a.threads:
        torch.set_num_threads(a.threads)
    loaded = load_model(a.model, a.device, a.dtype)
    model, dev = loaded.model, loaded.model.device
    rows_out = []
    for rows in ROWS:
        off = target_step(model, rows, False, a.context, a.reps)
        on = target_step(model, rows, True, a.context, a.reps)
        diff = (on["logits"] - off["logits"]).abs().max().item()
        same = bool(torch.equal(on["logits"].argmax(-1), off["logits"].argmax(-1)))
        rows_out.append({"step": f"target {rows} row{'s' if rows > 1 else ''}", "rows": rows,
                         "ms": off["ms"], "compiled_ms": on["ms"], "speedup": round(off["ms"] / on["ms"], 3),
                         "first_call_s": off["first_call_s"], "compiled_first_call_s": on["first_call_s"],
                         "max_abs_logit_diff": diff, "same_argmax": same})
    if a.dflash:
        off = dflash_propose(loaded, a.dflash, False, a.context, a.reps)
        on = dflash_propose(loaded, a.dflash, True, a.context, a.reps)
        rows_out.append({"step": f"dflash propose k={off['k']}", "rows": off["k"] + 1,
                         "ms": off["ms"], "compiled_ms": on["ms"], "speedup": round(off["ms"] / on["ms"], 3),
                         "first_call_s": off["first_call_s"], "compiled_first_call_s": on["first_call_s"],
                         "max_abs_logit_diff": None, "same_argmax": bool(torch.equal(on["tokens"], off["tokens"]))})
    report = {"machine": machine_description(dev), "commit": git_commit(), "model": a.model,
              "dtype": str(model.dtype).replace("torch.", ""), "device": str(dev), "cuda_graphs": dev.type == "cuda",
              "context": a.context, "reps": a.reps, "fresh_compile_cache": a.fresh, "torch": torch.__version__,
              "rows": rows_out}
    print(f"{report['machine']} | commit {report['commit']} | {report['dtype']} on {report['device']} | "
          f"cuda_graphs={report['cuda_graphs']} | context {a.context} | median of {a.reps}")
    cols = ["step", "ms", "compiled_ms", "speedup", "first_call_s", "compiled_first_call_s", "max_abs_logit_diff",
            "same_argmax"]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows_out:
        print("| " + " | ".join("" if r[c] is None else f"{r[c]:.3g}" if isinstance(r[c], float) and c ==
                                "max_abs_logit_diff" else str(r[c]) for c in cols) + " |")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=2)


if __name__ == "__main__":
    main()
