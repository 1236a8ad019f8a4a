"""Writing a :class:`~.plan.Plan` to a GGUF file safely, one tensor at a time.

The file is written under a temporary name in the output's own directory and renamed over
the output (``os.replace``, atomic on one file system) only once every byte is on disk. A
conversion that fails or is killed leaves at most that temporary file (``.OUT.gguf.*.tmp``,
removed on an ordinary failure), never a half-written ``OUT.gguf``.

The tensor table is written first from the planned shapes and types; then each tensor is read,
converted, encoded and appended, so memory holds one tensor (plus its encoding) at a time.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Callable

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from ..errors import CheckpointError
from .plan import Plan
from .quantize import FILE_TYPES, encode, nbytes, storage_type

ProgressFactory = Callable[[int, str], object]


def tensor_types(plan: Plan, requested: QT) -> dict[str, QT]:
    """The storage type of every planned tensor (see :func:`.quantize.storage_type`)."""
    return {t.name: storage_type(t.name, t.shape, requested) for t in plan.tensors}


def _bar(total: int, desc: str):
    """A tqdm bar on a terminal (stderr), silent elsewhere."""
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=not sys.stderr.isatty(), leave=False)


def write_plan(plan: Plan, out: str, requested: QT, *, force: bool = False, progress: ProgressFactory = _bar) -> dict[str, QT]:
    """Write ``plan`` to ``out`` with weights in ``requested`` (per-tensor fallbacks applied).

    Refuses an existing ``out`` unless ``force``. Returns the type each tensor was written in.
    """
    out = os.path.abspath(out)
    if os.path.isdir(out):
        raise CheckpointError(f"{out}: is a directory; give the output .gguf file name")
    if os.path.exists(out) and not force:
        raise CheckpointError(f"{out}: already exists; pass --force to overwrite it")
    folder = os.path.dirname(out)
    if not os.path.isdir(folder):
        raise CheckpointError(f"{folder}: output directory does not exist")
    types = tensor_types(plan, requested)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(out)}.", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        _write(plan, tmp, requested, types, progress)
        os.replace(tmp, out)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return types


def _write(plan: Plan, path: str, requested: QT, types: dict[str, QT], progress: ProgressFactory) -> None:
    w = gguf.GGUFWriter(path, plan.arch)
    for key, (value, vtype) in plan.metadata.items():
        w.add_key_value(key, value, vtype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_file_type(int(FILE_TYPES[requested]))
    for t in plan.tensors:
        qt = types[t.name]
        # the numpy dtype only tells the writer how to read the shape: the logical shape here
        np_dtype = {QT.F32: np.float32, QT.F16: np.float16}.get(qt, np.float32)
        w.add_tensor_info(t.name, t.shape, np.dtype(np_dtype), nbytes(t.shape, qt),
                          raw_dtype=None if qt in (QT.F32, QT.F16) else qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    bar = progress(sum(nbytes(t.shape, types[t.name]) for t in plan.tensors), f"writing {os.path.basename(path)}")
    try:
        for t in plan.tensors:
            arr = t.read()
            if tuple(arr.shape) != t.shape:
                raise AssertionError(f"tensor {t.name}: produced shape {list(arr.shape)}, planned {list(t.shape)}")
            data = encode(arr.float().numpy(), types[t.name])
            w.write_tensor_data(data)
            if bar is not None:
                bar.update(data.nbytes)
        w.flush()
        for fh in w.fout or []:
            os.fsync(fh.fileno())  # on disk before the rename makes it the output
    finally:
        if bar is not None:
            bar.close()
        w.close()
