"""Where MTP's host draft time goes inside ``specdec bench`` (issue 10 follow-up, session of 2026-12-06 (sixth)).

On the H100, ``specdec bench`` (four drafters interleaved) measured 0.64 ms of draft time a step for the shipped
SmolLM2 MTP head where ``scripts/profile_engine.py`` measured 0.258. This runs the bench with MTP alone and among the
four, in one process, with each ``MTPDrafter.propose`` timed and classified: the captured step (replayed, or captured
on this call) or the eager chain (more committed rows than a static step takes), and each cache growth counted.

    python scripts/probe_mtp_bench.py --model SmolLM2.gguf [--num-prompts 40] [-n 128] [--runs alone,four]
        [--json out.json]

(Session of 2026-12-06 (sixth), H100: its runs ``+catchup`` measured SPECDEC_MTP_CATCHUP, removed since; bea57c2.
Session of 2026-12-06 (seventh): ``+split``, SPECDEC_MTP_SPLIT_CATCHUP.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from specdec.bench import run_bench
from specdec.drafters import mtp as mtp_mod

CALLS: list[dict] = []
GROWTHS: list[dict] = []  # the drafter cache's growths: (calls so far, old and new positions)


def instrument() -> None:
    propose, static_call, ensure = mtp_mod.MTPDrafter.propose, mtp_mod._StaticPropose.__call__, mtp_mod.MTPDrafter._ensure

    def timed_propose(self, last_token, k, params, gen):
        rows = sum(t.shape[0] for t in self._pending_t) + 1  # the committed rows this propose takes in
        rec = {"drafter": id(self), "k": k, "path": "eager", "older": rows > k + 1}
        CALLS.append(rec)
        t = time.perf_counter()
        out = propose(self, last_token, k, params, gen)
        rec["ms"] = 1e3 * (time.perf_counter() - t)
        return out

    def timed_static(self, *a, **kw):
        CALLS[-1]["path"] = "capture" if self.graph is None else "replay"
        return static_call(self, *a, **kw)

    def counted_ensure(self, end):
        cap = 0 if self.cache is None else self.cache.k.shape[1]
        ensure(self, end)
        if self.cache.k.shape[1] != cap:
            GROWTHS.append({"drafter": id(self), "after_calls": len(CALLS), "from": cap, "to": self.cache.k.shape[1]})

    mtp_mod.MTPDrafter.propose = timed_propose
    mtp_mod._StaticPropose.__call__ = timed_static
    mtp_mod.MTPDrafter._ensure = counted_ensure


def summary(calls: list[dict]) -> dict:
    out = {"calls": len(calls)}
    # "+older": a static step after the older rows' eager forward (SPECDEC_MTP_SPLIT_CATCHUP); eager: any rows
    for name, path, older in (("replay", "replay", False), ("capture", "capture", False), ("eager", "eager", None),
                              ("replay+older", "replay", True), ("capture+older", "capture", True)):
        ms = [c["ms"] for c in calls if c["path"] == path and older in (None, c["older"])]
        if ms:
            q = statistics.quantiles(ms, n=10) if len(ms) > 1 else [ms[0]] * 9
            out[name] = {"n": len(ms), "total_ms": round(sum(ms), 1), "median_ms": round(statistics.median(ms), 3),
                         "p90_ms": round(q[8], 3), "max_ms": round(max(ms), 2)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--runs", default="alone,four,alone",
                    help="comma-separated: alone (none mtp) | four (none ngram mtp dflash), each with +split for "
                         "SPECDEC_MTP_SPLIT_CATCHUP on in that run (e.g. alone,alone+split)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    instrument()
    drafts = {"alone": ["none", "mtp"], "four": ["none", "ngram", "mtp", "dflash"]}
    runs = a.runs.split(",")
    for run in runs:  # before any model is loaded
        if run.removesuffix("+split") not in drafts:
            raise SystemExit(f"probe_mtp_bench: --runs entry {run!r}: want alone or four (+split)")
    report = []
    default_split = mtp_mod.SPLIT_CATCHUP
    for run in runs:
        first, grown = len(CALLS), len(GROWTHS)
        mtp_mod.SPLIT_CATCHUP = default_split or run.endswith("+split")
        r = run_bench(a.model, drafts[run.removesuffix("+split")], "gsm8k", a.num_prompts, a.n, num_draft_tokens=3)
        row = next(x for x in r["rows"] if x["draft"] == "mtp")
        steps = round(row["new_tokens"] / row["tau"]) if row["tau"] else 0  # ~: each prompt's first token is the prefill's
        calls = CALLS[first:]  # the bench's warm-up generation's proposes included
        ids = {c["drafter"] for c in calls}
        res = {"run": run, "machine": r["machine"], "mtp": row, "none_tok_s": r["rows"][0]["tokens_per_s"],
               "draft_ms_per_step": round(1e3 * row["draft_seconds"] / max(1, steps), 3), "drafters": len(ids),
               "proposes": summary(calls), "growths": GROWTHS[grown:]}
        report.append(res)
        print(json.dumps(res), flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
