"""The open streams of a pass's runs, and the open-ahead of the next ones.

Opening a run also starts opening the next runs in read order (as many as are
open at once: the interleave), so their bytes stream while this one is decoded.
Remote runs open in background threads (loading an offset index is a request
too); an error there is raised when the run is reached.

A remote pass may hold back the open-ahead of the runs that its first batch does
not read (:meth:`RunStreams.release` lets it go): on a shared link their fetches
would take bandwidth from the bytes that the first batch waits for.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from .. import storage
from ..sources.source import ShardSet
from .runs import RunTable
from .segments import Opened, close, open_segment

__all__ = ["RunStreams", "OPENERS"]

OPENERS = 4
"""Threads opening the next segments (each open waits on requests: index, first bytes)."""


class RunStreams:
    """The streams of the runs being read (:attr:`open`: run -> its :class:`Opened`).

    Args:
        table: the pass's runs.
        source: the shards.
        io: storage options.
        offsets: ``offsets(shard)``: the shard's offset index, or None.
        hold: a read position (the first batch's last): runs first read after it are
            not opened ahead before :meth:`release` (remote runs only; None: no hold).
        tag: with it, the samples come whole, with ``__source__`` ``tag`` (see
            :func:`~.segments.open_segment`).
    """

    def __init__(
        self,
        table: RunTable,
        source: ShardSet,
        io: storage.IOOptions,
        offsets: Callable[[int], np.ndarray | None],
        hold: int | None = None,
        tag: int | None = None,
    ) -> None:
        self.open: dict[int, Opened] = {}
        self._tag = tag
        self._table = table
        self._source = source
        self._io = io
        self._offsets = offsets
        self._rank_of = {run: j for j, run in enumerate(table.opening)}
        self._scheduled = 0  # opening[:scheduled] are open, done, or being opened
        # not for local files: opening one takes microseconds, and a thread doing it
        # costs the reader GIL hand-offs (see docs/benchmarks.md)
        self._ahead = not all(storage.is_local(table.url[run]) for run in table.opening)
        # Fetches shared by a rank's workers (storage.staging) go to local disk, not to RAM, and
        # run at the link's pace, not a reader's: opening two rounds of runs ahead keeps a
        # request streaming while the workers decode, where one round leaves the link idle
        # between the end of the next runs' fetches and the start of the runs after them.
        scope = storage.scope_of(io)
        self._depth = 2 if scope is not None and scope.num_workers > 1 else 1
        self._pool: ThreadPoolExecutor | None = None
        self._early: dict[int, Future[Opened]] = {}
        # opening[:limit] may be opened ahead (None: all)
        self.limit = bisect_right(table.opened_at, hold) if hold is not None and self._ahead else None

    def start(self, s: int) -> Opened:
        """Open run ``s`` (or take it from the open-ahead) and start opening the next ones."""
        early = self._early.pop(s, None)
        self._scheduled = max(self._scheduled, self._rank_of[s] + 1)
        it = self.open[s] = early.result() if early is not None else self._open(s)
        self._open_ahead()
        return it

    def release(self) -> None:
        """Let the open-ahead go past the hold (the first batch's reads are done)."""
        if self.limit is not None:
            self.limit = None
            self._open_ahead()

    def _open_ahead(self) -> None:
        opening = self._table.opening
        end = len(opening) if self.limit is None else min(self.limit, len(opening))
        while self._ahead and self._scheduled < end and len(self._early) < self._depth * len(self.open):
            if self._pool is None:
                self._pool = ThreadPoolExecutor(OPENERS, thread_name_prefix="shardflow-open")
            ahead = opening[self._scheduled]
            self._early[ahead] = self._pool.submit(self._open, ahead)
            self._scheduled += 1

    def reseek(self, s: int, start: int) -> Opened:
        """Open run ``s`` again through the shard's offset index at sample ``start``."""
        t = self._table
        shard = t.shard[s]
        it = self.open[s] = open_segment(
            self._source, shard, start, t.last[s] // t.expand + 1, self._offsets(shard), self._io, tag=self._tag
        )
        return it

    def _open(self, s: int) -> Opened:
        t = self._table
        shard, k = t.shard[s], t.expand
        start, stop = t.first[s] // k, t.last[s] // k + 1
        # A run that starts and ends within a read-through gap of the shard's ends
        # streams the shard from its start (skipping to ``start``): no offset index
        # to fetch, one request fewer per shard and worker on a remote store.
        gap = t.gaps[shard]
        counts = self._source.counts
        whole = counts is not None and start <= gap and counts[shard] - stop <= gap
        # A local shard read whole still gets its offset index (one small local read), to walk
        # its headers for many samples at once.
        index = self._offsets(shard) if not self._ahead or not whole else None
        return open_segment(self._source, shard, start, stop, None if whole else index, self._io, index, self._tag)

    def drop(self, s: int) -> None:
        """Close run ``s``'s stream, if open."""
        close(self.open.pop(s, None))

    def close(self) -> None:
        """Close every stream, and those opened ahead."""
        for it in self.open.values():
            close(it)
        for early in self._early.values():
            if not early.cancel() and early.exception() is None:
                close(early.result())
        if self._pool is not None:
            self._pool.shutdown(wait=True)
