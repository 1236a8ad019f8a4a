"""Greedy speculative decoding must equal plain greedy decoding token for token.

Scripted drafters drive every path of the loop: all drafts rejected (rollback of k positions
every step), all accepted (bonus token, no rollback), partial acceptance, random and short
proposals, and the n-gram drafter. Targets: a tiny Llama and, when ``specdec.models.qwen35``
is present, tiny Qwen3.5 dense and MoE hybrids (DeltaNet state rollback).
"""

from __future__ import annotations

import pytest
import torch

from _engine_util import (OracleDrafter, RandomDrafter, build_llama, check_accept_accounting, plain_generate)
from specdec.drafters import NgramDrafter
from specdec.engine import SpeculativeGenerator
from specdec.loading import load_model

NEW = 64
PROMPT_LENS = (1, 6, 19)


pytestmark = pytest.mark.usefixtures("single_thread")



TARGETS = ["llama", "qwen35_dense", "qwen35_moe"]


@pytest.fixture(scope="module", params=TARGETS)
def target(request, tmp_path_factory):
    """(model, vocab, greedy references by prompt length)."""
    kind = request.param
    path = tmp_path_factory.mktemp(kind)
    if kind == "llama":
        build_llama(path, vocab=48, seed=1)
    else:
        from _mtp_util import build_qwen35
        build_qwen35(path, moe=kind == "qwen35_moe", mtp=False, seed=1)
    model = load_model(str(path), "cpu", tokenizer=False).model
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(7)
    refs = {}
    for n in PROMPT_LENS:
        prompt = torch.randint(vocab, (n,), generator=g).tolist()
        # K+1 tokens past NEW so the oracle can propose a full block at the very end
        refs[n] = (prompt, prompt + plain_generate(model, prompt, NEW + 6).token_ids)
    return model, vocab, refs


def _drafters(vocab, ref, k):
    return {
        "oracle": OracleDrafter(ref, vocab),
        "never": OracleDrafter(ref, vocab, invert=True, seed=k),
        "noisy": OracleDrafter(ref, vocab, corrupt=0.3, seed=k),
        "random": RandomDrafter(vocab, seed=k),
        "ngram": NgramDrafter(),
    }


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_greedy_lossless(target, k):
    model, vocab, refs = target
    # the hybrid targets are slower: one prompt length per K there, rotating so all are covered
    lens = PROMPT_LENS if model.config.model_type == "llama" else (PROMPT_LENS[k % len(PROMPT_LENS)],)
    for n in lens:
        prompt, ref = refs[n]
        want = ref[len(prompt): len(prompt) + NEW]
        for name, drafter in _drafters(vocab, ref, k).items():
            res = SpeculativeGenerator(model, drafter, k).generate(prompt, NEW, trace=True)
            assert res.token_ids == want, f"{name} drafter, K={k}, prompt of {n}: output differs from plain greedy"
            assert res.finish_reason == "length"
            check_accept_accounting(prompt, ref, res)
            acc = res.stats.accepted
            if name == "oracle":
                # every step accepts its whole block; only the last one may be cut short by max_new_tokens
                assert all(a == k for a in acc[:-1]), f"oracle, K={k}: accepted {acc}"
                assert len(acc) == -(-(NEW - 1) // (k + 1)), f"oracle, K={k}: {len(acc)} steps"
            if name == "never":
                assert all(a == 0 for a in acc), f"0% drafter, K={k}: accepted {acc}"
                assert res.stats.tau == 1.0 and res.stats.steps == NEW - 1


def test_oracle_tau_is_k_plus_one(target):
    """tau counts the bonus token: a perfect drafter gives k+1 tokens per verify step."""
    model, vocab, refs = target
    prompt, ref = refs[PROMPT_LENS[1]]
    k = 3
    new = 1 + 5 * (k + 1)  # the prefill token plus exactly five full blocks
    res = SpeculativeGenerator(model, OracleDrafter(ref, vocab), k).generate(prompt, new)
    assert res.token_ids == ref[len(prompt): len(prompt) + new]
    assert res.stats.accepted == [k] * 5
    assert res.stats.tau == k + 1
    assert res.stats.acceptance_rate == 1.0


def test_k_larger_than_remaining(target):
    """Near max_new_tokens the engine drafts fewer tokens; output still matches."""
    model, vocab, refs = target
    prompt, ref = refs[PROMPT_LENS[0]]
    for new in (1, 2, 3, 5):
        res = SpeculativeGenerator(model, OracleDrafter(ref, vocab), 8).generate(prompt, new, trace=True)
        assert res.token_ids == ref[len(prompt): len(prompt) + new]
        assert all(len(s["draft"]) <= new - 1 for s in res.stats.trace)


def test_eos_inside_accepted_block(target):
    """An EOS among accepted drafts ends the output there, exactly as plain decoding would."""
    model, vocab, refs = target
    prompt, ref = refs[PROMPT_LENS[2]]
    cont = ref[len(prompt):]
    eos = cont[10]
    cut = cont.index(eos) + 1
    plain = SpeculativeGenerator(model, None, 0).generate(prompt, NEW, eos_ids=[eos])
    assert plain.token_ids == cont[:cut] and plain.finish_reason == "stop"
    for k in (2, 4):
        res = SpeculativeGenerator(model, OracleDrafter(ref, vocab), k).generate(prompt, NEW, eos_ids=[eos])
        assert res.token_ids == plain.token_ids and res.finish_reason == "stop"
