"""Rank 0's serving decisions, handed to the other tensor-parallel ranks at each step boundary.

Under tensor parallelism every rank runs the serving loop (:class:`~specdec.engine.serve_loop.
EngineLoop`) on its shard, and the collectives inside each forward require that every rank runs
the same forwards in the same order. What the loop decides from outside input or from timing
(which requests join which slots, cancellations, the draft length ``k`` the cost controller picks
from measured step times) is therefore decided on rank 0 alone and handed to the others here:
one small object per step boundary, carrying only what changed.

:meth:`BoundaryChannel.share` is one broadcast of a fixed :data:`INLINE`-byte buffer (the common
case: nothing joined, just ``k``), plus a second one only when a message is longer (prompts
joining). It runs over gloo: on the CPU that is the default group; with NCCL ranks a gloo group
of its own, so that a follower waits for rank 0 in a blocking socket read, not spinning on a
GPU stream, and no GPU time is spent on it. The payload is a pickle: it only ever travels between
the processes of one run.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

from .tp import Shard

INLINE = 512  # payload bytes carried by the one broadcast every boundary makes
HEARTBEAT_S = 5.0  # an idle rank 0 sends an empty boundary this often: the followers' waits never time out


class BoundaryChannel:
    """Rank 0 sends, the other ranks receive, one object per call (all ranks call :meth:`share`
    in the same order). Built collectively: every rank constructs it at the same point."""

    def __init__(self, shard: Shard):
        self.shard = shard
        self.lead = shard.rank == 0
        if dist.get_backend(shard.group) == "gloo":
            self.group = shard.group
        else:  # NCCL: a CPU group for the control messages
            self.group = dist.new_group(list(range(shard.world)), backend="gloo")

    def share(self, obj: Any = None) -> Any:
        """Rank 0: send ``obj`` and return it. Other ranks: return the object rank 0 sent."""
        buf = torch.zeros(8 + INLINE, dtype=torch.uint8)  # [length (8 bytes, little endian), payload...]
        if self.lead:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            head = len(data).to_bytes(8, "little") + data[:INLINE]
            buf[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.group)
        n = int.from_bytes(buf[:8].numpy().tobytes(), "little")
        if n > INLINE:  # the rest in a second broadcast
            rest = torch.empty(n - INLINE, dtype=torch.uint8)
            if self.lead:
                rest.copy_(torch.frombuffer(bytearray(data[INLINE:]), dtype=torch.uint8))
            dist.broadcast(rest, src=0, group=self.group)
        if self.lead:
            return obj
        body = buf[8: 8 + min(n, INLINE)].numpy().tobytes() + (rest.numpy().tobytes() if n > INLINE else b"")
        return pickle.loads(body)
