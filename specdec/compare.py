"""``specdec generate --compare``: one prompt decoded twice, by the target alone and with a drafter.

What speculation buys, on the user's own prompt: the same model, sampling settings and seed,
first plain decoding, then speculative decoding; the token ids of the two are compared and their
speed set side by side. Greedy output must be identical (the engine is lossless; a difference
is a bug). Sampled output follows the target's distribution either way, but the two runs draw
from their random stream in a different order, so with one seed their texts may differ.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from .engine import GenerationResult
from .errors import RequestError


@dataclass(frozen=True)
class Comparison:
    draft: str
    seed: int | None  # the seed both runs used (drawn once when sampling without one)
    greedy: bool
    plain: GenerationResult
    speculative: GenerationResult

    @property
    def identical(self) -> bool:
        """Token ids equal (not decoded text: two id sequences can decode to the same string)."""
        return self.plain.token_ids == self.speculative.token_ids

    @property
    def first_difference(self) -> int | None:
        """Index of the first token where the two outputs differ (None: identical)."""
        a, b = self.plain.token_ids, self.speculative.token_ids
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return i
        return None if len(a) == len(b) else min(len(a), len(b))

    @property
    def speedup(self) -> float | None:
        p, s = self.plain.stats.tokens_per_s, self.speculative.stats.tokens_per_s
        return s / p if p else None

    def rows(self) -> list[dict]:
        out = []
        for mode, r in (("plain", self.plain), (self.draft, self.speculative)):
            st = r.stats
            out.append({"mode": mode, "tokens": st.new_tokens, "seconds": round(st.total_s, 3),
                        "tokens_per_s": round(st.tokens_per_s, 2), "tau": round(st.tau, 3)})
        return out

    def to_dict(self) -> dict:
        return {"draft": self.draft, "seed": self.seed, "identical": self.identical,
                "first_difference": self.first_difference,
                "speedup": round(self.speedup, 3) if self.speedup is not None else None, "rows": self.rows(),
                **{name: {"text": r.text, "token_ids": r.token_ids, "finish_reason": r.finish_reason,
                          "stats": r.stats.to_dict()}
                   for name, r in (("plain", self.plain), ("speculative", self.speculative))}}


def compare(llm, prompt, gen: dict, *, label: str | None = None, chat: bool = False, trace: bool = False,
            on_tokens=None) -> Comparison:
    """Run ``prompt`` through ``llm`` (an :class:`~specdec.api.LLM` with a drafter) plainly, then
    speculatively, with the sampling arguments ``gen`` of :meth:`~specdec.api.LLM.generate`.

    Both engines first decode untimed (allocator, kernels, graph capture), so the timed runs are not
    charged for the warm-up: on CUDA the same prompt as far as the timed run goes (graphs are
    captured per span of live context and per prefill chunk, so a short warm-up leaves captures in
    the timed run), on the CPU (no graphs) a few tokens. ``on_tokens`` streams the speculative run;
    ``trace`` applies to it. ``label`` names the speculative row (default: the drafter's name).
    """
    if llm.drafter is None:
        raise RequestError("compare needs an LLM with a drafter (draft='ngram', 'mtp' or 'dflash:PATH')")
    seed = gen.get("seed")
    greedy = gen.get("temperature", 0.0) == 0
    if seed is None and not greedy:
        seed = secrets.randbelow(2**31)  # one seed for both runs, reported so the run can be repeated
    gen = {**gen, "seed": seed}
    ids = llm.encode_prompt(prompt, chat)
    # (with a 4-token warm-up on the H100, ee559cc, the shipped SmolLM2 drafters showed 0.76-1.10x plain at tau
    # 2.8-3.0 on a GSM8K question, plain decoding 408-541 tok/s, where `specdec bench` measures 2.2x and 1,285 tok/s)
    if llm.model.device.type == "cuda":
        warm_ids, warm = ids, gen
    else:
        warm_ids, warm = ids[:16], {**gen, "max_new_tokens": min(4, gen["max_new_tokens"]), "stop": None}
    for speculative in (False, True):
        llm.generate(warm_ids, speculative=speculative, **warm)
    plain = llm.generate(ids, speculative=False, **gen)
    spec = llm.generate(ids, speculative=True, trace=trace, on_tokens=on_tokens, **gen)
    return Comparison(label or getattr(llm.drafter, "name", "draft"), seed, greedy, plain, spec)


def verdict(c: Comparison) -> str:
    """One line on whether the two outputs agree, and what that means."""
    n = len(c.plain.token_ids)
    if c.identical:
        return f"identical: the speculative token ids equal plain decoding's ({n} of {n} tokens)"
    if not c.greedy:
        return "sampled: texts differ by design; both follow the target distribution"
    return (f"MISMATCH: greedy speculative output differs from plain decoding at token {c.first_difference} "
            f"(plain {n} tokens, speculative {len(c.speculative.token_ids)}): the engine should be lossless, "
            "this is a bug")


def format_table(c: Comparison) -> str:
    cols = ["mode", "tokens", "seconds", "tok/s", "tau"]
    keys = ["mode", "tokens", "seconds", "tokens_per_s", "tau"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in c.rows():
        lines.append("| " + " | ".join(str(r[k]) for k in keys) + " |")
    sp = c.speedup
    lines.append(f"speed-up: {sp:.2f}x" if sp is not None else "speed-up: n/a")
    return "\n".join(lines)
