"""The split attention kernel's fixed constants, swept on the GPU (each choice gives other bits, so the
shipped ones are one fixed choice per head size, never picked per shape): the keys a program (a split), the keys of an
inner block and the warps (``_tile``; query tile 64 rows), timed as the static steps run it (CUDA
graph) for the shapes and contexts of the issue-10 table (the keys a split: ``split_keys``, by head size), with the KV bytes the live context reads
and the bandwidth that implies. A sweep for choosing the constants, not a check: scripts/check_split_attention.py checks.

    python scripts/sweep_split_attention.py [--json F]
    python scripts/sweep_split_attention.py --decode [--json F]

``--long``: qwen3-8b's attention at 512, 4k and 16k live keys, 1 and 16 rows, 30 calls in a graph on 30 layers' own
keys and values (2 GB at 16k, past the L2): the tile (query rows, inner block, warps, pipeline depth ``_stages``) by the
split schedule (``schedule``: SPLIT-key splits over the first NEAR positions, FAR-key ones past them), then the combine's
chunk (``COMBINE``) 32 for the three of least summed time; each case is timed with the split kernel alone too
("... split", the combine launched as nothing).

``--decode``: the short contexts of a decode step instead (SmolLM2's 16-row step at the spans the static
steps use, qwen3-8b's at 512), with the query tile (16, 32, 64 rows) swept too; 30 calls in a graph,
each on its own layer's keys and values (as a step runs them).
"""
import argparse
import itertools
import json

import torch

from specdec.models import split_attention as sa

from check_split_attention import inputs, timed  # noqa: E402  (scripts/ is on sys.path when run as a script)

CASES = [  # name, heads, kv heads, d, rows (step width), cache positions, live context
    ("smollm2 16 rows ctx 128 cache 8k", 9, 3, 64, 16, 8192, 128),
    ("smollm2 16 rows ctx 8k", 9, 3, 64, 16, 8192, 8000),
    ("qwen3-8b 16 rows ctx 128 cache 16k", 32, 8, 128, 16, 16512, 128),
    ("qwen3-8b 16 rows ctx 4k cache 16k", 32, 8, 128, 16, 16512, 4096),
    ("qwen3-8b 16 rows ctx 16k", 32, 8, 128, 16, 16512, 16384),
    ("qwen3-8b 1 row ctx 16k", 32, 8, 128, 1, 16512, 16384),
]


DECODE = [  # name, heads, kv heads, d, rows, span, live context
    ("smollm2 16 rows ctx 116 span 244", 9, 3, 64, 16, 244, 116),
    ("smollm2 16 rows ctx 300 span 512", 9, 3, 64, 16, 512, 300),
    ("qwen3-8b 16 rows ctx 300 span 512", 32, 8, 128, 16, 512, 300),
]


def decode(path: str | None) -> None:
    shipped = (sa.split_keys, sa._tile, sa._stages, sa.FAR)
    sa._stages, sa.FAR = (lambda d: None), {}  # Triton's pipeline depth, one split size (as this sweep was written)
    rows = []
    for split, bm, block, warps in itertools.product((256, 512), (16, 32, 64), (64, 128), (2, 4, 8)):
        for name, h, hkv, d, t, span, ctx in DECODE:
            if (warps == 8) != (bm == 64) and warps != 4 or (split > 256 and span <= 256):
                continue  # 2 or 4 warps for the small tiles, 4 or 8 for 64 rows; one split either way up to 256
            sa.split_keys = lambda d, s=split: s
            sa._tile = lambda d, m=bm, n=block, w=warps: (m, n, w)
            layers = [inputs(1, h, hkv, d, t, span, [ctx - t], seed=i) for i in range(30)]
            row = {"split": split, "bm": bm, "block": block, "warps": warps, "case": name}
            try:
                row["us"] = round(timed(lambda: [sa.split_attention(q, k, v, m, d ** -0.5) for q, k, v, m in layers],
                                        n=4) / 30, 2)
            except Exception as e:  # e.g. out of shared memory: recorded, not fatal
                row["error"] = f"{type(e).__name__}: {str(e)[:80]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    sa.split_keys, sa._tile, sa._stages, sa.FAR = shipped
    if path:
        json.dump(rows, open(path, "w"), indent=1)


LONG = [  # name, heads, kv heads, d, rows, span, live context
    ("1 row ctx 512 span 1024", 32, 8, 128, 1, 1024, 512),
    ("1 row ctx 4k", 32, 8, 128, 1, 4224, 4096),
    ("1 row ctx 16k", 32, 8, 128, 1, 16512, 16384),
    ("16 rows ctx 512 span 1024", 32, 8, 128, 16, 1024, 512),
    ("16 rows ctx 4k", 32, 8, 128, 16, 4224, 4096),
    ("16 rows ctx 16k", 32, 8, 128, 16, 16512, 16384),
]
LONG_TILES = [(64, 128, 4, None), (64, 128, 4, 2), (16, 128, 4, None), (16, 128, 4, 2), (16, 64, 4, 2)]  # + stages
LONG_SCHEDULES = [(256, 0, 256), (256, 4096, 1024), (256, 2048, 512), (256, 4096, 512), (256, 2048, 1024),
                  (128, 2048, 512), (128, 1024, 256, 4096, 512)]  # (SPLIT, NEAR, FAR), or split_attention.schedule's 5


class _NoLaunch:  # stands in for the combine kernel: split_us times the split kernel alone
    def __getitem__(self, grid):
        return lambda *a, **k: None


def long(path: str | None) -> None:
    shipped = (sa.schedule, sa._tile, sa._stages, sa.COMBINE, sa._combine_kernel)
    cases = [(c, [inputs(1, *c[1:6], [c[6] - c[4]], seed=i) for i in range(30)]) for c in LONG]
    rows = []

    def run(tile, sched, chunk=sa.COMBINE):
        bm, block, warps, stages = tile
        sa.schedule = lambda d, s=sched: (s[0], s[1], s[2], s[1], s[2]) if len(s) == 3 else s  # (SPLIT, NEAR, FAR): 2 tiers
        sa._tile = lambda d, m=bm, n=block, w=warps: (m, n, w)
        sa._stages, sa.COMBINE = (lambda d, n=stages: n), chunk
        row = {"tile": tile, "schedule": sched, "chunk": chunk}
        for (name, h, hkv, d, t, span, ctx), layers in cases:
            call = lambda: [sa.split_attention(q, k, v, m, d ** -0.5) for q, k, v, m in layers]  # noqa: E731
            try:
                row[name] = round(timed(call, n=2) / 30, 2)
                sa._combine_kernel = _NoLaunch()
                row[name + " split"] = round(timed(call, n=2) / 30, 2)
            except Exception as e:  # e.g. out of shared memory: recorded, not fatal
                row[name] = f"{type(e).__name__}: {str(e)[:80]}"
            sa._combine_kernel = shipped[4]
        rows.append(row)
        print(json.dumps(row), flush=True)

    for tile, sched in itertools.product(LONG_TILES, LONG_SCHEDULES):
        run(tile, sched)
    ok = [r for r in rows if all(isinstance(r[c[0]], float) for c in LONG)]
    for r in sorted(ok, key=lambda r: sum(r[c[0]] for c in LONG))[:3]:
        run(r["tile"], r["schedule"], 32)
    sa.schedule, sa._tile, sa._stages, sa.COMBINE, sa._combine_kernel = shipped
    if path:
        json.dump(rows, open(path, "w"), indent=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--decode", action="store_true", help="the decode step's short contexts (see above)")
    ap.add_argument("--long", action="store_true", help="qwen3-8b's decode at long context (see above)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sweep_split_attention: needs CUDA (a GPU run; tests/_interpret_kernels.py split checks the kernel on the CPU)")
    if a.decode:
        return decode(a.json)
    if a.long:
        return long(a.json)
    shipped = (sa.split_keys, sa._tile, sa._stages, sa.FAR)
    sa._stages, sa.FAR = (lambda d: None), {}  # Triton's pipeline depth, one split size (as this sweep was written)
    rows = []
    for split, block, warps in itertools.product((128, 256, 512), (32, 64, 128), (4, 8)):
        if block > split:
            continue
        sa.split_keys = lambda d, s=split: s
        sa._tile = lambda d, n=block, w=warps: (64 if d <= 128 else 32, n, w)
        for name, h, hkv, d, t, span, ctx in CASES:
            q, k, v, mask = inputs(1, h, hkv, d, t, span, [ctx - t])
            try:
                us = timed(lambda: sa.split_attention(q, k, v, mask, d ** -0.5))
            except Exception as e:  # e.g. out of shared memory for a large block: recorded, not fatal
                us = f"{type(e).__name__}: {str(e)[:80]}"
            kv = 2 * hkv * ctx * d * 2
            row = {"split": split, "block": block, "warps": warps, "case": name, "us": us,
                   "GB_s": round(kv / us / 1e3, 1) if isinstance(us, float) else None}
            rows.append(row)
            print(json.dumps(row), flush=True)
    sa.split_keys, sa._tile, sa._stages, sa.FAR = shipped
    if a.json:
        json.dump(rows, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
