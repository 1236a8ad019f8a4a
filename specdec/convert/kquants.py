"""Vectorised numpy encoders for the K-quant blocks ``Q4_K`` and ``Q6_K`` (256 values a block).

The ``gguf`` package dequantizes every K-quant but quantizes none, so the two encoders live
here, written from ggml's block layouts (``block_q4_K`` / ``block_q6_K`` in ggml-common.h).
They use ggml's simple scale choice (no iterative error search), which is what its reference
``quantize_row_q*_K_ref`` starts from; the result decodes with any ggml reader.

Both take ``[n_blocks, 256]`` fp32 and return ``[n_blocks, type_size]`` uint8.
"""

from __future__ import annotations

import numpy as np

QK_K = 256


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a / b`` with 0 where ``b`` is 0 (an all-zero block or sub-block)."""
    return np.divide(a, b, out=np.zeros(np.broadcast_shapes(a.shape, b.shape), np.float32), where=b != 0)


def _fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def q6_k(blocks: np.ndarray) -> np.ndarray:
    """``block_q6_K``: ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] (int8), d (fp16).

    A value is ``d * scale[s] * (q - 32)`` with ``q`` in 0..63, for 16 sub-blocks of 16.
    """
    x = blocks.reshape(-1, 16, 16).astype(np.float32)
    # per sub-block: the value of largest magnitude maps to -32 (ggml's signed-max choice)
    idx = np.abs(x).argmax(-1)
    vmax = np.take_along_axis(x, idx[..., None], -1)[..., 0]  # [nb, 16]
    sub = vmax / -32.0
    # super-block: the sub-scale of largest magnitude maps to -128, scales are int8
    j = np.abs(sub).argmax(-1)
    smax = np.take_along_axis(sub, j[:, None], -1)[:, 0]
    d = _fp16(smax / -128.0)
    df = d.astype(np.float32)
    sc = np.clip(np.rint(_safe_div(sub, df[:, None])), -128, 127).astype(np.int8)
    step = df[:, None] * sc.astype(np.float32)  # [nb, 16]
    q = np.clip(np.rint(_safe_div(x, step[..., None])), -32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(-1, 2, 4, 32)  # half (128 values), quarter, lane
    ql = np.concatenate([(q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4),
                         (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4)], axis=2)  # [nb, 2, 64]
    qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
    nb = x.shape[0]
    return np.concatenate([ql.reshape(nb, 128), qh.reshape(nb, 64), sc.view(np.uint8),
                           d.reshape(nb, 1).view(np.uint8)], axis=1)


def _pack_scales_mins(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins -> ggml's 12 bytes (the inverse of ``get_scale_min_k4``):
    bytes 0-3 / 4-7 hold scales / mins 0-3 plus the top 2 bits of 4-7; bytes 8-11 the low
    nibbles of scales / mins 4-7."""
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    return out


def q4_k(blocks: np.ndarray) -> np.ndarray:
    """``block_q4_K``: d, dmin (fp16), scales[12] (6-bit scales and mins), qs[128] (nibbles).

    A value is ``d * sc[s] * q - dmin * m[s]`` with ``q`` in 0..15, for 8 sub-blocks of 32.
    """
    x = blocks.reshape(-1, 8, 32).astype(np.float32)
    lo = np.minimum(x.min(-1), 0.0)  # the min is stored as a non-negative offset
    scale = (x.max(-1) - lo) / 15.0
    d, dmin = _fp16(scale.max(-1) / 63.0), _fp16((-lo).max(-1) / 63.0)
    df, dmf = d.astype(np.float32), dmin.astype(np.float32)
    sc = np.clip(np.rint(_safe_div(scale, df[:, None])), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(_safe_div(-lo, dmf[:, None])), 0, 63).astype(np.uint8)
    step = df[:, None] * sc.astype(np.float32)
    offset = dmf[:, None] * m.astype(np.float32)
    q = np.clip(np.rint(_safe_div(x + offset[..., None], step[..., None])), 0, 15).astype(np.uint8)
    q = q.reshape(-1, 4, 2, 32)  # 64-value chunk, low/high nibble, lane
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    nb = x.shape[0]
    return np.concatenate([d.reshape(nb, 1).view(np.uint8), dmin.reshape(nb, 1).view(np.uint8),
                           _pack_scales_mins(sc, m), qs], axis=1)
