"""A read-only view of a checkpoint whose tensors are renamed, hidden or derived from others.

Architectures use it to present one checkpoint layout to the strict loader whatever the file
holds: per-expert tensors stacked into one, llama.cpp names and conventions turned into HF
ones, tensors another component owns (an MTP block) left out. Nothing is read until ``get``;
the underlying file is never modified, so a view is safe to build any number of times.

A tensor may also know how to read a slice of itself (``get_slice``, a tensor-parallel rank's
part): passed-through tensors read the slice from a source that can, stacked experts read only
the chosen experts (:func:`~specdec.models.moe.stacked_experts_view`); any other tensor is read
whole, then narrowed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from ..weights.source import TensorInfo, TensorSource


@dataclass(frozen=True)
class ViewTensor:
    """One tensor of a view: what it looks like, and how to read it (fp32, CPU); ``part(dim,
    start, stop)``, when set, reads entries ``start:stop`` along ``dim`` without the rest (a
    tensor-parallel rank's slice)."""

    info: TensorInfo
    read: Callable[[], torch.Tensor]
    part: Callable[[int, int, int], torch.Tensor] | None = None


class SourceView:
    """A :class:`~specdec.weights.source.TensorSource` built from another one."""

    def __init__(self, base: TensorSource, tensors: dict[str, ViewTensor]):
        self.base = base
        self.path = base.path
        self._tensors = tensors
        self.metadata = getattr(base, "metadata", None)

    def infos(self) -> dict[str, TensorInfo]:
        return {n: t.info for n, t in self._tensors.items()}

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        return self._tensors[name].read().to(dtype)

    def get_slice(self, name: str, dim: int, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Entries ``start:stop`` along ``dim`` of one tensor: read alone where the view knows how
        (:attr:`ViewTensor.part`), else derived whole and sliced."""
        t = self._tensors[name]
        if t.part is not None:
            out = t.part(dim, start, stop)
            want = t.info.shape[:dim] + (stop - start,) + t.info.shape[dim + 1:]
            if tuple(out.shape) != want:
                raise AssertionError(f"slice of '{name}' has shape {list(out.shape)}, expected {list(want)}")
            return out.to(dtype)
        return t.read().narrow(dim, start, stop - start).contiguous().to(dtype)

    def without(self, hidden: Callable[[str], bool]) -> "SourceView":
        """The same view less the tensors whose name ``hidden`` accepts."""
        return SourceView(self.base, {n: t for n, t in self._tensors.items() if not hidden(n)})


def passthrough(base: TensorSource, name: str) -> ViewTensor:
    """``name`` exactly as ``base`` holds it (slices read from ``base`` alone where it can)."""
    return ViewTensor(base.infos()[name], lambda: base.get(name, torch.float32),
                      lambda dim, start, stop: base_slice(base, name, dim, start, stop))


def base_slice(base: TensorSource, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
    """Entries ``start:stop`` along ``dim`` of ``base``'s tensor, fp32: read alone where ``base``
    offers ``get_slice``, else read whole and sliced."""
    get_slice = getattr(base, "get_slice", None)
    if get_slice is not None:
        return get_slice(name, dim, start, stop, torch.float32)
    return base.get(name, torch.float32).narrow(dim, start, stop - start).contiguous()


def derived(base: TensorSource, name: str, sources: Iterable[str], shape: tuple[int, ...],
            fn: Callable[..., torch.Tensor], part: Callable[[int, int, int], torch.Tensor] | None = None) -> ViewTensor:
    """A tensor ``fn(*tensors)`` computed from ``sources`` of ``base`` (read as fp32); ``part``,
    when given, reads a slice of the result alone (see :class:`ViewTensor`).

    Its storage dtype is reported as that of the first source, or ``MIXED`` when they differ.
    """
    sources = list(sources)
    infos = [base.infos()[s] for s in sources]
    dtypes = {i.dtype for i in infos}
    info = TensorInfo(name, tuple(int(s) for s in shape), dtypes.pop() if len(dtypes) == 1 else "MIXED",
                      all(i.is_float for i in infos), infos[0].file)

    def read() -> torch.Tensor:
        out = fn(*(base.get(s, torch.float32) for s in sources))
        if tuple(out.shape) != info.shape:
            raise AssertionError(f"derived tensor '{name}' has shape {list(out.shape)}, declared {list(info.shape)}")
        return out

    return ViewTensor(info, read, part)
