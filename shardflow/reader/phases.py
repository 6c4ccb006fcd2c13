"""Reading a worker's planned samples in two phases: what its first batch needs, then the rest.

A worker yields its batches in plan order, each as soon as every sample of it has
been read, and reads its samples in read order (shard by shard, so that a run of
samples is one stream). Two cases make the first batch wait for reads it does not
need:

* A resumed epoch: the first batch's samples are scattered over the whole
  shuffle buffer as it was at the resume point (some entered it thousands of
  reads earlier), so reading in read order reads all of the worker's samples
  still in that buffer (~8 batches' worth for a 1,000-sample buffer and batches
  of 64) before the first batch. The first phase reads the first batch's samples
  alone (seeking with the offset index).
* A fresh epoch on local shards: the first batch's samples lie among the first
  ~2 batches' worth of reads, spread over the ``interleave`` shards read at
  once, but each of those streams starts with a whole read block (4 MiB: all of a
  small shard), every header of which is walked. The first phase reads the
  needed positions up to the first batch's last one, so that its reads end where
  its samples do (through the offset index).

The second phase reads the rest in read order. What is yielded does not change,
only when it is read: :func:`~shardflow.reader.shards.emit_in_order` puts every sample
in its place in the plan's yield order either way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .. import storage
from ..errors import ShardflowError
from ..planning.plan import RankPlan
from ..policy import ErrorPolicy
from ..sources.source import ShardSet
from .planned import read_planned

__all__ = ["read_planned_in_phases", "PHASE_RATIO"]

PHASE_RATIO = 4
"""The first batch is read on its own when reading in read order would read more
than this many times its samples before it is complete (a resume)."""


def first_phase(needed: np.ndarray, order: np.ndarray, first: int, *, bounded: bool = False) -> np.ndarray | None:
    """The read positions to read before all others, or None (read in read order).

    Args:
        needed: bool, shape (read positions,): the positions the worker reads.
        order: int64, the worker's read positions in yield order.
        first: samples in the worker's first batch.
        bounded: also split a fresh start (see below); for shards read through
            an offset index from local files.

    Returns:
        ``order[:first]``, the first batch alone, when reading in read order
        would read more than :data:`PHASE_RATIO` times as many positions before
        it is complete (a resumed epoch). Else, with ``bounded``, the needed
        positions up to the first batch's last one (a fresh epoch: its first
        reads then end where the first batch's samples do, rather than reading
        a whole read block of every shard open). Else None. Also None when
        nothing would be left for a second phase.
    """
    if first <= 0 or len(order) <= first:
        return None
    head = order[:first]
    last = int(head.max())
    before = int(np.count_nonzero(needed[: last + 1]))
    if before > PHASE_RATIO * first:
        return head
    if bounded and before < len(order):
        return np.flatnonzero(needed[: last + 1])
    return None


def read_planned_in_phases(
    plan: RankPlan,
    needed: np.ndarray,
    order: np.ndarray,
    first: int,
    source: ShardSet,
    io: storage.IOOptions,
    policy: ErrorPolicy,
    offsets: Callable[[int], np.ndarray | None],
    expand: int = 1,
    prepare: Callable[[dict[str, Any]], list[Any] | None] | None = None,
) -> Iterator[tuple[int, Any]]:
    """:func:`~shardflow.reader.planned.read_planned`, the positions :func:`first_phase` gives
    read first, when every shard of the plan has an offset index (to seek to where
    the second phase starts; fresh starts are split on local shards only, where
    reading through the index costs no request).

    Args:
        plan, needed, source, io, policy, offsets, expand, prepare: as
            :func:`~shardflow.reader.planned.read_planned`.
        order: int64, the needed positions in yield order.
        first: samples in the first batch (its positions are ``order[:first]``).

    Yields:
        ``(position, item)`` for every needed position once: the first phase's
        in read order, then the others in read order.
    """
    shards = [seg.shard for seg in plan.segments]
    seekable = bool(shards) and all(source.index_urls[sh] is not None for sh in shards)
    local = seekable and all(storage.is_local(source.urls[sh]) for sh in shards)
    head = first_phase(needed, order, first) if seekable else None
    if head is None and local:
        head = first_phase(needed, order, first, bounded=True)
        if head is not None and not _plain(plan, head, source, io):
            head = None  # a fresh start on a compressed shard: it streams whole, never through the index
    if head is None:
        # a fresh remote start: the fetches of shards after the first batch's wait for its reads
        hold = int(order[:first].max()) if 0 < first and len(order) else None
        yield from read_planned(plan, needed, source, io, policy, offsets, expand, prepare, hold=hold)
        return
    now = np.zeros_like(needed)
    now[head] = True
    later = needed & ~now
    for part in (now, later):
        reads = read_planned(plan, part, source, io, policy, offsets, expand, prepare)
        try:
            yield from reads
        finally:
            reads.close()


def _plain(plan: RankPlan, positions: np.ndarray, source: ShardSet, io: storage.IOOptions) -> bool:
    """Whether the shards read at ``positions`` are plain tars (no gzip/zstd magic bytes) or
    framed zstd shards (a frame table seeks into them as an offset index into a tar).

    A compressed shard may still have an offset index (written before it was
    compressed); read from its start it streams whole, decompressed, and a fresh
    start must keep it so. One 4-byte read per shard (local files only come here).
    """
    # (a set, not np.unique: that imports numpy.ma on first use, slow in a fresh worker: docs/benchmarks.md)
    shards = {plan.segments[s].shard for s in set(plan.read_segment[positions].tolist())}
    try:
        return not any(source.load_frames(shard, io) is None and storage.is_compressed(source.urls[shard], io)
                       for shard in sorted(shards))
    except (OSError, ShardflowError):  # the reading itself reports what is wrong
        return False
