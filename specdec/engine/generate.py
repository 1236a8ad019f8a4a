"""The speculative decoding loop for one sequence.

prefill -> repeat { draft k -> verify k+1 positions in one target forward -> accept ->
roll caches back to the committed length -> the drafter observes the committed tokens }.
With no drafter (or k = 0) the same loop is plain autoregressive decoding.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass, field

import torch

from .. import cpu_exact, env
from ..drafters.base import Drafter, Proposal, slice_out
from ..errors import ContextOverflowError, RequestError
from ..hostcopy import HostReader, device_ints
from ..models.base import CausalLM, ForwardOut
from ..models.graphs import GraphedTarget
from ..sampling import SamplingParams, make_generator, probs_from_logits, sample_one
from .acceptance import StaticAcceptance, accept_greedy, accept_sampled


@dataclass
class Stats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0  # verify forwards after prefill
    accepted: list[int] = field(default_factory=list)  # accepted drafts per step
    drafted: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    trace: list[dict] | None = None

    @property
    def tau(self) -> float:
        """Mean tokens per target step, counting the bonus token (accepted + 1)."""
        return (sum(self.accepted) + len(self.accepted)) / len(self.accepted) if self.accepted else 0.0

    @property
    def acceptance_rate(self) -> float:
        return sum(self.accepted) / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = {
            "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens, "steps": self.steps,
            "accepted_per_step": self.accepted, "drafted": self.drafted, "tau": round(self.tau, 4),
            "acceptance_rate": round(self.acceptance_rate, 4), "prefill_s": round(self.prefill_s, 4),
            "draft_s": round(self.draft_s, 4), "verify_s": round(self.verify_s, 4),
            "total_s": round(self.total_s, 4), "tokens_per_s": round(self.tokens_per_s, 2),
        }
        if self.trace is not None:
            d["trace"] = self.trace
        return d


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "stop" (EOS or stop string) | "length"
    stats: Stats


class _Stopper:
    """Decides where output ends: EOS, stop strings (checked on decoded text), max tokens."""

    def __init__(self, max_new: int, eos: set[int], stop: list[str], decode):
        self.max_new, self.eos, self.stop, self.decode = max_new, eos, stop, decode
        self.ids: list[int] = []
        self.reason: str | None = None
        self.text_cut: int | None = None

    def push(self, tok: int) -> bool:
        """Append one token; return True when generation is over."""
        self.ids.append(tok)
        if tok in self.eos:
            self.reason = "stop"
            return True
        if self.stop:
            text = self.decode(self.ids)
            hits = [text.find(s) for s in self.stop if s in text]
            if hits:
                self.reason, self.text_cut = "stop", min(hits)
                return True
        if len(self.ids) >= self.max_new:
            self.reason = "length"
            return True
        return False


# Rows of every CUDA-graph decode/verify step in batch-invariant mode (k + 1 <= STEP_ROWS).
STEP_ROWS = 16
# Prompts of at most this many STEP_ROWS-row chunks are prefilled by replaying the padded static
# step, not by one eager forward. Seen on the H200: an eager SmolLM2 forward costs ~60 ms of
# host-side op dispatch (~6,400 aten ops) whatever its length, the captured 16-row step 2-3.7 ms;
# for long prompts one eager forward wins.
STATIC_PREFILL_CHUNKS = 8
# Prompts of targets without recurrent (linear-attention) caches are prefilled in chunks of a wider
# static step of this many rows, up to STATIC_PREFILL_TOKENS tokens, not in STEP_ROWS-row chunks: on
# the H200 (af71968) prefill was 7-27 % of a bench's time. Measured there (4d65acd, scripts/ab_prefill.py):
# SmolLM2 shape, 106 tokens 8.7 -> 1.8 ms, 300 tokens 27.8 (eager) -> 4.4 ms; qwen3-8b shape, 106 tokens
# 38.4 -> 7.6 ms, 300 tokens 48.3 -> 21.2 ms, but 1000 tokens 46.0 (eager) against 56.5 ms: hence the
# limit. Recurrent caches would need a rollback snapshot per row, so hybrid targets keep STEP_ROWS-row
# chunks. SPECDEC_PREFILL_ROWS=16 gives the narrow chunks back.
STATIC_PREFILL_TOKENS = 512
PREFILL_ROWS = env.integer("SPECDEC_PREFILL_ROWS")  # at most STATIC_PREFILL_TOKENS
# Plain decoding on static steps queues step i+1 before it reads step i's token (lookahead); 0 turns
# it off (to compare, SPECDEC_PLAIN_LOOKAHEAD=0).
PLAIN_LOOKAHEAD = env.switch("SPECDEC_PLAIN_LOOKAHEAD")
# Greedy plain decoding with lookahead on the greedy-chain steps (GraphedTarget.greedy_step): the argmax,
# the next step's input and its position inside the step, so a token costs the host one replay and one
# read, not a dozen small launches. The same step and argmax, so the same tokens (tested). Measured on the
# H200 (scripts/ab_lookahead.py --chain, one process): +0.7 to +1.2 % on SmolLM2 (predicted ~+8 %: the GPU, not the
# host, limits the step), +0.1 % on qwen3-8b; device_check with it on: 0 outputs differing.
# SPECDEC_GREEDY_CHAIN=0 turns it off.
GREEDY_CHAIN = env.switch("SPECDEC_GREEDY_CHAIN")
# --batch-invariant on the CPU as unpadded eager steps in cpu_exact's row-invariant forms (SmolLM2 on 2 cores:
# see cpu_exact.py for the cost) instead of 16-row static steps over the whole cache; SPECDEC_CPU_EXACT=0 pads
CPU_EXACT = env.switch("SPECDEC_CPU_EXACT")
# Sampled acceptance (temperature > 0) as one captured step (acceptance.StaticAcceptance) on CUDA graphs, not ~40
# eager kernels a step: on the H200 (c203459, SmolLM2, MT-Bench T=1) sampling cost ~0.35 ms of host time a step,
# plain decoding's step 0.749 ms at T=0 against 1.104 at T=1. The same uniforms from the same generator, so the same
# tokens (tested on the CPU, where it runs eagerly; on the H100, scripts/ab_sampled.py, 2026-12-06: no output of 80
# MT-Bench and 60 GSM8K prompts x 128 tokens differs, with none, n-gram, MTP and DFlash; it needs sampling's
# cumulative sums invariant to the row count, sampling.row_cumsum). Plain decoding +5-8 %, n-gram +4 %, MTP +2-3 %,
# DFlash +7 % (verify step 0.93-1.16 -> 0.87-1.10 ms). SPECDEC_STATIC_ACCEPT=0 gives the eager form back.
STATIC_ACCEPT = env.switch("SPECDEC_STATIC_ACCEPT")


def cache_positions(need: int, max_context: int) -> int:
    """The positions of a one-sequence decoding cache for ``need`` (reused across generations, so at
    least 1,024; a power of two; at most the model's context)."""
    return min(max_context, max(1024, 1 << (need - 1).bit_length()))


class SpeculativeGenerator:
    """Runs the loop for a target and an optional drafter (``num_draft_tokens`` per step)."""

    def __init__(self, target: CausalLM, drafter: Drafter | None = None, num_draft_tokens: int = 4,
                 cuda_graphs: bool = True, batch_invariant: bool | None = None, compile: bool = False,
                 lookahead: bool | None = None):
        """``cuda_graphs``: on CUDA, replay every decode/verify step as a CUDA graph.
        ``batch_invariant`` (default: on for CUDA, off for the CPU): run every decode/verify step as
        the same fixed ``STEP_ROWS``-row static step, so a committed position's logits are bitwise the
        same whatever its row in the step; speculative output then equals plain output bit for bit,
        also in bf16. Off, steps run only their own rows: faster, and on the CPU (fp32) the greedy
        tokens still match plain decoding (tested), though the last bits of logits may not.
        ``compile``: compile every static step (the target's decode/verify steps, a drafter's static
        draft step) with torch.compile before it is captured; it implies static steps, also where
        they would otherwise run as plain forwards (the CPU without ``batch_invariant``).
        ``lookahead`` (default: on CUDA, unless ``SPECDEC_PLAIN_LOOKAHEAD=0``): plain decoding on static
        steps queues each step before reading the previous step's token (:meth:`_plain_lookahead`)."""
        if num_draft_tokens < 0:
            raise RequestError(f"num_draft_tokens must be >= 0, got {num_draft_tokens}")
        self.target = target
        self.drafter = drafter
        self.k = num_draft_tokens if drafter is not None else 0
        limit = getattr(target, "snapshot_tokens", None)  # recurrent caches roll back within this many positions
        if limit is not None and self.k + 1 > limit:
            raise RequestError(f"{self.k} drafts per step need {self.k + 1}-token verify steps, but this target's "
                               f"linear-attention caches keep rollback snapshots for at most {limit}; use <= {limit - 1}")
        on_cuda = target.device.type == "cuda"
        if batch_invariant is None:
            batch_invariant = on_cuda
        # On the CPU a target whose eager steps are row-exact within cpu_exact.exact() (the Llama family, Gemma 3) is exact
        # without padding: its forwards run their own rows in that context (cpu_exact.py); others pad as on CUDA
        self.cpu_exact = (bool(batch_invariant) and not on_cuda and not compile and CPU_EXACT
                          and target.cpu_row_exact() and cpu_exact.available())
        if self.cpu_exact:
            batch_invariant = False
        # Under tensor parallelism the captured steps hold their NCCL all-reduces and all-gathers:
        # every rank captures and replays the same steps in the same order, so the collectives match.
        self.shard = getattr(target, "shard", None)
        self.use_graphs = bool(cuda_graphs) and on_cuda
        # Seen on the H200 (bf16): inductor fused the target's step differently when it also returned
        # the layers DFlash reads, so its logits (and 5 of 10 GSM8K outputs) differed from the plain
        # step's. The compiled step now returns every layer whatever the drafter reads (graphs.py), so
        # plain and DFlash decoding run the same compiled kernels (scripts/check_compile_capture.py).
        self.compile = bool(compile)
        # see _prefill. Not with compile: on the H200 (torch 2.11) a compiled step captured before
        # any eager forward of the process failed ("operation not permitted when stream is
        # capturing"); with the eager prefill first, compiled capture ran (0 of 180 outputs differing).
        # On CUDA without graphs too (the very same steps, run eagerly): the static steps' attention
        # (the split kernel) and an eager forward's (SDPA) round differently, so a short prompt
        # prefilled one way in one mode and the other way in the other would make --no-cuda-graphs
        # decode other tokens than graphs (seen on the H200 at 7d8b41c: 2-3 of 4 prompts per target)
        self.static_prefill = on_cuda and not self.compile
        if drafter is not None and hasattr(drafter, "compile"):
            drafter.compile = self.compile  # drafters with static draft steps compile them too
        # every step padded to STEP_ROWS rows: identical kernels for decode and verify (see graphs.py); a
        # row-exact target (base.ROW_EXACT) computes a row's bits alike at any row count: unpadded static steps
        # (its prefill keeps STEP_ROWS-row chunks)
        # (steps up to the k+1 rows of a verify step: a layer past fused_layer.MAX_HIDDEN runs the kernels up to WIDE_ROWS)
        self.row_exact = bool(batch_invariant) and not self.compile and target.row_exact(self.k + 1)
        if self.row_exact:
            # verify steps of fewer tokens (the last of an output) padded to the k+1 rows of every other one: one
            # captured step, not one per row count (captured mid-generation, they cost more than they save;
            # seen on the H200: the oracle at k = 15 0.6x slower unpadded); plain steps of 1 row
            self.pad_to = self.k + 1 if self.k else None
        else:
            self.pad_to = STEP_ROWS if batch_invariant and self.k + 1 <= STEP_ROWS else None
        if batch_invariant and self.pad_to is None and not self.row_exact:
            warnings.warn(f"{self.k} drafts per step need {self.k + 1}-row verify steps, more than the {STEP_ROWS} rows "
                          "every step is padded to: steps are not padded, and in low precision (bf16) drafted output "
                          f"may differ from plain output at near-ties; use at most {STEP_ROWS - 1} drafts per step "
                          f"(--block-size {STEP_ROWS} or less for DFlash) for exact output", stacklevel=2)
        # steps run as static steps (graphs.py); compiled steps are static steps
        self.static = self.use_graphs or self.pad_to is not None or self.compile or self.row_exact
        # the static prefill's chunk rows (see PREFILL_ROWS); under tensor parallelism the narrow ones,
        # the only ones checked there
        self.chunk_rows = STEP_ROWS if self.row_exact else self.pad_to
        widen = self.chunk_rows is not None and limit is None and self.shard is None and PREFILL_ROWS > self.chunk_rows
        self.prefill_rows = PREFILL_ROWS if widen else self.chunk_rows
        self._graphed: GraphedTarget | None = None
        # Under tensor parallelism every rank would queue the same extra step, but that path is
        # checked on the GPU without lookahead only: kept off there.
        if lookahead is None:
            lookahead = on_cuda and PLAIN_LOOKAHEAD
        self.lookahead = bool(lookahead) and self.k == 0 and self.static and self.shard is None
        # sampled acceptance as a captured step (see STATIC_ACCEPT; tests set it on the CPU, where it runs eagerly)
        self.static_accept = self.use_graphs and STATIC_ACCEPT
        self._acceptance: StaticAcceptance | None = None

    def _accept_sampled(self, drafts: torch.Tensor, q: torch.Tensor | None, logits: torch.Tensor,
                        params: SamplingParams, gen) -> torch.Tensor:
        """``accept_sampled`` of the target's ``logits`` under ``params``: on the static step
        (:class:`StaticAcceptance`) when ``static_accept``, else eagerly; the same draws, the same result."""
        if not self.static_accept:
            return accept_sampled(drafts, q, probs_from_logits(logits, params), gen)
        if self._acceptance is None:
            self._acceptance = StaticAcceptance(self.k, self.use_graphs)
        return self._acceptance(drafts, q, logits, params, gen)

    def _exact(self):
        """The context of the target's eager forwards: cpu_exact's row-invariant forms where ``cpu_exact``."""
        return cpu_exact.exact() if self.cpu_exact else contextlib.nullcontext()

    def _cache_for(self, need: int, capture: tuple[int, ...]):
        """A fresh cache, or for static steps a reused one (its captured graphs stay valid)."""
        tgt = self.target
        if not self.static:
            return tgt.new_cache(need), None
        # the widest step: verify steps, or the static prefill's chunks
        rows = max(self.k + 1, (self.prefill_rows or 0) if self.static_prefill else 0)
        spare = max(self.pad_to or 0, rows)  # rows only padding / unfinished verify rows occupy
        size = cache_positions(need, tgt.max_context)
        g = self._graphed
        if (g is not None and g.cache.max_len >= min(tgt.max_context, need) + spare and g.capture == capture
                and g.max_steps >= rows):
            g.cache.reset()
            return g.cache, g
        self._graphed = None  # free the old graphs and cache first
        cache = tgt.new_cache(size, spare=spare)
        self._graphed = GraphedTarget(tgt, cache, capture, max_steps=rows, pad_to=self.pad_to,
                                      use_graphs=self.use_graphs, compile=self.compile)
        return cache, self._graphed

    def generate(self, prompt_ids, max_new_tokens: int, params: SamplingParams = SamplingParams(), *,
                 eos_ids=(), stop: list[str] | None = None, decode=None, trace: bool = False,
                 on_tokens=None) -> GenerationResult:
        """Generate up to ``max_new_tokens`` after ``prompt_ids``.

        ``eos_ids`` end generation (the EOS token is kept in ``token_ids``, not in ``text``);
        ``stop`` strings end it on the decoded text (which is cut before the stop string);
        ``on_tokens(ids)`` is called with the tokens committed at each step (for streaming).
        """
        tgt = self.target
        if max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        prompt = torch.as_tensor(list(prompt_ids), dtype=torch.int64)
        if prompt.numel() == 0:
            raise RequestError("the prompt is empty")
        if int(prompt.max()) >= tgt.config.vocab_size or int(prompt.min()) < 0:
            raise RequestError(f"prompt token ids must be in 0..{tgt.config.vocab_size - 1}")
        need = prompt.numel() + max_new_tokens
        if need > tgt.max_context:
            raise ContextOverflowError(
                f"prompt ({prompt.numel()} tokens) + max_new_tokens ({max_new_tokens}) = {need} exceeds the "
                f"model's context of {tgt.max_context} tokens")
        if stop and decode is None:
            raise RequestError("stop strings need a tokenizer to decode with")
        stats = Stats(prompt_tokens=prompt.numel(), trace=[] if trace else None)
        stopper = _Stopper(max_new_tokens, set(eos_ids), list(stop or []), decode)
        dev = tgt.device
        seed = params.seed
        if seed is None and not params.greedy and self.shard is not None:
            seed = self.shard.same_seed()  # every rank must sample alike
        gen = None if params.greedy else make_generator(seed, dev)
        drafter = self.drafter
        capture = tuple(drafter.capture_layers) if drafter is not None else ()
        cache, graphed = self._cache_for(need, capture)

        t0 = time.perf_counter()
        out = self._prefill(prompt.to(dev), cache, graphed, capture)
        first = sample_one(out.logits[-1], params, gen)
        if drafter is not None:
            drafter.begin(prompt.to(dev), out)
        stats.prefill_s = time.perf_counter() - t0
        done = stopper.push(first)
        if on_tokens is not None:
            on_tokens(stopper.ids[-1:])
        last = first
        if self.lookahead and not done:
            self._plain_lookahead(graphed, cache, last, params, gen, stopper, stats, on_tokens)
            done = True
        while not done:
            k = max(0, min(self.k, max_new_tokens - len(stopper.ids)))
            t1 = time.perf_counter()
            prop = drafter.propose(last, k, params, gen) if (drafter is not None and k > 0) else Proposal(
                torch.empty(0, dtype=torch.int64, device=dev))
            drafts = prop.tokens.to(dev)[:k]
            t2 = time.perf_counter()
            start = cache.length
            ids = torch.cat([device_ints([last], dev), drafts])  # no stream sync: the drafter's step may still run
            if graphed is not None:
                out = graphed(ids)
            else:
                with self._exact():
                    out = tgt(ids, cache, capture=capture)
            if params.greedy:
                packed = accept_greedy(drafts, out.logits)
            else:
                q = prop.probs[: drafts.shape[0]] if prop.probs is not None else None
                packed = self._accept_sampled(drafts, q, out.logits, params, gen)
            res = packed.tolist()  # the one host sync of the step
            n, toks = res[0], res[1:res[0] + 2]
            cache.rollback(start + n + 1)
            if drafter is not None:
                drafter.observe(ids[: n + 1], slice_out(out, n + 1))
            t3 = time.perf_counter()
            stats.draft_s += t2 - t1
            stats.verify_s += t3 - t2
            stats.steps += 1
            stats.drafted += drafts.shape[0]
            stats.accepted.append(n)
            if trace:
                stats.trace.append({"draft": drafts.tolist(), "accepted": n})
            before = len(stopper.ids)
            for tok in toks:
                if stopper.push(tok):
                    done = True
                    break
            if on_tokens is not None:
                on_tokens(stopper.ids[before:])
            last = toks[-1]
        stats.total_s = time.perf_counter() - t0
        stats.new_tokens = len(stopper.ids)
        text = None
        if decode is not None:
            text = decode([t for t in stopper.ids if t not in stopper.eos])
            if stopper.text_cut is not None:
                text = text[: stopper.text_cut]
        return GenerationResult(stopper.ids, text, stopper.reason or "length", stats)

    def _plain_lookahead(self, graphed: GraphedTarget, cache, last: int, params: SamplingParams, gen,
                         stopper: _Stopper, stats: Stats, on_tokens) -> None:
        """Plain decoding with the host one step ahead of the GPU: step i+1 is queued, its input the
        token step i left on the device, before step i's token is read back (:class:`HostReader`),
        so the GPU never waits for the host's per-token work (reading, stop checks, streaming, the
        next launch). The steps, their inputs and the generator's draws are those of the loop in
        :meth:`generate`, in the same order, hence the same tokens (tested); once the output ends,
        the one step queued beyond it is dropped from the cache. Greedy under ``SPECDEC_GREEDY_CHAIN``,
        the steps are :meth:`GraphedTarget.greedy_step`'s: the same step and argmax, run inside it."""
        dev = self.target.device
        empty = torch.empty(0, dtype=torch.int64, device=dev)
        reader = HostReader(dev, 2)
        ids = device_ints([last], dev)
        chain = params.greedy and GREEDY_CHAIN
        queued = len(stopper.ids)  # tokens decided or being computed
        pending = None
        while True:
            staged = None
            if queued < stopper.max_new:
                t0 = time.perf_counter()
                if chain:  # the step's token (its last element, as in accept_greedy's packing)
                    packed, ids = graphed.greedy_step(ids), None
                else:
                    out = graphed(ids)
                    if params.greedy:
                        packed = accept_greedy(empty, out.logits)
                    else:
                        packed = self._accept_sampled(empty, None, out.logits, params, gen)
                    ids = packed[1:2]
                staged = reader.stage(packed)
                queued += 1
                stats.verify_s += time.perf_counter() - t0
            if pending is not None:
                t0 = time.perf_counter()
                tok = pending.read()[-1]
                stats.verify_s += time.perf_counter() - t0
                stats.steps += 1
                stats.accepted.append(0)
                if stats.trace is not None:
                    stats.trace.append({"draft": [], "accepted": 0})
                done = stopper.push(tok)
                if on_tokens is not None:
                    on_tokens([tok])
                if done:
                    if staged is not None:
                        cache.rollback(cache.length - 1)  # the step queued past the end
                    return
            assert staged is not None  # the stopper ends at max_new tokens at the latest
            pending = staged

    def _prefill(self, prompt: torch.Tensor, cache, graphed: GraphedTarget | None, capture) -> ForwardOut:
        """The prompt's forward: the last row's logits, every row's hidden state and captured layers.
        Short prompts on CUDA static steps (``static_prefill``: graphs or not, uncompiled) run as padded
        chunks of static steps: ``prefill_rows``-row chunks (one more captured step, see PREFILL_ROWS)
        and, for a remainder of at most ``chunk_rows`` tokens (``pad_to``, or 16 for a row-exact
        target), the decode step's row count; others as one eager
        forward (uncaptured, on the CPU, the chunks cost more than they save). Plain and speculative
        decoding prefill alike, so their outputs stay equal whatever the chunks."""
        narrow, wide = self.chunk_rows, self.prefill_rows
        if not self.static_prefill or graphed is None or narrow is None:
            with self._exact():
                return self.target(prompt, cache, capture=capture, logits="last", snapshots=False)
        n = prompt.numel()
        if n > (STATIC_PREFILL_TOKENS if wide > narrow else STATIC_PREFILL_CHUNKS * narrow):
            return self.target(prompt, cache, capture=capture, logits="last", snapshots=False)
        outs, i = [], 0
        while i < n:
            take = min(n - i, wide)
            outs.append(graphed(prompt[i:i + take], rows=narrow if take <= narrow else wide))
            i += take
        captured = torch.cat([o.captured for o in outs]) if capture else None
        return ForwardOut(outs[-1].logits[-1:].clone(), torch.cat([o.hidden for o in outs]), captured)
