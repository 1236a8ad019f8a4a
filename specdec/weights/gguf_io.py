"""Reading GGUF files through the ``gguf`` package: metadata, tensor table, dequantization.

Names stay llama.cpp's here; each architecture maps them to HF names (see ``models/``).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from ..errors import CheckpointError
from .source import TensorInfo

try:
    import gguf
    from gguf import GGMLQuantizationType as QT
except ImportError as e:  # pragma: no cover - a hard dependency
    raise ImportError("specdec needs the 'gguf' package: pip install gguf") from e

# Types we dequantize (the gguf package's numpy kernels); others are rejected by name.
SUPPORTED = {
    QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1,
    QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K,
}


class GGUFSource:
    """One GGUF file: ``metadata`` (a plain dict) and its tensors."""

    def __init__(self, path: str):
        self.path = path
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: file not found")
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            magic = fh.read(4)
        if magic != b"GGUF":
            raise CheckpointError(f"{path}: not a GGUF file (magic {magic!r})")
        try:
            self._reader = gguf.GGUFReader(path, "r")
        except Exception as e:  # the reader raises ValueError/IndexError/... on damaged files
            raise CheckpointError(f"{path}: truncated or corrupt GGUF ({type(e).__name__}: {e})") from e
        self.metadata: dict = {}
        for key, fld in self._reader.fields.items():
            if key.startswith("GGUF."):
                continue
            try:
                self.metadata[key] = fld.contents()
            except Exception as e:
                raise CheckpointError(f"{path}: corrupt metadata field '{key}' ({e})") from e
        self._tensors = {}
        self._infos: dict[str, TensorInfo] = {}
        for t in self._reader.tensors:
            end = int(t.data_offset) + int(t.n_bytes)
            if end > size:
                raise CheckpointError(f"{path}: truncated file: tensor '{t.name}' ends at byte {end}, file has {size}")
            qt = QT(int(t.tensor_type))
            shape = tuple(int(s) for s in reversed([int(x) for x in t.shape]))
            self._tensors[t.name] = t
            self._infos[t.name] = TensorInfo(t.name, shape, qt.name, True, path)

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not arch:
            raise CheckpointError(f"{self.path}: metadata has no 'general.architecture'")
        return str(arch)

    def infos(self) -> dict[str, TensorInfo]:
        return self._infos

    def quant_types(self) -> dict[str, int]:
        """How many tensors of each storage type the file holds."""
        out: dict[str, int] = {}
        for info in self._infos.values():
            out[info.dtype] = out.get(info.dtype, 0) + 1
        return out

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        t = self._tensors[name]
        qt = QT(int(t.tensor_type))
        if qt not in SUPPORTED:
            raise CheckpointError(f"{self.path}: tensor '{name}' has quantization type {qt.name}, which specdec cannot dequantize")
        shape = self._infos[name].shape
        try:
            if qt in (QT.F32, QT.F16):
                arr = np.asarray(t.data)
                out = torch.from_numpy(arr.astype(np.float32, copy=False).reshape(shape).copy())
            elif qt == QT.BF16:
                raw = np.ascontiguousarray(t.data).view(np.uint16).astype(np.uint32) << 16
                out = torch.from_numpy(raw.view(np.float32).reshape(shape).copy())
            else:
                arr = gguf.quants.dequantize(np.asarray(t.data), qt)
                out = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32).reshape(shape))
        except (ValueError, IndexError) as e:
            raise CheckpointError(f"{self.path}: cannot decode tensor '{name}' ({qt.name}, shape {list(shape)}): {e}") from e
        return out.to(dtype)
