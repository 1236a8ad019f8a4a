"""Tensor parallelism: ``tp`` (process-group view, parallel layers, load-time slices) and
``launch`` (one process per rank, rank 0's result back, clean failure)."""

from .tp import Shard

__all__ = ["Shard"]
