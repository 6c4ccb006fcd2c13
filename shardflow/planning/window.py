"""The window shuffle: an epoch's samples spread over a window of many shards, read by random access.

Shards that are sorted by class (what a class-ordered conversion or webdataset shards written
class by class give) make batches of a few classes when they are read one or a few at a time,
whatever the shuffle buffer. The window shuffle mixes them at plan time, as MosaicML Streaming's
``py1e`` does: after the epoch's shard permutation, stream position ``j`` gets the key
``j + window * u_j``, ``u_j`` uniform in ``[0, 1)`` drawn from ``(seed, epoch)``, and the epoch
is the positions sorted by key, the keys taken modulo the epoch's length ``n`` (so the first
batches draw from as wide a window as the others: without it they would come from the first
shards only). A sample therefore moves by less than ``window`` positions, circularly, and the
samples of any stretch of ``window`` positions (``window / samples per shard`` shards) are
shuffled together, within and across shards. A window at least as large as the epoch
(``min(window, n)`` is used) gives a uniform permutation of it.

Ranks take the permuted positions in turn (rank ``r``: positions ``r, r + W, r + 2W, ...``,
as ``DistributedSampler`` strides its permutation), so every rank's batches draw from the whole
window, not from its own stretch of shards. Every rank still gets the same number of samples,
and the ranks together see each stream position once: :func:`window_epoch` permutes the very
positions :func:`shardflow.planning.plan.rank_share` counts (padding and drops included).

The reads that follow are in random order inside each shard: each sample is read on its own
through the shard's offset index (:attr:`shardflow.planning.plan.RankPlan.scattered`). Costs: the plan
holds two int64 arrays of the epoch's positions while it is made (16 bytes per sample of the
epoch, e.g. 20 MB at 1.28M samples) and the rank's read arrays after; no sample bytes are held
for the window (the shuffle buffer and the reorder stash stay as they are); on local disk the
pages touched at once span ``window`` samples of the shards (the page cache's working set), and
nothing is written. Sources that are not local files do not use it (one request per sample
would cost more than the bytes): see :class:`shardflow.dataset.ShardDataset`.

Pure functions of ``(counts, world, seed, epoch)``; the worker count never enters.
"""

from __future__ import annotations

import numpy as np

from .order import Segment, interleave, positions_to_segments
from ..world import stable_seed

__all__ = ["DEFAULT_WINDOW", "window_permutation", "window_epoch", "window_rank", "window_reorder"]

DEFAULT_WINDOW = 1 << 18
"""Samples a sample may move by (MosaicML Streaming's ``py1e`` block size): 262,144."""


def window_permutation(n: int, window: int, seed: int) -> np.ndarray:
    """The order of ``n`` stream positions under a window shuffle.

    Args:
        n: positions.
        window: samples each position may move by (``<= 1``: identity).
        seed: 64-bit seed (:func:`shardflow.world.stable_seed`).

    Returns:
        int64 array, shape (n,), a permutation of ``range(n)``: position ``p`` of the
        result holds the stream position read there.
    """
    if window <= 1 or n <= 1:
        return np.arange(n, dtype=np.int64)
    bits = np.random.PCG64(seed)  # the bit generator's raw stream is the same in every numpy version
    u = (bits.random_raw(n) >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)
    keys = np.mod(np.arange(n, dtype=np.float64) + u * float(min(window, n)), float(n))
    return np.argsort(keys, kind="stable").astype(np.int64)


def window_epoch(
    counts: np.ndarray, first: int, total: int, seed: int, epoch: int, shards: bool, endless: bool, window: int
) -> tuple[list[Segment], np.ndarray, np.ndarray]:
    """The whole epoch's stream positions ``[first, first + total)``, window-shuffled.

    Args:
        counts: int64 samples per shard, manifest order.
        first: the epoch's first stream position (0, or ``epoch * W * n`` endless).
        total: positions in the epoch (``W * n``: padding past the end included).
        seed, epoch: the dataset seed and the epoch.
        shards: permute the shard order per pass (:func:`shardflow.planning.order.shard_order`).
        endless: the stream is endless (``samples_per_epoch``).
        window: the window in samples.

    Returns:
        ``(segments, segment, sample)``: the epoch's segments in stream order, and per
        permuted position its segment number (int32) and sample number (int64).
    """
    segments = positions_to_segments(counts, first, first + total, seed, epoch, shards, endless)
    seg, smp = interleave(segments, 1)
    perm = window_permutation(len(smp), window, stable_seed("window", seed, epoch))
    return segments, seg[perm], smp[perm]


def window_rank(
    segment: np.ndarray, sample: np.ndarray, rank: int, world_size: int, used: int
) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``rank``'s read order: every ``world_size``-th permuted position from ``rank`` on,
    its first ``used`` (``drop_last`` leaves the rest out). Returns ``(segment, sample)``."""
    mine = slice(rank, rank + used * world_size, world_size) if used else slice(0, 0)
    return segment[mine].astype(np.int32), sample[mine]


def window_reorder(segment: np.ndarray, sample: np.ndarray, window: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A rank's read order (a weighted mixture's) window-shuffled on its own: ``(segment, sample)``."""
    perm = window_permutation(len(sample), window, seed)
    return segment[perm].astype(np.int32), sample[perm]
