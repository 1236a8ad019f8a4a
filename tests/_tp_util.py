"""What each tensor-parallel rank runs in tests/test_tp.py. Spawned ranks import this module by
name, so it imports only specdec (no pytest, no transformers)."""

from __future__ import annotations

import os

from specdec import LLM, load_target


def logits_on_rank(shard, cases: list[tuple[str, list[int]]]) -> list:
    """fp32 logits ``[T, V]`` of each case's ids under its target."""
    return [load_target(path, shard=shard).logits(ids) for path, ids in cases]


def generate_on_rank(shard, path: str, drafts: list[str], prompts: list[list[int]], n: int,
                     references: list[list[int]] | None = None) -> dict:
    """Greedy token ids per drafter spec ("none": plain decoding); with ``references`` (prompt +
    plain continuation), also a spoiled oracle's ids and how many of its drafts were accepted
    (drafts that get accepted, so the sharded verify and rollback really run); with the last
    drafter, one reply sampled with a seed and one without (the ranks must agree on a seed, or
    their forwards would part ways)."""
    from _engine_util import SpoiledOracle

    out = {}
    if references:
        vocab = LLM(path, shard=shard).model.config.vocab_size
        out["oracle"], out["oracle accepted"] = [], 0
        for ref, p in zip(references, prompts):
            oracle = SpoiledOracle(ref, vocab, spoil=0.3)
            res = LLM(path, draft=oracle, shard=shard, num_draft_tokens=3).generate(p, n)
            out["oracle"].append(res.token_ids)
            out["oracle accepted"] += sum(res.stats.accepted)
    for spec in drafts:
        llm = LLM(path, draft=spec, shard=shard, num_draft_tokens=3)
        out[spec] = [llm.generate(p, n).token_ids for p in prompts]
    out["seed 5"] = llm.generate(prompts[0], n, temperature=1.0, seed=5).token_ids
    out["no seed"] = llm.generate(prompts[0], n, temperature=1.0).token_ids
    return out


def load_on_rank(shard, paths: list[str], ids: list[int]):
    """Rank r loads ``paths[r]`` (a broken one fails that rank alone), then runs a forward."""
    return load_target(paths[shard.rank], shard=shard).logits(ids)


def children(pid: int | None = None) -> list[tuple[int, str]]:
    """Live child processes of ``pid`` (default: this one) as (pid, command line), multiprocessing's
    resource tracker left out."""
    pid = os.getpid() if pid is None else pid
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as fh:
                stat = fh.read()
            with open(f"/proc/{d}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) == pid and fields[0] != "Z" and "resource_tracker" not in cmd:
            out.append((int(d), cmd))
    return out


def no_children_left() -> None:
    left = children()
    assert not left, f"processes left running: {left}"


def assert_logits_equal_single_process(cases: dict, deadline_s: float) -> None:
    """``cases``: name -> (target path, ids). Each target's logits at TP=2 (gloo) equal one
    process's within 1e-5 relative, and no rank is left running."""
    from _dense_util import rel_err
    from specdec.parallel.launch import run_parallel

    got = run_parallel(logits_on_rank, 2, list(cases.values()), deadline_s=deadline_s)
    for (name, (path, ids)), x in zip(cases.items(), got):
        ref = load_target(path, device="cpu").logits(ids)
        assert x.shape == ref.shape, name
        assert rel_err(x, ref) < 1e-5, (name, rel_err(x, ref))
    no_children_left()


def crash_on_rank(shard):
    """Rank 1 dies without a word (a crash); rank 0 waits for it in an all-reduce."""
    import torch

    if shard.rank == 1:
        os._exit(3)
    return shard.all_reduce(torch.ones(1))


# --- expert parallelism (module level) -------------------------------------------------------

MOE_SHAPE = dict(hidden=32, moe_intermediate=16, num_experts=7, top_k=3)  # 7 experts: ranks hold 3 and 4


def moe_block(seed: int, shared: int, shard=None):
    """A :class:`SparseMoeBlock` with seeded random weights (``shared``: the shared expert's width,
    0 for none); with a ``shard``, this rank's part of the same weights, cut by its ``tp_slices``."""
    import torch

    from specdec.models.moe import SparseMoeBlock
    from specdec.parallel.tp import param_slices

    full = SparseMoeBlock(shared_intermediate=shared, **MOE_SHAPE)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in full.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    if shard is None:
        return full.eval()
    part = SparseMoeBlock(shared_intermediate=shared, shard=shard, **MOE_SHAPE)
    slices = param_slices(part)
    state = {}
    for name, w in full.state_dict().items():
        s = slices.get(name)
        state[name] = w if s is None else w.narrow(s.dim, s.start, s.stop - s.start)
    part.load_state_dict(state, strict=True)
    return part.eval()


def moe_on_rank(shard, cases: list[tuple[int, int, int]]) -> list:
    """Outputs ``[T, H]`` of the sharded block, and of its routed experts alone (reduced by
    ``Experts.forward``, as Gemma 4 calls them), for each case (seed, shared width, rows T)."""
    import torch

    out = []
    for seed, shared, t in cases:
        x = torch.randn(t, MOE_SHAPE["hidden"], generator=torch.Generator().manual_seed(seed + 100))
        with torch.no_grad():
            block = moe_block(seed, shared, shard)
            out.append((block(x), block.experts(x, *block.route(x))))
    return out


def compiled_generate_on_rank(shard, path: str, drafts: list[str], prompts: list[list[int]], n: int,
                              references: list[list[int]]) -> dict:
    """Greedy token ids per drafter spec with every static step compiled (``compile=True``, with
    batch-invariant static steps, so the CPU runs them too): the collectives traced into the graph.
    Also a spoiled oracle's ids (``references``: prompt + plain continuation), so that compiled
    verify steps commit part of their rows and roll the rest back."""
    from _engine_util import SpoiledOracle

    out = {"oracle": [], "oracle accepted": 0}
    for ref, p in zip(references, prompts):
        oracle = SpoiledOracle(ref, LLM(path, shard=shard).model.config.vocab_size, spoil=0.3)
        res = LLM(path, draft=oracle, shard=shard, num_draft_tokens=3, compile=True, batch_invariant=True).generate(p, n)
        out["oracle"].append(res.token_ids)
        out["oracle accepted"] += sum(res.stats.accepted)
    for spec in drafts:
        llm = LLM(path, draft=spec, shard=shard, num_draft_tokens=3, compile=True, batch_invariant=True)
        out[spec] = [llm.generate(p, n).token_ids for p in prompts]
        graphed = llm.engine._graphed
        step = graphed.steps[(16, graphed.cache.max_len)].run  # (rows, span)
        out[spec + " compiled"] = hasattr(step, "__wrapped__")  # maybe_compile's wrapper
    return out


def serve_after_idle_on_rank(shard, path: str, prompt: list[int], idle_s: float):
    """The serving loop under tensor parallelism left idle for ``idle_s`` (longer than the collective
    timeout the test gives the ranks), then serving one greedy n-gram request: rank 0 starts the loop
    and returns the request's token ids and how often each k ran on rank 0 and on rank 1 (sent
    over after the loop ends); the other ranks follow it (and return None). Rank 0's controller
    cycles k, as no follower's own controller would."""
    import torch.distributed as dist
    import time

    from specdec.engine.serve_loop import EngineLoop, GenRequest
    from specdec.loading import load_model
    from specdec.sampling import SamplingParams

    engine = EngineLoop(load_model(path, shard.device, tokenizer=False, shard=shard), "ngram", max_slots=2)
    engine.heartbeat_s = 0.5
    engine.controller = CyclingController(engine.kmax) if shard.rank == 0 else engine.controller
    if shard.rank:
        engine.follow()
        dist.broadcast_object_list([engine.metrics()["k_chosen"]], src=1)
        return None
    engine.start()
    time.sleep(idle_s)
    handle = engine.submit(GenRequest(prompt, 8, SamplingParams()))
    toks = [t for ev in handle.events(timeout=60) if ev.kind == "tokens" for t in ev.token_ids]
    engine.stop()
    theirs = [None]
    dist.broadcast_object_list(theirs, src=1)
    return toks, engine.metrics()["k_chosen"], theirs[0]


class CyclingController:
    """A stand-in for the cost controller: k = kmax, kmax - 1, .. 0, kmax, .. whatever the timings
    (the real one, before it has measured, tries 0, 1, .. kmax)."""

    def __init__(self, kmax: int):
        self.kmax, self.chosen = kmax, []

    def choose(self, alphas: list[float], caps: list[int] | None = None) -> int:
        if not alphas:  # no step follows
            return 0
        self.chosen.append((self.kmax - len(self.chosen)) % (self.kmax + 1))
        return self.chosen[-1]

    def record(self, batch: int, k: int, seconds: float, tokens: int | None = None) -> None:
        pass


# --- the serving loop on hybrid targets (tests/test_serve_tp_hybrid.py) ------------------------

class PromptOracle:
    """A serving-loop drafter (one per slot) proposing the target's greedy continuation of its
    request's prompt (``refs``: prompt tuple -> prompt + continuation), each draft spoiled with
    probability ``spoil``. Its random stream is seeded by the prompt alone, so every rank (and a
    single process) proposes the same drafts for the same request, whatever the spawn order.
    ``inner``: a real drafter of the slot whose begin / propose / observe all run (its forwards
    too, with their collectives), only its tokens replaced."""

    name = "oracle"

    def __init__(self, refs: dict, vocab: int, spoil: float = 0.3, inner=None):
        self.refs, self.vocab, self.spoil, self.inner = refs, vocab, spoil, inner
        self.capture_layers = () if inner is None else tuple(inner.capture_layers)

    def begin(self, prompt_ids, out) -> None:
        self.seq = prompt_ids.tolist()
        self.ref = self.refs[tuple(self.seq)]
        import torch

        self.rng = torch.Generator().manual_seed(sum(self.seq) * 31 + len(self.seq))
        if self.inner is not None:
            self.inner.begin(prompt_ids, out)

    def observe(self, tokens, out) -> None:
        assert tokens.shape[0] == out.hidden.shape[0], "observe: one row per committed token"
        self.seq.extend(tokens.tolist())
        if self.inner is not None:
            self.inner.observe(tokens, out)

    def propose(self, last_token, k, params, gen):
        import torch

        from specdec.drafters.base import Proposal

        if self.inner is not None:
            k = self.inner.propose(last_token, k, params, gen).tokens.numel()
        pos = len(self.seq)  # last_token is ref[pos]
        toks = (self.ref[pos + 1: pos + 1 + k] + [0] * k)[:k]
        for i in range(k):
            if float(torch.rand(1, generator=self.rng)) < self.spoil:
                toks[i] = (toks[i] + 1 + int(torch.randint(self.vocab - 1, (1,), generator=self.rng))) % self.vocab
        return Proposal(torch.tensor(toks, dtype=torch.int64))


LOOP_CASES = {  # name -> EngineLoop settings, whether k cycles (kmax .. 0: steps without drafts too), inner drafter
    "exact": (dict(static_steps=True, exact=True), True, None),
    "eager": (dict(static_steps=False, exact=False), False, None),
    "static inexact": (dict(static_steps=True, exact=False), True, None),
    "exact mtp": (dict(static_steps=True, exact=True), False, "mtp"),  # the checkpoint's MTP block runs inside
}


def serve_loop(loaded, refs: dict, reqs: list, case: str, shard=None) -> tuple[list[list[int]] | None, dict]:
    """Serve the greedy ``reqs`` (prompt, max new tokens each) through an :class:`EngineLoop` of 3
    slots on ``loaded`` with :class:`PromptOracle` drafts: without ``shard`` (or on rank 0 of it)
    returns each request's token ids and the loop's metrics; a follower follows rank 0 and returns
    (None, its metrics)."""
    from specdec.drafters.factory import make_drafter
    from specdec.engine.serve_loop import EngineLoop, GenRequest
    from specdec.sampling import SamplingParams

    settings, cycle, inner = LOOP_CASES[case]
    vocab = loaded.model.config.vocab_size
    base = None if inner is None else make_drafter(inner, loaded)
    engine = EngineLoop(loaded, lambda: PromptOracle(refs, vocab, inner=base and base.spawn()), max_slots=3,
                        max_queue=len(reqs), num_draft_tokens=3, controller=cycle, **settings)
    # long prompts prefill in several chunks beside decoding; exact: up to 48 tokens in static steps
    engine.prefill_chunk, engine.static_prefill_chunk, engine.static_prefill_max = 72, 8, 48
    if cycle and (shard is None or shard.rank == 0):
        engine.controller = CyclingController(engine.kmax)
    greq = [GenRequest(list(p), n, SamplingParams()) for p, n in reqs]
    if shard is None:
        return engine.run(greq), engine.metrics()
    if shard.rank:
        engine.follow()
        return None, engine.metrics()
    handles = [engine.submit(r) for r in greq]  # queued before the loop starts: the same joins every run
    engine.start()
    try:
        events = [list(h.events(timeout=30)) for h in handles]
    finally:
        engine.stop()
    assert engine.error is None, engine.error
    errors = [ev.message for evs in events for ev in evs if ev.kind == "error"]
    assert not errors, errors
    return [[t for ev in evs if ev.kind == "tokens" for t in ev.token_ids] for evs in events], engine.metrics()


def serve_loop_on_rank(shard, path: str, refs: dict, reqs: list, cases: list[str]) -> dict:
    """Every case of :func:`serve_loop` on this rank's shard of ``path``: rank 0 returns, per case,
    its tokens, its metrics and the follower's metrics (sent over after the loop ends)."""
    import torch.distributed as dist

    from specdec.loading import load_model

    loaded = load_model(path, shard.device, "float32", tokenizer=False, shard=shard)
    out = {}
    for case in cases:
        toks, metrics = serve_loop(loaded, refs, reqs, case, shard)
        theirs = [metrics]
        dist.broadcast_object_list(theirs, src=1)
        out[case] = (toks, metrics, theirs[0])
    return out
