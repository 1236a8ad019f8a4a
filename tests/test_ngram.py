"""The n-gram drafter's index gives the scanning rule's drafts (the rule is the spec)."""

import random

import torch

from specdec.drafters import NgramDrafter
from specdec.drafters.ngram import lookup
from specdec.models.base import ForwardOut


def _started(d: NgramDrafter, prompt: list[int]) -> NgramDrafter:
    d.begin(torch.tensor(prompt), ForwardOut(None, torch.zeros(len(prompt), 4), None))
    return d


def test_index_equals_scan_as_history_grows():
    rng = random.Random(0)
    for trial in range(40):
        vocab = rng.choice([2, 3, 5, 20])  # small vocabularies repeat n-grams often
        max_n, min_n = rng.choice([(3, 1), (4, 2), (1, 1), (5, 3)])
        d = _started(NgramDrafter(max_n, min_n), [rng.randrange(vocab) for _ in range(rng.randrange(0, 12))])
        for _ in range(30):
            last, k = rng.randrange(vocab), rng.randrange(0, 7)
            want = lookup(d.history + [last], k, max_n, min_n) if k > 0 else []
            assert d.propose_ids(last, k) == want, (trial, d.history, last, k)
            # the step commits last and some of the drafts (or other tokens), fed in one observe
            fed = [last] + [rng.randrange(vocab) for _ in range(rng.randrange(0, 4))]
            d.observe(torch.tensor(fed) if trial % 2 else fed, None)  # a tensor (the engines) or a list (the loop)


def test_proposal_on_host_and_begin_resets_the_index():
    d = _started(NgramDrafter(), [1, 2, 3, 4, 1, 2])
    prop = d.propose(3, 3, None, None)
    assert prop.tokens.device.type == "cpu" and prop.tokens.tolist() == [4, 1, 2]
    _started(d, [7, 8, 9])  # a new request: nothing of the last one's history is proposed
    assert d.propose_ids(3, 3) == []
    assert d.propose_ids(8, 2) == [9, 8]  # "7 8" ... the latest "8" is followed by 9, then the last 8
