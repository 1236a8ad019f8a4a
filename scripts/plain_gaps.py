"""Where plain greedy decoding's time goes between the captured steps (issue 10): a random target of a
published shape, one sequence, CUDA only. Four measures of the same 1-row greedy-chain steps
(``GraphedTarget.greedy_step``), each after its own prefill of the same prompt:

- ``gpu``: the chain replayed back to back, nothing read until the end, a CUDA event before and after
  each replay: the GPU's time a step (by context) and the gap between one step's end and the next's start;
- ``staged``: the same, each step's token staged to the host (``HostReader``) and read one step behind,
  as ``SpeculativeGenerator``'s lookahead reads it;
- ``generate``: ``SpeculativeGenerator.generate`` itself (tok/s after its prefill; on CUDA its prompt runs as
  static chunks, not the one eager forward of the others, so random weights may decode other tokens);
- ``fixed``: the step replayed at one position (rolled back each time), back to back: its cost at each
  context without the chain.

    python scripts/plain_gaps.py --shape smollm2-135m --context 128 -n 256 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

DEVICE = "cuda"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens (random)")
    ap.add_argument("-n", "--new-tokens", type=int, default=256)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: plain_gaps.py needs a CUDA device", file=sys.stderr)
        return 2
    if a.context < 1 or a.new_tokens < 2:
        print("error: --context must be >= 1 and -n >= 2", file=sys.stderr)
        return 2
    from specdec.engine import SpeculativeGenerator
    from specdec.errors import SpecdecError
    from specdec.hostcopy import HostReader
    from specdec.models.graphs import GraphedTarget
    from specdec.sampling import SamplingParams
    from specdec.shapes import build_shape

    dev = torch.device(DEVICE)
    try:
        model = build_shape(a.shape, dev, torch.bfloat16)
    except SpecdecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (a.context,), generator=g)
    n = a.new_tokens
    gen = SpeculativeGenerator(model, None, 0)
    cache = model.new_cache(a.context + n + 32, spare=17)
    steps = GraphedTarget(model, cache, (), max_steps=16, pad_to=gen.pad_to)  # the generator's step rows
    report = {"shape": a.shape, "context": a.context, "new_tokens": n, "step_rows": gen.pad_to or 1}

    @torch.inference_mode()
    def chain(staged: bool):
        cache.rollback(0)
        out = model(prompt.to(dev), cache, logits="last", snapshots=False)
        seed = out.logits[-1].argmax().reshape(1)
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        reader = HostReader(dev, 1) if staged else None
        pending, toks = None, []
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(n):
            ev[i][0].record()
            tok = steps.greedy_step(seed if i == 0 else None)
            ev[i][1].record()
            if staged:
                s = reader.stage(tok)
                if pending is not None:
                    toks += pending.read()
                pending = s
        if pending is not None:
            toks += pending.read()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        step = [b.elapsed_time(e) for b, e in ev]
        gap = [ev[i - 1][1].elapsed_time(ev[i][0]) for i in range(1, n)]
        by_ctx = {}
        for i, ms in enumerate(step):
            by_ctx.setdefault((a.context + i) // 64 * 64, []).append(ms)
        return toks, {"wall_ms_per_token": round(1e3 * wall / n, 4), "gpu_step_ms": round(statistics.median(step), 4),
                "gap_ms": round(statistics.median(gap), 4), "gap_mean_ms": round(statistics.fmean(gap), 4),
                "span_ms_per_token": round(ev[0][0].elapsed_time(ev[-1][1]) / n, 4),
                "step_ms_by_context": {c: round(statistics.median(v), 4) for c, v in sorted(by_ctx.items())}}

    chain(False)  # capture
    report["gpu"] = chain(False)[1]
    report["staged"] = chain(True)[1]
    gen.generate(prompt[:8].tolist(), 8)
    torch.cuda.synchronize()
    r = gen.generate(prompt.tolist(), n, SamplingParams())
    decode_s = r.stats.total_s - r.stats.prefill_s
    report["generate"] = {"ms_per_token": round(1e3 * decode_s / (len(r.token_ids) - 1), 4),
                          "tok_per_s": round((len(r.token_ids) - 1) / decode_s, 2)}
    fixed = {}
    with torch.inference_mode():
        for c in sorted({a.context, a.context + n // 2, a.context + n}):
            cache.rollback(0)
            model(prompt.repeat(c // a.context + 1)[:c].to(dev), cache, logits="last", snapshots=False)
            ids = prompt[:1].to(dev)
            for _ in range(3):
                steps(ids)
                cache.rollback(c)
            b, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            b.record()
            for _ in range(50):
                steps(ids)
                cache.rollback(c)
            e.record()
            torch.cuda.synchronize()
            fixed[c] = round(b.elapsed_time(e) / 50, 4)
    report["fixed_ms_by_context"] = fixed
    print(json.dumps(report, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
