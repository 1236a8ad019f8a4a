"""``X+ngram`` (drafters/combined.py: history lookup first, the model drafter where the history has
no match): the spec's parsing and errors, the choice rule, greedy output equal to plain decoding with
both sides really proposing (DFlash and MTP, the single-sequence engine and the serving loop), and
sampled output following the target (test_sampling_lossless.py holds the chi-square check)."""

from __future__ import annotations

import pytest
import torch

from _engine_util import build_llama, plain_generate
from specdec.drafters.base import Proposal
from specdec.drafters.combined import NgramFirst
from specdec.drafters.factory import check_spec, make_drafter
from specdec.drafters.mtp_dir import new_mtp_block, save_mtp_dir
from specdec.engine import SpeculativeGenerator
from specdec.engine.serve_loop import EngineLoop, GenRequest
from specdec.errors import ConfigError
from specdec.loading import load_model
from specdec.sampling import SamplingParams
from specdec.train.dflash_batch import new_dflash_config, new_dflash_model, save_dflash_dir

VOCAB = 64
pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(loaded tiny Llama, {"dflash": dir, "mtp": dir}) with random drafters."""
    root = tmp_path_factory.mktemp("ngram_first")
    loaded = load_model(build_llama(root / "t", vocab=VOCAB, hidden=32, layers=3, seed=3, head_scale=4.0), "cpu",
                        "float32", tokenizer=False)
    cfg = new_dflash_config(loaded, num_layers=1, block_size=6, mask_token_id=VOCAB - 1)
    save_dflash_dir(new_dflash_model(loaded, cfg), cfg, str(root / "dflash"), dtype=None)
    block = new_mtp_block(loaded.model, init_from_layer=-1, generator=torch.Generator().manual_seed(6))
    save_mtp_dir(block, loaded.model, str(root / "mtp"), steps=3, dtype=None)
    return loaded, {"dflash": str(root / "dflash"), "mtp": str(root / "mtp")}


def _prompts() -> list[list[int]]:
    """Prompts that repeat a pattern (the history has matches) and random ones (it mostly has none)."""
    g = torch.Generator().manual_seed(1)
    pats = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 5, 4)]
    return [(p * 8)[:20] for p in pats] + [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (9, 14)]


@pytest.mark.parametrize("spec", ["dflash+ngram", "dflash:/x+ngram", "mtp+ngram", "mtp:/x+ngram"])
def test_spec_accepted(spec):
    check_spec(spec)


@pytest.mark.parametrize("spec, block_size, msg", [
    ("ngram+ngram", None, "follows a model drafter"), ("+ngram", None, "follows a model drafter"),
    ("none+ngram", None, "follows a model drafter"), ("auto+ngram", None, "follows a model drafter"),
    ("dflash+ngram+ngram", None, "follows a model drafter"), ("dflash:+ngram", None, "needs a path"),
    ("mtp+ngram", 8, "DFlash drafters only"), ("eagle+ngram", None, "unknown drafter")])
def test_spec_refused_in_one_line(spec, block_size, msg):
    with pytest.raises(ConfigError, match=msg):
        check_spec(spec, block_size)


class _Base:
    """A model drafter stand-in: proposes k copies of 0, records its calls."""
    name, capture_layers = "base", ()

    def __init__(self):
        self.calls, self.observed = 0, []

    def begin(self, prompt_ids, out):
        self.observed = prompt_ids.tolist()

    def observe(self, tokens, out):
        self.observed += tokens.tolist()

    def propose(self, last_token, k, params, gen):
        self.calls += 1
        return Proposal(torch.zeros(k, dtype=torch.int64))


def test_choice_rule():
    """The lookup proposes when the last three tokens (with the new one) occurred before with at
    least three tokens after them (or k, when k is smaller); else the model drafter. Both follow
    every committed token."""
    d = NgramFirst(_Base())
    d.begin(torch.tensor([7, 8, 9, 10, 11, 12, 7, 8]), None)
    assert d.propose(9, 4, SamplingParams(), None).tokens.tolist() == [10, 11, 12, 7]  # 7 8 9 -> 10 11 12 7
    assert (d.lookups, d.base.calls) == (1, 0)
    d.observe(torch.tensor([9, 10]), None)  # committed: ... 7 8 9 10
    assert d.base.observed[-4:] == [7, 8, 9, 10] and d.ngram.history[-4:] == [7, 8, 9, 10]
    assert d.propose(5, 4, SamplingParams(), None).tokens.tolist() == [0, 0, 0, 0]  # 9 10 5: no match
    assert (d.lookups, d.base.calls) == (1, 1)
    short = NgramFirst(_Base())
    short.begin(torch.tensor([1, 2, 1, 2]), None)  # 2 1 2 + 1: 1 2 1 occurred, then only "2" (and the 1 fed now)
    assert short.propose(1, 4, SamplingParams(), None).tokens.tolist() == [0, 0, 0, 0]
    assert short.propose(1, 2, SamplingParams(), None).tokens.tolist() == [2, 1]  # k = 2: two are enough
    assert (short.lookups, short.base.calls) == (1, 1)


@pytest.mark.parametrize("kind", ["dflash", "mtp"])
def test_greedy_equals_plain_with_both_sides(setup, kind):
    loaded, dirs = setup
    model = loaded.model
    d = make_drafter(f"{kind}:{dirs[kind]}+ngram", loaded)
    assert isinstance(d, NgramFirst) and d.name == f"{kind}+ngram"
    assert d.flat_draft_cost == (kind == "dflash") and d.block_size == getattr(d.base, "block_size", None)
    flushed = []
    if kind == "dflash":
        flush = d.base._flush
        d.base._flush = lambda: flushed.append(sum(p.shape[0] for p in d.base._pending)) or flush()
    k = d.block_size - 1 if d.block_size else 3
    gen = SpeculativeGenerator(model, d, k)
    accepted = 0
    for p in _prompts():
        flushed.clear()
        res = gen.generate(p, 24)
        assert res.token_ids == plain_generate(model, p, 24).token_ids, p
        accepted += sum(res.stats.accepted)
        if kind == "dflash":  # after the prompt's, the pending context rows written at every step (lookup
            assert flushed[0] == len(p) and max(flushed[1:]) <= d.block_size, flushed  # steps too): one step's
    assert d.lookups > 0 and d.model_proposals > 0 and accepted > 0, (d.lookups, d.model_proposals, accepted)


@pytest.mark.parametrize("kind", ["dflash", "mtp"])
def test_serving_loop_greedy_equals_plain(setup, kind):
    """In the serving loop the combined drafter runs one per slot (spawned: shared weights); the
    controller is off (with these random drafters it soon stops drafting)."""
    loaded, dirs = setup
    reqs = [GenRequest(p, 16, SamplingParams()) for p in _prompts()]
    engine = EngineLoop(loaded, f"{kind}:{dirs[kind]}+ngram", max_slots=3, num_draft_tokens=3, controller=False)
    engine.start()
    try:
        handles = [engine.submit(r) for r in reqs]
        got = [[t for ev in h.events(timeout=60) if ev.kind == "tokens" for t in ev.token_ids] for h in handles]
    finally:
        engine.stop()
    for r, toks in zip(reqs, got):
        assert toks == plain_generate(loaded.model, r.prompt_ids, 16).token_ids, r.prompt_ids
    assert engine.metrics()["accepted_total"] > 0
