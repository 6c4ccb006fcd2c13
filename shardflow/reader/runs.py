"""Planning a worker's reads: runs of needed samples, one stream each.

A run is a stretch of one plan segment that is read as one stream: its needed
samples, and the unneeded ones between them that are cheaper to read through
than to seek over. Everything here is computed once per pass, with numpy, into
plain lists that the main loop (:mod:`shardflow.reader.planned`) indexes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import numpy as np

from .. import storage
from ..planning.plan import RankPlan
from ..sources.source import ShardSet

__all__ = ["SEEK_GAP", "REMOTE_SEEK_BYTES", "RunTable", "read_through", "plan_runs", "blocks", "run_of"]

SEEK_GAP = 16
"""Unneeded samples read through rather than seeking over them (local files)."""

REMOTE_SEEK_BYTES = 4 << 20
"""On a remote store a seek is a new request (a round trip, and client CPU): gaps up to
this many bytes (estimated from the manifest's mean sample size) are read through instead."""


def read_through(source: ShardSet, shard: int) -> int:
    """The largest gap of unneeded samples that a run of ``shard`` reads through."""
    if storage.is_local(source.urls[shard]):
        return SEEK_GAP
    manifest = source.manifest
    if manifest is None:
        return SEEK_GAP
    info = manifest.shards[shard]
    if info.samples <= 0 or info.bytes <= 0:
        return SEEK_GAP
    return max(SEEK_GAP, REMOTE_SEEK_BYTES * info.samples // info.bytes)


def plan_runs(
    plan: RankPlan, positions: np.ndarray, source: ShardSet, expand: int, gaps: dict[int, int] | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs of needed samples: ``(segment, first, last)`` arrays, sorted by (segment, first).

    Within a segment, needed samples further apart than :data:`SEEK_GAP` (on a
    remote store: about :data:`REMOTE_SEEK_BYTES`) form separate runs when the
    shard has an offset index (so the reader can seek); without one a segment is
    a single run (reading restarts at the shard's start). A scattered plan
    (:attr:`~shardflow.plan.RankPlan.scattered`) makes every needed sample a run. ``gaps`` caches
    :func:`read_through` per shard (filled here, for the caller to reuse).
    """
    gaps = {} if gaps is None else gaps
    seg = plan.read_segment[positions].astype(np.int64)
    smp = plan.read_sample[positions]
    if len(seg) > 1 and not bool(((seg[1:] > seg[:-1]) | ((seg[1:] == seg[:-1]) & (smp[1:] >= smp[:-1]))).all()):
        order = np.lexsort((smp, seg))  # (read in order, the common case, needs none: 0.25 ms for 20,000)
        seg, smp = seg[order], smp[order]
    for s in plan.segments:
        if s.shard not in gaps:
            gaps[s.shard] = read_through(source, s.shard)
    # per segment: the largest gap read through; -1: not seekable (one run)
    through = np.asarray(
        [gaps[s.shard] if source.index_urls[s.shard] is not None else -1 for s in plan.segments], dtype=np.int64
    )
    if not plan.contiguous:  # a selection: the samples between two read positions are not in the plan
        through = np.where(through >= 0, 1, through)
    new = np.ones(len(seg), dtype=bool)
    if plan.scattered:  # a window shuffle reads a shard's samples in any order: each one on its own
        return seg, smp, smp
    if len(seg) > 1:
        lim = through[seg[1:]]
        gap = (smp[1:] // expand) - (smp[:-1] // expand) > lim
        new[1:] = (seg[1:] != seg[:-1]) | (gap & (lim >= 0))
    starts = np.flatnonzero(new)
    ends = np.append(starts[1:], len(seg)) - 1
    return seg[starts], smp[starts], smp[ends]


def blocks(run: np.ndarray, sample: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """For each read position, how many positions from it on (it included) read the next
    samples of its run, one after the other, all wanted (0 where it is not wanted or in no run)."""
    n = len(run)
    ok = (run >= 0) & wanted
    ends = np.ones(n, dtype=bool)  # the last position of a block
    if n > 1:
        ends[:-1] = ~(ok[1:] & ok[:-1] & (run[1:] == run[:-1]) & (sample[1:] == sample[:-1] + 1))
    at = np.arange(n)
    last = np.minimum.accumulate(np.where(ends, at, n)[::-1])[::-1]
    return np.where(ok, last - at + 1, 0)


def run_of(plan: RankPlan, lo: int, hi: int, runs: tuple[np.ndarray, np.ndarray, np.ndarray]) -> np.ndarray:
    """Run number of each read position in ``[lo, hi)``, or -1 outside every run."""
    run_seg, first, last = runs
    big = np.int64(1) << 40
    keys = run_seg * big + first
    seg = plan.read_segment[lo:hi].astype(np.int64)
    smp = plan.read_sample[lo:hi]
    idx = np.searchsorted(keys, seg * big + smp, side="right") - 1
    ok = idx >= 0
    safe = np.where(ok, idx, 0)
    ok &= (run_seg[safe] == seg) & (smp <= last[safe])
    return np.where(ok, idx, -1)


@dataclass
class RunTable:
    """A pass's runs, as plain lists (indexing numpy arrays element by element is several
    times slower), and the read positions the main loop steps through.

    Attributes:
        shard, first, last: per run, its shard and its first and last sample
            (items, with one-to-many samples: item ``i`` is sample ``i // expand``).
        url: per run, its shard's URL, set on every sample it gives.
        gaps: shard -> the gap its runs read through (:func:`read_through`).
        opening: runs in the order they are first read (the open-ahead order).
        opened_at: per run of :attr:`opening`, the read position where it is first read.
        lo, hi: the read positions stepped through, ``[lo, hi)``.
        run, sample, wanted: per read position in ``[lo, hi)``: its run (-1:
            none), its sample number in its segment, whether it is needed.
        ahead: per read position, :func:`blocks` (None: every position alone).
        expand: items per stored sample.
    """

    shard: list[int]
    first: list[int]
    last: list[int]
    url: list[str]
    gaps: dict[int, int]
    opening: list[int]
    opened_at: list[int]
    lo: int
    hi: int
    run: list[int]
    sample: list[int]
    wanted: list[bool]
    ahead: list[int] | None
    expand: int

    @classmethod
    def build(
        cls,
        plan: RankPlan,
        needed: np.ndarray,
        source: ShardSet,
        expand: int,
        in_blocks: bool,
    ) -> RunTable | None:
        """The runs of the ``needed`` read positions (bool, shape (read positions,)) of
        ``plan``; None when none is needed. ``in_blocks``: compute :attr:`ahead`."""
        positions = np.flatnonzero(needed)
        if positions.size == 0:
            return None
        lo, hi = int(positions[0]), int(positions[-1]) + 1
        # A gap of more unneeded samples than read_through allows (SEEK_GAP locally, about
        # REMOTE_SEEK_BYTES remotely) starts a new run, opened by seeking with the offset
        # index, so a worker that owns every k-th batch, or a resumed epoch, reads only what it yields.
        gaps: dict[int, int] = {}
        runs = plan_runs(plan, positions, source, expand, gaps)
        run_seg, first, last = runs
        run_all = run_of(plan, lo, hi, runs)
        # read-ahead order: runs in the order they are first read
        segs, first_at = np.unique(run_all[positions - lo], return_index=True)
        by_first = np.argsort(first_at, kind="stable")
        shards = [plan.segments[r].shard for r in run_seg.tolist()]
        urls = source.urls
        return cls(
            shard=shards,
            first=first.tolist(),
            last=last.tolist(),
            url=[urls[sh] for sh in shards],
            gaps=gaps,
            opening=segs[by_first].tolist(),
            opened_at=positions[first_at[by_first]].tolist(),
            lo=lo,
            hi=hi,
            run=run_all.tolist(),
            sample=plan.read_sample[lo:hi].tolist(),
            wanted=needed[lo:hi].tolist(),
            ahead=blocks(run_all, plan.read_sample[lo:hi], needed[lo:hi]).tolist() if in_blocks else None,
            expand=expand,
        )

    def steps(self) -> Iterator[tuple[int, int, int, bool, int]]:
        """``(position, run, sample, wanted, ahead)`` per read position in ``[lo, hi)``
        (``ahead`` 0 without :attr:`ahead`)."""
        aheads: Any = self.ahead if self.ahead is not None else repeat(0)
        return zip(range(self.lo, self.hi), self.run, self.sample, self.wanted, aheads)
