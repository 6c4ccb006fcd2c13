"""What an epoch will read from a remote store, before the first byte: requests and bytes of
shard data per rank, from the deterministic plan, the manifest and (for shard parts that
start or end inside a shard) the offset indexes and frame tables.

The rules follow the read path (docs/remote.md, docs/insight.md):

* A rank reads each segment of its plan (a shard part) as one stream. A part that starts and
  ends within a read-through gap of the shard's ends (:func:`~shardflow.reader.runs.read_through`:
  about :data:`~shardflow.reader.runs.REMOTE_SEEK_BYTES` of samples) streams the shard whole,
  its stored size; another is the byte range of its samples (of the zstd frames that hold
  them, for a framed ``.tar.zst``).
* Staged (the default, remote, with a manifest): the rank's workers share each fetch, so a
  part costs one GET and its bytes once per rank, whatever ``num_workers``; forked workers
  (``num_workers > 0``) get one GET more for each part the first batches read whole that is
  larger than :data:`~shardflow.storage.sharing.staged.PREFETCH_BYTES` (the main process fetched its
  first bytes before the workers existed).
* ``staging=False``: every worker streams every part it reads: ``max(workers, 1)`` times.
* ``cache_dir`` (one per rank here): a shard is downloaded whole once (one GET); later parts
  and epochs of that shard read the local copy.

What the plan cannot see is not counted in ``requests``: a worker that needs bytes of a part
read from inside its shard before where another worker's fetch began, or past where it ended,
fetches them itself (a small GET more; ``requests_max`` counts one per other worker), a block removed over
``staging_limit`` and needed again is fetched again, and retries repeat what a cut lost.
HEAD requests (one per shard on plain HTTP servers) are not GETs and are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import storage
from ..planning.plan import RankPlan
from ..sources.source import ShardSet
from ..storage.sharing.staged import PREFETCH_BYTES
from .runs import read_through

__all__ = ["PartRead", "part_reads", "RankCost", "rank_cost"]


@dataclass(frozen=True)
class PartRead:
    """One shard part of a rank's epoch as it will be read.

    Attributes:
        shard: the shard's number in the manifest; ``start``, ``stop``: its samples.
        lo, hi: the stored bytes read, ``[lo, hi)``.
        whole: the part streams the whole shard.
    """

    shard: int
    start: int
    stop: int
    lo: int
    hi: int
    whole: bool

    @property
    def bytes(self) -> int:
        """Stored bytes of the part."""
        return self.hi - self.lo


def part_reads(plan: RankPlan, source: ShardSet, io: storage.IOOptions) -> list[PartRead]:
    """The parts of ``plan`` in read order, with the byte ranges the reader will request.

    Raises:
        TypeError: the source has no manifest (nothing to plan from).
        ShardflowError: an offset index or frame table that cannot be read (a partial part needs it).
    """
    manifest = source.manifest
    counts = source.counts
    if manifest is None or counts is None:
        raise TypeError("no plan without a manifest (see `shardflow index`)")
    out = []
    for seg in plan.segments:
        size = int(manifest.shards[seg.shard].bytes)
        gap = read_through(source, seg.shard)
        indexed = source.index_urls[seg.shard] is not None
        whole = not indexed or (seg.start <= gap and int(counts[seg.shard]) - seg.stop <= gap)
        if whole:
            out.append(PartRead(seg.shard, seg.start, seg.stop, 0, size, True))
            continue
        offsets = source.load_offsets(seg.shard, io)
        lo, hi = int(offsets[seg.start]), int(offsets[seg.stop])  # type: ignore[index]
        frames = source.load_frames(seg.shard, io)
        if frames is not None:
            first, stop = frames.frames_for(lo, hi)
            lo, hi = int(frames.stored[first]), int(frames.stored[stop])
        out.append(PartRead(seg.shard, seg.start, seg.stop, lo, hi, False))
    return out


@dataclass
class RankCost:
    """One rank's epoch: GETs and bytes of shard data over the network, and local disk.

    Attributes:
        requests, bytes: GETs of shard data and the stored bytes they return.
        requests_max: GETs at most: a part read from inside its shard, shared by several
            workers, costs one GET more for each worker that needs its bytes before another's
            fetch began or after it ended (which worker comes first is a race, not in the plan).
        bytes_max: bytes at most: those GETs may repeat bytes of the part (up to the part, each).
        parts: shard parts read; ``partial``: those read from inside the shard (with its index).
        cache_bytes: bytes added to ``cache_dir`` this epoch (0 without a cache).
        staging_bytes: the most the staging area holds at once (``min(staging_limit, the
            parts read at once)``; 0 when not staged).
    """

    requests: int = 0
    bytes: int = 0
    requests_max: int = 0
    bytes_max: int = 0
    parts: int = 0
    partial: int = 0
    cache_bytes: int = 0
    staging_bytes: int = 0


def rank_cost(plan: RankPlan, source: ShardSet, io: storage.IOOptions, workers: int, interleave: int,
              cached: set[int] | None = None) -> RankCost:
    """Predict one rank's epoch (see the module's rules).

    Args:
        plan: the rank's plan of the epoch.
        source: the dataset's shards.
        io: the storage options the dataset reads with (``staging``, ``staging_limit``).
        workers: DataLoader workers of the rank (0: in the training process).
        interleave: shards read at once (``ShuffleConfig.interleave``; 1 without shuffling).
        cached: with a ``cache_dir``: the shards this rank's cache already holds (updated
            here); None: no cache.

    Returns:
        The rank's cost; local shards cost no request and no network byte.
    """
    out = RankCost()
    reads = part_reads(plan, source, io)
    out.parts = len(reads)
    out.partial = sum(1 for r in reads if not r.whole)
    remote = [r for r in reads if not storage.is_local(source.urls[r.shard])]
    if cached is not None:
        for r in remote:
            if r.shard not in cached:
                cached.add(r.shard)
                size = int(source.manifest.shards[r.shard].bytes)  # type: ignore[union-attr]
                out.requests += 1
                out.bytes += size
                out.cache_bytes += size
        out.requests_max, out.bytes_max = out.requests, out.bytes
        return out
    copies = 1 if io.staging else max(workers, 1)
    out.requests = copies * len(remote)
    out.bytes = copies * sum(r.bytes for r in remote)
    out.requests_max, out.bytes_max = out.requests, out.bytes
    if io.staging and remote:
        out.requests += _prefetch_extra(plan, reads, workers)
        others = max(workers, 1) - 1
        out.requests_max = out.requests + others * sum(1 for r in remote if not r.whole)
        out.bytes_max = out.bytes + others * sum(r.bytes for r in remote if not r.whole)
        at_once = sorted((r.bytes for r in remote), reverse=True)[: 2 * max(interleave, 1)]
        out.staging_bytes = min(io.staging_limit, sum(at_once))
    return out


def _prefetch_extra(plan: RankPlan, reads: list[PartRead], workers: int) -> int:
    """GETs more for the parts that the main process starts fetching before it forks the
    workers (those the first batches read whole) and that are larger than the prefetch."""
    if workers < 1 or plan.num_batches == 0:
        return 0
    _, positions = plan.batch_positions(list(range(min(workers, plan.num_batches))))
    first = {int(s) for s in plan.read_segment[positions]}
    return sum(1 for i in first if reads[i].whole and reads[i].bytes > PREFETCH_BYTES)
