"""What limits a drafter's tau: its acceptance at each depth, and its first draft's acceptance against the
target's own confidence (the probability the target gives its greedy token there).

For each prompt: greedy speculative decoding with ``trace`` (every step's drafts and how many were
accepted), then one teacher-forced forward of prompt + output through the target for its probabilities.
Printed and written to ``--json``:
- the conditional acceptance at depth j (steps that accepted >= j drafts over those that reached j - 1),
  over steps that drafted a whole block;
- the first draft's acceptance in bins of the target's top-1 probability at that position, beside the
  share of all generated tokens in each bin;
- the tau a geometric model gives for the measured per-draft acceptance, and for the same drafter with
  the drafts at tokens the target gives >= 0.7 accepted at ``--ideal`` (what better training could buy
  where the target is sure; the rest stays where the target itself nearly ties).

    SPECDEC_DFLASH_CPU_CONFIDENCE=0 python scripts/acceptance_limits.py --draft dflash --num-prompts 12 \\
        [--data-dir DIR] [--dataset gsm8k] [--json out.json]

(the variable keeps DFlash's whole blocks on the CPU, so that every depth is tried.)
"""

from __future__ import annotations

import argparse
import json

import torch

from specdec import LLM
from specdec.bench import load_prompts

BINS = ((0.0, 0.3), (0.3, 0.5), (0.5, 0.7), (0.7, 0.9), (0.9, 1.01))


def geometric_tau(a: float, k: int) -> float:
    """Tokens a step commits when each of ``k`` drafts is accepted with ``a`` given the ones before."""
    return k + 1.0 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default="dflash")
    ap.add_argument("-k", type=int, default=4, help="drafts per step (MTP, n-gram)")
    ap.add_argument("--dataset", default="gsm8k")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--ideal", type=float, default=0.98)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    llm = LLM(a.model, draft=a.draft, num_draft_tokens=a.k)
    m = llm.model
    depth = llm.engine.k
    ends, firsts, probs = [], [], []  # accepted per whole-block step; (p_top1, accepted) of first drafts; p_top1 of every token
    for p in load_prompts(a.dataset, a.num_prompts, a.data_dir):
        ids = llm.encode_prompt(p[0], chat=True)
        r = llm.generate(p[0], a.n, chat=True, trace=True)
        out = r.token_ids
        with torch.no_grad():
            lg = m(torch.tensor(ids + out), m.new_cache(len(ids) + len(out) + 8), logits="all").logits.float()
        pr = torch.softmax(lg[len(ids) - 1:len(ids) - 1 + len(out)], -1)  # row i: the distribution out[i] came from
        top = pr.max(-1)
        if top.indices.tolist() != out:
            raise SystemExit("the teacher-forced forward's argmax differs from the greedy output (not fp32?)")
        probs += top.values.tolist()
        pos = 0  # out[pos] is the token the step starts from; its drafts guess out[pos + 1 ..]
        for s in r.stats.trace:
            if s["draft"] and pos + 1 < len(out):
                firsts.append((top.values[pos + 1].item(), s["accepted"] >= 1))
            if len(s["draft"]) == depth:
                ends.append(s["accepted"])
            pos += s["accepted"] + 1
    reach = [sum(e >= j for e in ends) for j in range(depth + 1)]
    cond = [reach[j] / reach[j - 1] if reach[j - 1] else None for j in range(1, depth + 1)]
    per_draft = sum(ends) / (sum(ends) + sum(e < depth for e in ends))
    bins = []
    for lo, hi in BINS:
        sel = [ok for q, ok in firsts if lo <= q < hi]
        share = sum(lo <= q < hi for q in probs) / len(probs)
        bins.append({"p_top1": [lo, min(hi, 1.0)], "first_drafts": len(sel), "accepted": sum(sel) / max(len(sel), 1),
                     "share_of_tokens": share})
    sure = sum(b["share_of_tokens"] for b in bins if b["p_top1"][0] >= 0.7)
    unsure_acc = sum(b["share_of_tokens"] * b["accepted"] for b in bins if b["p_top1"][0] < 0.7)
    ideal = unsure_acc + sure * a.ideal
    res = {"draft": a.draft, "dataset": a.dataset, "data_dir": a.data_dir, "prompts": a.num_prompts, "n": a.n,
           "whole_block_steps": len(ends), "tau_whole_blocks": 1 + sum(ends) / max(len(ends), 1),
           "conditional_acceptance": cond, "per_draft_acceptance": per_draft,
           "geometric_tau": geometric_tau(per_draft, depth), "first_draft_by_target_p": bins,
           "ideal_sure": a.ideal, "per_draft_if_sure_at_ideal": ideal, "geometric_tau_if_sure_at_ideal": geometric_tau(ideal, depth)}
    print(f"{a.draft} on {a.dataset} ({a.data_dir or 'shipped sets'}), {a.num_prompts} prompts x {a.n}: "
          f"{len(ends)} whole-block steps, tau {res['tau_whole_blocks']:.3f}")
    print("conditional acceptance by depth: " + " ".join("-" if c is None else f"{c:.2f}" for c in cond))
    print(f"per-draft acceptance {per_draft:.3f} -> geometric tau {res['geometric_tau']:.2f}; with drafts at "
          f"p_top1 >= 0.7 accepted at {a.ideal}: {ideal:.3f} -> {res['geometric_tau_if_sure_at_ideal']:.2f}")
    for b in bins:
        print(f"  target p_top1 {b['p_top1'][0]:.1f}-{b['p_top1'][1]:.1f}: {b['share_of_tokens'] * 100:5.1f} % of tokens, "
              f"{b['first_drafts']:4d} first drafts, {b['accepted'] * 100:5.1f} % accepted")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
