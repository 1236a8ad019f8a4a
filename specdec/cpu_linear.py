"""Linear layers on the CPU through oneDNN instead of MKL's BLAS.

In fp32 on the CPU, ``F.linear`` calls MKL's sgemm, which on the 2-core AMD EPYC (Zen 4) this project
is tested on reads a decode step's weights at 12 GB/s where plain reads run at 33 GB/s: SmolLM2-135M's
1-row step took 51 ms for 538 MB of weights. oneDNN's matmul (``mkldnn::_linear_pointwise``, the op
inductor's CPU backend lowers linears to) reads them at 23-26 GB/s at 1 row and is faster at every row
count measured (16 rows 1.3x, a 1,024-row prefill 1.2x), so the step took 35 ms and a 16-row verify
62 ms instead of 84 ms. Neither library gives a row the same bits at every row count, so this changes
nothing in what is exact: on the CPU greedy tokens are tested equal, and ``batch_invariant`` pads steps
to fixed shapes either way.

:func:`linear` takes oneDNN only where no gradient is needed (the op has no autograd formula), for fp32
CPU tensors and weights of at least :data:`MIN_WEIGHT` elements, outside ``torch.compile``, once a probe
showed the op runs here and agrees with ``F.linear``; every other call is ``F.linear``.
``SPECDEC_CPU_ONEDNN=0`` (or :data:`ENABLED` set False) turns it off.

A weight used twice (a parameter, or a derived weight such as a fused q/k/v kept between steps) is then
reordered once into oneDNN's packed layout (``mkldnn::_reorder_linear_weight``) and kept beside it: with the
plain layout, calls of two rows or more ran 1.4-2.3x slower (a reorder inside every call, by all appearances). On the 2-core EPYC a 5-row
SmolLM2 step went 49.8 -> 32.8 ms (the cost of a 1-row step), 16 rows 71.3 -> 50.0 ms, 1 row 35.2 -> 32.9 ms;
the bits are those of the plain layout at two rows or more (checked at 2, 5 and 16 rows; tests/test_cpu_linear.py at
2, 5, 16 and 33). It costs a second copy of the weights in memory (SmolLM2: +538 MB), taken only while a weight fits in
half the memory available; ``SPECDEC_CPU_PACK=0`` keeps one copy.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from . import env
from .flags import switched_on

ENABLED = env.switch("SPECDEC_CPU_ONEDNN")
# Smaller weights stay on F.linear: a oneDNN call costs ~13 us more to start, so with weights cycled out of the
# caches it first wins at ~110K elements (192 x 576: 41 -> 38 us at 1 row) and loses at 32K (256 x 128: 20 -> 27 us)
MIN_WEIGHT = 65536
_works: bool | None = None  # the probe's verdict, once run
PACK = env.switch("SPECDEC_CPU_PACK")
_packs = WeakIdKeyDictionary()  # weight -> ((data_ptr, version), its packed copy, or None until its second use)
_pack_failed = False  # the reorder op failed here once


def _probe() -> bool:
    """Whether oneDNN's linear runs in this build and gives ``F.linear``'s values (to fp32 rounding)."""
    global _works
    if _works is None:
        try:
            g = torch.Generator().manual_seed(0)
            x, w, b = (torch.randn(*s, generator=g) for s in ((3, 40), (24, 40), (24,)))
            y = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
            _works = bool(torch.backends.mkldnn.is_available() and y.shape == (3, 24)
                          and torch.allclose(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5))
        except (AttributeError, RuntimeError, NotImplementedError):
            _works = False
    return _works


def active() -> bool:
    """Whether fp32 CPU linears without gradients run on oneDNN here (on, and the probe passed)."""
    return ENABLED and _probe()


def usable(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, any_size: bool = False) -> bool:
    """Whether :func:`linear` takes oneDNN for these tensors (``any_size``: whatever the weight's size)."""
    if (not ENABLED or x.dtype != torch.float32 or w.dtype != torch.float32 or x.device.type != "cpu"
            or (w.numel() < MIN_WEIGHT and not any_size)):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or (b is not None and b.requires_grad)):
        return False
    return not torch.compiler.is_compiling() and _probe()


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, b)``: ``x [..., K]``, ``w [N, K]`` -> ``[..., N]``, on oneDNN where :func:`usable`
    (within :func:`row_invariant`: every fp32 CPU linear without gradient, by :func:`row_invariant_linear`)."""
    if row_invariant_on() and usable(x, w, b, any_size=True):
        return row_invariant_linear(x, w, b)
    if usable(x, w, b):
        return torch.ops.mkldnn._linear_pointwise(x, packed(w), b, "none", [], "")
    return F.linear(x, w, b)


# specdec.cpu_exact's switch (this thread): see row_invariant
_ROW_INVARIANT = threading.local()


def row_invariant():
    """Within it (this thread), every fp32 CPU linear without gradient runs on oneDNN with 1-row calls padded to 2
    rows (:func:`row_invariant_linear`): a row's bits do not depend on the row count (:mod:`specdec.cpu_exact`)."""
    return switched_on(_ROW_INVARIANT)


def row_invariant_on() -> bool:
    """Whether this thread runs inside :func:`row_invariant`."""
    return getattr(_ROW_INVARIANT, "on", False)


def row_invariant_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, pack: bool = True) -> torch.Tensor:
    """oneDNN's linear (fp32, CPU, no gradient), a 1-row call padded to 2 rows: oneDNN gives a row the same bits at
    every row count from 2 on, and a 1-row call alone rounds otherwise once K > 576 (scripts/probe_cpu_row_invariance.py).
    ``pack=False``: ``w`` is used once (an attention's keys), never packed."""
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    one = rows.shape[0] == 1
    if one:
        rows = torch.cat([rows, rows.new_zeros(1, k)])
    y = torch.ops.mkldnn._linear_pointwise(rows, packed(w) if pack else w, b, "none", [], "")
    return (y[:1] if one else y).reshape(*x.shape[:-1], y.shape[-1])


def packed(w: torch.Tensor) -> torch.Tensor:
    """``w`` in oneDNN's packed layout from its second use on (the copy kept while ``w``'s storage and
    version stay the same), else ``w`` itself: views (made anew at every call) and inference tensors (no
    version to tell a change by) are never packed."""
    global _pack_failed
    if not PACK or _pack_failed or w._base is not None or not w.is_contiguous():
        return w
    try:
        key = (w.data_ptr(), w._version)
    except RuntimeError:  # an inference tensor
        return w
    kept = _packs.get(w)
    if kept is not None and kept[0] == key:
        if kept[1] is not None:
            return kept[1]
        if not _room(w.numel() * w.element_size()):
            return w
        try:
            p = torch.ops.mkldnn._reorder_linear_weight(w, 16)  # 16 rows: a verify's width (any hint measured alike)
        except (AttributeError, RuntimeError, NotImplementedError):  # not in this build: plain layouts from now on
            _pack_failed = True
            return w
        _packs[w] = (key, p)
        return p
    _packs[w] = (key, None)  # first use, or changed since packed: pack at the next use if it stays so
    return w


def _room(nbytes: int) -> bool:
    """Whether a packed copy of ``nbytes`` fits in half the memory available (Linux's MemAvailable; True
    where it cannot be read)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return nbytes < int(line.split()[1]) * 1024 // 2
    except (OSError, ValueError, IndexError):
        pass
    return True


def packed_bytes() -> int:
    """Bytes held by packed copies of weights now."""
    return sum(kept[1].numel() * 4 for kept in _packs.values() if kept[1] is not None)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and names) computed by :func:`linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def plain(m) -> bool:
    """Whether ``m`` is a plain linear layer, ``nn.Linear`` or :class:`Linear` (not a tensor-parallel or
    row-invariant one): what the fused CUDA paths check before reading its weight directly."""
    return type(m) in (nn.Linear, Linear)
