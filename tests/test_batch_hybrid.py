"""Batched forwards on Qwen3.5 hybrid targets (Gated DeltaNet + gated attention, dense and MoE):
``forward_batch`` rows equal the single-sequence forward at their positions (ragged prefills into
scattered slots, ragged verify steps whose padding and rejected rows are rolled back per slot),
and the serving loop and ``generate_batch`` equal plain single-sequence greedy decoding with
drafts accepted and rejected. Tiny random configs, fp32 on the CPU."""

from __future__ import annotations

import pytest
import torch

from _engine_util import SlotOracle, plain_generate
from _mtp_util import build_qwen35
from specdec.drafters.factory import make_drafter
from specdec.engine.batch import forward_ragged, generate_batch
from specdec.engine.serve_loop import EngineLoop, GenRequest
from specdec.loading import load_model
from specdec.sampling import SamplingParams

VOCAB = 256

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module", params=["dense", "moe"])
def loaded(request, tmp_path_factory):
    path = build_qwen35(tmp_path_factory.mktemp(request.param), moe=request.param == "moe", mtp=True)
    return load_model(path, "cpu", "float32", tokenizer=False)


def _close(a, b):
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_forward_batch_rows_equal_single_forward(loaded):
    m = loaded.model
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in (40, 36, 38)]
    refs = [m.forward(s, m.new_cache(64), capture=(1, 2), snapshots=False) for s in seqs]
    slots = [2, 0, 3]
    cache = m.new_batch_cache(4, 48, spare=5)
    # a ragged prefill (13, 4 and 10 positions) into scattered slots, then a second chunk
    pos = [13, 4, 10]
    out = forward_ragged(m, cache, [s[:p] for s, p in zip(seqs, pos)], [0] * 3, slots, capture=(1, 2))
    for r, p in enumerate(pos):
        _close(out.hidden[r, :p], refs[r].hidden[:p])
        _close(out.captured[r, :p], refs[r].captured[:p])
        _close(out.logits[r], refs[r].logits[p - 1])
    out = forward_ragged(m, cache, [s[p:p + 3 + r] for r, (s, p) in enumerate(zip(seqs, pos))], pos, slots)
    pos = [p + 3 + r for r, p in enumerate(pos)]
    for r, p in enumerate(pos):
        _close(out.logits[r], refs[r].logits[p - 1])
    # ragged verify steps: row r holds w[r] real tokens then padding (junk ids); each slot keeps
    # keep[r] of its rows, the rest (rejected rows and padding) is rolled back
    for w, keep in (([5, 2, 4], [2, 1, 4]), ([3, 5, 1], [3, 1, 1]), ([4, 4, 4], [1, 4, 2])):
        ids = torch.full((3, 5), 7, dtype=torch.long)
        for r, p in enumerate(pos):
            ids[r, : w[r]] = seqs[r][p:p + w[r]]
        step = m.forward_batch(ids, cache, torch.tensor(pos), slots=torch.tensor(slots), span=max(pos) + 5,
                               capture=(1, 2), logits="all")
        for r, p in enumerate(pos):
            _close(step.logits[r, : w[r]], refs[r].logits[p:p + w[r]])
            _close(step.captured[r, : w[r]], refs[r].captured[p:p + w[r]])
        cache.commit(slots, keep)
        pos = [p + k for p, k in zip(pos, keep)]
    # a static-style step over every slot in order (slots=None: views, no gather), idle slot 1 at
    # position 0 running junk; only the live slots commit, twice, so the second step reads the first
    at = dict(zip(slots, range(3)))
    for keep in ([3, 1, 2], [2, 2, 1]):
        ids = torch.full((4, 3), 5, dtype=torch.long)
        starts = torch.zeros(4, dtype=torch.long)
        for s, r in at.items():
            ids[s] = seqs[r][pos[r]:pos[r] + 3]
            starts[s] = pos[r]
        step = m.forward_batch(ids, cache, starts, span=48, logits="all")
        for s, r in at.items():
            _close(step.logits[s], refs[r].logits[pos[r]:pos[r] + 3])
        cache.commit(slots, keep)
        pos = [p + k for p, k in zip(pos, keep)]
    # whole padded sequences without a cache (training features)
    ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True)
    feats = m.forward_batch_train(ids, capture=(1, 2))
    for r, s in enumerate(seqs):
        _close(feats.hidden[r, : len(s)], refs[r].hidden)
        _close(feats.captured[r, : len(s)], refs[r].captured)


def test_verify_step_is_limited_to_the_spare_rows(loaded):
    m = loaded.model
    cache = m.new_batch_cache(2, 32, spare=2)
    with pytest.raises(RuntimeError, match="exceeds the 2 rows"):
        m.forward_batch(torch.zeros(2, 3, dtype=torch.long), cache, torch.tensor([0, 0]), logits="all")


def _requests(n: int, repetitive: bool) -> list[GenRequest]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        size = int(torch.randint(1, 19, (1,), generator=g))
        if repetitive:
            pat = torch.randint(0, VOCAB, (int(torch.randint(2, 4, (1,), generator=g)),), generator=g).tolist()
            prompt = (pat * 10)[:max(size, 6)]
        else:
            prompt = torch.randint(0, VOCAB, (size,), generator=g).tolist()
        out.append(GenRequest(prompt, 6 + 3 * (i % 4), SamplingParams()))
    return out


@pytest.mark.parametrize("kind", ["none", "ngram", "mtp"])
def test_serving_loop_equals_plain_greedy(loaded, kind):
    model = loaded.model
    reqs = _requests(7, repetitive=kind == "ngram")
    refs = [plain_generate(model, r.prompt_ids, r.max_new_tokens).token_ids for r in reqs]
    draft = None if kind == "none" else kind
    if kind == "mtp":  # the checkpoint's own MTP block, one per slot, behind a spoiled oracle
        base = make_drafter("mtp", loaded)
        full = {tuple(r.prompt_ids): r.prompt_ids + ref for r, ref in zip(reqs, refs)}
        seeds = iter(range(100))
        draft = lambda: SlotOracle(base.spawn(), full, VOCAB, seed=next(seeds))  # noqa: E731
    engine = EngineLoop(loaded, draft, max_slots=3, max_queue=0, num_draft_tokens=3, controller=False)
    engine.prefill_chunk = 8  # prompts of up to 18 tokens prefill in several chunks, beside decode steps
    got = engine.run(reqs)
    assert got == refs
    m = engine.metrics()
    if kind != "none":
        assert 0 < m["accepted_total"] < m["drafted_total"], m


def test_greedy_exact_beside_seeded_sampled_requests(loaded):
    model = loaded.model
    reqs = _requests(6, repetitive=True)
    for r in reqs[1::2]:
        r.params = SamplingParams(temperature=0.9, seed=11)
    runs = [EngineLoop(loaded, "ngram", max_slots=3, max_queue=0, num_draft_tokens=3, controller=False).run(reqs)
            for _ in range(2)]
    assert runs[0] == runs[1]
    for r, got in zip(reqs[::2], runs[0][::2]):
        assert got == plain_generate(model, r.prompt_ids, r.max_new_tokens).token_ids


def test_generate_batch_equals_per_prompt_greedy(loaded):
    model = loaded.model
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (int(torch.randint(1, 14, (1,), generator=g)),), generator=g).tolist()
               for _ in range(6)]
    ref = [plain_generate(model, p, 10).token_ids for p in prompts]
    assert generate_batch(model, prompts, 10, set(), slots=4) == ref

