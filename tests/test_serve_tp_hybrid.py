"""The serving loop (:class:`EngineLoop`) under tensor parallelism on hybrid Qwen3.5 targets, on the
CPU (gloo, 2 spawned ranks): Gated DeltaNet layers whose per-slot recurrent and conv states are split
by key-head groups, gated attention split by heads, and (MoE) experts split across ranks. Rank 0
serves concurrent greedy requests of ragged prompt lengths (more than the slots, so requests join as
others end, and prompts prefill in chunks beside running verify steps); rank 1 follows. A drafter
proposes the greedy continuation with spoiled drafts, so verify steps commit part of their rows and
roll the rest of each slot's recurrent state back. Every request's tokens must equal the
single-process loop's and plain greedy decoding, with exact batching (static steps, run eagerly on
the CPU, each prompt prefilled alone through the static prefill step) and without it (eager steps;
and static steps with a 1-wide step when k = 0), and (dense) with the checkpoint's own MTP block
running inside the drafter (sharded embedding and head). One spawn per target, with a deadline."""

from __future__ import annotations

import pytest
import torch

from _engine_util import plain_generate
from _qwen35_util import build_tp_dense, build_tp_moe
from _tp_util import LOOP_CASES, children, serve_loop, serve_loop_on_rank
from specdec.loading import load_model
from specdec.parallel.launch import run_parallel

DEADLINE = 120.0
COLLECTIVE_S = 20.0  # ranks that part ways (different steps) fail in a collective this soon, not at the deadline
pytestmark = pytest.mark.usefixtures("single_thread")

# prompt lengths: with exact, up to 48 tokens prefill through the static [1, 8] prefill step, 90 in
# eager forwards of its own (72 + 18 positions, the first in two chunks of the chunked DeltaNet form);
# without, the joining prompts prefill together, 72 positions per boundary
SIZES = [1, 19, 6, 90, 3]
NEW = [9, 7, 12, 6, 10]  # new tokens per request


@pytest.fixture(scope="module", params=["dense", "moe"])
def target(request, tmp_path_factory):
    """(dense or moe, checkpoint, its loaded single-process model, the requests (prompt, new tokens),
    prompt -> prompt + greedy continuation)."""
    root = tmp_path_factory.mktemp(f"tploop-{request.param}")
    path = build_tp_dense(root / "t", seed=3) if request.param == "dense" else build_tp_moe(root / "t", seed=6)
    loaded = load_model(path, "cpu", "float32", tokenizer=False)
    g = torch.Generator().manual_seed(7)
    reqs = [(torch.randint(0, loaded.model.config.vocab_size, (m,), generator=g).tolist(), n)
            for m, n in zip(SIZES, NEW)]
    refs = {tuple(p): p + plain_generate(loaded.model, p, n).token_ids for p, n in reqs}
    return request.param, path, loaded, reqs, refs


def test_loop_under_tp_equals_single_process(target):
    kind, path, loaded, reqs, refs = target
    cases = [c for c, (_, _, inner) in LOOP_CASES.items() if inner is None or kind == "dense"]  # MoE: no MTP block
    got = run_parallel(serve_loop_on_rank, 2, path, refs, reqs, cases, timeout_s=COLLECTIVE_S, deadline_s=DEADLINE)
    want = [refs[tuple(p)][len(p):] for p, _ in reqs]
    for case in cases:
        one, one_metrics = serve_loop(loaded, refs, reqs, case)
        assert one == want, case  # the single-process loop equals plain greedy decoding
        toks, metrics, follower = got[case]
        assert toks == want, case
        # drafts were accepted and rejected: verify steps kept part of their rows on both ranks
        assert 0 < metrics["accepted_total"] < metrics["drafted_total"], (case, metrics)
        for key in ("accepted_total", "drafted_total", "steps_total", "k_chosen"):
            assert follower[key] == metrics[key] == one_metrics[key], (case, key)
    assert not children(), f"processes left running: {children()}"
