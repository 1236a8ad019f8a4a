"""Reading GGUF files: metadata, tensor table, dequantization.

The container (header, key/values, tensor table) is parsed here directly from a memory map:
the ``gguf`` package's ``GGUFReader`` builds numpy views for every string of a vocabulary and
takes ~15 s on a 150k-token file, where a plain loop takes a fraction of a second. The
``gguf`` package still supplies the quantization constants and the dequantization kernels.

Every read is bounds-checked, and every declared count or length (keys, tensors, array
elements, string bytes, tensor extents) is checked against the file size before anything is
allocated, so a truncated or corrupt file is a :class:`CheckpointError` naming the file and the
key or tensor being read, at once. GGUF has no checksums: a flipped bit inside tensor data (or a
metadata value that stays plausible) cannot be detected and loads without complaint. Names stay
llama.cpp's here; each architecture maps them to HF names (see ``models/``).
"""

from __future__ import annotations

import mmap
import os
import struct

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
_INT_TYPES = {QT.I8, QT.I16, QT.I32, QT.I64}

# GGUF value types (gguf.GGUFValueType): scalar struct formats, little-endian
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4  # GGML_MAX_DIMS


class _Cursor:
    """Bounds-checked little-endian reads from a buffer; errors name what was being read."""

    def __init__(self, buf, path: str):
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)
        self.what = "header"

    def fail(self, msg: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: truncated or corrupt GGUF ({msg}, while reading {self.what})")

    def need(self, n: int) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"needs {n} bytes at offset {self.pos}, file has {self.size}")

    def scalar(self, fmt: str):
        n = struct.calcsize(fmt)
        self.need(n)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def string(self) -> str:
        n = self.scalar("<Q")
        self.need(n)
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"string is not UTF-8 ({e})") from e

    def value(self, vtype: int):
        if vtype in _SCALAR:
            return self.scalar(_SCALAR[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar("<I"), self.scalar("<Q")
            if etype in _NP:
                width = np.dtype(_NP[etype]).itemsize
                self.need(count * width)
                arr = np.frombuffer(self.buf, dtype=_NP[etype], count=count, offset=self.pos)
                self.pos += count * width
                return arr.tolist()
            if etype == _STRING:
                self.need(count * 8)  # every string has at least its length field
                return [self.string() for _ in range(count)]
            if etype == _ARRAY:
                self.need(count * 12)
                return [self.value(_ARRAY) for _ in range(count)]
            raise self.fail(f"unknown array element type {etype}")
        raise self.fail(f"unknown value type {vtype}")


class GGUFSource:
    """One GGUF file: ``metadata`` (a plain dict of Python values) and its tensors."""

    def __init__(self, path: str):
        self.path = path
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: file not found")
        size = os.path.getsize(path)
        if size < 24:
            raise CheckpointError(f"{path}: truncated GGUF file ({size} bytes)")
        with open(path, "rb") as fh:
            if fh.read(4) != b"GGUF":
                fh.seek(0)
                raise CheckpointError(f"{path}: not a GGUF file (magic {fh.read(4)!r})")
            self._mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        cur = _Cursor(self._mm, path)
        cur.pos = 4
        version = cur.scalar("<I")
        if version not in (2, 3):
            if struct.unpack(">I", struct.pack("<I", version))[0] in (2, 3):
                raise CheckpointError(f"{path}: big-endian GGUF files are not supported")
            raise CheckpointError(f"{path}: GGUF version {version} is not supported (supported: 2, 3)")
        n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
        # every key/value and tensor entry takes more than 8 bytes: reject absurd counts early
        if (n_tensors + n_kv) * 8 > size:
            raise cur.fail(f"{n_tensors} tensors and {n_kv} metadata keys cannot fit in {size} bytes")
        self.metadata: dict = {}
        for i in range(n_kv):
            cur.what = f"metadata key #{i}"
            key = cur.string()
            cur.what = f"metadata key '{key}'"
            vtype = cur.scalar("<I")
            if key in self.metadata:
                raise cur.fail("duplicate key")
            self.metadata[key] = cur.value(vtype)
        entries = []
        for i in range(n_tensors):
            cur.what = f"tensor table entry #{i}"
            name = cur.string()
            cur.what = f"tensor table entry '{name}'"
            n_dims = cur.scalar("<I")
            if not 1 <= n_dims <= _MAX_DIMS:
                raise cur.fail(f"{n_dims} dimensions")
            dims = [cur.scalar("<Q") for _ in range(n_dims)]
            ttype, offset = cur.scalar("<I"), cur.scalar("<Q")
            entries.append((name, dims, ttype, offset))
        align = self.metadata.get("general.alignment", 32)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise CheckpointError(f"{path}: metadata 'general.alignment' = {align!r} is not a power of two")
        data_start = -(-cur.pos // align) * align
        self._tensors: dict[str, tuple[QT, int, int]] = {}  # name -> (type, start byte, n bytes)
        self._infos: dict[str, TensorInfo] = {}
        for name, dims, ttype, offset in entries:
            try:
                qt = QT(ttype)
            except ValueError:
                raise CheckpointError(f"{path}: tensor '{name}' has unknown GGML type id {ttype}; supported types: "
                                      f"{_supported_names()}") from None
            block, type_size = _block_sizes(qt, path, name)
            if dims[0] % block:
                raise CheckpointError(f"{path}: tensor '{name}' rows of {dims[0]} are not a multiple of the "
                                      f"{qt.name} block size {block}")
            nbytes = dims[0] // block * type_size
            for d in dims[1:]:
                nbytes *= d
            start = data_start + offset
            if start + nbytes > size:
                raise CheckpointError(f"{path}: truncated file: tensor '{name}' ends at byte {start + nbytes}, "
                                      f"file has {size}")
            if name in self._tensors:
                raise CheckpointError(f"{path}: tensor '{name}' appears twice in the tensor table")
            shape = tuple(int(d) for d in reversed(dims))  # GGUF lists the fastest dimension first
            self._tensors[name] = (qt, start, nbytes)
            self._infos[name] = TensorInfo(name, shape, qt.name, qt not in _INT_TYPES, path)

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

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes of one tensor (read-only ``uint8`` view of the memory map)."""
        if name not in self._tensors:
            raise CheckpointError(f"{self.path}: no tensor '{name}'")
        _, start, nbytes = self._tensors[name]
        return np.frombuffer(self._mm, dtype=np.uint8, count=nbytes, offset=start)

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Read one tensor, dequantized to fp32 and then converted explicitly to ``dtype``."""
        qt, shape = self._decodable(name)
        return self._decode(name, self.raw(name), qt, shape).to(dtype)

    def get_slice(self, name: str, dim: int, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Entries ``start:stop`` along ``dim`` of one tensor (a rank's part under tensor
        parallelism). A block of rows (``dim`` 0 of a matrix) is whole quantization blocks and
        is decoded alone; F32/F16/BF16 read only the slice along any dim; a column slice of a
        quantized tensor dequantizes the whole tensor, then slices (blocks run along a row)."""
        qt, shape = self._decodable(name)
        raw = self.raw(name)
        if dim == 0 and len(shape) > 1:
            row = raw.shape[0] // shape[0]
            part = (stop - start,) + tuple(shape[1:])
            return self._decode(name, raw[start * row:stop * row], qt, part).to(dtype)
        if qt in _FLOAT_STORAGE:
            view = raw.view(_FLOAT_STORAGE[qt]).reshape(shape)[(slice(None),) * dim + (slice(start, stop),)]
            return torch.from_numpy(_widen(view, qt)).to(dtype)
        return self.get(name, torch.float32).narrow(dim, start, stop - start).contiguous().to(dtype)

    def _decodable(self, name: str) -> tuple[QT, tuple[int, ...]]:
        if name not in self._tensors:
            raise CheckpointError(f"{self.path}: no tensor '{name}'")
        qt = self._tensors[name][0]
        if qt not in SUPPORTED:
            raise CheckpointError(f"{self.path}: tensor '{name}' has quantization type {qt.name}, which specdec cannot "
                                  f"dequantize; supported types: {_supported_names()}")
        return qt, self._infos[name].shape

    def _decode(self, name: str, raw: np.ndarray, qt: QT, shape: tuple[int, ...]) -> torch.Tensor:
        """Stored bytes of ``shape`` entries -> fp32."""
        try:
            if qt in _FLOAT_STORAGE:
                arr = _widen(raw.view(_FLOAT_STORAGE[qt]), qt)
            else:
                arr = gguf.quants.dequantize(raw.reshape(-1, self._row_bytes(qt, shape[-1])), qt)
            return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32).reshape(shape))
        except (ValueError, IndexError) as e:
            raise CheckpointError(f"{self.path}: cannot decode tensor '{name}' ({qt.name}, shape {list(shape)}): {e}") from e

    def _row_bytes(self, qt: QT, row: int) -> int:
        block, type_size = _block_sizes(qt, self.path)
        return row // block * type_size


_FLOAT_STORAGE = {QT.F32: np.float32, QT.F16: np.float16, QT.BF16: np.uint16}


def _widen(arr: np.ndarray, qt: QT) -> np.ndarray:
    """Stored F32/F16/BF16 values (a view of the memory map) -> a new fp32 array."""
    if qt == QT.F32:
        return np.array(arr, dtype=np.float32)  # a copy: the memory map is read-only
    if qt == QT.F16:
        return arr.astype(np.float32)
    # bf16 is the high half of an fp32: widen the bits, never reinterpret the bytes
    return (arr.astype(np.uint32) << 16).view(np.float32)


def _block_sizes(qt: QT, path: str, tensor: str | None = None) -> tuple[int, int]:
    """(elements per block, bytes per block) of a GGML type, from the gguf package's table."""
    sizes = gguf.GGML_QUANT_SIZES.get(qt)
    if sizes is None:
        where = f"tensor '{tensor}'" if tensor else "a tensor"
        raise CheckpointError(f"{path}: {where} has GGML type {qt.name} (id {int(qt)}), whose block size the "
                              f"installed gguf package does not know; supported types: {_supported_names()}")
    return sizes


def _supported_names() -> str:
    return ", ".join(t.name for t in sorted(SUPPORTED))
