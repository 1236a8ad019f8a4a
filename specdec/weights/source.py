"""The one interface every checkpoint reader offers: names, shapes, dtypes, and tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class TensorInfo:
    """What a checkpoint says about one tensor before it is read.

    ``shape`` is in torch order (rows first). ``dtype`` is the storage type as the file
    names it (``F32``, ``BF16``, ``Q4_K`` ...); ``is_float`` says whether it decodes to floats.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    is_float: bool
    file: str


class TensorSource(Protocol):
    """A read-only view of a checkpoint's tensors."""

    path: str

    def infos(self) -> dict[str, TensorInfo]:
        """All tensors, by name."""
        ...

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Read (and dequantize) one tensor and convert it explicitly to ``dtype`` on the CPU."""
        ...
