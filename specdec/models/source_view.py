"""A read-only view of a checkpoint whose tensors are renamed, hidden or derived from others.

Architectures use it to present one checkpoint layout to the strict loader whatever the file
holds: per-expert tensors stacked into one, llama.cpp names and conventions turned into HF
ones, tensors another component owns (an MTP block) left out. Nothing is read until ``get``;
the underlying file is never modified, so a view is safe to build any number of times.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from ..weights.source import TensorInfo, TensorSource


@dataclass(frozen=True)
class ViewTensor:
    """One tensor of a view: what it looks like, and how to read it (fp32, CPU)."""

    info: TensorInfo
    read: Callable[[], torch.Tensor]


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

    def without(self, hidden: Callable[[str], bool]) -> "SourceView":
        """The same view less the tensors whose name ``hidden`` accepts."""
        return SourceView(self.base, {n: t for n, t in self._tensors.items() if not hidden(n)})


def passthrough(base: TensorSource, name: str) -> ViewTensor:
    """``name`` exactly as ``base`` holds it."""
    return ViewTensor(base.infos()[name], lambda: base.get(name, torch.float32))


def derived(base: TensorSource, name: str, sources: Iterable[str], shape: tuple[int, ...],
            fn: Callable[..., torch.Tensor]) -> ViewTensor:
    """A tensor ``fn(*tensors)`` computed from ``sources`` of ``base`` (read as fp32).

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

    return ViewTensor(info, read)
