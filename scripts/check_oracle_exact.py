"""Whether speculative output equals plain output on a random-weight shape with the oracle drafter at a high tau
(``specdec bench --shape``'s end-to-end run: plain decoding, then the oracle proposing plain's own continuation, k
drafts a step, spoiled), for each of scripts/ab_flags.py's variants in one process: tau and equality per variant. A
variant sets ab_flags' module flags, over any SPECDEC_* setting of the same switch.

    python scripts/check_oracle_exact.py --shape qwen3.5-35b-a3b [--context 512] [-n 256] [-k 15] \\
        [--variants defaults defaults-pdl] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch
from ab_flags import VARIANTS, flags  # scripts/ (this script's folder) is on the path

from specdec.bench_shape import end_to_end
from specdec.shapes import build_shape


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", required=True)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("-n", "--new-tokens", type=int, default=256)
    ap.add_argument("-k", type=int, default=15)
    ap.add_argument("--tau", "--oracle-tau", type=float, default=6.5,
                    help="the oracle's mean tokens a step (bench's --oracle-tau)")
    ap.add_argument("--variants", nargs="+", default=["defaults"], choices=sorted(VARIANTS))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    dev = torch.device(a.device)
    model = build_shape(a.shape, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)
    out = []
    for v in a.variants:
        with flags(VARIANTS[v]):
            r = end_to_end(model, a.context, a.new_tokens, a.tau, a.k, dev.type == "cuda", None)
        out.append({"variant": v, "tau": r["measured_tau"], "equal": r["output_equals_plain"],
                    "oracle_tok_s": r["oracle_tokens_per_s"], "plain_tok_s": r["plain_tokens_per_s"]})
        print(json.dumps(out[-1]), flush=True)
    if a.json:
        json.dump(out, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    from specdec.errors import SpecdecError
    try:
        main()
    except SpecdecError as e:  # bad input (an unknown shape, one that does not fit): one line, no traceback
        raise SystemExit(f"check_oracle_exact.py: {e}")
