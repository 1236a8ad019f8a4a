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
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import CheckpointError
from ..weights.source import TensorSource
from .layers import SwiGLU
from .source_view import SourceView, ViewTensor, derived, passthrough


class Experts(nn.Module):
    """``E`` gated-MLP experts stored as 3-D tensors: ``down(act(gate(x)) * up(x))``, ``act`` SiLU
    (SwiGLU, Qwen) unless given (Gemma 4: GELU-tanh)."""

    # Forwards of up to this many rows (every decode and verify step, padded or not) gather each
    # (token, expert) pair's weights: no host sync, graph-safe, and one kernel path whose
    # per-row arithmetic does not depend on the row or on the other rows' experts, with or without
    # CUDA graphs. Longer forwards (prefill) group tokens by expert.
    gather_max_rows = 16

    def __init__(self, num_experts: int, hidden: int, inter: int, act=F.silu):
        super().__init__()
        self.num_experts = num_experts
        self.act = act
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``x [T, H]``, chosen experts ``idx [T, k]`` with ``weights [T, k]`` -> ``[T, H]``."""
        t, k = idx.shape
        # Inside a CUDA-graph capture always gather: the grouped path reads counts on the host.
        if t <= self.gather_max_rows or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            flat = idx.reshape(-1)
            xs = x.repeat_interleave(k, dim=0)[:, :, None]  # [T*k, H, 1]
            gate, up = torch.bmm(self.gate_up_proj[flat], xs)[..., 0].chunk(2, dim=-1)
            y = torch.bmm(self.down_proj[flat], (self.act(gate) * up)[:, :, None])[..., 0]  # [T*k, H]
            return (y.view(t, k, -1) * weights[..., None]).sum(1)
        out = torch.zeros_like(x)
        flat = idx.reshape(-1)
        order = flat.argsort()
        token = order // k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # one host sync
        pos = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows, sel = token[pos:pos + n], order[pos:pos + n]
            gate, up = F.linear(x[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(self.act(gate) * up, self.down_proj[e]) * weights.reshape(-1)[sel, None]
            out.index_add_(0, rows, y)
            pos += n
        return out


class SparseMoeBlock(nn.Module):
    """Top-k routed experts (fp32 softmax router, weights renormalised over the top k) plus a
    sigmoid-gated shared expert. See the module docstring for the parameter names."""

    def __init__(self, hidden: int, moe_intermediate: int, shared_intermediate: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden, moe_intermediate)
        self.shared_expert = SwiGLU(hidden, shared_intermediate) if shared_intermediate else None
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if shared_intermediate else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, H]`` -> (expert ids ``[T, k]``, weights ``[T, k]`` in ``x``'s dtype)."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        top, idx = torch.topk(probs, self.top_k, dim=-1)
        return idx, (top / top.sum(-1, keepdim=True)).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx, w = self.route(x)
        out = self.experts(x, idx, w)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


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
            source, f"{prefix}.gate_up_proj", gate_names + up_names, (n, 2 * inter, hidden),
            lambda *ts, n=n: torch.stack([torch.cat([ts[e], ts[n + e]], dim=0) for e in range(n)]))
        tensors[f"{prefix}.down_proj"] = derived(
            source, f"{prefix}.down_proj", down_names, (n, hidden, inter), lambda *ts: torch.stack(ts))
    return SourceView(source, tensors)
