"""Shard affinity (``ShuffleConfig(affinity=True)``): a rank keeps its shards across epochs.

Without it every epoch deals the shards to the ranks afresh (the epoch's shard order), so over
a run each rank reads every shard and, with a per-node ``cache_dir``, fetches most of them
again each epoch. With it, rank ``r`` reads in every epoch the shard parts that epoch 0 gave
it, in an order drawn per ``(seed, epoch, rank)``, their samples through the shuffle buffer
as ever: with a cache large enough for its share, epochs after the first fetch nothing.
Every rank still reads the same number of samples (the parts are epoch 0's, which were
equal), and an epoch's plan is still a pure function of ``(counts, world, seed, epoch)``,
so resuming stays exact.

What it gives up: a rank's batches come from the same ``1 / world_size`` of the shards all
run long; its epochs differ only in the order of those shards and in the buffer's draws.
The global batch (all ranks together) still holds samples of every rank's shards at every
step.
"""

from __future__ import annotations

import numpy as np

from .order import Segment
from ..world import stable_seed

__all__ = ["keep_parts"]


def keep_parts(parts: list[Segment], seed: int, epoch: int, rank: int) -> list[Segment]:
    """``parts`` (a rank's shard parts of epoch 0) in the order of ``(seed, epoch, rank)``;
    epoch 0 keeps its own order."""
    if epoch == 0 or len(parts) < 2:
        return list(parts)
    rng = np.random.Generator(np.random.PCG64(stable_seed("affinity", seed, epoch, rank)))
    return [parts[i] for i in rng.permutation(len(parts))]
