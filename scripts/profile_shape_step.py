"""Where a static target step's GPU time goes, on a random-weight target of a published shape:
the captured step's median ms (uncompiled and compiled), then the kernels of one step, uncaptured and
(CUDA) one replay of the captured graph (torch.profiler), grouped by name, with the span from the first
kernel's start to the last one's end (the kernels' sum plus the gaps between them), what each kernel name
adds to that span (``span_added_ms``: under PDL a kernel's own duration counts its wait for the kernel
before it; an idle gap before a kernel counts as its own), and the bytes the step must read and the bound they imply.

    python scripts/profile_shape_step.py --shape qwen3-8b [--rows 16] [--pad-to 16] [--context 512] [--cache N] [--compile]
    python scripts/profile_shape_step.py --shape smollm2-135m --drafter dflash|mtp [--context 512] [--compile]

``--drafter``: a random drafter's step instead (``specdec bench --shape``'s: DFlash of 5 layers, block 16,
or an MTP block at k = 3): its proposal and, for DFlash, the context write of ``--rows`` committed rows,
each timed and profiled like the target's step.

``--pad-to N``: the step runs as N rows of which ``--rows`` are real (plain decoding's padded step:
``--rows 1 --pad-to 16``; its kernels skip the padding rows' work where they follow ``StepContext.live``).

``--cache``: the cache's positions (default: the context and two steps); the kernels of the uncaptured
step are listed for each mode run (uncompiled, and compiled with ``--compile``).
"""

from __future__ import annotations

import argparse
import json

import torch

from specdec.bench_shape import _median_ms, bandwidth, decode_bytes
from specdec.models.base import ForwardOut
from specdec.models.graphs import GraphedTarget
from specdec.shapes import build_shape


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--pad-to", type=int, default=0, help="run the step as this many rows, --rows of them real")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--cache", type=int, default=0, help="cache positions (default: context + 2 * rows + 2)")
    ap.add_argument("--compile", action="store_true", help="also time the compiled step")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--device", default="cuda", help="cuda (cpu: a smoke test, nothing captured or profiled)")
    ap.add_argument("--drafter", choices=["dflash", "mtp"], default=None, help="profile this drafter's step instead")
    ap.add_argument("--timeline", default=None, help="write the captured step's kernels in start order to this JSON "
                    "file: [name, start us, duration us, us added to the span]")
    a = ap.parse_args()
    dev = torch.device(a.device)
    m = build_shape(a.shape, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)
    if a.drafter:
        print(json.dumps(profile_drafter(m, a, dev), indent=1))
        return
    total, per_token, _ = decode_bytes(m, a.context)
    bw = bandwidth(dev, 256 << 20, 10)
    if a.pad_to and a.pad_to < a.rows:
        ap.error("--pad-to must be at least --rows")
    if a.timeline and dev.type != "cuda":
        ap.error("--timeline profiles the captured step: CUDA only")
    res = {"shape": a.shape, "rows": a.rows, "pad_to": a.pad_to or None, "context": a.context, "cache": a.cache or None, "bound_ms": round(per_token / bw * 1e3, 3)}
    ids = torch.randint(0, min(1000, m.config.vocab_size), (a.rows,), device=dev)
    for comp in ([False, True] if a.compile else [False]):
        for graphs in ((True, False) if dev.type == "cuda" else (False,)):
            width = max(a.rows, a.pad_to)
            cache = m.new_cache(a.cache or a.context + 2 * width + 2, spare=width)
            with torch.inference_mode():
                m(torch.randint(0, min(1000, m.config.vocab_size), (a.context,), device=dev), cache, logits="last")
            st = GraphedTarget(m, cache, (), max_steps=max(a.rows, a.pad_to), use_graphs=graphs, compile=comp)

            def one():
                st(ids, rows=a.pad_to or None)
                cache.rollback(a.context)
            key = ("compiled " if comp else "") + ("captured" if graphs else "uncaptured")
            res[key + "_ms"] = round(_median_ms(one, dev, 20), 3)
            if dev.type == "cuda" or not graphs:
                kernels(one, dev, a.top, res, ("compiled_" if comp else "") + ("captured_" if graphs else ""),
                        a.timeline if graphs and not comp else None)
    print(json.dumps(res, indent=1))


def kernels(one, dev, top: int, res: dict, pre: str, timeline: str | None = None) -> None:
    """One call of ``one`` (after a warm one) under torch.profiler: its kernels grouped by name into
    ``res`` (count, ms), their sum, and the span from the first kernel's start to the last one's end."""
    one()
    cuda = dev.type == "cuda"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU]) as prof:
        one()
        if cuda:
            torch.cuda.synchronize()
    kern, spans = {}, []
    for e in prof.events():
        if e.device_type == (torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU):
            spans.append((e.time_range.start, e.time_range.end, e.name[:90]))
            k = kern.setdefault(e.name[:90], [0, 0.0])
            k[0] += 1
            k[1] += e.device_time_total / 1e3 if hasattr(e, "device_time_total") else e.cuda_time_total / 1e3
    ranked = sorted(kern.items(), key=lambda kv: -kv[1][1])[:top]
    if spans:  # first kernel's start to last kernel's end: the busy time plus the gaps
        res[pre + "span_ms"] = round((max(e for _, e, _ in spans) - min(s for s, _, _ in spans)) / 1e3, 3)
        res[pre + "span_added_ms"] = [(n, c, round(ms, 3)) for n, (c, ms) in span_added(spans)[:top]]
        if timeline:
            with open(timeline, "w") as f:
                json.dump(ordered(spans), f)
    res[pre + "kernels"] = sum(v[0] for v in kern.values())
    res[pre + "kernel_ms_total"] = round(sum(v[1] for v in kern.values()), 3)
    res[pre + "top_kernels"] = [(n, c, round(ms, 3)) for n, (c, ms) in ranked]


def _adds(spans: list[tuple[float, float, str]]):
    """``(start, end, name, added)`` in start order: under PDL a kernel starts before the one ahead of it ends and
    waits, so its own duration counts that wait; it adds only how far its end passes the latest end before it (the
    first kernel its start-to-end). The adds sum to the span."""
    last = None
    for s, e, name in sorted(spans):
        yield s, e, name, (e - s if last is None else max(0.0, e - last))
        last = e if last is None else max(last, e)


def ordered(spans: list[tuple[float, float, str]]) -> list[tuple[str, float, float, float]]:
    """The kernels in start order: ``(name, start, duration, added)`` in us from the first start (:func:`_adds`)."""
    first = min(s for s, _, _ in spans)
    return [(name, round(s - first, 2), round(e - s, 2), round(add, 2)) for s, e, name, add in _adds(spans)]


def span_added(spans: list[tuple[float, float, str]]) -> list[tuple[str, tuple[int, float]]]:
    """What each kernel name adds to the span (:func:`_adds`), largest first: ``(name, (count, ms))`` (us in)."""
    added: dict[str, list] = {}
    for _, _, name, add in _adds(spans):
        a = added.setdefault(name, [0, 0.0])
        a[0] += 1
        a[1] += add / 1e3
    return sorted(((n, (c, ms)) for n, (c, ms) in added.items()), key=lambda kv: -kv[1][1])


def profile_drafter(m, a, dev) -> dict:
    """The random ``--drafter``'s steps after a ``--context``-token prompt: the proposal (for DFlash
    also the context write of ``--rows`` rows), timed (median ms) and profiled, plain and (with
    ``--compile``) compiled."""
    from specdec.bench_shape import _dflash, _mtp
    from specdec.sampling import SamplingParams

    res = {"shape": a.shape, "drafter": a.drafter, "context": a.context, "rows": a.rows}
    greedy = SamplingParams()
    prompt = torch.randint(0, min(1000, m.config.vocab_size), (a.context,), device=dev)
    for comp in ([False, True] if a.compile else [False]):
        d, k, _ = (_dflash if a.drafter == "dflash" else _mtp)(m)
        d.compile = comp
        cache = m.new_cache(a.context + 64, spare=16)
        with torch.inference_mode():
            out = m(prompt, cache, capture=tuple(d.capture_layers), logits="last")
        d.begin(prompt, out)
        pre = "compiled_" if comp else ""

        if a.drafter == "mtp":  # past the prompt's catch-up: each timed proposal starts from one observed row
            d.propose(7, k, greedy, None)
            d.observe(prompt[:1], ForwardOut(logits=None, hidden=out.hidden[-1:], captured=None))
            saved = (d.length, list(d._pending_h), list(d._pending_t), d._last_h)

        def propose():
            if a.drafter == "mtp":
                d.length, d._pending_h, d._pending_t, d._last_h = saved[0], list(saved[1]), list(saved[2]), saved[3]
                d._fed_last = False
            d.propose(7, k, greedy, None)
        res[pre + "propose_ms"] = round(_median_ms(propose, dev, 20), 3)
        if dev.type == "cuda":
            kernels(propose, dev, a.top, res, pre + "propose_")
        if a.drafter == "dflash":
            rows = min(a.rows, d.block_size)
            feats = out.captured[:rows].clone()
            fake = ForwardOut(logits=None, hidden=out.hidden[:rows], captured=feats)
            length = d.length

            def flush():
                d.length, d._written = length, length  # the same positions each time
                d.observe(prompt[:rows], fake)
                d.catch_up()
            res[pre + f"flush_{rows}_rows_ms"] = round(_median_ms(flush, dev, 20), 3)
            if dev.type == "cuda":
                kernels(flush, dev, a.top, res, pre + "flush_")
    return res


if __name__ == "__main__":
    from specdec.errors import SpecdecError
    try:
        main()
    except SpecdecError as e:  # bad input (an unknown shape, ...): one line, no traceback
        raise SystemExit(f"profile_shape_step.py: {e}")
