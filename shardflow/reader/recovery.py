"""What a run does when its stream is not open, fails or ends early (the slow path).

A run's stream opens when its first sample is reached. When reading fails, the
run either goes on through the shard's offset index (a format error met while
reading from the shard's start, or through a gap, may lie in samples that are not
this reader's: only its own samples decide), loses just the one sample the index
led to, or is dead: its remaining samples are counted lost. Every error goes to
the :class:`~shardflow.policy.ErrorPolicy`.
"""

from __future__ import annotations

from typing import Any

from ..errors import ShardflowError, ShardFormatError, TruncatedShardError
from ..policy import ErrorPolicy
from ..sources.source import ShardSet
from .runs import RunTable
from .streams import RunStreams
from .segments import one_sample_lost

__all__ = ["Recovery", "LOST"]

LOST = object()
"""What :meth:`Recovery.reach` returns when the position's sample is lost (yield None for it)."""


class Recovery:
    """The slow path of a pass: opening runs, and the runs that failed.

    Attributes:
        streams: the runs' streams.
        dead: runs whose shard failed: their samples are lost.
        cached: with one-to-many samples, run -> ``(sample, items)`` of the
            sample read last (kept by the main loop; None items: dropped).
    """

    def __init__(
        self,
        table: RunTable,
        source: ShardSet,
        policy: ErrorPolicy,
        streams: RunStreams,
    ) -> None:
        self.dead: set[int] = set()
        self.cached: dict[int, tuple[int, list[Any] | None]] = {}
        self.streams = streams
        self._table = table
        self._source = source
        self._policy = policy
        # runs that go on through the offset index after a format error: the sample the
        # index was entered at (-1: not yet), and the error that sent them there
        self._reseek: dict[int, int] = {}
        self._first_error: dict[int, ShardflowError] = {}

    def ended(self, s: int, sample: int) -> TruncatedShardError:
        """The error of run ``s``'s stream ending before ``sample`` (a sample number)."""
        shard = self._table.shard[s]
        counts = self._source.counts
        return TruncatedShardError(
            f"{self._source.urls[shard]}: shard ended before sample {sample}; the manifest lists "
            f"{counts[shard] if counts is not None else '?'} samples"
        )

    def reach(self, s: int, i: int, want: bool, error: ShardflowError | None) -> Any:
        """The item at sample ``i`` of run ``s``, whose stream is not open or failed with ``error``.

        Returns:
            The item (a ``(key, offset, fields)`` tuple), None when there is nothing
            at this position (not wanted, or the run resumes at its next needed
            sample), or :data:`LOST` when the wanted sample is lost (counted), in
            a dead run too.

        Raises:
            ShardflowError: under ``on_error="raise"``, the error met.
        """
        if s in self.dead:  # (a dead run has no open stream)
            return self._lose(want)
        k = self._table.expand
        reseek = self._reseek
        while True:
            if error is None:
                if s in reseek and not want:
                    return None  # resumed through the index at the next needed sample
                item, error = self._next(s, i)
                if item is not None:
                    return item
            self.streams.drop(s)
            e, error = error, None
            if (
                isinstance(e, ShardFormatError)
                and reseek.get(s) != i // k
                and self._source.index_urls[self._table.shard[s]] is not None
                and e.reason != "compressed_shard"
            ):
                # go on through the offset index from this sample on, so that only this
                # reader's samples decide; an error in the sample the index led to is this sample's
                reseek[s] = -1
                self._first_error.setdefault(s, e)
                continue
            return self._fail(s, i, want, e)

    def _next(self, s: int, i: int) -> tuple[Any, ShardflowError | None]:
        """Open run ``s`` (through the index when it reseeks) and read its item at ``i``."""
        k = self._table.expand
        try:
            if s in self._reseek:
                it = self.streams.reseek(s, i // k)
                self._reseek[s] = i // k
            else:
                it = self.streams.start(s)
            item = next(it, None)
        except ShardflowError as e:
            return None, e
        if item is None:
            return None, self.ended(s, i // k)
        return item, None

    def _fail(self, s: int, i: int, want: bool, e: ShardflowError) -> Any:
        """Hand ``e`` to the policy; the run loses this sample only, or is dead."""
        k = self._table.expand
        if e.reason == "compressed_shard" and s in self._first_error:
            e = self._first_error[s]  # the index cannot enter it: the first error is the one
        self._policy.handle(e, samples=0, shard=self._table.url[s])
        if one_sample_lost(e) and self._reseek.get(s) == i // k:
            # the sample the index led to is damaged, and the index knows where the next
            # one starts: only this one is lost, the next needed one is sought again
            if k > 1 and i != self._table.last[s]:
                self.cached[s] = (i // k, None)
        else:
            self.dead.add(s)
        return self._lose(want)

    def _lose(self, want: bool) -> Any:
        if want:
            self._policy.lost()
            return LOST
        return None

