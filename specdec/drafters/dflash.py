"""DFlash drafter: loads a z-lab checkpoint for a target and drafts one block per step.

``--draft dflash:PATH`` builds it through :func:`load_dflash_drafter`. The drafter asks the
engine to capture the target's hidden states after ``target_layer_ids``; after each step the
committed rows become context keys/values in the drafter's own cache (committed positions
only: a block's own keys/values are never cached), and :meth:`DFlashDrafter.propose` runs
one forward over ``[last token, mask x (B-1)]``. See :mod:`.dflash_model` for the math.
"""

from __future__ import annotations

import os

import torch

from .. import env
from ..config import read_json
from ..errors import CheckpointError, ConfigError
from ..hostcopy import device_ints
from ..models.base import CausalLM, ForwardOut
from ..models.graphs import capture, maybe_compile
from ..models.invariant_linear import row_counts
from ..models.layers import drafter_static_attention, static_step_attention
from ..sampling import SamplingParams, probs_from_logits, sample_inverse_cdf
from ..weights import load_into
from ..weights.loader import check_layer_count
from ..weights.safetensors_io import SafetensorsSource
from .base import Proposal
from . import dflash_fast
from .dflash_model import DFlashConfig, DFlashDraftModel
from .draft_vocab import PromptPart


class _ContextKV:
    """Keys and values of committed context positions for one drafter layer, grown by
    doubling (the drafter does not know the request length when it starts)."""

    def __init__(self, n_kv: int, head_dim: int, capacity: int, dtype, device):
        self.k = torch.zeros(n_kv, capacity, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k, v [n_kv, T, d]`` at positions ``start..start+T-1``."""
        end = start + k.shape[1]
        if end > self.k.shape[1]:
            cap = max(end, 2 * self.k.shape[1])
            self.k, self.v = _grown(self.k, start, cap), _grown(self.v, start, cap)
        self.k[:, start:end] = k
        self.v[:, start:end] = v

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


def _grown(t: torch.Tensor, keep: int, cap: int) -> torch.Tensor:
    """``t [n_kv, *, d]`` reallocated to ``cap`` positions, the first ``keep`` copied."""
    out = t.new_zeros(t.shape[0], cap, t.shape[2])
    out[:, :keep] = t[:, :keep]
    return out


# The context K/V write of the rows accepted since the last proposal (``DFlashDrafter._flush``) as one
# static step (a CUDA graph on CUDA) of ``block_size`` rows, instead of ~70 eager kernels at a new row
# count each step. On the H200 (2d96082, SmolLM2, GSM8K 60, T=0) it took DFlash from 1.10x to 1.68x plain
# decoding, the same tokens (device_check: 0 outputs differ). On by default; SPECDEC_DFLASH_STATIC_FLUSH=0
# turns it off (the eager write).
STATIC_FLUSH = env.switch("SPECDEC_DFLASH_STATIC_FLUSH")


# On the CPU a verify costs by its rows (SmolLM2, 2 cores: 35.7 ms at 1 row, 52.5 at 5, 75.3 at 16), so a greedy
# block is cut before the first draft after the first to which the drafter itself gives a probability under this:
# those are rarely accepted (12 GSM8K prompts at 0.3: tau 3.28 -> 3.15, a verify's rows 16 -> 6.0 on average).
# Lossless whatever the value (only fewer drafts are verified). CUDA, whose verify of 16 rows costs about one of
# 1 row, keeps whole blocks, and so does the serving loop (spawn). SPECDEC_DFLASH_CPU_CONFIDENCE=0 keeps whole
# blocks on the CPU too. Re-checked with packed oneDNN weights (2026-12-05, a 16-row verify 50 against 33 ms for 1-5
# rows; GSM8K 10 prompts, scripts/ab_dflash_confidence.py): floor 0 1.65x, 0.1 1.64x, 0.2 1.85x, 0.3 1.93x / 1.89x,
# 0.4 1.85x, 0.5 1.80x plain decoding.
CPU_MIN_CONFIDENCE = env.probability("SPECDEC_DFLASH_CPU_CONFIDENCE")
# The same cut for sampled blocks (temperature > 0), read off the filtered distributions the drafts are sampled
# from; lossless for the same reason (acceptance of each kept draft is unchanged). Whole sampled blocks ran slower
# than plain decoding on the CPU (T=1, 10 prompts x 128 tokens, scripts/ab_dflash_confidence.py -t 1, 2026-12-05):
# HumanEval 0.80x whole, 1.18x at 0.2, 1.16x at 0.3, 1.11x at 0.5; MT-Bench 0.87x at 0.1, 0.94x at 0.2, 0.92x at
# 0.3. SPECDEC_DFLASH_CPU_SAMPLED_CONFIDENCE=0 keeps whole sampled blocks.
CPU_MIN_SAMPLED_CONFIDENCE = env.probability("SPECDEC_DFLASH_CPU_SAMPLED_CONFIDENCE")
# Sampled blocks (temperature > 0) on static steps filter and draw inside the step (one block a set of sampling
# params; a uniform a row, drawn outside the step from the request's generator; inverse CDF, as MTP's static
# proposals draw), not from the block's logits by ~8 eager kernels (filter, torch.multinomial): on the H200
# (c203459, SmolLM2, MT-Bench T=1) a sampled proposal cost 0.487 ms against 0.164 greedy. Another draw than
# torch.multinomial's, from the same distribution (returned with the drafts: acceptance stays exact). On the H100
# (scripts/ab_sampled.py, 2026-12-06, with the captured acceptance): a sampled proposal 0.30 -> 0.12 ms, DFlash at
# T=1 +4-6 % more (MT-Bench 1.071x -> 1.135x the eager form). SPECDEC_DFLASH_STATIC_SAMPLING=0 gives
# torch.multinomial's draw back.
STATIC_SAMPLING = env.switch("SPECDEC_DFLASH_STATIC_SAMPLING")


def confident_prefix(logits: torch.Tensor, floor: float, probs: bool = False) -> int:
    """How many of a block's drafts to keep: up to (not including) the first after the first whose
    drafter probability ``max softmax(logits [n, V])`` (``max logits`` when ``probs``: they are
    probabilities already) is under ``floor``; all ``n`` when none is."""
    if floor <= 0 or logits.shape[0] <= 1:
        return logits.shape[0]
    p = logits if probs else torch.softmax(logits.float(), dim=-1)
    low = (p.amax(-1)[1:] < floor).nonzero()
    return 1 + int(low[0]) if low.numel() else logits.shape[0]


def _check_block_size(block_size, trained: int, source: str) -> int:
    bs = trained if block_size is None else block_size
    if not isinstance(bs, int) or isinstance(bs, bool) or not 2 <= bs <= trained:
        raise ConfigError(f"block_size must be an integer in 2..{trained} (the trained block size of {source}), "
                          f"got {block_size!r}")
    return bs


class DFlashDrafter:
    """A loaded DFlash drafter bound to its target (whose embedding and LM head it uses)."""

    name = "dflash"
    flat_draft_cost = True  # a proposal costs the same for any k (the serving controller reads it)

    def __init__(self, model: DFlashDraftModel, target: CausalLM, block_size: int | None = None, path: str = ""):
        c = model.config
        self.model, self.target, self.path = model, target, path
        self.block_size = _check_block_size(block_size, c.block_size, path or "the drafter")
        self.capture_layers: tuple[int, ...] = tuple(c.target_layer_ids)
        self.length = 0  # committed positions (their context K/V cached, or pending: see observe)
        self._written, self._pending = 0, []  # positions whose K/V are written; captured rows not yet written
        self.kv: list[_ContextKV] = []
        # Blocks as one static step (a CUDA graph on CUDA, with the target's sharded embedding and
        # head's collectives inside under tensor parallelism; eager elsewhere, for tests)
        self.static_steps = target.device.type == "cuda"
        # the context write as a static step too (see STATIC_FLUSH; tests set it on the CPU)
        self.static_flush = self.static_steps and STATIC_FLUSH
        self._flusher: _StaticFlush | None = None
        self.min_capacity = 1024  # context K/V rows at least (see begin)
        # torch.compile the static block (set by the engine's ``compile``); compiled blocks are static
        self.compile = False
        # the static blocks: greedy (the argmax inside the step) and sampled (the draw inside it, for the
        # last sampling params; see STATIC_SAMPLING), each built at its first use for the current context buffers
        self._static: _StaticBlock | None = None
        self._sampled: _StaticBlock | None = None
        self._fast_w: dflash_fast.FastWeights | None = None  # the fast steps' weight layout (dflash_fast)
        self.int8_weights = False  # the fast steps' GEMMs on int8 copies of the weights (use_int8_weights)
        self.vocab = None  # a DraftVocab: drafts from its tokens only (use_draft_vocab)
        self._part = None  # the vocabulary's PromptPart: this request's prompt tokens off it (begin; not DFlashSlots)
        self.cut_unconfident = True  # eager blocks on the CPU cut at CPU_MIN_(SAMPLED_)CONFIDENCE (spawn: whole blocks)

    def use_draft_vocab(self, ids, source: str = "draft vocabulary") -> None:
        """Draft only tokens of ``ids`` (:class:`~.draft_vocab.DraftVocab`: the target's head, their rows)."""
        from .draft_vocab import DraftVocab
        self.vocab = DraftVocab(ids, self.target.head_weight(), self.target.config.vocab_size, source)
        if self.int8_weights:
            self.vocab.use_int8()
        self._part = None
        self._static = self._sampled = None  # steps captured with the whole head

    def logits(self, h: torch.Tensor, part=None) -> torch.Tensor:
        """The block's final hidden rows -> fp32 draft logits ``[..., V]``: the target's head (raw:
        z-lab applies the drafter's own multiplier and soft cap, never the target's), over the draft
        vocabulary's rows when there is one (``-inf`` off it) and this request's prompt tokens (``part``:
        :class:`DFlashSlots`' slots' instead)."""
        if self.vocab is not None:
            return self.vocab.logits(h, self.model.scale_logits, self._part if part is None else part)
        return self.model.scale_logits(self.target.raw_logits(h, exact=False))

    def use_int8_weights(self) -> None:
        """Run the fast steps' GEMMs (:mod:`.dflash_fast`: every layer's, ``fc``'s and the context write's) on int8
        copies of the weights, a scale a row (``fused_layer.Int8Rows``): half the bytes a proposal reads. The
        drafts may differ from the bf16 drafter's, the output never does (the target verifies them). The whole LM head
        (the target's) stays as it is; a draft vocabulary's copy of its rows is read as int8 too
        (``DraftVocab.use_int8``). CUDA only: the fused kernels' path."""
        w = self.model.fc.weight
        with torch.no_grad():  # (usable() asks no gradient of a forward: the steps run without one)
            fast = dflash_fast.usable(self.model, w)
        if not fast or self.compile:
            why = ("needs CUDA and bf16/fp16 weights" if not w.is_cuda or w.dtype not in (torch.bfloat16, torch.float16)
                   else "runs on its fast CUDA steps, not with --compile" if self.compile
                   else "needs the fast CUDA steps, which this drafter does not take (dflash_fast.eligible; or "
                   "SPECDEC_DFLASH_FAST=0 / SPECDEC_FUSED_LAYER=0)")
            raise ConfigError(f"--draft-int8: the int8 DFlash drafter {why}")
        self.int8_weights = True
        if self.vocab is not None:
            self.vocab.use_int8()
        self._fast_w = None
        self._static = self._sampled = self._flusher = None  # steps captured on the bf16 weights

    def fast_weights(self) -> "dflash_fast.FastWeights | None":
        """The weights of :mod:`.dflash_fast`'s steps when this drafter's static steps take them (made
        at the first use, shared with spawned drafters), else None."""
        if self.compile or not dflash_fast.usable(self.model, self.model.fc.weight):
            if self.int8_weights:  # (compile is set after use_int8_weights checked it: the engine's)
                raise ConfigError("--draft-int8: the int8 DFlash drafter runs on its fast CUDA steps, not with --compile")
            return None
        if self._fast_w is None:
            self._fast_w = dflash_fast.FastWeights(self.model, int8=self.int8_weights)
        return self._fast_w

    def for_slots(self, slots: int, capacity: int, width: int, span_of=None, span_invariant: bool = False
                  ) -> "DFlashSlots":
        """One drafter for all ``slots`` of the serving loop (:class:`DFlashSlots`)."""
        return DFlashSlots(self, slots, capacity, width, span_of, span_invariant)

    def spawn(self) -> "DFlashDrafter":
        """A drafter sharing these weights with an empty context cache (one per sequence of a batch)."""
        d = DFlashDrafter(self.model, self.target, self.block_size, self.path)
        # the serving loop's slots (spawn's user) keep whole blocks: its controller counts acceptance per
        # draft asked for (requests.ema_acceptance), so a cut block would read as rejected drafts
        d.cut_unconfident = False
        d.compile = self.compile
        d._fast_w, d.int8_weights = self._fast_w, self.int8_weights
        d.vocab = self.vocab
        return d

    # --- the drafter protocol -----------------------------------------------------
    @torch.inference_mode()
    def begin(self, prompt_ids: torch.Tensor, out: ForwardOut) -> None:
        c, w = self.model.config, self.model.fc.weight
        # capacities in powers of two from 1024 that only grow, kept across requests (stale
        # positions are masked by length): the static block (its CUDA graph, its compiled code:
        # seconds to compile) is rebuilt only when a context outgrows every earlier one
        cap = max(self.min_capacity, 1 << (2 * int(prompt_ids.numel()) - 1).bit_length())
        have = self.kv[0].k.shape[1] if self.kv else 0
        if have < cap:
            self._static = self._sampled = self._flusher = None  # they hold the last request's buffers: free them first
            self.kv = [_ContextKV(c.num_key_value_heads, c.head_dim, cap, w.dtype, w.device)
                       for _ in range(c.num_hidden_layers)]
        self.length, self._written, self._pending = 0, 0, []
        if self.vocab is not None:  # refilled in place: captured blocks keep reading it
            self._part = self.vocab.prompt_part(prompt_ids, self._part)
        self._append(out, int(prompt_ids.numel()))
        self._flush()

    @torch.inference_mode()
    def observe(self, tokens: torch.Tensor, out: ForwardOut) -> None:
        """Take the committed rows' captured features; their context K/V are written at the next
        proposal, all pending rows at once: a serving step that drafts nothing (the controller's
        k = 0) then costs this drafter a copy, not a forward."""
        self._append(out, int(tokens.numel()))

    @torch.inference_mode()
    def propose(self, last_token: int, k: int, params: SamplingParams, gen: torch.Generator | None) -> Proposal:
        """Draft ``min(k, block_size - 1)`` tokens after ``last_token`` (at position ``length``).

        Greedy: the argmax of each block row (on the CPU, up to the first unconfident one: see
        CPU_MIN_CONFIDENCE). Sampling: each row sampled from the drafter's
        own filtered distribution, returned with it so acceptance stays exact (z-lab does the same;
        on the CPU, eager, up to the first unconfident row: CPU_MIN_SAMPLED_CONFIDENCE).
        With static steps both run the block as a static step; sampled blocks filter and draw inside
        it, from uniforms the generator gives it (STATIC_SAMPLING; off, the step returns its logits
        and they are filtered and sampled outside it).
        """
        self._flush()
        floor = 0.0  # the sampled block's cut (CPU_MIN_SAMPLED_CONFIDENCE): eager CPU blocks only
        if self.static_steps or self.compile:
            cap = self.kv[0].k.shape[1]
            if self.length + self.block_size > cap and self.fast_weights() is not None:
                self._grow(2 * cap)  # the fast block writes its keys and values at length .. length + B - 1
            if params.greedy:
                return Proposal(self._static_block(None)(int(last_token), self.length)[: max(0, k)])
            if STATIC_SAMPLING:
                st = self._static_block(params)
                st.u.uniform_(0.0, 1.0, generator=gen)  # the block's uniforms, drawn outside its step
                toks, probs = st(int(last_token), self.length)
                return Proposal(toks[: max(0, k)], probs[: max(0, k)])
            logits = self._static_block(params, logits=True)(int(last_token), self.length)[: max(0, k)]
        else:
            logits = self.block_logits(last_token)[: max(0, k)]
            cut = self.cut_unconfident and self.target.device.type == "cpu"  # see CPU_MIN_CONFIDENCE
            if params.greedy:
                return Proposal(logits[: confident_prefix(logits, CPU_MIN_CONFIDENCE if cut else 0.0)].argmax(-1))
            floor = CPU_MIN_SAMPLED_CONFIDENCE if cut else 0.0
        probs = probs_from_logits(logits, params)
        probs = probs[: confident_prefix(probs, floor, probs=True)]
        return Proposal(torch.multinomial(probs, 1, generator=gen).squeeze(1), probs)

    @torch.inference_mode()
    def catch_up(self) -> None:
        """Write the pending rows' context K/V now (a step drafted by someone else: ``X+ngram``), so
        that rows never pile up past the static flush's ``block_size``."""
        self._flush()

    def _static_block(self, params: SamplingParams | None, logits: bool = False) -> "_StaticBlock":
        """The greedy (``params`` None) or the sampled static block over the current context buffers,
        (re)built at its first use, for a new request's buffers, after the context cache grew, and for
        sampled blocks other sampling params (they replace the last ones) or, with ``logits``, the
        block that returns its logits (STATIC_SAMPLING off)."""
        if not self.kv:
            raise RuntimeError("DFlashDrafter.propose called before begin")
        draws = None if logits else params  # the params a sampled block draws under (None: it returns its logits)
        st = self._static if params is None else self._sampled
        want = None if draws is None else draws.filter_key
        if st is None or not st.reads(self.kv) or (params is not None and st.sampling != want):
            # free the old step and the buffers it holds first
            if params is not None:
                self._sampled = None
                st = self._sampled = _StaticBlock(self, draws, logits=logits)
            else:
                self._static = None
                st = self._static = _StaticBlock(self)
        return st

    # --- the work -------------------------------------------------------------------
    def _grow(self, cap: int) -> None:
        """Every layer's context buffers reallocated to ``cap`` positions (the written ones kept); the
        static steps holding the old ones are freed, and rebuilt at their next use."""
        self._static = self._sampled = self._flusher = None
        for s in self.kv:
            s.k, s.v = _grown(s.k, self._written, cap), _grown(s.v, self._written, cap)

    def _append(self, out: ForwardOut, n: int) -> None:
        feats = out.captured
        if feats is None or feats.shape[0] != n:
            raise RuntimeError(f"DFlash needs the target's captured layers {self.capture_layers} for the {n} "
                               "committed rows; the engine must forward with capture=drafter.capture_layers")
        self._pending.append(feats.clone())  # a view of a static step's output: copied before its next replay
        self.length += n

    def _flush(self) -> None:
        """Write the context K/V of the rows observed since the last proposal (positions
        ``_written .. length - 1``)."""
        if not self._pending:
            return
        feats = self._pending[0] if len(self._pending) == 1 else torch.cat(self._pending)
        self._pending = []
        n = feats.shape[0]
        if self.static_flush and n <= self.block_size and self._written + self.block_size <= self.kv[0].k.shape[1]:
            if self._flusher is None or not self._flusher.reads(self.kv):
                self._flusher = None  # free the old step (and the buffers it holds) first
                self._flusher = _StaticFlush(self)
            self._flusher(feats, self._written)
        else:  # a prompt, rows piled up, or a context about to grow its buffers: eagerly
            pos = torch.arange(self._written, self._written + n, device=feats.device)
            for store, (k, v) in zip(self.kv, self.model.context_kv(feats, pos)):
                store.write(self._written, k, v)
        self._written += n

    @torch.inference_mode()
    def block_logits(self, last_token: int) -> torch.Tensor:
        """fp32 logits ``[B - 1, V]`` for the block after ``last_token``; changes no state."""
        if not self.kv:
            raise RuntimeError("DFlashDrafter.propose called before begin")
        self._flush()
        c, start = self.model.config, self.length
        ids = torch.full((self.block_size,), c.mask_token_id, dtype=torch.int64, device=self.target.device)
        ids[0] = int(last_token)
        # z-lab (model.py) embeds the block with the raw table times the drafter's own
        # input_embedding_scale, not through the target's embedding: a Gemma target's sqrt(hidden)
        # (its ``embed``) is not applied, a Gemma drafter carries its scale in its config. So
        # ``embed_tokens`` (the raw table module: a rank's rows gathered under tensor parallelism),
        # never ``embed``. Likewise the logits (:meth:`logits`): the target's soft cap is not
        # applied, the drafter's own is (scale_logits), once.
        x = self.target.embed_tokens(ids).to(self.model.fc.weight.dtype)
        if c.input_embedding_scale != 1.0:
            x = x * c.input_embedding_scale
        ctx = [(s.k[:, :start], s.v[:, :start]) for s in self.kv]
        h = self.model.block_hidden(x, start, ctx)
        return self.logits(h[1:])

    # --- accounting -----------------------------------------------------------------
    def weight_bytes(self) -> int:
        """The drafter's weights, the fast steps' copies of them once made (:mod:`.dflash_fast`) and its draft
        vocabulary's head rows."""
        own = sum(p.numel() * p.element_size() for p in self.model.parameters())
        vocab = self.vocab.nbytes() if self.vocab is not None else 0
        return own + vocab + (self._fast_w.nbytes() if self._fast_w is not None else 0)

    def cache_bytes(self) -> int:
        return sum(s.nbytes() for s in self.kv)

    def resident_bytes(self) -> int:
        """Device memory the drafter holds: its weights plus its context cache (the embedding
        and LM head are the target's and are not counted)."""
        return self.weight_bytes() + self.cache_bytes()

    def info(self) -> dict:
        c = self.model.config
        return {
            "drafter": "dflash", "path": self.path, "block_size": self.block_size,
            "trained_block_size": c.block_size, "drafts_per_step": self.block_size - 1,
            "layers": c.num_hidden_layers, "layer_types": list(c.layer_types), "hidden_size": c.hidden_size,
            "target_layer_ids": list(c.target_layer_ids), "target_layer_ids_default": c.target_layer_ids_default,
            "mask_token_id": c.mask_token_id, "dtype": str(self.model.fc.weight.dtype).replace("torch.", ""),
            "fast_weights": "int8" if self.int8_weights else "as dtype",
            "weight_bytes": self.weight_bytes(), "cache_bytes": self.cache_bytes(),
            "resident_bytes": self.resident_bytes(),
        }


class _StaticBlock:
    """One block with static shapes: the last token and the start position are device buffers,
    attention reads the whole context cache masked by position. It returns the greedy drafts
    ``[B - 1]`` (the argmax inside the step); with ``params`` the drafts sampled under them and
    their filtered probabilities ``([B - 1], [B - 1, V])``, drawn by inverse CDF from the uniforms
    ``u`` the caller fills before each call; with ``logits`` the drafter's fp32 logits ``[B - 1, V]``.
    On CUDA it is captured once per context buffer and replayed; it writes no drafter state.

    It holds the context buffers it was built for and reads only those: a captured graph
    replays their addresses, so they must stay alive, and the drafter's check that its cache is
    still these buffers (:meth:`reads`) compares objects, not ``id()`` values that a freed
    buffer's successor may reuse."""

    def __init__(self, d: DFlashDrafter, params: SamplingParams | None = None, logits: bool = False):
        self.d, self.logits, self.params = d, logits, params
        # a sampled block's (temperature, top-k, top-p), its uniforms (drawn outside the step, one a row)
        self.sampling = None if params is None else params.filter_key
        self.u = None if params is None else torch.zeros(d.block_size - 1, dtype=torch.float32, device=d.target.device)
        self.buffers = [(s.k, s.v) for s in d.kv]
        c, dev = d.model.config, d.target.device
        self.ids = torch.full((d.block_size,), c.mask_token_id, dtype=torch.int64, device=dev)
        self.start = torch.zeros((), dtype=torch.int64, device=dev)
        self.graph = None
        self.out = None
        # the fused kernels (dflash_fast), with their cos / sin tables and key positions for these buffers
        self.fast = d.fast_weights()
        if self.fast is not None:
            cap = self.buffers[0][0].shape[1]
            self.cos, self.sin = dflash_fast.tables(d.model, cap, d.model.fc.weight)
            self.slots = torch.arange(cap, device=dev)
        self.fn = maybe_compile(self._compute, d.compile)

    def _compute(self) -> torch.Tensor:
        d = self.d
        c = d.model.config
        x = d.target.embed_tokens(self.ids).to(d.model.fc.weight.dtype)
        if c.input_embedding_scale != 1.0:
            x = x * c.input_embedding_scale
        if self.fast is not None:
            h = dflash_fast.block_hidden(d.model, self.fast, x, self.start, self.buffers, self.slots, self.cos, self.sin)
        else:
            h = d.model.block_hidden_static(x, self.start, self.buffers)
        logits = d.logits(h[1:])
        if self.params is not None:
            probs = probs_from_logits(logits, self.params)
            return sample_inverse_cdf(probs, self.u), probs
        return logits if self.logits else logits.argmax(-1)

    def reads(self, kv: list[_ContextKV]) -> bool:
        """Whether ``kv`` is still made of the buffers this step reads."""
        return len(kv) == len(self.buffers) and all(
            s.k is k and s.v is v for s, (k, v) in zip(kv, self.buffers))

    @torch.inference_mode()
    def __call__(self, last_token: int, start: int) -> torch.Tensor:
        self.ids[:1].fill_(last_token)  # a kernel with the value: no copy, no stream sync
        self.start.fill_(start)
        if not self.ids.is_cuda:
            with drafter_static_attention():
                return self.fn()
        if self.graph is None:
            with drafter_static_attention():
                self.graph, self.out = capture(self.fn, self.ids.device)
        self.graph.replay()
        if isinstance(self.out, tuple):
            return tuple(t.clone() for t in self.out)
        return self.out.clone()


class _StaticFlush:
    """The context K/V write of up to ``block_size`` committed rows with static shapes: the rows
    (padded with stale ones) and their first position are device buffers. All ``block_size`` rows are
    projected and written at positions ``start ..``; the padding rows land past the committed
    positions, where the blocks' position mask hides them and the next write overwrites them (the
    caller checks that they fit the buffers). On CUDA it is captured once per context buffer and
    replayed; it holds the buffers it was built for (see :class:`_StaticBlock`)."""

    def __init__(self, d: DFlashDrafter):
        c, w = d.model.config, d.model.fc.weight
        self.d, self.rows = d, d.block_size
        self.buffers = [(s.k, s.v) for s in d.kv]
        self.feats = torch.zeros(self.rows, len(c.target_layer_ids) * c.hidden_size, dtype=w.dtype, device=w.device)
        self.start = torch.zeros((), dtype=torch.int64, device=w.device)
        self.graph = None
        self.fast = d.fast_weights()  # the fused kernels (dflash_fast) and their cos / sin tables
        if self.fast is not None:
            self.cos, self.sin = dflash_fast.tables(d.model, self.buffers[0][0].shape[1], w)
        self.fn = maybe_compile(self._compute, d.compile)

    def _compute(self) -> None:
        if self.fast is not None:
            dflash_fast.write_context(self.d.model, self.fast, self.feats, self.start, self.buffers, self.cos, self.sin)
            return
        pos = self.start + torch.arange(self.rows, device=self.start.device)
        for (kb, vb), (k, v) in zip(self.buffers, self.d.model.context_kv(self.feats, pos)):
            kb.index_copy_(1, pos, k)
            vb.index_copy_(1, pos, v)

    reads = _StaticBlock.reads  # the same buffers check: both hold ``buffers``

    @torch.inference_mode()
    def __call__(self, feats: torch.Tensor, start: int) -> None:
        self.feats[: feats.shape[0]].copy_(feats)
        self.start.fill_(start)
        if not self.feats.is_cuda:
            self.fn()
            return
        if self.graph is None:  # warm-ups write the same rows at the same positions
            self.graph, _ = capture(self.fn, self.feats.device)
        self.graph.replay()


class DFlashSlots:
    """One DFlash drafter for every slot of the serving loop: one static step drafts a block for
    every slot, and one writes every slot's committed rows into its context cache, instead of a
    pass per slot for each.

    Context keys and values live in ``[slots, n_kv, capacity, d]`` buffers per drafter layer (a
    slot's positions past its length are masked, or overwritten later). Both steps have shapes
    that depend on the slot count (and the proposal's on its span) only, so a slot's drafts never
    depend on what the other slots hold: a seeded sampled request drafts, and so samples, the same
    served alone or beside others. ``span_of(need)``: the span a proposal attends over (the
    loop's span buckets), run with span-invariant attention when ``span_invariant``. On CUDA the
    steps are captured as graphs and replayed; elsewhere the same functions run eagerly.

    Slot buckets: while no sampled request is served (``begin(..., sampled=True)`` until its
    ``drop``), both steps run the first 1, 2, 4, ... slots holding the ones they serve, not all of
    them: a greedy request's output does not depend on its drafts' bits (the verify keeps the
    target's tokens), only a sampled one's random stream does. On the H200 (ce828ae) the block step
    over all 32 slots took 1.07 ms at span 256, for 1 or 4 live ones."""

    def __init__(self, d: DFlashDrafter, slots: int, capacity: int, width: int, span_of=None,
                 span_invariant: bool = False):
        c, w = d.model.config, d.model.fc.weight
        dev = d.target.device
        self.d, self.slots, self.capacity, self.width = d, slots, capacity, width
        self.block = d.block_size
        self.span_of = span_of or (lambda need: capacity)
        self.span_invariant = span_invariant
        self.k = [torch.zeros(slots, c.num_key_value_heads, capacity, c.head_dim, dtype=w.dtype, device=dev)
                  for _ in range(c.num_hidden_layers)]
        self.v = [torch.zeros_like(t) for t in self.k]
        self.lengths = [0] * slots  # positions written per slot
        self.sampled: set[int] = set()  # slots serving a sampled request: the steps then run every slot
        self.buckets = row_counts(slots)  # 1, 2, 4, ... and all of them
        self.pending: dict[int, list[torch.Tensor]] = {}  # slot -> captured rows observed, not yet written
        feat = len(c.target_layer_ids) * c.hidden_size
        # static inputs, refilled before each run
        self.obs_feats = torch.zeros(slots, width, feat, dtype=w.dtype, device=dev)
        self.obs_start = torch.zeros(slots, dtype=torch.int64, device=dev)
        self.ids = torch.full((slots, self.block), c.mask_token_id, dtype=torch.int64, device=dev)
        self.start = torch.zeros(slots, dtype=torch.int64, device=dev)
        self.use_graphs = dev.type == "cuda"
        # each slot's prompt tokens off the draft vocabulary (refilled in place at begin), if there is one
        vocab = d.vocab
        self.parts = (PromptPart.empty(vocab, vocab.prompt_tokens, slots) if vocab is not None and vocab.prompt_tokens
                      else None)
        self._observe_graphs: dict[int, object] = {}  # rows -> the context-write step's graph
        self._blocks: dict[tuple[int, int], tuple] = {}  # (rows, span) -> (graph, outputs)

    # --- per request --------------------------------------------------------------
    @torch.inference_mode()
    def begin(self, s: int, prompt_ids: torch.Tensor, out: ForwardOut, sampled: bool = False) -> None:
        """Slot ``s``'s new request: its prompt rows (``out.captured``) become its context.
        ``sampled``: the request samples (its drafts must not depend on the other slots)."""
        n = int(prompt_ids.numel())
        feats = out.captured
        if feats is None or feats.shape[0] != n:
            raise RuntimeError(f"DFlash needs the target's captured layers for the {n} prompt rows")
        if n + self.width > self.capacity:
            raise RuntimeError(f"a prompt of {n} tokens does not fit the drafter's context of {self.capacity}")
        pos = torch.arange(n, device=feats.device)
        for i, (k, v) in enumerate(self.d.model.context_kv(feats, pos)):
            self.k[i][s, :, :n] = k
            self.v[i][s, :, :n] = v
        self.lengths[s] = n
        self.pending.pop(s, None)
        (self.sampled.add if sampled else self.sampled.discard)(s)
        if self.parts is not None:
            self.d.vocab.prompt_part(prompt_ids, self.parts.slot(s))

    def drop(self, s: int) -> None:
        """Slot ``s``'s request ended: nothing of it is read again."""
        self.lengths[s] = 0
        self.pending.pop(s, None)
        self.sampled.discard(s)

    def _rows(self, need: int) -> int:
        """The slots a step runs: the first bucket holding slots ``0 .. need-1``; all of them
        while a sampled request is served."""
        if self.sampled:
            return self.slots
        return next(n for n in self.buckets if n >= need)

    # --- per step -------------------------------------------------------------------
    def _observe_run(self, n: int) -> None:
        m = self.d.model
        pos = self.obs_start[:n, None] + torch.arange(self.width, device=self.obs_start.device)[None, :]
        rows = torch.arange(n, device=pos.device)[:, None]
        for i, (k, v) in enumerate(m.context_kv_slots(self.obs_feats[:n], pos)):
            self.k[i][rows, :, pos] = k.transpose(1, 2)
            self.v[i][rows, :, pos] = v.transpose(1, 2)

    @torch.inference_mode()
    def observe(self, items: list[tuple[int, torch.Tensor]]) -> None:
        """Each ``(slot, captured rows [n, F])`` appends its slot's committed rows. They are kept
        (the loop's captured rows are copies) and written by the next proposal, or once a slot
        holds ``width`` pending rows: a step that drafts nothing costs no drafter step."""
        for s, feats in items:
            n = feats.shape[0]
            if not 0 < n <= self.width:
                raise RuntimeError(f"DFlash observe takes 1..{self.width} rows a step, got {n}")
            self.pending.setdefault(s, []).append(feats)
        if any(sum(p.shape[0] for p in parts) >= self.width for parts in self.pending.values()):
            self._flush()

    def _flush(self) -> None:
        """Write every slot's pending rows, up to ``width`` a slot per step over the slots' bucket
        (the others write past their lengths, where nothing is read)."""
        while self.pending:
            if max(self.lengths) + self.width > self.capacity:
                raise RuntimeError(f"the drafter's context of {self.capacity} positions is full")
            took = {}
            for s, parts in self.pending.items():
                rows = torch.cat(parts) if len(parts) > 1 else parts[0]
                n = min(rows.shape[0], self.width)
                self.obs_feats[s, :n] = rows[:n]
                took[s] = n
                self.pending[s] = [rows[n:]] if n < rows.shape[0] else []
            n = self._rows(max(took) + 1)
            self.obs_start[:n].copy_(device_ints(self.lengths[:n], self.obs_start.device))
            if not self.use_graphs:
                self._observe_run(n)
            else:
                self._observe_step(n).replay()
            for s, n in took.items():
                self.lengths[s] += n
            self.pending = {s: p for s, p in self.pending.items() if p}

    def _block_run(self, n: int, span: int):
        d = self.d
        c = d.model.config
        x = d.target.embed_tokens(self.ids[:n]).to(d.model.fc.weight.dtype)
        if c.input_embedding_scale != 1.0:
            x = x * c.input_embedding_scale
        ctx = [(k[:n, :, :span], v[:n, :, :span]) for k, v in zip(self.k, self.v)]
        with static_step_attention(self.span_invariant, x.is_cuda):  # a slot's bits: its own inputs only
            h = d.model.block_hidden_slots(x, self.start[:n], ctx)
        logits = d.logits(h[:, 1:], None if self.parts is None else self.parts.first(n))  # [S, B-1, V] fp32
        return logits.argmax(-1), logits

    @torch.inference_mode()
    def warmup(self, spans: list[int]) -> None:
        """Capture (on CUDA) the context-write step and the block step of each slot bucket and span
        before serving, with no request in the loop: dummy rows, no state kept (a slot's rows are
        written again at its ``begin``)."""
        if not self.use_graphs:
            return
        for n in self.buckets:
            self._observe_step(n)
            for span in spans:
                if span <= self.capacity:
                    self._block_step(n, span)

    def _observe_step(self, n: int):
        """The context-write step's CUDA graph over the first ``n`` slots, captured at its first use."""
        g = self._observe_graphs.get(n)
        if g is None:
            g = self._observe_graphs[n] = capture(lambda: self._observe_run(n), self.obs_start.device)[0]
        return g

    def _block_step(self, n: int, span: int) -> tuple:
        """(graph, outputs) of the block step over the first ``n`` slots and ``span`` positions,
        captured at its first use."""
        st = self._blocks.get((n, span))
        if st is None:
            st = self._blocks[(n, span)] = capture(lambda: self._block_run(n, span), self.ids.device)
        return st

    def _run_block(self, slots: torch.Tensor, rows) -> tuple[torch.Tensor, torch.Tensor]:
        """The block step over the slots' bucket, ``rows`` giving the last token of the drafting
        ``slots`` (on the device): (argmax drafts ``[n, block - 1]``, logits), the step's own
        buffers, row ``s`` slot ``s``."""
        self._flush()
        self.ids[slots, 0] = device_ints([int(r[1]) for r in rows], self.ids.device)  # one write, not one a slot
        n = self._rows(max(r[0] for r in rows) + 1)
        self.start[:n].copy_(device_ints(self.lengths[:n], self.start.device))
        span = self.span_of(max(self.lengths[:n]))
        if not self.use_graphs:
            return self._block_run(n, span)
        graph, outs = self._block_step(n, span)
        graph.replay()
        return outs

    def _slots_of(self, rows) -> torch.Tensor:
        return device_ints([r[0] for r in rows], self.ids.device)

    @torch.inference_mode()
    def propose_greedy(self, rows: list[tuple[int, int, int, SamplingParams, torch.Generator | None]]
                       ) -> tuple[torch.Tensor, list[int]]:
        """:meth:`propose` for greedy rows in one tensor: (``[len(rows), K]`` argmax drafts, each row's
        draft count ``min(k, block - 1)``), ``K`` the largest count, a row's drafts past its own
        zeroed (the padding a list of proposals gets). The serving loop's step then builds its ids
        with no call per slot."""
        slots = self._slots_of(rows)
        greedy, _ = self._run_block(slots, rows)
        counts = [max(0, min(r[2], self.block - 1)) for r in rows]
        width = max(counts, default=0)
        out = greedy[slots, :width]  # a copy (gather)
        past = torch.arange(width, device=out.device)[None, :] >= device_ints(counts, out.device)[:, None]
        return out.masked_fill_(past, 0), counts

    @torch.inference_mode()
    def propose(self, rows: list[tuple[int, int, int, SamplingParams, torch.Generator | None]]) -> list[Proposal]:
        """One block for every slot; ``rows``: ``(slot, last token, k, params, generator)`` of the
        slots that draft, each getting ``min(k, block - 1)`` drafts (sampled from the drafter's own
        filtered distribution, returned with it, for sampled requests)."""
        greedy, logits = self._run_block(self._slots_of(rows), rows)
        out = []
        for s, _, k, params, gen in rows:
            k = max(0, min(k, self.block - 1))
            if params.greedy:
                out.append(Proposal(greedy[s, :k].clone()))
            else:
                probs = probs_from_logits(logits[s, :k], params)
                out.append(Proposal(torch.multinomial(probs, 1, generator=gen).squeeze(1), probs))
        return out


def check_fit(c: DFlashConfig, target: CausalLM, source: str) -> None:
    """Refuse a drafter that was not built for this target's width, depth or vocabulary."""
    tc = target.config
    n_layers = len(target.layers)
    if c.hidden_size != tc.hidden_size:
        raise ConfigError(f"{source}: drafter hidden_size={c.hidden_size} does not match the target's "
                          f"hidden_size={tc.hidden_size}; this DFlash checkpoint is for another model")
    if c.num_target_layers is not None and c.num_target_layers != n_layers:
        raise ConfigError(f"{source}: drafter num_target_layers={c.num_target_layers} but the target has "
                          f"{n_layers} layers; this DFlash checkpoint is for another model")
    bad = [i for i in c.target_layer_ids if i >= n_layers]
    if bad:
        raise ConfigError(f"{source}: target_layer_ids {bad} do not exist in the target ({n_layers} layers)")
    vocab = int(target.config.vocab_size)
    if c.mask_token_id >= vocab:
        raise ConfigError(f"{source}: mask_token_id={c.mask_token_id} is outside the target's vocabulary "
                          f"(size {vocab})")


def load_dflash_drafter(path: str, loaded, block_size: int | None = None) -> DFlashDrafter:
    """Load a z-lab DFlash checkpoint (``config.json`` + ``model.safetensors``) for the target in
    ``loaded`` (a :class:`~specdec.loading.LoadedModel` or a bare :class:`CausalLM`).

    Strict: a missing, unexpected, mis-shaped or non-float tensor, or a drafter built for
    another target, is an error naming the tensor or field. ``block_size`` (default: the
    trained one) may be lowered at run time; the engine then drafts ``block_size - 1`` tokens.
    """
    target: CausalLM = getattr(loaded, "model", loaded)
    arch = getattr(loaded, "arch", None)
    if arch is not None and "dflash" not in arch.drafters:
        raise ConfigError(f"{loaded.path}: DFlash drafters are not supported for {arch.name} targets yet "
                          f"(drafters that fit: {', '.join(arch.drafters)})")
    path = os.path.expanduser(str(path))
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: a DFlash drafter is a directory with config.json and model.safetensors")
    cfg_path = os.path.join(path, "config.json")
    cfg = DFlashConfig.from_dict(read_json(cfg_path), source=cfg_path)
    check_fit(cfg, target, cfg_path)
    _check_block_size(block_size, cfg.block_size, cfg_path)  # before reading any weights
    src = SafetensorsSource(path)
    check_layer_count(cfg.num_hidden_layers, len(src.infos()), path)
    with torch.device("meta"):
        model = DFlashDraftModel(cfg)
    names = {n: n for n in model.state_dict()}
    load_into(model, src, names, dtype=target.dtype, device=target.device, desc="loading dflash drafter")
    model.eval()
    # Every tensor was converted (not reinterpreted) to the run dtype; norms included.
    for n, p in model.named_parameters():
        assert p.dtype == target.dtype and p.device == target.device, f"{n}: {p.dtype} on {p.device}"
    try:
        model.rotary.inv_freq(target.device)  # an unsupported rope_type fails here
    except ConfigError as e:
        raise ConfigError(f"{cfg_path}: {e}") from e
    return DFlashDrafter(model, target, block_size, path)
