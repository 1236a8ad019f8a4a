"""Bit for bit on real weights: the committed positions' logits of plain and speculative decoding on the CPU,
with ``--batch-invariant`` (the unpadded exact steps, ``specdec/cpu_exact.py``) and without (the fast default,
whose last bits differ while its greedy tokens are tested equal), for the embedded SmolLM2 and its shipped drafters.

    PYTHONPATH=. python scripts/check_cpu_exact.py [--num-prompts 3] [-n 64] [--drafts mtp dflash]
"""

from __future__ import annotations

import argparse

import torch

from specdec import LLM
from specdec.bench import load_prompts
from specdec.engine import generate as engine_mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafts", nargs="+", default=["mtp", "dflash"])
    ap.add_argument("--num-prompts", type=int, default=3)
    ap.add_argument("-n", type=int, default=64)
    a = ap.parse_args()
    rows: list[torch.Tensor] = []
    accept = engine_mod.accept_greedy

    def recording(drafts, logits):
        packed = accept(drafts, logits)
        rows.append(logits[: int(packed[0]) + 1].clone())  # the rows whose positions are committed
        return packed

    engine_mod.accept_greedy = recording
    prompts = [t[0] for t in load_prompts("gsm8k", a.num_prompts)]
    for exact in (True, False):
        for draft in a.drafts:
            llm = LLM(draft=draft, batch_invariant=exact, num_draft_tokens=3)
            assert llm.engine.cpu_exact == exact
            total = differ = same = accepted = steps = 0
            for p in prompts:
                rows.clear()
                plain = llm.generate(p, a.n, chat=True, speculative=False)
                plain_rows = torch.cat(rows)
                rows.clear()
                spec = llm.generate(p, a.n, chat=True)
                spec_rows = torch.cat(rows)
                n = min(len(plain_rows), len(spec_rows))
                total += n
                differ += int((plain_rows[:n] != spec_rows[:n]).any(-1).sum())
                same += plain.token_ids == spec.token_ids
                accepted += sum(spec.stats.accepted)
                steps += len(spec.stats.accepted)
            print(f"{'--batch-invariant' if exact else 'default':17s} {draft:6s}: tau {1 + accepted / steps:.2f}, "
                  f"{differ} of {total} committed positions' logits differ, {same} of {len(prompts)} outputs equal")


if __name__ == "__main__":
    main()
