"""Per-thread switches: a ``threading.local`` turned on within a ``with`` block (the row-invariant CPU forms,
the attention forms of static steps); a model on another thread (the server's engine) is unaffected."""

from __future__ import annotations

import contextlib
import threading


@contextlib.contextmanager
def switched_on(flag: threading.local):
    """Within it (this thread), ``flag.on`` is True; the previous value comes back after."""
    prev = getattr(flag, "on", False)
    flag.on = True
    try:
        yield
    finally:
        flag.on = prev
