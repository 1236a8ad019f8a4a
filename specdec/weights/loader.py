"""Strict loading of a checkpoint into a module built on the meta device.

Missing, unexpected, mis-shaped and non-float tensors are errors naming the tensor and file.
Tensors are converted explicitly to the run dtype (norm statistics are computed in fp32 by the
layers themselves, so weights of one dtype suffice).
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn
from tqdm.auto import tqdm

from ..errors import CheckpointError
from ..parallel.tp import Blocks, Slice
from .source import TensorSource

# hf_name, tensor -> tensor: per-architecture fix-ups (q/k un-permute, norm shifts ...)
Transform = Callable[[str, torch.Tensor], torch.Tensor]


def load_into(
    module: nn.Module,
    source: TensorSource,
    names: dict[str, str],
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    transform: Transform | None = None,
    ignore: Iterable[str] = (),
    optional: Iterable[str] = (),
    desc: str = "loading",
    slices: dict[str, Slice | Blocks] | None = None,
) -> None:
    """Load ``source`` into ``module`` strictly.

    ``names`` maps every checkpoint tensor name the architecture knows to the module's
    parameter name. Checkpoint tensors not in ``names`` and not matched by ``ignore`` (exact
    names) are an error, as are parameters no tensor fills, except those in ``optional``.
    ``slices`` (tensor parallelism, :func:`specdec.parallel.tp.param_slices`): parameters that
    hold a slice of their checkpoint tensor; only that slice is read where the source can
    (``get_slice``), and ``transform`` then sees the slice (the transforms of the families that
    split act per head or per row, so a block of heads transforms alike).
    """
    slices = slices or {}
    infos = source.infos()
    ignore = set(ignore)
    optional = set(optional)
    expected = dict(module.state_dict(keep_vars=True))
    # a tensor is unexpected when the name map does not know it or maps it to no parameter
    unexpected = sorted(n for n in infos if n not in ignore and (n not in names or names[n] not in expected))
    if unexpected:
        raise CheckpointError(
            f"{source.path}: unexpected tensor(s) {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''} "
            f"(not parameters of {type(module).__name__})"
        )
    filled = {names[n]: n for n in infos if n in names}
    missing = sorted(p for p in expected if p not in filled and p not in optional)
    if missing:
        # name the checkpoint tensors the user would look for (llama.cpp names in a GGUF)
        wanted: dict[str, str] = {}
        for cname, pname in names.items():
            wanted.setdefault(pname, cname)
        shown = [f"{wanted[p]} (for {p})" if wanted.get(p, p) != p else p for p in missing[:8]]
        raise CheckpointError(
            f"{source.path}: missing tensor(s) {shown}{' ...' if len(missing) > 8 else ''}"
        )
    for pname, cname in filled.items():
        info = infos[cname]
        want = tuple(expected[pname].shape)
        if pname in slices:  # the checkpoint holds the whole tensor
            s = slices[pname]
            assert want[s.dim] == s.size, f"{pname}: parameter of {want[s.dim]} along {s.dim}, slice of {s.size}"
            want = want[:s.dim] + (s.full,) + want[s.dim + 1:]
        if not info.is_float:
            raise CheckpointError(f"{info.file}: tensor '{cname}' has dtype {info.dtype}; a float type is required")
        if info.shape != want:
            raise CheckpointError(f"{info.file}: tensor '{cname}' has shape {list(info.shape)}, expected {list(want)}")
    device = torch.device(device)
    state: dict[str, torch.Tensor] = {}
    show = len(filled) > 20  # a bar on a terminal (tqdm hides it elsewhere) for real models
    for pname, cname in tqdm(sorted(filled.items()), desc=desc, unit="tensor", disable=True if not show else None, leave=False):
        s = slices.get(pname)
        t = source.get(cname, torch.float32) if s is None else read_slice(source, cname, s)
        if transform is not None:
            t = transform(pname, t)
        if s is not None and s.size > t.shape[s.dim]:  # zero rows: vocabulary padding
            pad = list(t.shape)
            pad[s.dim] = s.size - t.shape[s.dim]
            t = torch.cat([t, t.new_zeros(pad)], dim=s.dim)
        state[pname] = t.to(device=device, dtype=dtype)
    # Buffers that are not in checkpoints (rope tables, ...) are materialised by the module.
    module.load_state_dict(state, strict=False, assign=True)
    still_meta = [n for n, p in module.state_dict().items() if p.is_meta and n not in optional]
    if still_meta:
        raise CheckpointError(f"{source.path}: parameters left unloaded: {still_meta[:8]}")


def read_slice(source: TensorSource, name: str, s: Slice | Blocks) -> torch.Tensor:
    """The entries of ``s`` along ``s.dim`` of one tensor (a :class:`Blocks`: its blocks
    concatenated), fp32: each block read alone where the source offers ``get_slice``, else the
    tensor read whole (once) and sliced."""
    get_slice = getattr(source, "get_slice", None)
    if get_slice is not None:
        parts = [get_slice(name, s.dim, a, b, torch.float32) for a, b in s.ranges]
    else:
        whole = source.get(name, torch.float32)
        parts = [whole.narrow(s.dim, a, b - a) for a, b in s.ranges]
    return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim=s.dim)


def check_layer_count(n_layers: int, n_tensors: int, path: str) -> None:
    """Refuse a config whose layer count the checkpoint cannot hold (every layer has tensors of
    its own) before building a module per layer: a corrupt count would otherwise spend minutes
    building millions of layers before the strict load names the missing tensors."""
    if n_layers > n_tensors:
        raise CheckpointError(f"{path}: the config declares {n_layers} layers but the checkpoint holds only "
                              f"{n_tensors} tensors")
