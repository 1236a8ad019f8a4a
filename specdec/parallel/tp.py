"""Tensor parallelism across the devices of one host: a rank's view of the process group, and
the pieces that split a decoder's matrices across ranks (Megatron's split).

- column-parallel (a rank holds a block of output rows, no communication): q/k/v, gate/up;
  attention heads split evenly (a gated head's query and gate rows together), KV heads split
  too, or replicated where there are fewer than ranks (each rank keeps the one KV head its
  query heads read); Gated DeltaNet key heads with the value heads each serves (in-projections,
  conv channels, per-head decay and norm, so the recurrent and conv caches hold them alone);
- row-parallel (a block of input columns): o_proj, down_proj, DeltaNet's out_proj; the partial
  products are summed by one all-reduce, the bias added once after it;
- vocab-parallel embedding (a block of table rows; ids outside it look up zeros, then an
  all-reduce) and LM head (each rank's logits for its rows, all-gathered, so every rank holds
  the whole ``[T, V]`` fp32 logits).

An all-reduce and an all-gather hand every rank the same bits, so each rank runs the engine
loop identically (same inputs, same logits, same drafts, same accepted lengths) with no
messages beyond those inside the forward. Weights are split at load: a module built for one
rank carries ``tp_slices`` (parameter name -> :class:`Slice` of the checkpoint tensor), which
:func:`param_slices` collects for :func:`specdec.weights.loader.load_into` (or :class:`Blocks`,
several blocks of one tensor, where a fused projection splits part by part).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import env
from ..cpu_linear import Linear, linear
from ..errors import ConfigError


@dataclass(frozen=True)
class Shard:
    """One rank of a tensor-parallel group: ``rank`` of ``world``, its ``device`` ("cpu" or
    "cuda:N"), and the process group (None: the default one)."""

    rank: int
    world: int
    device: str = "cpu"
    group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over ranks, in place; returns it. Small bf16/fp16 tensors on CUDA (a decode
        or verify step's activations) go through symmetric memory's one-shot all-reduce where
        :func:`enable_symmetric_memory` set it up (~8 us against NCCL's ~11.5 us in a CUDA graph on
        two H200s; the same bits as NCCL's sum there, and on every rank), the rest through NCCL
        or gloo."""
        symm = _SYMM.get(self.device)
        if symm is not None and x.dtype == symm[0].dtype and x.numel() <= symm[0].numel() and x.is_cuda:
            buf = symm[0][: x.numel()]
            buf.copy_(x.reshape(-1))
            x.copy_(torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", symm[1]).view_as(x))
            return x
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` (same shape on all) concatenated along ``dim`` in rank order."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim)

    def same_seed(self) -> int:
        """A random seed drawn on rank 0 and shared by all (sampling without a seed)."""
        s = torch.randint(0, 2**62, (1,), dtype=torch.int64) if self.rank == 0 else torch.zeros(1, dtype=torch.int64)
        s = s.to(self.device)
        dist.broadcast(s, src=0, group=self.group)
        return int(s.item())


# device -> (symmetric buffer, group name), set by enable_symmetric_memory (CUDA ranks only)
_SYMM: dict[str, tuple[torch.Tensor, str]] = {}
SYMM_MAX_BYTES = 1 << 20  # one-shot pays for small messages; larger ones (prefill) take NCCL


def enable_symmetric_memory(shard: Shard, dtype: torch.dtype) -> bool:
    """Set up one-shot all-reduces over symmetric memory (P2P loads, no NVLink multicast) for
    ``shard``'s CUDA rank: a collective call, every rank at once. False (NCCL stays) where torch
    lacks it, the GPUs cannot map each other's memory, or ``SPECDEC_SYMM_ALLREDUCE=0``."""

    if not shard.device.startswith("cuda") or not env.switch("SPECDEC_SYMM_ALLREDUCE") or shard.world < 2:
        return False
    try:
        import torch.distributed._symmetric_memory as symm_mem

        group = shard.group or dist.group.WORLD
        buf = symm_mem.empty(SYMM_MAX_BYTES // torch.finfo(dtype).bits * 8, dtype=dtype, device=shard.device)
        symm_mem.rendezvous(buf, group.group_name)
        probe = torch.full((4,), float(shard.rank + 1), dtype=dtype, device=shard.device)
        buf[:4].copy_(probe)
        got = torch.ops.symm_mem.one_shot_all_reduce(buf[:4], "sum", group.group_name)
        ok = bool((got == shard.world * (shard.world + 1) / 2).all())
    except Exception:  # noqa: BLE001 - an older torch, or no P2P between these GPUs: NCCL it is
        ok = False
    flag = torch.tensor([int(ok)], device=shard.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=shard.group)  # all ranks take the same path
    if flag.item():
        _SYMM[shard.device] = (buf, group.group_name)
    return bool(flag.item())


@dataclass(frozen=True)
class Slice:
    """Entries ``start:stop`` along ``dim`` of a checkpoint tensor of ``full`` entries there; the
    parameter holds ``size`` of them (``size > stop - start``: zero rows after, vocab padding)."""

    dim: int
    start: int
    stop: int
    full: int
    size: int

    def along(self, dim: int) -> "Slice":
        return Slice(dim, self.start, self.stop, self.full, self.size)

    def scaled(self, factor: int) -> "Slice":
        """The same block counted in units ``factor`` times finer (heads of ``factor * d`` rows)."""
        return Slice(self.dim, self.start * factor, self.stop * factor, self.full * factor, self.size * factor)

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        return ((self.start, self.stop),)


@dataclass(frozen=True)
class Blocks:
    """Several blocks ``ranges`` along ``dim`` of a checkpoint tensor of ``full`` entries there,
    concatenated in order (a fused projection whose parts are split separately: Gated DeltaNet's
    ``[q | k | v]``). The parameter holds exactly ``size`` entries (no padding)."""

    dim: int
    ranges: tuple[tuple[int, int], ...]
    full: int

    @property
    def size(self) -> int:
        return sum(b - a for a, b in self.ranges)


def even_split(n: int, shard: Shard, what: str) -> Slice:
    """Rows ``n * rank / world ..`` of ``n``: the block of one rank (blocks may differ by one)."""
    if n < shard.world:
        raise ConfigError(f"{what}={n} cannot be split across {shard.world} tensor-parallel ranks")
    start, stop = shard.rank * n // shard.world, (shard.rank + 1) * n // shard.world
    return Slice(0, start, stop, n, stop - start)


def vocab_split(vocab: int, shard: Shard) -> Slice:
    """Equal blocks of ``ceil(V / world)`` rows (the last one zero-padded), so that logits gather
    into equal parts."""
    chunk = -(-vocab // shard.world)
    start, stop = min(vocab, shard.rank * chunk), min(vocab, (shard.rank + 1) * chunk)
    return Slice(0, start, stop, vocab, chunk)


@dataclass(frozen=True)
class HeadSplit:
    heads: int  # query heads of this rank
    kv_heads: int  # KV heads it keeps (one, replicated, where there are fewer KV heads than ranks)
    q: Slice  # rows of q_proj (and columns of o_proj)
    kv: Slice  # rows of k_proj / v_proj


def split_heads(n_heads: int, n_kv: int, head_dim: int, shard: Shard) -> HeadSplit:
    """This rank's query heads and the KV heads they read (GQA groups stay whole or are shared)."""
    w, r = shard.world, shard.rank
    if n_heads % w:
        raise ConfigError(f"num_attention_heads={n_heads} is not divisible by the {w} tensor-parallel ranks")
    if n_kv % w and w % n_kv:
        raise ConfigError(f"num_key_value_heads={n_kv} and {w} tensor-parallel ranks: one must divide the other "
                          "(KV heads are split, or replicated when fewer than ranks)")
    heads, kv = n_heads // w, max(1, n_kv // w)
    q0, kv0 = r * heads, r * n_kv // w  # with n_kv < w, ranks r*w/n_kv .. share KV head r*n_kv//w
    return HeadSplit(heads, kv, Slice(0, q0 * head_dim, (q0 + heads) * head_dim, n_heads * head_dim, heads * head_dim),
                     Slice(0, kv0 * head_dim, (kv0 + kv) * head_dim, n_kv * head_dim, kv * head_dim))


class RowParallelLinear(nn.Linear):
    """A linear layer over a block of input features: partial products summed over ranks
    (one all-reduce), the bias added once after the sum. Parameter names are ``nn.Linear``'s."""

    def __init__(self, in_features: int, out_features: int, bias: bool, shard: Shard):
        super().__init__(in_features, out_features, bias=bias)
        self.shard = shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.shard.all_reduce(linear(x, self.weight))
        return y if self.bias is None else y + self.bias


def row_parallel(in_features: int, out_features: int, bias: bool, shard: Shard | None) -> nn.Linear:
    """``nn.Linear`` on one process, :class:`RowParallelLinear` on a rank."""
    if shard is None:
        return Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, shard)


class VocabParallelEmbedding(nn.Embedding):
    """A block of the embedding table's rows (:func:`vocab_split`); ids outside it contribute
    zeros and the all-reduce fills them in, so every rank gets every row exactly."""

    def __init__(self, vocab: int, dim: int, shard: Shard):
        self.rows = vocab_split(vocab, shard)
        super().__init__(self.rows.size, dim)
        self.shard = shard
        self.tp_slices = {"weight": self.rows}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.rows.start
        outside = (local < 0) | (local >= self.rows.size)
        from ..models.layers import embedding  # (layers imports this module)

        x = embedding(local.masked_fill(outside, 0), self.weight)
        return self.shard.all_reduce(x.masked_fill(outside[..., None], 0))


def vocab_parallel_head(hidden: int, vocab: int, shard: Shard) -> nn.Linear:
    """An untied LM head holding this rank's vocab rows (see :func:`gather_vocab`)."""
    head = Linear(hidden, vocab_split(vocab, shard).size, bias=False)
    head.tp_slices = {"weight": vocab_split(vocab, shard)}
    return head


def gather_vocab(logits: torch.Tensor, shard: Shard, vocab: int) -> torch.Tensor:
    """Each rank's logits ``[..., V/world]`` -> the whole ``[..., V]`` on every rank."""
    return shard.all_gather(logits, dim=-1)[..., :vocab]


def param_slices(module: nn.Module) -> dict[str, Slice | Blocks]:
    """Parameter name -> the :class:`Slice` of its checkpoint tensor, for every sliced parameter
    (parameters not named are replicated: read whole)."""
    out: dict[str, Slice | Blocks] = {}
    for prefix, m in module.named_modules():
        for name, s in getattr(m, "tp_slices", {}).items():
            out[f"{prefix}.{name}" if prefix else name] = s
    return out
