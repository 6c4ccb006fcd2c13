"""Reading a worker's planned samples with its first batch first.

A worker yields its batches in plan order, each as soon as every sample of it has
been read, and reads its samples in read order (shard by shard, so that a run of
samples is one stream). In a fresh epoch the first batch's samples lie among the
first ~2 batches' worth of reads (the shuffle buffer starts emitting early), but
in a resumed epoch they are scattered over the whole shuffle buffer as it was at
the resume point: some entered it thousands of reads earlier. Reading in read
order, a resumed worker then reads all of its samples still in that buffer
(~8 batches' worth for a 1,000-sample buffer and batches of 64) before its first
batch. :func:`read_planned_in_phases` reads the first batch's samples on their own
first (seeking with the offset index), then the rest in read order.

What is yielded does not change, only when it is read: :func:`~shardflow.stages.emit_in_order`
puts every sample in its place in the plan's yield order either way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from . import stages, storage
from .plan import RankPlan
from .source import ShardSet

__all__ = ["read_planned_in_phases", "PHASE_RATIO"]

PHASE_RATIO = 4
"""The first batch is read on its own when reading in read order would read more
than this many times its samples before it is complete."""


def first_phase(needed: np.ndarray, order: np.ndarray, first: int) -> np.ndarray | None:
    """The read positions of the first batch to read on their own, or None.

    Args:
        needed: bool, shape (read positions,): the positions the worker reads.
        order: int64, the worker's read positions in yield order.
        first: samples in the worker's first batch.

    Returns:
        ``order[:first]`` when reading in read order would read more than
        :data:`PHASE_RATIO` times as many positions before the first batch is
        complete; else None (a fresh epoch: reading in order costs little more).
    """
    if first <= 0 or len(order) <= first:
        return None
    head = order[:first]
    before = int(np.count_nonzero(needed[: int(head.max()) + 1]))
    return head if before > PHASE_RATIO * first else None


def read_planned_in_phases(
    plan: RankPlan,
    needed: np.ndarray,
    order: np.ndarray,
    first: int,
    source: ShardSet,
    io: storage.IOOptions,
    policy: stages.ErrorPolicy,
    offsets: Callable[[int], np.ndarray | None],
    expand: int = 1,
    prepare: Callable[[dict[str, Any]], list[Any] | None] | None = None,
) -> Iterator[tuple[int, Any]]:
    """:func:`~shardflow.stages.read_planned`, the first batch's positions first when
    :func:`first_phase` says so.

    Args:
        plan, needed, source, io, policy, offsets, expand, prepare: as
            :func:`~shardflow.stages.read_planned`.
        order: int64, the needed positions in yield order.
        first: samples in the first batch (its positions are ``order[:first]``).

    Yields:
        ``(position, item)`` for every needed position once: the first batch's in
        read order, then the others in read order.
    """
    head = first_phase(needed, order, first)
    if head is None:
        yield from stages.read_planned(plan, needed, source, io, policy, offsets, expand, prepare)
        return
    now = np.zeros_like(needed)
    now[head] = True
    later = needed & ~now
    for part in (now, later):
        reads = stages.read_planned(plan, part, source, io, policy, offsets, expand, prepare)
        try:
            yield from reads
        finally:
            reads.close()
