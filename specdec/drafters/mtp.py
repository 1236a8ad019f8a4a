"""Multi-token prediction ("NextN") drafter: Qwen3.5 / Qwen3.6's own block, or a trained one.

The MTP block that Qwen3.5 checkpoints carry beside the main stack predicts the token after next
(a head trained for a Llama-family target has the same structure with the target's own kind of
decoder layer and plain norms, and lives in a directory of its own: :mod:`.mtp_dir`):

    x = fc([pre_fc_norm_embedding(embed(t_{i+1})), pre_fc_norm_hidden(h_i)])    # embedding first
    x = FullAttentionDecoderLayer(x)        # gated attention, its own KV cache, dense or MoE FFN
    g = norm(x)                             # shared_head_norm; also the input of the next chained step
    logits = head(g)                        # predicts t_{i+2}

``h_i`` is the target's final hidden state **after** its final norm at position ``i``
(``ForwardOut.hidden``). Embedding and head are the target's unless the checkpoint carries
dedicated ones (``mtp.embed_tokens`` / GGUF ``nextn.embed_tokens``, ``nextn.shared_head_head``).
Drafting ``k`` tokens chains the block: step ``j + 1`` is fed ``g`` of step ``j`` with the
embedding of the draft step ``j`` made, one position further.

Positions: row ``i`` (the pair ``h_i``, ``t_{i+1}``) sits at position ``i``, the position of
``h_i``, as vLLM places it (only relative positions matter; the cache index is the position).

Cache: the block's KV cache holds committed rows only. Row ``i`` needs ``t_{i+1}``, so after
``L`` committed target positions the rows ``0 .. L-2`` are known and ``h_{L-1}`` waits for the
next token. :meth:`MTPDrafter.propose` first runs every pending committed row together with the
row ``(h_{L-1}, t)`` of the token it drafts from (kept: it pairs a real hidden state with a
committed token), then the chained rows, which are made from the block's own hidden states and
are dropped (overwritten by the next propose's committed rows), so the cache never holds
a draft-made entry when ``propose`` starts. :meth:`observe` only queues the committed rows;
they are computed with the real target hidden states in the next ``propose``, in one forward.

Sampling (temperature > 0): drafts are sampled from the block's own processed distribution
(temperature, top-k, top-p) and returned with their probabilities. Acceptance is then
``1 - TV(p, q)`` per token, which for a good drafter beats argmax drafts (accepted with
probability ``p(argmax q)``, at most the target's top probability). Both are lossless.

HF checkpoints: ``mtp.fc``, ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``,
``mtp.norm``, ``mtp.layers.0.*`` (and the optional ``mtp.embed_tokens``). GGUF:
``blk.{n}.nextn.{eh_proj,enorm,hnorm,shared_head_norm,embed_tokens,shared_head_head}`` and the
inner block under ``blk.{n}.*`` (``n`` = main layers); the names and the baked ``+1`` of the
norms are converted by :func:`specdec.models.qwen35.checkpoint_view`, as for the target.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from .. import env
from ..cpu_linear import Linear, linear, plain
from ..errors import CheckpointError, ConfigError
from ..hostcopy import device_ints
from ..models import fused_layer
from ..models.base import CausalLM, ForwardOut
from ..models.graphs import capture, maybe_compile
from ..models.layers import Embedding, RMSNorm, drafter_static_attention
from ..models.qwen35 import FullAttentionDecoderLayer, checkpoint_view
from ..sampling import SamplingParams, probs_from_logits, sample_inverse_cdf
from ..weights import load_into
from .base import Proposal

_PREFIXES = ("mtp.", "model.mtp.")
# HF name -> llama.cpp name of the wrapper tensors, for error messages about GGUF files
_GGUF_NEXTN = {"fc.weight": "nextn.eh_proj.weight", "pre_fc_norm_embedding.weight": "nextn.enorm.weight",
               "pre_fc_norm_hidden.weight": "nextn.hnorm.weight", "norm.weight": "nextn.shared_head_norm.weight",
               "embed_tokens.weight": "nextn.embed_tokens.weight",
               "shared_head.head.weight": "nextn.shared_head_head.weight"}


class MTPBlock(nn.Module):
    """The MTP weights under HF names less the ``mtp.`` prefix (see the module docstring).

    ``layer`` is the one decoder layer, of the target's own kind: Qwen3.5's
    :class:`FullAttentionDecoderLayer` or a Llama-family ``DenseDecoderLayer``; it is called as
    ``layer(x, ctx, cache)`` with a cache from ``layer.make_cache``. ``zero_centered``: the
    wrapper norms scale by ``1 + w`` (Qwen3.5) or by ``w`` (Llama family).
    """

    def __init__(self, config, layer: nn.Module, zero_centered: bool = True, dedicated_embed: bool = False,
                 dedicated_head: bool = False):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.fc = Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(h, eps, zero_centered)
        self.pre_fc_norm_hidden = RMSNorm(h, eps, zero_centered)
        self.layers = nn.ModuleList([layer])
        self.norm = RMSNorm(h, eps, zero_centered)
        self.embed_tokens = Embedding(config.vocab_size, h) if dedicated_embed else None
        self.shared_head = nn.Module() if dedicated_head else None
        if dedicated_head:
            self.shared_head.head = Linear(h, config.vocab_size, bias=False)

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor, ctx, cache, fast: "FastLayer | None" = None
                ) -> torch.Tensor:
        """``emb``, ``hidden`` ``[T, H]`` (rows at ``ctx.start ..``) -> normed output ``[T, H]``. ``fast``:
        the layer on the fused kernels (:class:`FastLayer`), where they take ``emb``."""
        both = torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(hidden)], dim=-1)
        if fast is not None and fused_layer.usable(both):
            x = fused_layer.linear(both, self.fc.weight)
            x, delta = self.layers[0].forward_fused(x, None, ctx, cache, fast.weights)
            return self.norm.add(x, delta)[1]
        return self.norm(self.layers[0](self.fc(both), ctx, cache))


# A Llama-family MTP head's layer on the target's fused kernels (models/fused_layer.py: the q/k/v, o_proj,
# gate/up + SwiGLU and down_proj GEMMs, the norms' residual adds folded), with fc on the same GEMM. On the
# H200 (random weights, SmolLM2's shape, context 300, scripts/profile_shape_step.py --drafter mtp) a k = 3
# proposal went 0.53 / 0.58 -> 0.41 / 0.46 ms (128 -> 110 kernels: most of the rest are the head, the norms
# and the embedding); the shipped head end to end on GSM8K (first 80, k = 3, T=0) 1.52x -> 1.49x and 1.40x ->
# 1.53x plain decoding in two alternated rounds (noisy; +4 % on the mean), HumanEval 1.08x -> 1.15x. The
# drafts' bits change (other GEMMs), never a greedy output nor a sampled one's distribution (acceptance
# reads the probabilities drafted from). On by default; SPECDEC_MTP_FAST=0 gives the eager layer back.
FAST = env.switch("SPECDEC_MTP_FAST")


class FastLayer:
    """A ``DenseDecoderLayer``'s q/k/v and gate/up weights concatenated for the fused GEMMs (copies, made
    once), handed to :meth:`DenseDecoderLayer.forward_fused` in place of the layer's own fused projections
    (the block's parameters stay separate tensors, as training and saving want them)."""

    def __init__(self, layer):
        a, m = layer.self_attn, layer.mlp
        qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).contiguous()
        sizes = [a.q_proj.out_features, a.k_proj.out_features, a.v_proj.out_features]
        self.weights = (qkv, sizes, torch.cat([m.gate_proj.weight, m.up_proj.weight]).contiguous())

    @staticmethod
    def eligible(layer) -> bool:
        """A Llama-family layer without q/k norms, biases, output gate or shard, SwiGLU, at most
        ``fused_layer.MAX_HIDDEN`` wide (what the fused GEMMs compute)."""
        from ..models.llama import DenseDecoderLayer
        if type(layer) is not DenseDecoderLayer:
            return False
        a, m = layer.self_attn, layer.mlp
        return (a.q_norm is None and not a.gated and not hasattr(a, "tp_slices") and not hasattr(m, "tp_slices")
                and plain(a.o_proj) and plain(m.down_proj) and a.q_proj.bias is None
                and a.o_proj.bias is None and m.gate_proj.bias is None and m.down_proj.bias is None
                and type(m).act is fused_layer._silu_act() and layer.config.hidden_size <= fused_layer.MAX_HIDDEN)


# Sampled proposals (temperature > 0) as one static step like greedy ones (a CUDA graph on CUDA;
# :class:`_StaticPropose`), instead of the eager chain: on the H200 (69c9b6b) an MTP k=3 proposal at
# T=1 cost 5.8 ms of host time a step against 0.39 ms greedy, and MTP ran at 0.36x plain decoding; captured
# (2d96082, GSM8K 60, k=3, T=1) it runs at 1.00x (0.38x eager in the same session). On by default;
# SPECDEC_MTP_STATIC_SAMPLING=0 turns it off (the eager chain).
STATIC_SAMPLING = env.switch("SPECDEC_MTP_STATIC_SAMPLING")
# A propose with more committed rows than its static step takes (a prompt's first, one after a step without a
# propose) runs the older rows through the block eagerly, in one forward, and the last k + 1 through the static step,
# instead of running the whole eager chain (the rows, then k heads and k - 1 one-row forwards). On the H100 (real
# SmolLM2, `specdec bench` on GSM8K 40, -n 128, k 3, alternated 8 times in one process; 2026-12-06 (seventh)) such a
# propose went 5.4-7.2 -> 2.7-2.9 ms (median) and MTP 1,593.6 -> 1,663.6 tok/s (1.30x -> 1.33x plain; faster in
# 4 of 4 pairs). The drafts' bits may change (the rows' forward splits elsewhere), never an output.
# SPECDEC_MTP_SPLIT_CATCHUP=0 gives the eager chain back.
SPLIT_CATCHUP = env.switch("SPECDEC_MTP_SPLIT_CATCHUP")
# Tried and removed (session of 2026-12-06 (sixth), H100; code at bea57c2): the prompt's rows through the block in
# ``begin`` (eagerly, padded to 16-row tiles), so that a prompt's first propose takes the captured step instead of the
# eager chain. On the real SmolLM2 (bench, GSM8K 40, -n 128, k 3, one process) the eager first proposes' 190 ms went,
# but the prefill grew by as much (0.243 -> 0.435 s) and MTP went 1.393x -> 1.342x plain decoding.


class MTPDrafter:
    """Drafts with a loaded :class:`MTPBlock` bound to its target (see the module docstring)."""

    name = "mtp"
    capture_layers: tuple[int, ...] = ()  # needs only ForwardOut.hidden

    def __init__(self, block: MTPBlock, target: CausalLM, sample_drafts: bool = True):
        self.block, self.target, self.sample_drafts = block, target, sample_drafts
        self.length = 0  # committed rows in the KV cache
        self.cache = None
        self._pending_h: list[torch.Tensor] = []  # committed rows not yet in the cache
        self._pending_t: list[torch.Tensor] = []
        self._last_h: torch.Tensor | None = None  # [1, H]: h of the last committed target position
        self._fed_last = False  # whether propose already cached the row (last_h, last token)
        self.last_logits: torch.Tensor | None = None  # [k, V] of the last propose (for inspection)
        # Greedy proposals as one replayable static step (a CUDA graph on CUDA): the catch-up
        # rows padded to k + 1, then the k chained rows, argmax on the device (with the sharded
        # embedding and head's collectives inside under tensor parallelism).
        self.static_steps = target.device.type == "cuda"
        # sampled proposals as static steps too (see STATIC_SAMPLING; tests set it on the CPU)
        self.static_sampling = self.static_steps and STATIC_SAMPLING
        # torch.compile the static proposal (set by the engine's ``compile``); compiled proposals are static
        self.compile = False
        self._static: dict = {}  # k, or (k, temperature, top_k, top_p) for a sampled one -> its static step
        self._fast_layer: FastLayer | None = None  # the layer on the fused kernels (FastLayer), made at first use
        self.vocab = None  # a DraftVocab: drafts from its tokens only (use_draft_vocab)
        self.path = ""  # the directory of a trained head (mtp_dir); "" for the target's own block
        self._part = None  # the vocabulary's PromptPart: this request's prompt tokens off it (begin)

    def use_draft_vocab(self, ids, source: str = "draft vocabulary") -> None:
        """Draft only tokens of ``ids`` (:class:`~.draft_vocab.DraftVocab`: the head reads their rows)."""
        from .draft_vocab import DraftVocab
        b = self.block
        w = b.shared_head.head.weight if b.shared_head is not None else self.target.head_weight()
        self.vocab = DraftVocab(ids, w, self.target.config.vocab_size, source)
        self._part = None
        self._static = {}  # steps captured with the whole head

    def fast_layer(self) -> "FastLayer | None":
        """The block's layer on the fused kernels when they apply (SPECDEC_MTP_FAST, CUDA, not compiled),
        else None."""
        w = self.block.fc.weight
        if not (FAST and not self.compile and fused_layer.usable(w) and FastLayer.eligible(self.block.layers[0])):
            return None
        if self._fast_layer is None:
            self._fast_layer = FastLayer(self.block.layers[0])
        return self._fast_layer

    def spawn(self) -> "MTPDrafter":
        """A drafter sharing this block's weights with an empty KV cache (one per sequence of a batch)."""
        d = MTPDrafter(self.block, self.target, self.sample_drafts)
        d.compile = self.compile
        d._fast_layer = self._fast_layer
        d.vocab = self.vocab
        return d

    # --- embedding / head (dedicated or the target's) ----------------------------------
    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        b = self.block
        return b.embed_tokens(ids) if b.embed_tokens is not None else self.target.embed(ids)

    def _head(self, g: torch.Tensor) -> torch.Tensor:
        b = self.block
        if self.vocab is not None:  # the subset's rows; the target's soft cap unless the head is the block's own
            return self.vocab.logits(g, None if b.shared_head is not None else self.target.soft_cap, self._part)
        if b.shared_head is not None:
            return linear(g, b.shared_head.head.weight).float()
        return self.target.head(g, exact=False)  # drafts: cuBLAS, not the row-exact GEMM

    def _ensure(self, end: int) -> None:
        """Grow the KV cache (by doubling) to hold positions ``0 .. end-1``."""
        cap = 0 if self.cache is None else self.cache.k.shape[1]
        if end <= cap:
            return
        layer = self.block.layers[0]
        new = layer.make_cache(max(end, 2 * cap, 64), self.target.dtype, self.target.device)
        if self.cache is not None:  # everything, chained rows of the current propose included
            new.k[:, :cap] = self.cache.k
            new.v[:, :cap] = self.cache.v
        self.cache = new

    def _run(self, tokens: torch.Tensor, hidden: torch.Tensor, start: int) -> torch.Tensor:
        """Rows ``(hidden[j], tokens[j])`` at positions ``start + j`` -> normed outputs ``[T, H]``."""
        t = tokens.shape[0]
        self._ensure(start + t)
        ctx = self.target.step_context(start, t)
        return self.block(self._embed(tokens), hidden.to(self.target.dtype), ctx, self.cache, self.fast_layer())

    # --- the drafter protocol ---------------------------------------------------------
    @torch.inference_mode()
    def begin(self, prompt_ids: torch.Tensor, out: ForwardOut) -> None:
        ids = prompt_ids.to(self.target.device).reshape(-1)
        if self.vocab is not None:  # refilled in place: captured proposals keep reading it
            self._part = self.vocab.prompt_part(ids, self._part)
        self.length = 0  # the cache is kept when large enough: rows past the length are masked by position
        self._ensure(ids.numel() + 1024)  # room for the reply: each new cache means a new graph capture
        self._pending_h = [out.hidden[:-1]]
        self._pending_t = [ids[1:]]
        self._last_h = out.hidden[-1:]
        self._fed_last = False

    @torch.inference_mode()
    def observe(self, tokens: torch.Tensor, out: ForwardOut) -> None:
        tokens = tokens.to(self.target.device).reshape(-1)
        n = tokens.shape[0]
        if not self._fed_last:  # no propose this step: the row (last_h, tokens[0]) is still missing
            self._pending_h.append(self._last_h)
            self._pending_t.append(tokens[:1])
        self._pending_h.append(out.hidden[:n - 1])
        self._pending_t.append(tokens[1:])
        self._last_h = out.hidden[n - 1:n]
        self._fed_last = False

    @torch.inference_mode()
    def propose(self, last_token: int, k: int, params: SamplingParams, gen: torch.Generator | None) -> Proposal:
        dev = self.target.device
        if k <= 0:
            return Proposal(torch.empty(0, dtype=torch.int64, device=dev))
        if self._fed_last:
            raise RuntimeError("MTPDrafter.propose called twice without observe in between")
        # committed rows first, then (h_{L-1}, last_token): all real, all kept
        hidden = torch.cat(self._pending_h + [self._last_h], dim=0)
        toks = torch.cat(self._pending_t + [device_ints([int(last_token)], dev)])
        greedy = params.greedy or not self.sample_drafts
        static = (greedy or self.static_sampling) and (self.static_steps or self.compile)
        if static and SPLIT_CATCHUP and toks.shape[0] > k + 1:  # the older rows eagerly, the rest static
            older = toks.shape[0] - (k + 1)
            self._run(toks[:older], hidden[:older], self.length)
            self.length += older
            toks, hidden = toks[older:], hidden[older:]
        if static and toks.shape[0] <= k + 1:
            return self._propose_static(toks, hidden, k, None if greedy else params, gen)
        g = self._run(toks, hidden, self.length)[-1:]
        self.length += toks.shape[0]
        self._pending_h, self._pending_t, self._fed_last = [], [], True

        drafts, probs, logits_all = [], [], []
        for j in range(k):
            logits = self._head(g)  # [1, V]
            logits_all.append(logits)
            if params.greedy or not self.sample_drafts:
                d = logits.argmax(-1)
            else:
                q = probs_from_logits(logits, params)
                d = torch.multinomial(q, 1, generator=gen).reshape(1)
                probs.append(q)
            drafts.append(d)
            if j + 1 < k:
                # a chained row made from the block's own hidden state: at position length + j,
                # past the committed rows, so the next propose overwrites it
                g = self._run(d, g, self.length + j)
        self.last_logits = torch.cat(logits_all)
        return Proposal(torch.cat(drafts), torch.cat(probs) if probs else None)


    def _propose_static(self, toks: torch.Tensor, hidden: torch.Tensor, k: int, params: SamplingParams | None = None,
                        gen: torch.Generator | None = None) -> Proposal:
        n, rows = toks.shape[0], k + 1
        self._ensure(self.length + rows + k)
        key = k if params is None else (k, *params.filter_key)
        step = self._static.get(key)
        if step is None or step.cache is not self.cache:
            self._static.pop(key, None)  # free the old step (and the buffers it holds) first
            if params is not None:  # sampled steps of one set of params kept at a time (each set is graphs)
                self._static = {kk: st for kk, st in self._static.items()
                                if not isinstance(kk, tuple) or kk[1:] == key[1:]}
            step = self._static[key] = _StaticPropose(self, k, params)  # new cache buffers: (re)capture
        drafts, logits, probs = step(toks, hidden, self.length, n, gen)
        self.length += n
        self._pending_h, self._pending_t, self._fed_last = [], [], True
        self.last_logits = logits
        return Proposal(drafts, probs)


class _StaticPropose:
    """One propose of ``k`` drafts with static shapes: ``k + 1`` catch-up rows (the real
    ones first; padding rows write cache entries past the committed rows, which the chained rows
    and the next propose overwrite and the position mask hides), then ``k - 1`` chained rows.
    Start position and the number of real rows are 0-d device tensors, so on CUDA the whole
    proposal is captured once and replayed (off CUDA it runs eagerly, for tests).

    Greedy (``params`` None): each draft is the argmax. Sampled: each draft is drawn from the
    block's filtered distribution ``q`` (``params`` are fixed per step) by inverse CDF, with ``k``
    uniforms drawn from the request's generator before the replay: the first token whose
    cumulative probability exceeds ``u * total``, never one of probability 0. The ``q`` rows come
    out with the drafts, so acceptance stays exact."""

    def __init__(self, drafter: "MTPDrafter", k: int, params: SamplingParams | None = None):
        d, tgt = drafter, drafter.target
        self.d, self.k, self.rows, self.cache, self.params = d, k, k + 1, d.cache, params
        dev = tgt.device
        self.tok = torch.zeros(self.rows, dtype=torch.int64, device=dev)
        self.hid = torch.zeros(self.rows, tgt.config.hidden_size, dtype=tgt.dtype, device=dev)
        self.start = torch.zeros((), dtype=torch.int64, device=dev)
        self.n = torch.ones((), dtype=torch.int64, device=dev)
        self.u = torch.zeros(k, dtype=torch.float32, device=dev)  # the sampled step's uniforms
        self.graph = None
        self.out = None
        self.fn = maybe_compile(self._compute, d.compile)

    def _draft(self, logits: torch.Tensor, j: int):
        """Draft ``j`` from ``logits [1, V]``: ``(token [1], q [1, V] or None)``."""
        if self.params is None:
            return logits.argmax(-1), None
        q = probs_from_logits(logits, self.params)
        return sample_inverse_cdf(q, self.u[j:j + 1]), q

    def _compute(self):
        d, tgt, cap = self.d, self.d.target, self.cache.k.shape[1]
        fast = d.fast_layer()
        x = d.block(d._embed(self.tok), self.hid, tgt.static_context(self.start, self.rows, cap), self.cache, fast)
        g = x.index_select(0, (self.n - 1).reshape(1))
        drafts, logits_all, probs = [], [], []
        for j in range(self.k):
            logits = d._head(g)
            dj, q = self._draft(logits, j)
            drafts.append(dj)
            logits_all.append(logits)
            probs.append(q)
            if j + 1 < self.k:
                ctx = tgt.static_context(self.start + self.n + j, 1, cap)
                g = d.block(d._embed(dj), g, ctx, self.cache, fast)
        return torch.cat(drafts), torch.cat(logits_all), (torch.cat(probs) if self.params is not None else None)

    def __call__(self, toks, hidden, start: int, n: int, gen: torch.Generator | None = None):
        self.tok[:n].copy_(toks)
        self.hid[:n].copy_(hidden)
        self.start.fill_(start)
        self.n.fill_(n)
        if self.params is not None:
            self.u.uniform_(generator=gen)
        if self.d.target.device.type != "cuda":
            with drafter_static_attention():
                self.out = self.fn()
        else:
            if self.graph is None:
                # warm-ups write the same real rows the replay writes; the rest lies past the commits
                with drafter_static_attention():
                    self.graph, self.out = capture(self.fn, self.tok.device)
            self.graph.replay()
        drafts, logits, probs = self.out
        return drafts.clone(), logits.clone(), None if probs is None else probs.clone()


# --- loading ------------------------------------------------------------------------------

def _strip(name: str) -> str | None:
    for p in _PREFIXES:
        if name.startswith(p):
            return name[len(p):]
    return None


def load_mtp_drafter(loaded, sample_drafts: bool = True) -> MTPDrafter:
    """Build the MTP drafter of a loaded Qwen3.5 / Qwen3.6 target from its own checkpoint."""
    arch, cfg, target = loaded.arch, loaded.model.config, loaded.model
    if "mtp" not in getattr(arch, "drafters", ()):
        raise ConfigError(f"{loaded.path}: --draft mtp needs a Qwen3.5/Qwen3.6 target with an MTP block; "
                          f"architecture '{arch.name}' has none (try --draft ngram)")
    view = checkpoint_view(cfg, loaded.source, loaded.format, mtp=True)
    n_layer = cfg.num_hidden_layers
    extra = re.compile(r"^blk\.(\d+)\.")

    def is_mtp(name: str) -> bool:
        m = extra.match(name)  # GGUF tensors of MTP blocks the view did not rename: reported as unexpected
        return _strip(name) is not None or (m is not None and int(m[1]) >= n_layer)

    mtp_view = view.without(lambda n: not is_mtp(n))
    infos = mtp_view.infos()
    names = {n: _strip(n) or n for n in infos}
    where = loaded.path

    def ckpt_name(p: str) -> str:
        if loaded.format == "gguf":
            g = _GGUF_NEXTN.get(p)
            return f"mtp.{p} (GGUF blk.{n_layer}.{g})" if g else f"mtp.{p} (GGUF under blk.{n_layer}.*)"
        return f"mtp.{p}"

    n_mtp = int(getattr(cfg, "mtp_num_hidden_layers", 0) or 0)
    if not infos:
        raise CheckpointError(f"{where}: the checkpoint has no MTP block (no mtp.* / blk.{n_layer}.nextn.* tensors); "
                              f"--draft mtp needs one (try --draft ngram)")
    if n_mtp == 0:
        found = {int(m[1]) for n in names.values() if (m := re.match(r"^layers\.(\d+)\.", n))}
        n_mtp = len(found) or 1  # config.json without mtp_num_hidden_layers: count the blocks
    if n_mtp != 1:
        raise ConfigError(f"{where}: mtp_num_hidden_layers={n_mtp}: only one MTP layer is supported "
                          f"(every published Qwen3.5/3.6 checkpoint has one)")

    params = set(names.values())
    flag = bool(cfg.raw.get("mtp_use_dedicated_embeddings", False))
    dedicated_embed = "embed_tokens.weight" in params
    if flag and not dedicated_embed:
        raise CheckpointError(f"{where}: config sets mtp_use_dedicated_embeddings=true but the checkpoint has no "
                              f"tensor {ckpt_name('embed_tokens.weight')}")
    dedicated_head = "shared_head.head.weight" in params
    moe = hasattr(cfg, "moe_intermediate_size")
    with torch.device("meta"):
        block = MTPBlock(cfg, FullAttentionDecoderLayer(cfg, moe), True, dedicated_embed, dedicated_head)
    missing = sorted(p for p in block.state_dict() if p not in params)
    if missing:
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise CheckpointError(f"{where}: MTP block incomplete: missing tensor(s) "
                              f"{', '.join(ckpt_name(p) for p in missing[:8])}{more}")
    load_into(block, mtp_view, names, dtype=target.dtype, device=target.device, desc="loading MTP block")
    block.eval()
    return MTPDrafter(block, target, sample_drafts=sample_drafts)
