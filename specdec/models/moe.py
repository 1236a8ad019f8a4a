"""Sparse mixture-of-experts FFN with a gated shared expert (Qwen3.5-MoE, Qwen3-Next, their MTP blocks).

Parameter names (transformers' in-memory layout, as ``mlp.*`` of a decoder layer):

- ``gate.weight`` ``[E, H]``: the router;
- ``experts.gate_up_proj`` ``[E, 2*I, H]``: per expert, the gate rows then the up rows;
- ``experts.down_proj`` ``[E, H, I]``;
- ``shared_expert.{gate,up,down}_proj.weight``: a SwiGLU of width ``shared_intermediate``;
- ``shared_expert_gate.weight`` ``[1, H]``: the shared expert's output is scaled by
  ``sigmoid(shared_expert_gate(x))``.

Checkpoints on the hub (and transformers' ``save_pretrained``) store experts one by one
(``experts.{e}.{gate,up,down}_proj.weight``); :func:`stacked_experts_view` presents them in the
stacked layout above.

Tensor parallelism (a ``shard``): experts are split across ranks (expert parallel: rank r holds
the :func:`~specdec.parallel.tp.even_split` block of ``num_experts``), the router and the shared
expert's gate are replicated, so every rank routes every token alike; each rank adds up the
(token, expert) pairs of its own experts only (the others contribute zero). The shared expert is
split like a dense MLP (column-parallel gate/up, row-parallel down): replicating it would cost
every rank its whole weights and FLOPs for nothing, since its partial sums ride on the experts'
all-reduce: ``sigmoid(g) * sum_r s_r = sum_r sigmoid(g) * s_r``. So a MoE layer does exactly one
all-reduce. A rank loads only its experts: per-expert HF tensors through
:func:`stacked_experts_view` (only its experts' tensors are read), stacked HF tensors as a
safetensors slice, GGUF ``*_exps`` as its block of rows (only those are dequantized).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from .. import env
from ..cpu_linear import Linear, linear
from ..errors import CheckpointError, ConfigError
from ..parallel.tp import Shard, even_split
from ..weights.source import TensorSource
from . import expert_kernel, fused_ops
from .layers import SwiGLU, derived_weight, fuse_linears, gelu_tanh
from .source_view import SourceView, ViewTensor, derived, passthrough


# Long eager forwards (prefill) as two batched GEMMs (Experts._grouped_bmm) instead of a loop over the experts of ~7
# kernels an expert: on the H200 (scripts/ab_flags.py, defaults+moe-bmm) the qwen3.5-35b-a3b shape's 512-token prefill
# took 1,068 -> 163 ms (session of 2026-12-05 (second)) and 1,923-3,579 -> 753-912 ms (2026-12-05 (fourth), another
# machine). Its first form added each pair's row into its token with index_add_ (CUDA atomics over repeated rows: the
# same prompt prefilled to other bits run to run; device_check saw speculative decoding differ from plain on 2 of 4
# prompts); this form has no such accumulation (a CPU test checks it), and on the H200 device_check (random Qwen3.5
# MoE, graphs and eager, prompts of 150 and 300 tokens among its 4) and the 35b shape's oracle saw 0 outputs differ.
# On by default since; SPECDEC_MOE_GROUPED_BMM=0 gives the loop back. Not timed on the CPU. A forward is grouped
# GROUPED_TOKENS tokens at a time (each expert's rows padded to the chunk's busiest expert: memory bounded by
# experts x chunk x hidden), a chunk whose padding would exceed GROUPED_WASTE times its pairs by the loop.
GROUPED_BMM = env.switch("SPECDEC_MOE_GROUPED_BMM")
GROUPED_TOKENS = 1024
GROUPED_WASTE = 8


class Experts(nn.Module):
    """``E`` gated-MLP experts stored as 3-D tensors: ``down(act(gate(x)) * up(x))``, ``act`` SiLU
    (SwiGLU, Qwen) unless given (Gemma 4: GELU-tanh).

    ``shard``: the module holds experts ``rows.start .. rows.stop`` (``rows``, an even split of
    ``num_experts``); :meth:`partial` is this rank's share of the output, :meth:`forward` the
    whole output (the shares summed by one all-reduce).
    """

    # Forwards of up to this many rows (every decode and verify step, padded or not), and every
    # forward inside a CUDA-graph capture, take a static path: no host sync, graph-safe, and
    # per-row arithmetic that does not depend on the other rows' experts. Longer eager forwards
    # (prefill) group tokens by expert, which reads the counts on the host.
    gather_max_rows = 16

    def __init__(self, num_experts: int, hidden: int, inter: int, act=F.silu, shard: Shard | None = None):
        super().__init__()
        self.num_experts = num_experts
        self.act = act
        self.shard = shard
        self.rows = None if shard is None else even_split(num_experts, shard, "num_experts")
        local = num_experts if shard is None else self.rows.size
        if shard is not None:
            self.tp_slices = {"gate_up_proj": self.rows, "down_proj": self.rows}
        self.gate_up_proj = nn.Parameter(torch.empty(local, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(local, hidden, inter))

    def static_form(self, t: int, live: torch.Tensor | None, x: torch.Tensor) -> bool:
        """Whether a forward of ``t`` rows takes the static forms (no host sync, graph-safe): a step of at most
        ``gather_max_rows`` rows, a static step (``live`` given: its real rows) or a CUDA-graph capture. A static step
        takes them whether captured or not, so that ``--no-cuda-graphs`` computes what the graphs compute (a static
        prefill chunk wider than 16 rows took the grouped form eagerly and the dense one captured: device_check's random
        Gemma 4 decoded other tokens in the two modes on 2 of 4 prompts, H100, 2026-12-06 (eleventh))."""
        return (t <= self.gather_max_rows or live is not None
                or (x.is_cuda and torch.cuda.is_current_stream_capturing()))

    def block_rows(self, top_k: int) -> int:
        """The rows a sequence up to which :meth:`block_kernels_run`'s shape limits hold for every forward: at most
        ``gather_max_rows`` rows and one pair an expert (a row-exact target's steps stay within it)."""
        return min(self.gather_max_rows, self.gate_up_proj.shape[0] // top_k)

    def block_kernels_run(self, x: torch.Tensor, top_k: int, live: torch.Tensor | None) -> bool:
        """Whether a whole MoE block's step over these experts may run :func:`~specdec.models.expert_kernel.moe`:
        the kernels on (``SPECDEC_FUSED_MOE``) and usable (CUDA, this activation), every expert here (no expert
        parallelism), at most one pair an expert, a static step (:meth:`static_form`), no gradients. The block asks
        the rest (a shared expert's shape, the router's layout)."""
        t = x.shape[0]
        return (expert_kernel.FUSED_MOE and self.rows is None and expert_kernel.usable(x, self.act)
                and t * top_k <= self.gate_up_proj.shape[0] and self.static_form(t, live, x)
                and not (torch.is_grad_enabled() and self.gate_up_proj.requires_grad))

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
                live: torch.Tensor | None = None) -> torch.Tensor:
        """``x [T, H]``, chosen experts ``idx [T, k]`` with ``weights [T, k]`` -> ``[T, H]``. ``live``: a
        static step's real rows (``StepContext.live``), whose padding rows the expert kernel skips."""
        out = self.partial(x, idx, weights, live)
        return out if self.shard is None else self.shard.all_reduce(out)

    def partial(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
                live: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's share of :meth:`forward` (all of it without a shard): the pairs whose
        expert it holds, ``[T, H]``, not yet summed over ranks."""
        t, k = idx.shape
        if self.static_form(t, live, x):
            # one GEMV a pair, in place (CUDA): up to one pair an expert (a single sequence's steps); a batch
            # of many more pairs would read experts many times over, where the dense form reads each once
            if self.rows is None and t * k <= self.gate_up_proj.shape[0] and expert_kernel.usable(x, self.act):
                y = expert_kernel.pairs(x, idx, self.gate_up_proj, self.down_proj, live, gelu=self.act is gelu_tanh)
                return (y * weights[..., None]).sum(1)
            mine = None
            if self.rows is not None:  # other ranks' pairs: computed with local expert 0, then dropped
                idx = idx - self.rows.start
                mine = (idx >= 0) & (idx < self.rows.size)
                idx = idx.masked_fill(~mine, 0)
            # Two static forms; which one depends only on the shape, so a step's rows never see
            # each other. Gathering copies each (token, expert) pair's weights (~3 x the pair's
            # bytes moved); running every local expert on every row reads each expert once. A
            # padded 16-row step routes 128 pairs (top 8): on 128-256 experts the dense form moves
            # 1.5-3x fewer bytes, and under expert parallelism it is the form that divides the
            # experts' work across ranks. A 1-row decode (8 pairs) gathers.
            dense = 3 * t * k > self.gate_up_proj.shape[0]
            y = self._dense(x, idx) if dense else self._gather(x, idx)  # [T, k, H]
            y = y * weights[..., None]
            if mine is not None:
                y = y.masked_fill(~mine[..., None], 0)
            return y.sum(1)
        if GROUPED_BMM:
            outs = [self._grouped_bmm(x[i:i + GROUPED_TOKENS], idx[i:i + GROUPED_TOKENS], weights[i:i + GROUPED_TOKENS])
                    for i in range(0, t, GROUPED_TOKENS)]
            return outs[0] if len(outs) == 1 else torch.cat(outs)
        return self._loop(x, idx, weights)

    def _loop(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """:meth:`partial`'s long eager forwards, one expert at a time (its pairs gathered, two GEMMs, added back)."""
        k = idx.shape[1]
        out = torch.zeros_like(x)
        flat = idx.reshape(-1)
        order = flat.argsort()
        token = order // k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # one host sync
        first = 0 if self.rows is None else self.rows.start
        pos = sum(counts[:first])  # pairs of lower experts (other ranks'), sorted before ours
        for e in range(first, first + self.gate_up_proj.shape[0]):
            n = counts[e]
            if n == 0:
                continue
            rows, sel = token[pos:pos + n], order[pos:pos + n]
            gate, up = linear(x[rows], self.gate_up_proj[e - first]).chunk(2, dim=-1)
            y = linear(self.act(gate) * up, self.down_proj[e - first]) * weights.reshape(-1)[sel, None]
            out.index_add_(0, rows, y)
            pos += n
        return out

    def _grouped_bmm(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """:meth:`partial`'s long eager forwards (prefill) as two batched GEMMs over this rank's experts instead of a
        loop of ~7 kernels an expert: each expert's pairs gathered into ``[E, cap, H]`` (``cap``: the most pairs an
        expert got; the rest zero rows), ``bmm`` with gate/up, the activation, ``bmm`` with down, each pair's row
        weighted and added to its token (``GROUPED_BMM``)."""
        k = idx.shape[1]
        first = 0 if self.rows is None else self.rows.start
        local = self.gate_up_proj.shape[0]
        flat = idx.reshape(-1) - first
        pair = torch.nonzero((flat >= 0) & (flat < local)).flatten()  # this rank's pairs
        e = flat[pair]
        order = torch.argsort(e, stable=True)
        pair, e = pair[order], e[order]
        counts = torch.bincount(e, minlength=local)
        cap = int(counts.max()) if pair.numel() else 0  # one host sync
        if local * cap > GROUPED_WASTE * pair.numel():  # routing so skewed that the padded rows would dwarf the pairs
            return self._loop(x, idx, weights)
        if cap == 0:
            return torch.zeros_like(x)
        slot = torch.arange(pair.numel(), device=x.device) - (torch.cumsum(counts, 0) - counts)[e]
        token = pair // k
        buf = x.new_zeros(local, cap, x.shape[-1])
        buf[e, slot] = x[token]
        gate, up = torch.bmm(buf, self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)  # [E, cap, I] each
        y = torch.bmm(self.act(gate) * up, self.down_proj.transpose(1, 2))  # [E, cap, H]
        # each pair's row into its own place, then a token's k rows summed in order: no index_add_ over repeated tokens,
        # whose CUDA atomics add in any order (the same prompt prefilled to other bits run to run)
        ys = x.new_zeros(idx.numel(), x.shape[-1])
        ys[pair] = y[e, slot] * weights.reshape(-1)[pair, None]
        return ys.view(*idx.shape, -1).sum(1)

    def _gather(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Each pair's output ``[T, k, H]`` from its expert's gathered weights (one GEMV a pair)."""
        t, k = idx.shape
        flat = idx.reshape(-1)
        xs = x.repeat_interleave(k, dim=0)[:, :, None]  # [T*k, H, 1]
        gate, up = torch.bmm(self.gate_up_proj[flat], xs)[..., 0].chunk(2, dim=-1)
        return torch.bmm(self.down_proj[flat], (self.act(gate) * up)[:, :, None])[..., 0].view(t, k, -1)

    def _dense(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Every local expert on every row (``[E, T, H]``), then each pair's row picked out."""
        gate, up = torch.matmul(x, self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)  # [E, T, I] each
        y = torch.matmul(self.act(gate) * up, self.down_proj.transpose(1, 2))  # [E, T, H]
        return y[idx, torch.arange(idx.shape[0], device=idx.device)[:, None]]  # [T, k, H]

class SparseMoeBlock(nn.Module):
    """Top-k routed experts (fp32 softmax router, weights renormalised over the top k) plus a
    sigmoid-gated shared expert. See the module docstring for the parameter names and for what
    a ``shard`` splits."""

    def __init__(self, hidden: int, moe_intermediate: int, shared_intermediate: int, num_experts: int, top_k: int,
                 shard: Shard | None = None):
        super().__init__()
        if shard is not None and shared_intermediate and shared_intermediate < shard.world:
            raise ConfigError(f"shared_expert_intermediate_size={shared_intermediate} cannot be split across "
                              f"{shard.world} tensor-parallel ranks")
        self.top_k = top_k
        self.shard = shard
        self.gate = Linear(hidden, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden, moe_intermediate, shard=shard)
        self.shared_expert = SwiGLU(hidden, shared_intermediate, shard=shard) if shared_intermediate else None
        self.shared_expert_gate = Linear(hidden, 1, bias=False) if shared_intermediate else None
        self._router = None  # fuse(): the router and the shared gate as one weight

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, H]`` -> (expert ids ``[T, k]``, weights ``[T, k]`` in ``x``'s dtype)."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        top, idx = torch.topk(probs, self.top_k, dim=-1)
        return idx, (top / top.sum(-1, keepdim=True)).to(x.dtype)

    def _fused_ready(self, x: torch.Tensor, live: torch.Tensor | None = None) -> bool:
        """Whether :func:`~specdec.models.expert_kernel.moe` runs this step: a static step (as
        :meth:`Experts.partial` takes one) on CUDA within the pair kernel's limit, no gradients, and a
        shared expert (if any) without biases and as wide as the routed experts."""
        return self.experts.block_kernels_run(x, self.top_k, live) and self._shared_fits()

    def _shared_fits(self) -> bool:
        """No shared expert, or one the MoE kernels take: no biases, as wide as the routed experts."""
        se = self.shared_expert
        return se is None or (se.gate_proj.bias is None and se.down_proj.bias is None
                              and 2 * se.gate_proj.out_features == self.experts.gate_up_proj.shape[1])

    def fused_rows(self) -> int:
        """The rows a sequence up to which every forward (captured or eager) of this block on CUDA takes
        :func:`~specdec.models.expert_kernel.moe` (a row's bits its own at any row count; :meth:`_fused_ready`'s
        shape limits), 0 where it never does (expert parallelism, GELU experts, the kernels off, a shared expert
        it cannot take): a row-exact target's steps must stay within it."""
        ex = self.experts
        if not (expert_kernel.FUSED_MOE and expert_kernel.ENABLED and self.shard is None and ex.act is F.silu
                and self._shared_fits()):
            return 0
        return ex.block_rows(self.top_k)

    def fuse(self) -> None:
        """The router and the shared expert's gate as one weight ``[E + 1, H]`` (see
        :func:`~specdec.models.layers.fuse_linears`): one GEMM gives the kernels every logit; call after loading."""
        if self._router is None and self.shared_expert_gate is not None and self.shard is None:
            self._router = fuse_linears(self.gate, self.shared_expert_gate)

    def _router_weight(self) -> torch.Tensor:
        """The router's weight for the kernels, the shared expert's gate as its last row (if any): the fused
        weight where the model fused it at load, else a concatenated copy kept per version of the weights."""
        if self.shared_expert_gate is None:
            return self.gate.weight
        if self._router is not None:
            return self._router[0]
        return derived_weight(self, "_router_cat", (self.gate.weight, self.shared_expert_gate.weight),
                              lambda r, g: torch.cat([r, g]))

    def _shared_weights(self):
        """The shared expert's (gate/up ``[2I, H]``, down ``[H, I]``) for the kernels: its fused weight where
        the model fused it at load, else a concatenated copy kept per version of the weights (an MTP block
        loaded on its own)."""
        se = self.shared_expert
        if se is None:
            return None
        gate_up = se._fused[0] if se._fused is not None else derived_weight(
            self, "_shared_gate_up", (se.gate_proj.weight, se.up_proj.weight), lambda g, u: torch.cat([g, u]))
        return gate_up, se.down_proj.weight

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor, norm, live: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + delta, self(norm(x + delta), live))`` for the layer's post-mixer ``norm`` (an ``RMSNorm``): where
        the MoE kernels take the step, the add, the norm and the router's GEMM as one kernel
        (:func:`~specdec.models.expert_kernel.norm_router`, :data:`~specdec.models.expert_kernel.NORM_ROUTER`), so
        that every step those kernels route takes its logits from it; elsewhere ``norm.add`` and :meth:`forward`."""
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        live = live if x.dim() == 2 else None  # batched steps route their rows flattened, as forward does
        if (expert_kernel.NORM_ROUTER and self.shard is None and fused_ops.usable(x) and delta.shape == shape
                and delta.dtype == x.dtype and self._fused_ready(rows, live)
                and not (torch.is_grad_enabled() and norm.weight.requires_grad)):
            router = self._router_weight()
            s, h, logits = expert_kernel.norm_router(rows.contiguous(), delta.reshape(-1, shape[-1]).contiguous(),
                                                     norm.fp32_scale(), norm.eps, router, live)
            out = expert_kernel.moe(h, router, self.top_k, self.experts.gate_up_proj, self.experts.down_proj,
                                    self._shared_weights(), live, logits=logits)
            return s.view(shape), out.view(shape)
        x, h = norm.add(x, delta)
        return x, self(h, live)

    def forward(self, x: torch.Tensor, live: torch.Tensor | None = None) -> torch.Tensor:
        """``x [T, H]`` (or batched ``[b, T, H]``); ``live``: a static step's real rows (see :class:`Experts`)."""
        if x.dim() > 2:  # batched steps [b, T, H]: tokens are independent, route them flattened
            return self.forward(x.reshape(-1, x.shape[-1])).view(x.shape)
        if self.shard is None and self._fused_ready(x, live):  # CUDA static steps: the router's GEMM and three kernels
            return expert_kernel.moe(x, self._router_weight(), self.top_k, self.experts.gate_up_proj,
                                     self.experts.down_proj, self._shared_weights(), live)
        idx, w = self.route(x)
        if self.shard is None:
            out = self.experts(x, idx, w, live)
            if self.shared_expert is not None:
                out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
            return out
        out = self.experts.partial(x, idx, w)
        if self.shared_expert is not None:
            se = self.shared_expert  # its block of the intermediate, the row-parallel down_proj unreduced
            part = linear(se.inner(x), se.down_proj.weight)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * part
        return self.shard.all_reduce(out)


_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def stacked_experts_view(source: TensorSource) -> SourceView:
    """``source`` with every ``X.experts.{e}.{gate,up,down}_proj.weight`` family replaced by
    ``X.experts.gate_up_proj`` ``[E, 2I, H]`` and ``X.experts.down_proj`` ``[E, H, I]``.

    Every other tensor passes through unchanged (the ``mtp.*`` experts are stacked too).
    Raises :class:`CheckpointError` naming the first missing expert tensor of a family.
    """
    infos = source.infos()
    families: dict[str, dict[tuple[int, str], str]] = {}
    tensors: dict[str, ViewTensor] = {}
    for name in infos:
        m = _PER_EXPERT.match(name)
        if m:
            families.setdefault(m["prefix"], {})[(int(m["e"]), m["proj"])] = name
        else:
            tensors[name] = passthrough(source, name)
    for prefix, fam in families.items():
        n = max(e for e, _ in fam) + 1
        for e in range(n):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                if (e, proj) not in fam:
                    raise CheckpointError(f"{source.path}: missing tensor '{prefix}.{e}.{proj}.weight' "
                                          f"(the checkpoint holds other experts of '{prefix}')")
        gate_names = [fam[(e, "gate_proj")] for e in range(n)]
        up_names = [fam[(e, "up_proj")] for e in range(n)]
        down_names = [fam[(e, "down_proj")] for e in range(n)]
        inter, hidden = infos[gate_names[0]].shape
        for names, want in ((gate_names + up_names, (inter, hidden)), (down_names, (hidden, inter))):
            for nm in names:
                if infos[nm].shape != want:
                    raise CheckpointError(f"{infos[nm].file}: tensor '{nm}' has shape {list(infos[nm].shape)}, "
                                          f"expected {list(want)} like the other experts of '{prefix}'")
        tensors[f"{prefix}.gate_up_proj"] = derived(
            source, f"{prefix}.gate_up_proj", gate_names + up_names, (n, 2 * inter, hidden), _stack_gate_up,
            part=_expert_rows(source, f"{prefix}.gate_up_proj", list(zip(gate_names, up_names)), _stack_gate_up))
        tensors[f"{prefix}.down_proj"] = derived(
            source, f"{prefix}.down_proj", down_names, (n, hidden, inter), _stack,
            part=_expert_rows(source, f"{prefix}.down_proj", [(d,) for d in down_names], _stack))
    return SourceView(source, tensors)


def _stack(*ts: torch.Tensor) -> torch.Tensor:
    return torch.stack(ts)


def _stack_gate_up(*ts: torch.Tensor) -> torch.Tensor:
    """gate_0 .. gate_{n-1}, up_0 .. up_{n-1} -> ``[n, 2I, H]``, each expert's gate rows first."""
    n = len(ts) // 2
    return torch.stack([torch.cat([ts[e], ts[n + e]], dim=0) for e in range(n)])


def _expert_rows(source: TensorSource, name: str, per_expert: list[tuple[str, ...]], fn):
    """A slice reader for a stacked tensor: along dim 0 (a rank's experts, tensor parallelism) it
    reads only those experts' tensors; along another dim it reads the whole and narrows."""
    def read_slice(dim: int, start: int, stop: int) -> torch.Tensor:
        if dim != 0:
            whole = fn(*(source.get(s, torch.float32) for group in zip(*per_expert) for s in group))
            return whole.narrow(dim, start, stop - start).contiguous()
        chosen = per_expert[start:stop]
        return fn(*(source.get(s, torch.float32) for group in zip(*chosen) for s in group))
    return read_slice
