"""Exact batching (``EngineLoop(static_steps=True, exact=True)``, the default on CUDA): a request's
numerics do not depend on the other requests. Each request is served alone and beside seven others
(ragged prompts of 1..40 tokens, joining as slots free up); every row the loop hands its drafter
(the prompt's hidden and captured rows with the first token's logits, then each committed
position's verify logits, hidden and captured rows) must be bitwise equal (``torch.equal``), not
merely close. Plain decoding and an oracle drafter whose drafts are accepted and rejected; a
controller forced to draft nothing whenever others run (so the width of the step would differ);
a tiny Llama and tiny Qwen3.5 hybrids (dense and MoE), fp32 on the CPU, where the static steps run eagerly (the
very function the GPU replays as a CUDA graph).

On the CPU the old loop fails these: its batched eager prefill gives a prompt's first-token logits
other bits beside other prompts, and its 1-wide fallback step other bits than the wide step
(``test_inexact_batching_is_batch_dependent`` keeps that visible)."""

from __future__ import annotations

import pytest
import torch

from _engine_util import build_llama, plain_generate
from _mtp_util import build_qwen35
from specdec.drafters.base import Proposal
from specdec.engine.serve_loop import EngineLoop, GenRequest
from specdec.loading import load_model
from specdec.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")

GREEDY = SamplingParams()


@pytest.fixture(scope="module", params=["llama", "qwen35", "qwen35-moe"])
def target(request, tmp_path_factory):
    """(loaded tiny target, layers to capture)."""
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        path = build_llama(root / "t", vocab=64, hidden=32, layers=3, seed=3, head_scale=4.0)
        return load_model(path, "cpu", "float32", tokenizer=False), (0, 2)
    path = build_qwen35(root / "t", moe=request.param == "qwen35-moe", mtp=False)
    return load_model(path, "cpu", "float32", tokenizer=False), (1, 3)


class Probe:
    """Records every row the loop hands it, by prompt; proposes the target's greedy continuation
    (``refs``: prompt -> continuation), each draft spoiled with probability ``spoil``."""

    name = "probe"

    def __init__(self, refs: dict, log: dict, capture: tuple, vocab: int, spoil: float = 0.3):
        self.refs, self.log, self.capture_layers, self.vocab, self.spoil = refs, log, capture, vocab, spoil

    def _keep(self, out):
        for name in ("logits", "hidden", "captured"):
            self.rows[name].append(getattr(out, name).clone())

    def begin(self, prompt_ids, out):
        self.seq = prompt_ids.tolist()
        self.ref, self.n_prompt = self.refs[tuple(self.seq)], len(self.seq)
        self.rng = torch.Generator().manual_seed(sum(self.seq))
        self.rows = self.log.setdefault(tuple(self.seq), {"logits": [], "hidden": [], "captured": []})
        assert not self.rows["logits"], "one request per prompt"
        self._keep(out)

    def observe(self, tokens, out):
        self.seq.extend(tokens.tolist())
        self._keep(out)

    def propose(self, last_token, k, params, gen):
        pos = len(self.seq) - self.n_prompt  # committed tokens observed so far; the newest (last_token) is ref[pos]
        toks = (self.ref[pos + 1: pos + 1 + k] + [0] * k)[:k]
        for i in range(k):
            if float(torch.rand(1, generator=self.rng)) < self.spoil:
                toks[i] = (toks[i] + 1) % self.vocab
        return Proposal(torch.tensor(toks, dtype=torch.int64))


def _requests(vocab: int, n: int = 8) -> list[GenRequest]:
    g = torch.Generator().manual_seed(5)
    sizes = [1, 40, 7, 13, 3, 26, 9, 18][:n]
    return [GenRequest(torch.randint(0, vocab, (m,), generator=g).tolist(), 6 + 3 * i, GREEDY)
            for i, m in enumerate(sizes)]


def _serve(loaded, capture, reqs, refs, *, k: int, force_k0: bool, static_max: int = 512, **kw) -> tuple[list, dict]:
    log: dict = {}
    engine = EngineLoop(loaded, lambda: Probe(refs, log, capture, loaded.model.config.vocab_size), max_slots=4,
                        num_draft_tokens=k, static_steps=True, controller=force_k0, **kw)
    engine.static_prefill_chunk = 8  # prompts of up to 40 tokens take 1..5 chunks
    engine.prefill_chunk = 16  # two static chunks per boundary: long prompts prefill while others decode
    engine.static_prefill_max = static_max  # longer prompts: eager forwards of their own
    if force_k0:  # draft nothing whenever other requests run: the width the step runs then depends on them
        engine.controller.choose = lambda alphas, caps=None: 0 if len(alphas) > 1 else k
    out = engine.run(reqs)
    return out, {p: {n: torch.cat(v) for n, v in rows.items()} for p, rows in log.items()}


def _alone_and_shared(target, k: int, force_k0: bool, **kw):
    loaded, capture = target
    reqs = _requests(loaded.model.config.vocab_size)
    refs = {tuple(r.prompt_ids): plain_generate(loaded.model, r.prompt_ids, r.max_new_tokens).token_ids for r in reqs}
    shared, rows_s = _serve(loaded, capture, reqs, refs, k=k, force_k0=force_k0, **kw)
    for r, toks in zip(reqs, shared):
        assert toks == refs[tuple(r.prompt_ids)]
    alone = [_serve(loaded, capture, [r], refs, k=k, force_k0=force_k0, **kw) for r in reqs]
    assert [out[0] for out, _ in alone] == shared
    return reqs, rows_s, [rows for _, rows in alone]


def _assert_same_rows(reqs, rows_s, rows_a) -> None:
    """Every row each prompt's drafter saw served beside others equals the one it saw alone."""
    for r, alone in zip(reqs, rows_a):
        key = tuple(r.prompt_ids)
        a, s = alone[key], rows_s[key]
        for name in ("logits", "hidden", "captured"):
            # one row per position (logits: the prompt's last, then each committed one); the last
            # step's committed rows are never observed, and how many that is depends on k
            n = min(a[name].shape[0], s[name].shape[0])
            assert n >= (len(key) + 1 if name != "logits" else 2)
            assert torch.equal(a[name][:n], s[name][:n]), f"prompt of {len(key)} tokens: {name} differ"


@pytest.mark.parametrize("k, force_k0, static_max", [(0, False, 512), (3, False, 512), (3, True, 512), (3, False, 20)],
                         ids=["plain", "oracle", "oracle-k0", "oracle-long-eager"])
def test_rows_bitwise_alone_or_shared(target, k, force_k0, static_max):
    reqs, rows_s, rows_a = _alone_and_shared(target, k, force_k0, static_max=static_max)
    _assert_same_rows(reqs, rows_s, rows_a)


def test_inexact_batching_is_batch_dependent(target):
    """The same comparison with ``exact=False`` (prompts joining together prefill in one eager
    forward, steps without drafts run 1 wide): on the CPU some rows differ (tokens stay equal in
    fp32). If this starts passing, the exact test above no longer shows anything on the CPU."""
    reqs, rows_s, rows_a = _alone_and_shared(target, 3, True, exact=False)
    same = [torch.equal(rows_a[i][tuple(r.prompt_ids)]["logits"], rows_s[tuple(r.prompt_ids)]["logits"])
            for i, r in enumerate(reqs)]
    assert not all(same)


def test_exact_needs_static_steps(target):
    with pytest.raises(Exception, match="static_steps"):
        EngineLoop(target[0], "none", static_steps=False, exact=True)


@pytest.mark.parametrize("k", [0, 3], ids=["plain", "oracle"])
def test_span_buckets_rows_bitwise(target, k, monkeypatch):
    """Span buckets: each static step attends over the smallest bucket that holds every slot's
    positions (16, 32, 64 here, from a lowered minimum), with the span-invariant attention. A
    request alone runs steps of shorter spans than beside longer ones, and its rows must keep
    their bits. (On the CPU this holds for spans under ~768, where its kernel walks keys in the
    same blocks; the GPU check is scripts/bench_serve.py's equal_to_serial on the H200.)"""
    from specdec.engine import loop_work

    monkeypatch.setattr(loop_work, "SPAN_BUCKET_MIN", 16)
    reqs, rows_s, rows_a = _alone_and_shared(target, k, False, span_buckets=True)
    spans_used = set()
    _assert_same_rows(reqs, rows_s, rows_a)
    loaded, capture = target
    engine = EngineLoop(loaded, "none", max_slots=4, static_steps=True, span_buckets=True)
    for need in (1, 16, 17, 40, 64, 65):
        spans_used.add(engine._span(need))
    assert sorted(spans_used) == [16, 32, 64, 128] or engine.cache.max_len < 128


def test_span_buckets_need_static_steps(target):
    with pytest.raises(Exception, match="span_buckets"):
        EngineLoop(target[0], "none", static_steps=False, span_buckets=True)


@pytest.mark.parametrize("k", [0, 3], ids=["plain", "oracle"])
def test_rows_bitwise_alone_or_shared_two_threads(target, k, two_threads):
    """The exactness test above with two intra-op threads: a request alone (slot 0) and beside
    others (any slot) must still give the same bits. The static steps attend one slot at a time
    on the CPU; with a batched SDPA call, half the prompts' logits differed here."""
    reqs, rows_s, rows_a = _alone_and_shared(target, k, False)
    _assert_same_rows(reqs, rows_s, rows_a)
