"""The first batches' bytes requested by the main process as its DataLoader workers start.

On a link with latency, a worker's first request goes out only once the worker is forked,
has set up its pipeline and made its own store client: with several workers on few cores,
that is several tenths of a second after ``iter()``. The rank's workers share their fetches
through a staging area (:mod:`shardflow.storage.sharing.staging`), so the main process can start
those fetches itself, at ``iter()``, into the area the workers are about to read: the bytes
are on their way while the workers start, and a worker that needs them waits for them there
as it would for another worker's fetch.

Only the shards of the workers' first batches that the rank reads whole are fetched (from
the start, as a worker reading them whole would fetch them), each up to
:data:`~shardflow.storage.sharing.staged.PREFETCH_BYTES`: the first batches' bytes, not large shards
through the training process. Every byte is still fetched once per rank, in the same
requests for shards up to that size (one more per larger shard: the worker fetches on
from the next block).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from .. import storage
from ..reader.runs import read_through

__all__ = ["OPEN_WAIT", "prefetch_first", "staged_io"]

OPEN_WAIT = 0.05
"""Seconds at most that the main process waits for the store to answer its first requests
before it forks the workers (on a link with a longer round trip, the requests are out by then)."""

log = logging.getLogger(__name__)


def staged_io(ds: Any, world: Any, epoch: int, worker: int, num_workers: int, *, in_worker: bool) -> Any:
    """``ds.io`` for DataLoader worker ``worker`` of ``num_workers`` (0 of 1 in the main process),
    sharing the rank's staging area (:func:`shardflow.storage.staging_for`). Its key is the one
    place that names an area: the job (the process that owns the loader, by pid and start time,
    so a restarted job has its own), the rank, the world size and the epoch; the main process
    computes the same key its forked workers will."""
    key = (storage.job_id(in_worker), world.rank, world.world_size, epoch)
    return storage.staging_for(ds.io, ds.shards.urls, key, worker, num_workers)


def prefetch_first(ds: Any, epoch: int, num_workers: int) -> None:
    """Start fetching the bytes of ``ds``'s first ``num_workers`` batches of ``epoch`` into
    the staging area that its forked DataLoader workers will share (nothing when there is
    none: local shards, no manifest, ``staging=False``, a ``cache_dir``).

    Args:
        ds: the :class:`~shardflow.dataset.ShardDataset` (main process, the epoch applied).
        epoch: the epoch the workers read.
        num_workers: DataLoader workers of the rank, to be forked from this process.
    """
    if num_workers < 1 or not ds.sized or ds.expand is not None:
        return
    world = ds.world()
    io = staged_io(ds, world, epoch, 0, num_workers, in_worker=False)
    scope = storage.scope_of(io)
    if scope is None:
        return
    plan = ds.plan(epoch, world.rank)
    shards = _first_shards(plan, ds.shards, min(num_workers, plan.num_batches))
    if not shards:
        return
    users = storage.enter_area(scope, storage.job_id(False))  # no sweep removes it before the workers enter it
    fetches = []
    try:
        for shard in shards:
            fetch = storage.prefetch(ds.shards.urls[shard], ds.shards.options_for(shard, io))
            if fetch is not None:
                fetches.append(fetch)
        # Until the store answers (a round trip; at most OPEN_WAIT): the requests go out now,
        # not after forking the workers, which holds the interpreter lock in this process
        until = time.monotonic() + OPEN_WAIT
        for fetch in fetches:
            fetch.opened.wait(max(0.0, until - time.monotonic()))
    finally:
        threading.Thread(target=_leave_after, args=(fetches, scope, users), name="shardflow-prefetch", daemon=True).start()
    log.debug("epoch %d: the first batches' bytes of %d shards requested before the workers start", epoch, len(fetches))


def _first_shards(plan: Any, source: Any, batches: int) -> list[int]:
    """The shards that the rank's first ``batches`` batches read, in read order, those the
    rank reads whole only (its workers fetch them from the start)."""
    if batches < 1:
        return []
    _, order = plan.batch_positions(list(range(batches)))
    counts: Sequence[int] = source.counts
    out: list[int] = []
    for s in sorted(set(plan.read_segment[order].tolist())):
        seg = plan.segments[s]
        gap = read_through(source, seg.shard)
        if seg.shard not in out and seg.start <= gap and counts[seg.shard] - seg.stop <= gap:
            out.append(seg.shard)
    return out


def _leave_after(fetches: list[Any], scope: Any, users: int) -> None:
    """Let go of the area once the fetches are over (its last worker out removes it, or this
    thread when every worker finished first)."""
    try:
        for fetch in fetches:
            fetch.join()
    finally:
        storage.leave_prefetch(scope, users)
