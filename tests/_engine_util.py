"""Shared helpers of the engine / drafter lossless tests: tiny targets, scripted drafters, statistics.

Every drafter here follows the protocol of ``specdec.drafters.base`` and is deliberately simple:
the point is to drive the engine through each accept / reject / rollback path, not to draft well.
"""

from __future__ import annotations

import math

import torch

from specdec.drafters.base import Proposal
from specdec.engine import SpeculativeGenerator, accept_sampled
from specdec.sampling import SamplingParams, probs_from_logits


# --- tiny targets ----------------------------------------------------------------------------------

def build_llama(path, *, vocab: int = 48, hidden: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                seed: int = 0, head_scale: float = 1.0) -> str:
    """Save a random tiny Llama with transformers; ``head_scale`` multiplies the LM head (peakier logits)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    model.save_pretrained(str(path))
    return str(path)


def tiny_llama(hidden: int = 32, inter: int = 64, max_pos: int = 128, vocab: int = 97):
    """A random 2-layer specdec Llama (4 heads, 2 KV heads) in eval mode, weights drawn with std 0.2
    after ``torch.manual_seed(0)`` (peaky enough logits for stable greedy tokens)."""
    from specdec.models.llama import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos)
    m = LlamaForCausalLM(cfg)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return m.eval()


def qwen35_text_config(**over) -> dict:
    """A tiny dense Qwen3.5 config for ``parse_config``: 4 layers of 64 (three Gated DeltaNet layers, then one gated
    full attention), vocab 256, partial RoPE; ``over`` replaces fields."""
    return {"model_type": "qwen3_5_text", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
            "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "full_attention_interval": 4, "rms_norm_eps": 1e-6,
            "max_position_embeddings": 512, "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}, **over}


def split_kernel_stand_in(monkeypatch) -> list:
    """SPECDEC_DRAFTER_SPLIT on, with the split attention kernel (CUDA only) stood in for by its torch
    form and routed as on CUDA; returns the list each of its calls appends to."""
    from specdec.models import layers, split_attention
    calls = []
    monkeypatch.setattr(layers, "DRAFTER_SPLIT", True)
    monkeypatch.setattr(split_attention, "supported", lambda q, k, mask: mask is not None and q.dim() == 4)
    monkeypatch.setattr(split_attention, "split_attention",
                        lambda *a: calls.append(a[0].shape) or split_attention.split_attention_reference(*a))
    return calls


def plain_generate(model, prompt, n: int, params: SamplingParams = SamplingParams()):
    """Target-only decoding through the same engine (no drafter)."""
    return SpeculativeGenerator(model, None, 0).generate(prompt, n, params)


# --- scripted drafters -----------------------------------------------------------------------------

class _HistoryDrafter:
    """Base: tracks the committed sequence (prompt + every committed token)."""

    name = "scripted"
    capture_layers: tuple[int, ...] = ()

    def begin(self, prompt_ids, out) -> None:
        self.history = [int(t) for t in prompt_ids.tolist()]
        self.device = out.hidden.device

    def observe(self, tokens, out) -> None:
        assert tokens.shape[0] == out.hidden.shape[0], "observe: tokens and hidden rows must pair up"
        self.history.extend(int(t) for t in tokens.tolist())

    def _tensor(self, toks) -> torch.Tensor:
        return torch.tensor([int(t) for t in toks], dtype=torch.int64, device=self.device)


class OracleDrafter(_HistoryDrafter):
    """Proposes the target's own greedy continuation (``reference`` = prompt + continuation).

    ``corrupt``: probability of replacing each proposed token by a wrong one (partial acceptance).
    ``invert``: always propose a token different from the reference (0% acceptance).
    """

    def __init__(self, reference: list[int], vocab: int, corrupt: float = 0.0, invert: bool = False, seed: int = 0):
        self.ref, self.vocab, self.corrupt, self.invert = list(reference), vocab, corrupt, invert
        self.rng = torch.Generator().manual_seed(seed)

    def propose(self, last_token, k, params, gen) -> Proposal:
        pos = len(self.history)  # index of last_token in the full sequence
        assert self.ref[pos] == int(last_token), f"engine fed token {last_token} at {pos}, greedy says {self.ref[pos]}"
        toks = list(self.ref[pos + 1: pos + 1 + k])
        for i, t in enumerate(toks):
            flip = self.invert or float(torch.rand(1, generator=self.rng)) < self.corrupt
            if flip:
                toks[i] = (t + 1 + int(torch.randint(self.vocab - 1, (1,), generator=self.rng))) % self.vocab
        return Proposal(self._tensor(toks))


class SpoiledOracle:
    """Proposes the target's own greedy continuation (``reference`` = prompt + continuation), each
    draft replaced by a wrong id with probability ``spoil``: most drafts are accepted and every
    spoiled one forces a rollback. Unlike :class:`OracleDrafter` it never asserts that the engine
    followed the reference, so a diverging run (a mutation test, a device check) is reported by
    the comparison that follows, not by the drafter."""

    name = "oracle"
    capture_layers: tuple[int, ...] = ()

    def __init__(self, reference: list[int], vocab: int, spoil: float = 0.3, seed: int = 0):
        self.ref, self.vocab, self.spoil = list(reference), vocab, spoil
        self.rng = torch.Generator().manual_seed(seed)

    def begin(self, prompt_ids, out) -> None:
        self.n, self.device = prompt_ids.shape[0], out.hidden.device

    def observe(self, tokens, out) -> None:
        self.n += tokens.shape[0]

    def propose(self, last_token, k, params, gen) -> Proposal:
        toks = (list(self.ref[self.n + 1:self.n + 1 + k]) + [0] * k)[:k]
        for i in range(k):
            if float(torch.rand(1, generator=self.rng)) < self.spoil:
                toks[i] = (toks[i] + 1 + int(torch.randint(self.vocab - 1, (1,), generator=self.rng))) % self.vocab
        return Proposal(torch.tensor(toks, dtype=torch.int64, device=self.device))


def chunked_verify_form(q, k, v, g, beta, state):
    """A stand-in for ``deltanet.recurrent_gated_delta`` that runs the chunked form (the row
    dependence the recurrent form removed): for mutation checks that must see the invariance break."""
    from specdec.models import deltanet

    hm = [x.transpose(0, 1).contiguous() for x in (q, k, v, g, beta)]
    o, states = deltanet.chunked_gated_delta(*hm, state, 64, all_states=True)
    return o.transpose(0, 1), states


class RandomDrafter(_HistoryDrafter):
    """Uniformly random drafts (argmax-style: ``probs=None``); ``short`` sometimes proposes fewer than k."""

    def __init__(self, vocab: int, seed: int = 0, short: bool = True):
        self.vocab, self.short = vocab, short
        self.rng = torch.Generator().manual_seed(seed)

    def propose(self, last_token, k, params, gen) -> Proposal:
        n = int(torch.randint(0, k + 1, (1,), generator=self.rng)) if self.short else k
        return Proposal(torch.randint(self.vocab, (n,), generator=self.rng).to(self.device))


class DistDrafter(_HistoryDrafter):
    """Samples drafts from a distribution derived from the target's next-token logits.

    ``next_logits(seq) -> [V]`` gives the target's raw logits after ``seq`` (the full sequence).
    ``mode``: "target" (q = the target's processed distribution p: the ideal drafter), "uniform",
    "adversarial" (q favours the target's *least* likely tokens, including ones top-k/top-p
    removed) or "argmax" (the target's argmax, ``probs=None``).
    """

    def __init__(self, next_logits, mode: str = "target"):
        assert mode in ("target", "uniform", "adversarial", "argmax"), mode
        self.next_logits, self.mode = next_logits, mode

    def propose(self, last_token, k, params, gen) -> Proposal:
        seq = self.history + [int(last_token)]
        toks, qs = [], []
        for _ in range(k):
            raw = self.next_logits(seq)
            p = probs_from_logits(raw, params)
            if self.mode == "target":
                q = p
            elif self.mode == "uniform":
                q = torch.full_like(p, 1.0 / p.numel())
            elif self.mode == "adversarial":
                q = torch.softmax(-2.0 * raw.float(), -1)
            else:
                q = None
            t = int(p.argmax()) if q is None else int(torch.multinomial(q, 1, generator=gen))
            toks.append(t)
            if q is not None:
                qs.append(q)
            seq.append(t)
        probs = torch.stack(qs).to(self.device) if qs else None
        return Proposal(self._tensor(toks), probs)


def model_next_logits(model):
    """``next_logits`` for :class:`DistDrafter` that runs ``model`` on the whole sequence."""
    def f(seq):
        return model(torch.tensor(seq), model.new_cache(len(seq)), logits="last").logits[-1]
    return f


# --- deliberately broken acceptance rules (the statistical tests must reject them) ----------------

def accept_always_broken(draft, draft_probs, target_probs, gen):
    """BROKEN: keep every draft, bonus from p."""
    k = draft.shape[0]
    bonus = torch.multinomial(target_probs[k], 1, generator=gen)
    return torch.cat([torch.tensor([k]), draft, bonus])


def resample_from_p_broken(draft, draft_probs, target_probs, gen):
    """BROKEN: correct accept test, but on rejection draw from p instead of norm(max(0, p - q))."""
    k = draft.shape[0]
    res = accept_sampled(draft, draft_probs, target_probs, gen)
    n = int(res[0])
    if n < k:
        res[n + 1] = torch.multinomial(target_probs[n], 1, generator=gen)[0]
    return res


# --- checks ----------------------------------------------------------------------------------------

def check_accept_accounting(prompt: list[int], reference: list[int], result) -> None:
    """Greedy: every step accepted exactly the longest prefix of its drafts that matches the target."""
    pos = len(prompt) + 1  # the first new token comes from the prefill
    for step in result.stats.trace:
        d, n = step["draft"], step["accepted"]
        want = 0
        while want < len(d) and d[want] == reference[pos + want]:
            want += 1
        assert n == want, (f"step at position {pos}: drafts {d} vs target {reference[pos:pos + len(d)]}: "
                           f"accepted {n}, expected {want}")
        pos += n + 1


def chi2_sf(stat: float, df: int) -> float:
    """Survival function of the chi-square distribution (regularised upper incomplete gamma)."""
    if df <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def pooled_chi2(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int, float]:
    """Pearson goodness of fit of ``counts`` (any shape) to ``probs`` (same shape, sums to 1).

    Cells whose expected count is below ``min_expected`` are pooled into one cell so the
    chi-square approximation holds. A count in a cell of probability exactly 0 is an impossible
    event and returns p-value 0. Returns (statistic, degrees of freedom, p-value).
    """
    c = counts.flatten().double()
    p = probs.flatten().double()
    n = float(c.sum())
    if bool(((p == 0) & (c > 0)).any()):
        return math.inf, 0, 0.0
    exp = p * n
    small = exp < min_expected
    cells_c = torch.cat([c[~small], c[small].sum().reshape(1)])
    cells_e = torch.cat([exp[~small], exp[small].sum().reshape(1)])
    keep = cells_e > 0
    cells_c, cells_e = cells_c[keep], cells_e[keep]
    stat = float(((cells_c - cells_e) ** 2 / cells_e).sum())
    df = int(cells_c.numel()) - 1
    return stat, df, chi2_sf(stat, df)


def total_variation(counts: torch.Tensor, probs: torch.Tensor) -> float:
    c = counts.flatten().double()
    return 0.5 * float((c / c.sum() - probs.flatten().double()).abs().sum())


class SlotOracle:
    """Wraps one slot's real drafter in the serving loop (its begin / propose / observe all run,
    with the slot's own rows) but proposes the target's greedy continuation of that prompt
    (``refs``: prompt tuple -> prompt + continuation), each draft spoiled with probability
    ``spoil``: most drafts are accepted and every spoiled one forces a rollback."""

    def __init__(self, inner, refs: dict, vocab: int, spoil: float = 0.3, seed: int = 0):
        self.inner, self.refs, self.vocab, self.spoil = inner, refs, vocab, spoil
        self.name, self.capture_layers = "oracle", inner.capture_layers
        self.block_size = getattr(inner, "block_size", None)
        self.rng = torch.Generator().manual_seed(seed)

    def begin(self, prompt_ids, out):
        self.seq = prompt_ids.tolist()
        self.ref = self.refs[tuple(self.seq)]
        self.inner.begin(prompt_ids, out)

    def observe(self, tokens, out):
        assert tokens.shape[0] == out.hidden.shape[0], "observe: one row per committed token"
        self.seq.extend(tokens.tolist())
        self.inner.observe(tokens, out)
        if hasattr(self.inner, "kv"):  # DFlash: its context cache holds exactly the committed positions
            assert self.inner.length == len(self.seq)

    def propose(self, last_token, k, params, gen):
        n = self.inner.propose(last_token, k, params, gen).tokens.numel()
        pos = len(self.seq)
        toks = (self.ref[pos + 1: pos + 1 + n] + [0] * n)[:n]
        for i in range(n):
            if float(torch.rand(1, generator=self.rng)) < self.spoil:
                toks[i] = (toks[i] + 1 + int(torch.randint(self.vocab - 1, (1,), generator=self.rng))) % self.vocab
        return Proposal(torch.tensor(toks, dtype=torch.int64))
