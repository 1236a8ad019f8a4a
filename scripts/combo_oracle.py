"""How rules that choose between the shipped DFlash drafter and the history lookup would do, offline, on
the embedded SmolLM2-135M-Instruct's own greedy replies (tau is a property of the tokens, so the CPU measures it).

For each prompt: the target's plain greedy reply, then one forward over prompt + reply capturing the
drafter's layers. At every position p of the reply (an anchor: the token at p is known, the drafter's
context is positions 0 .. p - 1), the DFlash block (15 tokens) and the history lookup (a trigram match,
up to 15 tokens) are computed once; each rule is then a walk through the reply, p -> p + accepted + 1,
as greedy speculative decoding would take it, and its tau is the reply's tokens over its steps. The
rules are drafts only: the target verifies, so none can change an output; what they change is tau, and
the DFlash forwards a walk runs (``dflash_share``: a lookup step runs none). The ``tree_*`` rows are upper
bounds for a verification of several candidates at once (not built): DFlash's block with its second
choices branched off (see :func:`tree`).

    python scripts/combo_oracle.py [--dataset gsm8k] [--num-prompts 20] [-n 128] [--json F]
"""

from __future__ import annotations

import argparse
import json

import torch

from specdec.api import LLM
from specdec.bench import load_prompts
from specdec.drafters.dflash import load_dflash_drafter
from specdec.drafters.ngram import lookup
from specdec.drafters.shipped import shipped_dir
from specdec.models.base import ForwardOut

K = 15


def accepted(prop: list[int], seq: list[int], p: int) -> int:
    a = 0
    while a < len(prop) and p + 1 + a < len(seq) and prop[a] == seq[p + 1 + a]:
        a += 1
    return a


def tree(dfl: list[int], top2: list[int], seq: list[int], p: int, jmax: int, tail: int) -> int:
    """Tokens a tree would accept: DFlash's block, plus at each of its first ``jmax + 1`` positions the
    second choice followed by ``tail`` more of the block's own tokens (15 + (jmax + 1) * (1 + tail) rows at
    most). The block's later rows predict later positions whatever the earlier ones hold, so the tail
    after a second choice is the block's own."""
    a = accepted(dfl, seq, p)
    if a >= len(dfl) or a > jmax or p + 1 + a >= len(seq) or top2[a] != seq[p + 1 + a]:
        return a
    rest = dfl[a + 1:a + 1 + tail]
    return a + 1 + accepted(rest, seq, p + 1 + a)


TREES = {"tree_top2_all_positions (135 rows)": (14, 14), "tree_top2_first_2_positions (44 rows)": (1, 14),
         "tree_top2_first_4_positions_tail_6 (43 rows)": (3, 6)}


def rules(dfl: list[int], ng: list[int], seq: list[int], p: int, top2: list[int] | None = None
          ) -> dict[str, tuple[int, bool]]:
    """Each rule's (accepted tokens, ran DFlash) at anchor ``p``."""
    a_d, a_n = accepted(dfl, seq, p), accepted(ng, seq, p)
    out = {"dflash": (a_d, True), "ngram_only": (a_n, False), "best_of_both (oracle)": (max(a_d, a_n), True)}
    for m in (1, 2, 3, 4, 6, 8):
        out[f"lookup_first_min{m}"] = (a_n, False) if len(ng) >= m else (a_d, True)
    # both run; the lookup where it agrees with DFlash's first token, else DFlash
    out["lookup_if_first_agrees"] = (a_n, True) if len(ng) >= 3 and ng[0] == dfl[0] else (a_d, True)
    # both run; the lookup unless DFlash agrees with it on its whole length (then DFlash's longer block)
    agree = len(ng) >= 3 and dfl[:len(ng)] == ng
    out["dflash_if_it_extends_lookup"] = (a_d, True) if agree else ((a_n, True) if len(ng) >= 3 else (a_d, True))
    # both run; the longer common-prefix proposal: the lookup, then DFlash past it where they agree so far
    out["lookup_then_dflash_tail"] = ((accepted(ng + dfl[len(ng):], seq, p), True) if len(ng) >= 3 and ng[0] == dfl[0]
                                      else ((a_n, True) if len(ng) >= 3 else (a_d, True)))
    for name, (jmax, tail) in TREES.items():
        out[name] = (tree(dfl, top2 or dfl, seq, p, jmax, tail), True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", default="gsm8k")
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("-n", "--new-tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    llm = LLM(None, draft="none", device="cpu")
    d = load_dflash_drafter(shipped_dir("dflash", llm.loaded.path), llm.loaded)
    totals: dict[str, list[float]] = {}
    for turns in load_prompts(a.dataset, a.num_prompts):
        ids = llm.encode_prompt(turns[0], chat=True)
        reply = llm.generate(turns[0], a.new_tokens, chat=True, speculative=False).token_ids
        seq = ids + reply
        with torch.inference_mode():
            fo = llm.model(torch.tensor(seq), llm.model.new_cache(len(seq)), capture=d.capture_layers, logits="none")
        walks: dict[str, list] = {}
        at: dict[int, dict] = {}
        for name in rules([0], [], seq, len(ids)):
            p, steps, drafts = len(ids), 0, 0
            while p < len(seq) - 1:
                if p not in at:
                    with torch.inference_mode():
                        d.begin(torch.tensor(seq[:p]), ForwardOut(None, None, fo.captured[:p]))
                        top = d.block_logits(seq[p])[:K].topk(2, dim=-1).indices
                    dfl, top2 = top[:, 0].tolist(), top[:, 1].tolist()
                    at[p] = rules(dfl, lookup(seq[:p + 1], K, 3, 3), seq, p, top2)
                acc, ran = at[p][name]
                p, steps, drafts = p + acc + 1, steps + 1, drafts + ran
            walks[name] = [len(seq) - 1 - len(ids), steps, drafts]
        for name, (tokens, steps, drafts) in walks.items():
            t = totals.setdefault(name, [0, 0, 0])
            t[0], t[1], t[2] = t[0] + tokens, t[1] + steps, t[2] + drafts
    report = {name: {"tau": round(t[0] / t[1], 3), "dflash_share": round(t[2] / t[1], 3)} for name, t in totals.items()}
    for name, r in report.items():
        print(f"{name:32s} tau {r['tau']:.3f}  DFlash forwards on {100 * r['dflash_share']:.0f} % of steps")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"dataset": a.dataset, "prompts": a.num_prompts, "new_tokens": a.new_tokens, "rules": report}, fh,
                      indent=1)


if __name__ == "__main__":
    main()
