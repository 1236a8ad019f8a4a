"""Reading HF safetensors checkpoints (single file or sharded with an index).

The header is parsed and checked here (header length within the file, offsets inside the file,
no overlap, sizes that match shape x dtype) so a truncated or corrupt file is a clear
:class:`CheckpointError` naming the file, not a failure deep inside a later read. The format
has no checksums: a flipped bit inside tensor data cannot be detected and loads as it is.
"""

from __future__ import annotations

import json
import os
import struct

import torch
from safetensors import safe_open

from ..errors import CheckpointError
from .source import TensorInfo

_ST_DTYPES = {
    "F64": (torch.float64, 8, True),
    "F32": (torch.float32, 4, True),
    "F16": (torch.float16, 2, True),
    "BF16": (torch.bfloat16, 2, True),
    "I64": (torch.int64, 8, False),
    "I32": (torch.int32, 4, False),
    "I16": (torch.int16, 2, False),
    "I8": (torch.int8, 1, False),
    "U8": (torch.uint8, 1, False),
    "BOOL": (torch.bool, 1, False),
}


def read_header(path: str) -> dict[str, TensorInfo]:
    """Parse and validate one safetensors file's header."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file (no header length)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise CheckpointError(f"{path}: truncated or corrupt safetensors file (header of {n} bytes, file of {size})")
            raw = fh.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from e
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({type(e).__name__}: {e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    data_size = size - 8 - n
    out: dict[str, TensorInfo] = {}
    ranges: list[tuple[int, int, str]] = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = str(meta["dtype"]), tuple(int(s) for s in meta["shape"])
            start, end = (int(x) for x in meta["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: corrupt header entry for tensor '{name}'") from e
        if dtype not in _ST_DTYPES:
            raise CheckpointError(f"{path}: tensor '{name}' has unsupported dtype {dtype}")
        numel = 1
        for s in shape:
            numel *= s
        if end - start != numel * _ST_DTYPES[dtype][1] or start < 0:
            raise CheckpointError(f"{path}: tensor '{name}' byte range does not match shape {list(shape)} x {dtype}")
        if end > data_size:
            raise CheckpointError(
                f"{path}: truncated file: tensor '{name}' ends at byte {end} of a data section of {data_size}"
            )
        out[name] = TensorInfo(name, shape, dtype, _ST_DTYPES[dtype][2], path)
        ranges.append((start, end, name))
    ranges.sort()
    for (_, end_a, a), (start_b, _, b) in zip(ranges, ranges[1:]):
        if start_b < end_a:
            raise CheckpointError(f"{path}: corrupt header: tensors '{a}' and '{b}' overlap")
    return out


def _index_files(index: str) -> set[str]:
    """The shard file names of a ``model.safetensors.index.json`` (its ``weight_map`` values)."""
    try:
        with open(index, encoding="utf-8") as fh:
            weight_map = json.load(fh)["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: unreadable shard index ({type(e).__name__}: {e})") from e
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) and f for f in weight_map.values()):
        raise CheckpointError(f"{index}: field 'weight_map' must map tensor names to shard file names")
    return set(weight_map.values())


class SafetensorsSource:
    """All tensors of an HF checkpoint directory or a single ``.safetensors`` file."""

    def __init__(self, path: str):
        self.path = path
        if os.path.isdir(path):
            index = os.path.join(path, "model.safetensors.index.json")
            single = os.path.join(path, "model.safetensors")
            if os.path.exists(index):
                files = sorted({os.path.join(path, f) for f in _index_files(index)})
            elif os.path.exists(single):
                files = [single]
            else:
                found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
                if not found:
                    raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")
                files = [os.path.join(path, f) for f in found]
        else:
            files = [path]
        self._infos: dict[str, TensorInfo] = {}
        for f in files:
            if not os.path.exists(f):
                raise CheckpointError(f"{f}: shard named by the index is missing")
            for name, info in read_header(f).items():
                if name in self._infos:
                    raise CheckpointError(f"{f}: tensor '{name}' also appears in {self._infos[name].file}")
                self._infos[name] = info
        self._handles: dict[str, object] = {}

    def infos(self) -> dict[str, TensorInfo]:
        return self._infos

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        t = self._handle(name).get_tensor(name)  # type: ignore[attr-defined]
        return t.to(dtype)

    def get_slice(self, name: str, dim: int, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Entries ``start:stop`` along ``dim`` of one tensor, reading only those bytes
        (a rank's part under tensor parallelism)."""
        index = (slice(None),) * dim + (slice(start, stop),)
        return self._handle(name).get_slice(name)[index].to(dtype)  # type: ignore[attr-defined]

    def _handle(self, name: str):
        info = self._infos[name]
        h = self._handles.get(info.file)
        if h is None:
            try:
                h = safe_open(info.file, framework="pt")
            except Exception as e:  # safetensors raises its own error types
                raise CheckpointError(f"{info.file}: cannot open ({e})") from e
            self._handles[info.file] = h
        return h
