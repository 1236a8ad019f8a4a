"""``specdec bench --shape NAME``: what a target of a given shape costs per step, and what that buys.

One run on one device, for a random-weight target of a published shape (:mod:`specdec.shapes`):

- per-step costs: a 1-token decode step and verify steps of k+1 tokens (k = 1..16), timed as the
  static steps plain and speculative decoding run (``GraphedTarget``: CUDA graphs on CUDA, the same
  steps eagerly elsewhere), the median of ``reps`` after warm-up, at a context of ``context``
  tokens; plus one propose of a random drafter of the published shape where one fits (DFlash:
  5 layers, block 16, alone and after 16 committed rows, its context write included; Qwen3.5 shapes also
  their MTP block, Llama-family shapes a head of ``specdec train mtp``'s shape); with ``wide_rows``,
  steps of more rows too (``wide_ms``: what verifying a tree of drafts in one step would cost);
- the bandwidth bound: a device-to-device copy measures bytes/s, and tok/s <= bandwidth / (the
  weight bytes a decode step reads + the KV bytes at the context);
- with ``contexts``, the decode step and plain decoding's step at each of those contexts, all in one
  cache sized for the largest (attention's cost should follow the live context, not the cache), each
  against the bound counted with the KV bytes live there;
- end to end: plain decoding, then speculative decoding with an ORACLE drafter: it proposes the
  target's own greedy continuation, spoiled at a cut whose law (each draft spoiled with one probability) gives a
  mean of ``oracle_tau`` tokens per step, drawn at low-discrepancy points so that a short run realizes it. Random weights make real drafters useless (tau ~1); the
  oracle shows what a drafter of that tau would give on this target. It is not a real drafter.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from types import SimpleNamespace

import torch

from .bench import git_commit, machine_description
from .cache import KVCache
from .drafters import mtp_dir
from .drafters.base import Proposal
from .engine import SpeculativeGenerator
from .engine.generate import STEP_ROWS
from .errors import ConfigError
from .loading import resolve_device, resolve_dtype
from .models.base import ForwardOut
from .sampling import SamplingParams
from .shapes import build_shape, param_count, shape_config

MAX_K = 16
MAX_WIDE = 256  # --wide-rows: the most rows a timed step may have


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _median_ms(fn, dev: torch.device, reps: int, warmup: int = 3, setup=None) -> float:
    """Median ms of ``fn()`` over ``reps`` calls after ``warmup``; ``setup()`` runs untimed before each."""
    times = []
    for i in range(warmup + reps):
        if setup is not None:
            setup()
        if i < warmup:
            fn()
            continue
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return round(1e3 * statistics.median(times), 4)


def oracle_spoil(tau: float, k: int) -> float:
    """The per-draft spoil probability p giving a mean of ``tau`` tokens per step with ``k`` drafts.

    Drafts are spoiled independently; the accepted prefix stops at the first spoiled one, so
    E[tokens per step] = 1 + sum_{i=1..k} q^i with q = 1 - p (the bonus token included).
    Solved for q by bisection (the sum grows with q)."""
    if not 1.0 <= tau <= k + 1:
        raise ConfigError(f"--oracle-tau {tau} must lie in [1, {k + 1}] for {k} drafts per step")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        q = (lo + hi) / 2
        lo, hi = (q, hi) if 1 + sum(q ** i for i in range(1, k + 1)) < tau else (lo, q)
    return 1.0 - (lo + hi) / 2


class OracleDrafter:
    """ORACLE (benchmarks only): proposes ``reference`` (prompt + the target's plain greedy
    continuation) from the current position, with the draft at the step's cut replaced by a wrong id.
    Output stays exactly plain decoding's (the target verifies every draft).

    The cut (the drafts the target accepts) follows the model of :func:`oracle_spoil`, each draft spoiled
    independently with probability ``spoil``: P(cut >= j) = (1 - spoil)^j, at most k. It is drawn by the inverse
    CDF at a low-discrepancy sequence (``u_i = u_0 + i * 0.618... mod 1``, ``u_0`` from ``seed``), so that the cuts of
    a short run already follow that distribution: with independent draws one seed's 20 steps of bench --shape's
    default run realized tau 5.82 where 6.5 was asked (H100, session of 2026-12-06 (fifth))."""

    name = "oracle"
    capture_layers: tuple[int, ...] = ()
    STEP = (5 ** 0.5 - 1) / 2  # the golden ratio's fraction: the sequence's stride

    def __init__(self, reference: list[int], vocab: int, spoil: float, seed: int = 0):
        self.ref, self.vocab, self.spoil, self.seed = list(reference), vocab, spoil, seed
        self.rng = torch.Generator().manual_seed(seed)

    def begin(self, prompt_ids, out) -> None:
        """A generation's start: the cuts and wrong ids drawn from ``seed`` again (the warm-up call and the timed one
        alike)."""
        self.n, self.device = int(prompt_ids.shape[0]), out.hidden.device
        self.rng.manual_seed(self.seed)
        self.u0, self.i = float(torch.rand(1, generator=self.rng)), 0

    def observe(self, tokens, out) -> None:
        self.n += int(tokens.shape[0])

    def cut(self, k: int) -> int:
        """The next step's accepted drafts (0 .. k): the inverse CDF of the model at the sequence's next point."""
        u = (self.u0 + self.i * self.STEP) % 1.0
        self.i += 1
        q = 1.0 - self.spoil
        if q <= 0.0:
            return 0
        if q >= 1.0:
            return k
        return min(k, int(math.log1p(-u) / math.log(q)))

    def propose(self, last_token, k, params, gen) -> Proposal:
        toks = (self.ref[self.n + 1:self.n + 1 + k] + [0] * k)[:k]  # past the reference: padding
        c = self.cut(k)
        if c < k:  # a wrong id there: the target accepts the c drafts before it
            toks[c] = (toks[c] + 1 + int(torch.randint(self.vocab - 1, (1,), generator=self.rng))) % self.vocab
        return Proposal(torch.tensor(toks, dtype=torch.int64, device=self.device))


def step_costs(model, context: int, reps: int, use_graphs: bool, compile: bool = False,
               sweep: tuple[int, ...] = (), wide: tuple[int, ...] = ()) -> tuple[dict, dict, dict]:
    """Median ms of static steps of 1 .. MAX_K + 1 rows at position ``context`` (rolled back after
    each), and of ``wide`` rows (more than MAX_K + 1: what verifying a tree of drafts would cost);
    compiled (each shape compiles for seconds to minutes), only the 1-row and the padded
    STEP_ROWS-row steps that decoding runs. ``sweep``: also the 1-row and STEP_ROWS-row steps at
    each of these contexts. One cache, sized for the largest context as decoding sizes its cache,
    serves every point (the steps attend over all of it, masked: their cost should follow the live
    context only); it is
    filled in ascending order, each point's prompt extending the last (a recurrent cache cannot
    roll back further than its last forward). Returns ``(costs at context, {ctx: costs}, {ctx: ms})``,
    the last being plain decoding's padded step at each point: STEP_ROWS rows of which one is real
    (kernels that follow a static step's real rows, ``StepContext.live``, skip the others' work)."""
    from .engine.generate import cache_positions
    from .models.graphs import GraphedTarget

    dev = model.device
    points = sorted(set(sweep) | {context})
    # sized as decoding sizes it (its attention then runs the kernels decoding runs: the split attention's
    # splits follow the cache's size)
    most = max((MAX_K + 1, *wide))
    need = points[-1] + most + 1
    cache = model.new_cache(max(cache_positions(need, model.max_context), need), spare=most)
    g = torch.Generator().manual_seed(1)
    steps = GraphedTarget(model, cache, (), max_steps=most, use_graphs=use_graphs, compile=compile)
    main, by_context, padded = {}, {}, {}
    for c in points:
        with torch.inference_mode():  # the prompt up to c, appended to the last point's (no per-position snapshots)
            ids = torch.randint(0, model.config.vocab_size, (c - cache.length,), generator=g).to(dev)
            model(ids, cache, logits="last", snapshots=False)
        rows = (1, STEP_ROWS) if compile or c != context else (*range(1, MAX_K + 2), *sorted(set(wide)))
        out = {}
        for t in rows:
            ids = torch.randint(0, model.config.vocab_size, (t,), generator=g).to(dev)

            def one():
                steps(ids)
                cache.rollback(c)
            out[t] = _median_ms(one, dev, reps)
        one_real = ids[:1]

        def plain_step():
            steps(one_real, rows=STEP_ROWS)
            cache.rollback(c)
        padded[c] = _median_ms(plain_step, dev, reps)
        if c == context:
            main = out
        if c in sweep:
            by_context[c] = {t: out[t] for t in (1, STEP_ROWS)}
    return main, by_context, padded


def bandwidth(dev: torch.device, nbytes: int, reps: int) -> float:
    """Bytes/s of a device-to-device copy of ``nbytes`` (read + write: 2 * nbytes moved)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev).fill_(1)
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), dev, reps)
    return 2 * nbytes / (ms / 1e3)


def decode_bytes(model, context: int) -> tuple[int, int, int]:
    """``(weight bytes, bytes a decode step reads, KV bytes at context)``. A decode step reads every
    weight except the experts a token does not route to (MoE: top-k of E), where the LM head
    is its own matrix the embedding table (one row of it), and a per-layer embedding table (Gemma 4's
    small models: one row of it)."""
    size = model.dtype.itemsize
    total = param_count(model) * size
    active = total
    if model.lm_head is not None:
        active -= model.embed_tokens.weight.numel() * size
    per_layer = getattr(model, "embed_tokens_per_layer", None)
    if per_layer is not None:
        active -= per_layer.weight.numel() * size
    c = model.config
    if getattr(c, "num_experts", 0):
        experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n) * size
        top_k = getattr(c, "num_experts_per_tok", None) or c.top_k_experts  # Qwen / Gemma 4 spelling
        active -= int(experts * (1 - top_k / c.num_experts))
    cache = model.new_cache(1)
    kv_per_pos = sum(lc.k[:, :1].numel() + lc.v[:, :1].numel() for lc in cache.layers if isinstance(lc, KVCache)) * size
    return total, active + kv_per_pos * context, kv_per_pos * context


def drafter_steps(model, context: int, reps: int, draft_vocab: int | None = None, draft_int8: bool = False) -> dict:
    """Median ms of one propose of random drafters of the published shapes that fit this target (an MTP
    block for Qwen3.5 shapes, a head of ``specdec train mtp``'s shape for Llama-family ones); for DFlash
    also ``step_ms``, the proposal after 16 committed rows (its context write included). ``draft_vocab``:
    each drafter timed again with its head over that many of the vocabulary's rows (the first ones:
    random weights), labelled ``..., draft vocab N``. ``draft_int8``: the DFlash drafter timed again with
    its fast steps on int8 weights (``DFlashDrafter.use_int8_weights``), labelled ``..., int8 weights``."""
    out = {}
    labels = {"dflash": "dflash (5 layers, block 16)", "mtp": "mtp (1 layer)"}
    makers = {labels[name]: make for name, make in drafter_makers(model).items()}
    ids = torch.randint(0, model.config.vocab_size, (context,), generator=torch.Generator().manual_seed(2))
    runs = [(label, make, None, False) for label, make in makers.items()]
    if draft_vocab:
        runs += [(f"{label}, draft vocab {draft_vocab}", make, draft_vocab, False) for label, make in makers.items()]
    if draft_int8:
        runs.append((f"{next(iter(makers))}{f', draft vocab {draft_vocab}' if draft_vocab else ''}, int8 weights",
                     _dflash, draft_vocab, True))
    for label, make, vocab, int8 in runs:
        out[label] = _time_drafter(model, make, ids.to(model.device), reps, vocab, int8)
        if label.startswith("dflash") and not model.config.intermediate_size:
            out[label]["note"] = "MoE target: drafter FFN width assumed = moe_intermediate_size * num_experts_per_tok"
    return out


@torch.inference_mode()
def _time_drafter(model, make, ids: torch.Tensor, reps: int, draft_vocab: int | None = None, int8: bool = False) -> dict:
    d, k, needs_observe = make(model)
    if draft_vocab:
        d.use_draft_vocab(range(draft_vocab), f"the first {draft_vocab} token ids")
    if int8:
        d.use_int8_weights()
    cache = model.new_cache(ids.numel() + 64)
    fo = model(ids, cache, capture=d.capture_layers, logits="last")  # hidden and captured: every row
    d.begin(ids, fo)
    # DFlash's greedy propose changes no state: repeat it. MTP proposes once per observed step:
    # before each call, commit one token (the steady state where every draft is rejected; its
    # static propose runs k + 1 rows whatever the number accepted). Re-beginning instead would
    # drop the captured graphs and time their capture.
    one = ForwardOut(None, fo.hidden[-1:], None if fo.captured is None else fo.captured[-1:])
    setup = (lambda: d.observe(ids[-1:], one)) if needs_observe else None
    ms = _median_ms(lambda: d.propose(int(ids[-1]), k, SamplingParams(), None), model.device, reps, setup=setup)
    if needs_observe:
        return {"k": k, "ms": ms}
    # DFlash: a step's proposal writes the context of the rows committed since the last one first; here
    # 16 (a whole block accepted), observed untimed before each call
    rows = min(16, ids.numel())
    block = ForwardOut(None, fo.hidden[-rows:], fo.captured[-rows:])
    step = _median_ms(lambda: d.propose(int(ids[-1]), k, SamplingParams(), None), model.device, reps,
                      setup=lambda: d.observe(ids[-rows:], block))
    return {"k": k, "ms": ms, "step_ms": step}


def _dflash(model):
    from .drafters.dflash import DFlashDrafter
    from .train.dflash_batch import default_target_layer_ids, new_dflash_config, new_dflash_model

    c, view = model.config, model
    if not c.intermediate_size:  # an MoE target. Assumed: a dense FFN of the target's active width
        wide = dataclasses.replace(c, intermediate_size=c.moe_intermediate_size * c.num_experts_per_tok)
        view = SimpleNamespace(config=wide, layers=model.layers, embed_tokens=model.embed_tokens)
    if c.model_type.startswith("gemma"):
        view = SimpleNamespace(config=SimpleNamespace(**{**vars(c), "rope_scaling": None, "partial_rotary_factor": 1.0}),
                               layers=model.layers, embed_tokens=model.embed_tokens)
    cfg = new_dflash_config(view, 5, 16, mask_token_id=c.vocab_size - 1)
    if c.model_type.startswith("gemma"):  # the seed drafter's layout (gemma-4-26B-A4B-it): 4 sliding + 1 full
        n = len(model.layers)             # layers, 6 target layers, soft-capped logits, its own embedding scale
        cfg.update(layer_types=["sliding_attention"] * 4 + ["full_attention"], use_sliding_window=True,
                   sliding_window=c.sliding_window)
        cfg["dflash_config"].update(target_layer_ids=default_target_layer_ids(n, 6), input_embedding_scale=c.hidden_size ** 0.5,
                                    final_logit_softcapping=c.final_logit_softcapping)
    d = DFlashDrafter(new_dflash_model(model, cfg, init="random").to(model.dtype).eval(), model)
    return d, d.block_size - 1, False


def _mtp(model):
    from .drafters.mtp import MTPDrafter

    return MTPDrafter(mtp_dir.new_mtp_block(model).to(model.dtype).eval(), model, sample_drafts=False), 3, True


def drafter_makers(model) -> dict:
    """The random drafters of the published shapes that fit ``model``, by name: DFlash always, an MTP block where one
    fits its family (``mtp_dir.fits``: no Gemma). Each maker returns (drafter, drafts a propose, whether it samples)."""
    return {"dflash": _dflash, **({"mtp": _mtp} if mtp_dir.fits(model) else {})}


def end_to_end(model, prompt_len: int, new_tokens: int, tau: float, k: int, cuda_graphs: bool,
               batch_invariant: bool | None, seed: int = 0, compile: bool = False) -> dict:
    """Plain decoding, then the oracle drafter at ``tau`` with ``k`` drafts per step: tok/s of each."""
    dev = model.device
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, model.config.vocab_size, (prompt_len,), generator=g).tolist()
    spoil = oracle_spoil(tau, k)

    def timed(gen):
        # warm-up: the same call, so that the timed one finds its cache, graphs and kernels (a shorter warm-up left
        # a 16,000-token prompt's cache and graphs to the timed call: decoding measured 9.7 ms a token for a 7.0 ms step)
        gen.generate(prompt, new_tokens, SamplingParams())
        _sync(dev)
        t0 = time.perf_counter()
        r = gen.generate(prompt, new_tokens, SamplingParams())
        _sync(dev)
        return r, time.perf_counter() - t0

    plain, t_plain = timed(SpeculativeGenerator(model, None, 0, cuda_graphs, batch_invariant, compile=compile))
    oracle = OracleDrafter(prompt + plain.token_ids, model.config.vocab_size, spoil, seed)
    gen = SpeculativeGenerator(model, oracle, k, cuda_graphs=cuda_graphs, batch_invariant=batch_invariant,
                               compile=compile)
    spec, t_spec = timed(gen)
    plain_tps = len(plain.token_ids) / t_plain
    spec_tps = len(spec.token_ids) / t_spec

    def decode_tps(r, t):  # the tokens after the first over the time after the prefill (and first token)
        return round((len(r.token_ids) - 1) / max(t - r.stats.prefill_s, 1e-9), 2)
    return {"drafter": "ORACLE (the target's own greedy continuation, spoiled; not a real drafter)",
            "k": k, "requested_tau": tau, "spoil_probability": round(spoil, 4),
            "measured_tau": round(spec.stats.tau, 3),
            "prompt_tokens": prompt_len, "new_tokens": len(plain.token_ids),
            "plain_tokens_per_s": round(plain_tps, 2), "oracle_tokens_per_s": round(spec_tps, 2),
            "speedup": round(spec_tps / plain_tps, 3), "output_equals_plain": spec.token_ids == plain.token_ids,
            "plain_prefill_s": round(plain.stats.prefill_s, 4), "oracle_prefill_s": round(spec.stats.prefill_s, 4),
            "plain_decode_tokens_per_s": decode_tps(plain, t_plain),
            "oracle_decode_tokens_per_s": decode_tps(spec, t_spec)}


def run_shape_bench(shape: str, *, device=None, dtype=None, context: int = 512, reps: int = 20,
                    new_tokens: int = 128, oracle_tau: float = 6.5, oracle_k: int = 15, cuda_graphs: bool = True,
                    batch_invariant: bool | None = None, drafters: bool = True, copy_bytes: int = 256 << 20,
                    shard=None, compile: bool = False, contexts: tuple[int, ...] = (),
                    wide_rows: tuple[int, ...] = (), draft_vocab: int | None = None, draft_int8: bool = False) -> dict:
    """The whole shape benchmark as one JSON-able dict (see the module docstring). ``shard``: run
    as one tensor-parallel rank (every rank runs the same bench; weights and bytes are per rank,
    the drafters' own steps are not timed). ``wide_rows``: also time steps of that many rows
    (``wide_ms``). ``draft_vocab``: also time the drafters over that many vocabulary rows
    (:func:`drafter_steps`); ``draft_int8``: and the DFlash drafter on int8 weights. A model drafter's
    ``step_ratio``: its verify (``k`` drafts) plus its propose over a decode step (issue 10's MTP K = 3 target: at most 1.3)."""
    if reps < 1 or context < 1 or new_tokens < 1 or oracle_k < 1:
        raise ConfigError("--reps, --context, -n and --oracle-k must be >= 1")
    for n in wide_rows:
        if not MAX_K + 1 < n <= MAX_WIDE:
            raise ConfigError(f"--wide-rows: {n} must lie in {MAX_K + 2}..{MAX_WIDE} (steps up to {MAX_K + 1} rows "
                              "are always timed)")
    if wide_rows and compile:
        raise ConfigError("--wide-rows cannot be used with --compile (each step shape would compile its own code)")
    oracle_spoil(oracle_tau, oracle_k)  # a bad tau fails before building anything
    if draft_int8 and (not drafters or compile or shard is not None):
        raise ConfigError("--draft-int8 with --shape times the DFlash drafter, which is not timed with --compile, "
                          "--tensor-parallel or without drafters")
    limit, vocab = shape_config(shape)[1].max_position_embeddings, shape_config(shape)[1].vocab_size
    if draft_vocab is not None and not 1 <= draft_vocab <= vocab:
        raise ConfigError(f"--draft-vocab: {draft_vocab} must lie in 1..{vocab} (shape {shape}'s vocabulary)")
    for c in contexts:
        if not 1 <= c <= limit - (MAX_K + 2):
            raise ConfigError(f"--contexts: {c} must lie in 1..{limit - (MAX_K + 2)} (shape {shape}'s {limit} positions, "
                              f"less {MAX_K + 2} step rows)")
    if wide_rows and context + max(wide_rows) + 1 > limit:
        raise ConfigError(f"--context {context} + --wide-rows {max(wide_rows)} exceeds shape {shape}'s {limit} positions")
    if context + new_tokens + 2 * (MAX_K + 1) > limit:
        raise ConfigError(f"--context {context} + -n {new_tokens} (+ {2 * (MAX_K + 1)} step rows) exceeds shape "
                          f"{shape}'s {limit} positions")
    dev = torch.device(shard.device) if shard is not None else resolve_device(str(device) if device is not None else None)
    dt = resolve_dtype(dtype, dev)
    if draft_int8 and (dev.type != "cuda" or dt not in (torch.bfloat16, torch.float16)):
        raise ConfigError("--draft-int8: the int8 DFlash drafter needs CUDA and bf16/fp16 weights")
    model = build_shape(shape, dev, dt, shard=shard)
    use_graphs = cuda_graphs and dev.type == "cuda"
    invariant = dev.type == "cuda" if batch_invariant is None else batch_invariant
    plain_rows = STEP_ROWS if invariant and not model.row_exact() else 1
    steps, swept, padded = step_costs(model, context, reps, use_graphs, compile, tuple(contexts), tuple(wide_rows))
    plain_ms = padded if plain_rows > 1 else {c: ms[1] for c, ms in [(context, steps), *swept.items()]}
    total, per_token, kv = decode_bytes(model, context)
    bw = bandwidth(dev, copy_bytes, reps)  # far larger than any cache level
    report = {
        "shape": shape, "machine": machine_description(dev), "commit": git_commit(),
        "tensor_parallel": shard.world if shard is not None else 1,
        "dtype": str(dt).replace("torch.", ""), "device": str(dev), "cuda_graphs": use_graphs, "compile": compile,
        "params": param_count(model), "weight_bytes": total, "context": context, "reps": reps,
        "decode_ms": steps[1],
        # the step plain decoding really runs: batch-invariant steps are padded to STEP_ROWS rows (one of them
        # real), a row-exact target's are not (generate.py)
        "batch_invariant": invariant, "plain_step_rows": plain_rows, "plain_step_ms": plain_ms[context],
        "padded_one_real_ms": padded[context],  # a STEP_ROWS-row step with one real row (the rest pad it)
        "verify_ms": {str(t - 1): ms for t, ms in steps.items() if 1 < t <= MAX_K + 1},  # keyed by k (k + 1 rows)
        "wide_ms": {str(t): ms for t, ms in steps.items() if t > MAX_K + 1},  # keyed by rows
        "bandwidth_bytes_per_s": round(bw), "decode_bytes_per_token": per_token, "kv_bytes_at_context": kv,
        "bound_tokens_per_s": round(bw / per_token, 2),
    }
    report["contexts"] = [{**_context_point(model, c, swept[c], bw, plain_ms[c]), "padded_one_real_ms": padded[c]}
                          for c in sorted(swept)]
    report["drafter_ms"] = (drafter_steps(model, context, reps, draft_vocab, draft_int8)
                            if drafters and shard is None and not compile else {})
    for d in report["drafter_ms"].values():
        if str(d["k"]) in report["verify_ms"]:
            d["step_ratio"] = round((report["verify_ms"][str(d["k"])] + d.get("step_ms", d["ms"])) / steps[1], 3)
    report["oracle_e2e"] = end_to_end(model, context, new_tokens, oracle_tau, oracle_k, cuda_graphs, batch_invariant,
                                      compile=compile)
    return report


def _context_point(model, context: int, ms: dict, bw: float, plain: float) -> dict:
    """One point of the context sweep: step costs, and plain decoding's step (``plain`` ms) against the
    bound counted with the KV bytes live at that context."""
    _, per_token, kv = decode_bytes(model, context)
    bound = bw / per_token
    return {"context": context, "decode_ms": ms[1], f"step_{STEP_ROWS}_rows_ms": ms[STEP_ROWS], "plain_step_ms": plain,
            "kv_bytes": kv, "decode_bytes_per_token": per_token, "bound_tokens_per_s": round(bound, 2),
            "plain_step_tokens_per_s": round(1e3 / plain, 2), "fraction_of_bound": round(1e3 / plain / bound, 4)}


def format_shape(r: dict) -> str:
    e = r["oracle_e2e"]
    tp = r.get("tensor_parallel", 1)
    per = f" per rank of {tp}" if tp > 1 else ""
    lines = [f"shape {r['shape']}: {r['params']:.3g} params, {r['weight_bytes'] / 1e9:.2f} GB {r['dtype']}{per} on "
             f"{r['device']} ({r['machine']}) | commit {r['commit']} | context {r['context']} | "
             f"cuda_graphs={r['cuda_graphs']} batch_invariant={r['batch_invariant']} compile={r.get('compile', False)}",
             f"decode step {r['decode_ms']} ms | bandwidth {r['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s -> bound "
             f"{r['bound_tokens_per_s']} tok/s ({r['decode_bytes_per_token'] / 1e9:.3f} GB read per token)",
             "verify ms by k: " + " ".join(f"{k}:{ms}" for k, ms in r["verify_ms"].items())]
    if r.get("wide_ms"):
        lines.append("wide steps ms by rows: " + " ".join(f"{n}:{ms}" for n, ms in r["wide_ms"].items()))
    for label, d in r["drafter_ms"].items():
        step = f" ({d['step_ms']} ms with the context write of 16 committed rows)" if "step_ms" in d else ""
        ratio = (f"; verify of {d['k']} + propose = {d['step_ratio']}x a decode step" if "step_ratio" in d else "")
        lines.append(f"drafter {label}: {d['ms']} ms per propose of {d['k']}{step}{ratio}")
    n = r["plain_step_rows"]
    lines.append(f"plain decoding's step ({n} row{'' if n == 1 else 's, one real'}): {r['plain_step_ms']} ms")
    for p in r.get("contexts", []):
        lines.append(f"context {p['context']}: decode {p['decode_ms']} ms, {STEP_ROWS}-row step "
                     f"{p[f'step_{STEP_ROWS}_rows_ms']} ms; plain's step = {p['plain_step_tokens_per_s']} tok/s, "
                     f"{100 * p['fraction_of_bound']:.1f} % of the bound {p['bound_tokens_per_s']} "
                     f"(weights + {p['kv_bytes'] / 1e9:.3f} GB of live KV)")
    lines.append(f"ORACLE drafter (not real) k={e['k']} tau {e['measured_tau']} (asked {e['requested_tau']}): "
                 f"{e['oracle_tokens_per_s']} tok/s vs plain {e['plain_tokens_per_s']} ({e['speedup']}x), "
                 f"output equals plain: {e['output_equals_plain']}")
    lines.append(f"after the {e['prompt_tokens']}-token prefill (plain {e['plain_prefill_s']} s, oracle "
                 f"{e['oracle_prefill_s']} s): plain {e['plain_decode_tokens_per_s']} tok/s, oracle "
                 f"{e['oracle_decode_tokens_per_s']} tok/s")
    return "\n".join(lines)


def plot_verify(r: dict, path: str) -> None:
    """A PNG of verify cost vs k (decode as k = 0); needs matplotlib (not a dependency)."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("--plot needs matplotlib (pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = [0] + [int(k) for k in r["verify_ms"]]
    ms = [r["decode_ms"]] + list(r["verify_ms"].values())
    sweep = r.get("contexts") or []
    fig, axes = plt.subplots(1, 2 if sweep else 1, figsize=(11 if sweep else 6, 4), squeeze=False)
    ax = axes[0][0]
    ax.plot(ks, ms, marker="o")
    ax.set_xlabel("k (drafts verified; k + 1 rows)")
    ax.set_ylabel("ms per step (median)")
    ax.set_title(f"{r['shape']} {r['dtype']} on {r['device']}, context {r['context']}")
    ax.set_ylim(bottom=0)
    if sweep:  # step cost against the live context, and the bound's step time there
        ax = axes[0][1]
        cs = [p["context"] for p in sweep]
        ax.plot(cs, [p["decode_ms"] for p in sweep], marker="o", label="decode (1 row)")
        ax.plot(cs, [p[f"step_{STEP_ROWS}_rows_ms"] for p in sweep], marker="o", label=f"{STEP_ROWS}-row step")
        ax.plot(cs, [1e3 / p["bound_tokens_per_s"] for p in sweep], linestyle="--", label="bound (weights + live KV)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens; one cache sized for the largest)")
        ax.set_ylabel("ms per step (median)")
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
