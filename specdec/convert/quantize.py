"""Output types: which GGML type each tensor gets, and encoding fp32 arrays into it.

Policy (llama.cpp's): 1-D tensors (norms, biases, ``ssm_a``), names not ending in ``.weight``
and a few small tensors the kernels read in f32 (the MoE router, the shared-expert gate, the
DeltaNet conv kernel) stay F32; every other weight takes the requested type. A block type needs
rows that are a whole number of blocks (32 values, 256 for K-quants); a tensor whose rows do
not fit falls back, like ``llama-quantize``, to the nearest wider type that fits:
Q4_K -> Q5_0, Q6_K -> Q8_0, then F16.

Encoding is vectorised numpy over many rows at once (``gguf.quants`` for BF16 and the legacy
block types, :mod:`.kquants` for Q4_K / Q6_K), in slices of rows so memory stays bounded.
"""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from ..errors import ConfigError
from . import kquants

# --type name -> GGML tensor type, and the file type llama.cpp records for it (general.file_type)
TYPES: dict[str, QT] = {"f32": QT.F32, "f16": QT.F16, "bf16": QT.BF16, "q8_0": QT.Q8_0, "q4_0": QT.Q4_0,
                        "q4_k": QT.Q4_K, "q6_k": QT.Q6_K}
FILE_TYPES: dict[QT, gguf.LlamaFileType] = {
    QT.F32: gguf.LlamaFileType.ALL_F32, QT.F16: gguf.LlamaFileType.MOSTLY_F16, QT.BF16: gguf.LlamaFileType.MOSTLY_BF16,
    QT.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0, QT.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0,
    QT.Q4_K: gguf.LlamaFileType.MOSTLY_Q4_K_S, QT.Q6_K: gguf.LlamaFileType.MOSTLY_Q6_K,
}
_FALLBACK = {QT.Q4_K: QT.Q5_0, QT.Q6_K: QT.Q8_0, QT.Q5_0: QT.F16, QT.Q8_0: QT.F16, QT.Q4_0: QT.F16}
# small tensors llama.cpp's converter always keeps in F32
_KEEP_F32 = tuple(gguf.TENSOR_NAMES[t].split(".", 2)[-1] + ".weight" for t in (
    gguf.MODEL_TENSOR.FFN_GATE_INP, gguf.MODEL_TENSOR.FFN_GATE_INP_SHEXP, gguf.MODEL_TENSOR.SSM_CONV1D))
_ROWS_PER_SLICE_BYTES = 64 << 20  # fp32 input bytes encoded at a time


def parse_type(name: str) -> QT:
    """The GGML type for a ``--type`` name; :class:`ConfigError` naming the choices otherwise."""
    qt = TYPES.get(str(name).lower())
    if qt is None:
        raise ConfigError(f"--type '{name}' is not supported; choose one of {', '.join(TYPES)}")
    return qt


def storage_type(name: str, shape: tuple[int, ...], requested: QT) -> QT:
    """The type tensor ``name`` (GGUF name, torch-order ``shape``) is written in."""
    if len(shape) < 2 or not name.endswith(".weight") or name.endswith(_KEEP_F32) or requested == QT.F32:
        return QT.F32
    qt = requested
    while qt in _FALLBACK and shape[-1] % gguf.GGML_QUANT_SIZES[qt][0]:
        qt = _FALLBACK[qt]
    return qt


def nbytes(shape: tuple[int, ...], qt: QT) -> int:
    """Bytes of a tensor of ``shape`` stored as ``qt`` (rows must be whole blocks)."""
    block, size = gguf.GGML_QUANT_SIZES[qt]
    n = 1
    for d in shape[:-1]:
        n *= d
    assert shape[-1] % block == 0, f"row of {shape[-1]} is not whole {qt.name} blocks"
    return n * (shape[-1] // block) * size


def _encode_rows(rows: np.ndarray, qt: QT) -> np.ndarray:
    """``[n, cols]`` fp32 -> the stored array (``[n, bytes]`` uint8 for block types)."""
    if qt == QT.F32:
        return rows
    if qt == QT.F16:
        return rows.astype(np.float16)
    if qt in (QT.Q4_K, QT.Q6_K):
        blocks = rows.reshape(-1, kquants.QK_K)
        out = kquants.q4_k(blocks) if qt == QT.Q4_K else kquants.q6_k(blocks)
        return out.reshape(rows.shape[0], -1)
    return gguf.quants.quantize(rows, qt)  # BF16, Q8_0, Q4_0, Q5_0


def encode(arr: np.ndarray, qt: QT) -> np.ndarray:
    """``arr`` (fp32, any rank) in ``qt`` storage, as a flat array for ``GGUFWriter.write_tensor_data``."""
    rows = np.ascontiguousarray(arr, dtype=np.float32).reshape(-1, arr.shape[-1])
    step = max(1, _ROWS_PER_SLICE_BYTES // (4 * rows.shape[1]))
    if rows.shape[0] <= step:
        return _encode_rows(rows, qt).reshape(-1)
    return np.concatenate([_encode_rows(rows[i:i + step], qt).reshape(-1) for i in range(0, rows.shape[0], step)])
