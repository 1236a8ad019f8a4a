"""Long fuzz run of the checkpoint loaders (the suite's tests/test_fuzz_loaders.py runs a few dozen
cases; this runs thousands). Needs the test dependencies (transformers) and the embedded SmolLM2.

    python scripts/fuzz_loaders.py --cases 3000 [--seed 0] [--kinds gguf hf dflash mtp mtp-gguf gguf-full]

Prints outcome counts per seed kind, the slowest case, the largest peak-RSS growth, and every
case that escaped as a raw exception or ran past the time limit; exits 1 if there was one.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import torch  # noqa: E402

from _fuzz_util import EXTRA_KINDS, KINDS, build_seeds, fuzz  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kinds", nargs="+", choices=KINDS + EXTRA_KINDS, default=list(KINDS),
                    help="seeds to corrupt (gguf-full: the whole SmolLM2 vocabulary, slower)")
    ap.add_argument("--time-limit", type=float, default=5.0, help="seconds per case")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    bad, slowest, biggest = [], (0.0, ""), (0.0, "")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        # the GGUF seed is also the DFlash drafters' target
        seeds = build_seeds(root, sorted(set(args.kinds) | ({"gguf"} if "dflash" in args.kinds else set())))
        for i, (kind, what, out) in enumerate(fuzz(seeds, root, args.cases, args.seed, args.time_limit, args.kinds)):
            counts[kind][out.kind] += 1
            slowest = max(slowest, (out.seconds, f"{kind} {what}"))
            biggest = max(biggest, (out.rss_growth_mb, f"{kind} {what}"))
            if out.kind in ("raw", "timeout"):
                bad.append(f"#{i} {kind} {what}: {out.detail[:300]}")
    total = time.perf_counter() - t0
    print(f"{args.cases} cases in {total:.0f} s (seed {args.seed})")
    for kind in sorted(counts):
        print(f"  {kind:7s} " + ", ".join(f"{k} {n}" for k, n in sorted(counts[kind].items())))
    print(f"slowest case {slowest[0]:.2f} s ({slowest[1]})")
    print(f"largest peak-RSS growth {biggest[0]:.0f} MiB ({biggest[1]})")
    for line in bad:
        print("  " + line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
