"""Per-position invariance: a committed position's logits are bitwise the same whether plain
decoding computed it (always row 0 of a step) or a verify step did (row 0..k, beside accepted and
rejected drafts, then rolled back). This is what makes speculative output exactly plain output in
bf16; here it is checked bit for bit in fp32 on the CPU, with a drafter that is actually accepted
(the target's own continuation, partly spoiled), so rollback runs at every step.

Paths: ``static`` is the batch-invariant step (fixed 16 rows, attention over the whole cache
masked by position) that CUDA runs captured as a graph or, with ``--no-cuda-graphs``, eagerly;
on the CPU it runs uncaptured (here the llama and gemma3 targets take the CPU's unpadded exact steps instead,
cpu_exact.py: the same assertion holds). ``eager`` is the CPU default (each step runs its own rows only).
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from _engine_util import SpoiledOracle, chunked_verify_form  # noqa: E402
from specdec.engine import SpeculativeGenerator  # noqa: E402
from specdec.engine import generate as engine_mod  # noqa: E402
from specdec.models import deltanet  # noqa: E402

TARGETS = ("llama", "qwen35-dense", "qwen35-moe", "gemma3")
pytestmark = pytest.mark.cpu_exact  # the product's CPU path (tests/conftest.py)
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def targets(tmp_path_factory, single_thread):
    from _engine_util import build_llama
    from _qwen35_util import hf_model

    from specdec.loading import load_model

    root = tmp_path_factory.mktemp("inv")
    paths = {"llama": build_llama(root / "llama", vocab=97, hidden=48, layers=3, seed=1)}
    for kind in ("dense", "moe"):
        p = root / kind
        hf_model(kind, seed=2).save_pretrained(p)
        paths[f"qwen35-{kind}"] = str(p)
    from _dense_util import save_hf
    from _gemma_util import tiny_model as tiny_gemma
    # Gemma 3 with a window of 8 (the prompts and 48 new tokens cross it), sliding and global layers, an untied head
    paths["gemma3"] = save_hf(tiny_gemma("base", seed=3, tied=False), str(root / "gemma3"))
    return {name: load_model(p, "cpu", "float32", tokenizer=False).model for name, p in paths.items()}


def record(model, drafter, k, prompt, batch_invariant, monkeypatch):
    """Generate greedily; return (tokens, committed positions' logits [N, V] in order, stats)."""
    rows = []
    accept = engine_mod.accept_greedy

    def recording(drafts, logits):
        packed = accept(drafts, logits)
        rows.append(logits[: int(packed[0]) + 1].clone())  # the rows whose positions are committed
        return packed

    monkeypatch.setattr(engine_mod, "accept_greedy", recording)
    res = SpeculativeGenerator(model, drafter, k, batch_invariant=batch_invariant).generate(prompt, NEW_TOKENS)
    monkeypatch.setattr(engine_mod, "accept_greedy", accept)
    return res.token_ids, torch.cat(rows), res.stats


def compare(model, prompt, batch_invariant, monkeypatch, k=4):
    """Plain vs spoiled-oracle decoding: (number of positions whose logits differ, positions, stats)."""
    plain, plain_rows, _ = record(model, None, 0, prompt, batch_invariant, monkeypatch)
    oracle = SpoiledOracle(prompt + plain, model.config.vocab_size, spoil=0.3)
    spec, spec_rows, stats = record(model, oracle, k, prompt, batch_invariant, monkeypatch)
    n = min(len(plain_rows), len(spec_rows))
    differ = int((plain_rows[:n] != spec_rows[:n]).any(-1).sum())
    return differ, n, stats, plain == spec


def _check_exercised(stats):
    # the comparison means something only if drafts were accepted at rows > 0 and rejected too
    acc = stats.accepted
    assert sum(acc) >= 10 and any(a < 4 for a in acc) and any(a >= 2 for a in acc), acc


@pytest.mark.parametrize("target", TARGETS)
def test_static_steps_are_per_position_invariant(targets, target, monkeypatch):
    model = targets[target]
    for seed in (0, 1):
        prompt = torch.randint(0, model.config.vocab_size, (7 + 9 * seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        differ, n, stats, same = compare(model, prompt, True, monkeypatch)
        _check_exercised(stats)
        assert n >= NEW_TOKENS - 1
        assert differ == 0, f"{target}: {differ} of {n} positions' logits differ between plain and speculative decoding"
        assert same


@pytest.mark.parametrize("target", ["llama", "gemma3"])
def test_padded_static_steps_too(targets, target, monkeypatch):
    """The llama and gemma3 targets on the padded static steps (SPECDEC_CPU_EXACT=0; what CUDA runs without the fused
    kernels), not the CPU's exact ones."""
    monkeypatch.setattr(engine_mod, "CPU_EXACT", False)
    model = targets[target]
    assert not SpeculativeGenerator(model, None, 0, batch_invariant=True).cpu_exact
    prompt = torch.randint(0, 97, (7,), generator=torch.Generator().manual_seed(0)).tolist()
    differ, n, stats, same = compare(model, prompt, True, monkeypatch)
    _check_exercised(stats)
    assert differ == 0 and same


@pytest.mark.parametrize("target", TARGETS)
def test_eager_cpu_steps_keep_greedy_tokens(targets, target, monkeypatch):
    """The CPU default runs each step's own rows only: padding every step to 16 rows costs CPU
    decoding about 35-45% (SmolLM2-135M, 2 cores), so it is opt-in there (``batch_invariant=True``).
    Its greedy tokens equal plain decoding; its logits differ in the last bits (the CPU's matrix
    kernels change with the row count, and a KV entry computed in a 5-row step then differs for
    every later position), which is why CUDA (bf16, where such bits flip near-tie tokens) runs the
    static steps by default."""
    model = targets[target]
    prompt = torch.randint(0, model.config.vocab_size, (11,), generator=torch.Generator().manual_seed(3)).tolist()
    differ, n, stats, same = compare(model, prompt, False, monkeypatch)
    _check_exercised(stats)
    assert same, f"{target}: speculative tokens differ from plain decoding"
    assert n >= NEW_TOKENS - 1


@pytest.mark.parametrize("target", ("qwen35-dense", "qwen35-moe"))
def test_chunked_verify_steps_break_invariance(targets, target, monkeypatch):
    """Mutation check: running verify steps through the chunked form (the old behaviour) makes a
    position's arithmetic depend on its row, and the invariance test sees it."""

    monkeypatch.setattr(deltanet, "recurrent_gated_delta", chunked_verify_form)
    model = targets[target]
    prompt = torch.randint(0, model.config.vocab_size, (7,), generator=torch.Generator().manual_seed(0)).tolist()
    differ, n, _, _ = compare(model, prompt, True, monkeypatch)
    assert differ > 0


def test_grouped_moe_in_verify_steps_breaks_invariance(targets, monkeypatch):
    """Mutation check: routing verify steps through the long forwards' per-expert loop (matmuls whose
    row counts depend on the other rows' experts) makes the invariance test fail. (The grouped form,
    moe.GROUPED_BMM, pads each expert's rows to the busiest one's: on this tiny target's fp32 CPU bmm
    that kept every bit, so it is not the mutation here.)"""
    from specdec.models import moe

    monkeypatch.setattr(moe.Experts, "static_form", lambda self, t, live, x: False)
    monkeypatch.setattr(moe, "GROUPED_BMM", False)
    model = targets["qwen35-moe"]
    prompt = torch.randint(0, model.config.vocab_size, (7,), generator=torch.Generator().manual_seed(0)).tolist()
    differ, n, _, _ = compare(model, prompt, True, monkeypatch)
    assert differ > 0


def test_too_many_drafts_for_the_padded_step_warn(targets):
    """More drafts than the 16-row step holds cannot be padded: say so instead of silently losing
    bitwise exactness (the CPU default does not pad, so no warning there; nor on the CPU's unpadded exact
    steps of a Llama-family target, tests/test_cpu_exact.py)."""
    import warnings

    from specdec import cpu_exact

    model = targets["qwen35-dense"]
    vocab = model.config.vocab_size
    with pytest.warns(UserWarning, match="16 rows"):
        SpeculativeGenerator(model, SpoiledOracle([], vocab), 16, batch_invariant=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SpeculativeGenerator(model, SpoiledOracle([], vocab), 15, batch_invariant=True)
        SpeculativeGenerator(model, SpoiledOracle([], vocab), 16)
        llama = SpeculativeGenerator(targets["llama"], SpoiledOracle([], 97), 16, batch_invariant=True)
        assert llama.cpu_exact == cpu_exact.available()
