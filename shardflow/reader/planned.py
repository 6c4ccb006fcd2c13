"""The main loop of a pass over a worker's planned samples: :func:`read_planned`.

Samples come out as read, whole (``__key__``, ``__url__``, fields as bytes, ``__source__`` 0,
one dict made by the tar reader: :func:`~shardflow.format.tar.iter_samples`' ``frame``):
:class:`.samples.Prepare` makes them ready (and tags them again where there are several sources). It steps through the read positions in read order (:mod:`.runs`); a run's next
samples come from its open stream (:mod:`.streams`), and anything unusual (a
stream to open, a failure, the end of a shard) goes to :mod:`.recovery`. A block
of positions that read the next samples of an open run, all wanted, goes in one
inner loop: the hot path of reading.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any

import numpy as np

from .. import fastpath, storage
from ..errors import SampleError, ShardflowError
from ..format.tar import raw_sample
from ..planning.plan import RankPlan
from ..policy import ErrorPolicy
from ..sources.source import ShardSet
from .recovery import LOST, Recovery
from .runs import RunTable
from .streams import RunStreams

__all__ = ["read_planned"]

Sample = dict[str, Any]


def read_planned(
    plan: RankPlan, needed: np.ndarray, source: ShardSet, io: storage.IOOptions, policy: ErrorPolicy,
    offsets: Callable[[int], np.ndarray | None], expand: int = 1, prepare: Callable[[Sample], list[Any] | None] | None = None,
    *, positioned: bool = True, hold: int | None = None,
) -> Iterator[Any]:
    """Read the needed positions of a rank's plan, in read order.

    Args:
        plan: the rank's plan.
        needed: bool array over read positions.
        source: shard URLs.
        io: storage options.
        policy: error policy (shard errors drop the shard's remaining samples).
        offsets: ``offsets(shard)`` returns the shard's offset index or None.
        expand: items per stored sample (one-to-many samples): the plan counts
            items, item ``i`` of a shard comes from sample ``i // expand``.
        prepare: with ``expand``, turns one raw sample into its ``expand`` items (or
            None when the sample was dropped); each sample is read and prepared once.
        positioned: False to yield the items alone (read order is the order wanted).
        hold: the first batch's last read position: remote runs first read after it
            are opened ahead only once it is read (:class:`~.streams.RunStreams`).

    Yields:
        ``(position, item)`` for every needed position, in read order (or the
        ``item`` alone, see ``positioned``); ``item`` is None when it was dropped. Without
        ``prepare``, an item is the sample whole, ``__source__`` 0 last (see the module's docstring).
    """
    k, many = expand, prepare is not None  # with expand == 1 too: the sample is still prepared
    opened = _open(plan, needed, source, io, policy, offsets, k, not many and not positioned, hold, not many)
    if opened is None:
        return
    table, recovery, steps = opened
    streams, cached = recovery.streams, recovery.cached
    iters, last_l, run_url = streams.open, table.last, table.url
    try:
        for pos, s, i, want, ahead in steps:
            if s < 0:  # outside every run
                continue
            if many and (got := _cached(cached, s, i, k, last_l[s])) is not _MISS:  # from the sample read last
                if want:
                    yield (pos, got) if positioned else got
                continue
            item = error = None
            it = iters.get(s)
            if it is not None and ahead > 1:  # the common case: the run is open, its next samples wanted
                done = 0
                try:
                    for item in islice(it.samples, ahead):
                        fields = item[2]
                        if type(fields) is not dict:  # a bad sample: the general code below drops it
                            break
                        yield fields  # whole already (the stream's frame): one dict a sample
                        done += 1
                    else:
                        item = None
                except ShardflowError as e:
                    item, error = None, e
                if done > 1:
                    next(islice(steps, done - 2, None), None)  # the block's positions are served
                if done == ahead:
                    if i + done - 1 == last_l[s]:
                        streams.drop(s)
                    continue
                if done:  # on at the first position not served, with what it met
                    pos, s, i, want, ahead = next(steps)
                if item is None and error is None:
                    error = recovery.ended(s, i)
            elif it is not None:  # the run's stream is open
                try:
                    item = next(it.samples, None)  # (the generator itself: no __next__ in Python)
                    if item is None:
                        error = recovery.ended(s, i // k)
                except ShardflowError as e:
                    error = e
            if item is None:  # no open stream (to open, or a dead run), or an error: the slow path
                item = recovery.reach(s, i, want, error)
                if item is None:
                    continue
                if item is LOST:
                    yield (pos, None) if positioned else None
                    continue
            if i // k == last_l[s] // k:
                streams.drop(s)
            if many:
                got = _prepared(item, run_url[s], prepare, policy, cached, s, i, k, last_l[s])
                if want:
                    yield (pos, got) if positioned else got
                continue
            if want:
                sample = _sample(item, policy)
                yield (pos, sample) if positioned else sample
    finally:
        streams.close()


def _open(
    plan: RankPlan,
    needed: np.ndarray,
    source: ShardSet,
    io: storage.IOOptions,
    policy: ErrorPolicy,
    offsets: Callable[[int], np.ndarray | None],
    k: int,
    in_blocks: bool,
    hold: int | None,
    whole: bool,
) -> tuple[RunTable, Recovery, Iterator[tuple[int, int, int, bool, int]]] | None:
    """The run table, its recovery (and streams: with ``whole``, samples come whole, tagged
    ``__source__`` 0) and the steps of :func:`read_planned`; None when no position is needed."""
    table = RunTable.build(plan, needed, source, k, in_blocks=in_blocks and fastpath.enabled("blocks"))
    if table is None:
        return None
    recovery = Recovery(table, source, policy, RunStreams(table, source, io, offsets, hold, 0 if whole else None))
    steps = table.steps()
    if recovery.streams.limit is not None and hold is not None:
        steps = _released(steps, hold + 1 - table.lo, recovery.streams.release)
    return table, recovery, steps


def _sample(item: tuple[str, int, Any], policy: ErrorPolicy) -> Sample | None:
    """The sample of a read ``(key, offset, sample)`` (made whole by its stream), or None for a bad
    sample (a SampleError in its place, handed to ``policy``)."""
    sample = item[2]
    if type(sample) is not dict:
        policy.handle(sample)
        return None
    return sample


_MISS = object()


def _released(steps: Iterator[Any], n: int, release: Callable[[], None]) -> Iterator[Any]:
    """``steps``, calling ``release`` once its first ``n`` are taken."""
    yield from islice(steps, max(n, 0))
    release()
    yield from steps


def _cached(cached: dict[int, tuple[int, list[Any] | None]], s: int, i: int, k: int, last: int) -> Any:
    """Item ``i`` of run ``s`` when it comes from the sample prepared last (one-to-many
    samples; None: dropped), else :data:`_MISS`; the entry is dropped at the run's last item."""
    hit = cached.get(s)
    if hit is None or hit[0] != i // k:
        return _MISS
    if i == last:
        cached.pop(s, None)
    return _item(hit[1], i, k)


def _item(items: list[Any] | None, i: int, k: int) -> Any:
    return items[i % k] if items is not None else None


def _prepared(
    item: tuple[str, int, Any],
    url: str,
    prepare: Callable[[Sample], list[Any] | None] | None,
    policy: ErrorPolicy,
    cached: dict[int, tuple[int, list[Any] | None]],
    s: int,
    i: int,
    k: int,
    last: int,
) -> Any:
    """Item ``i`` of the raw sample ``item`` of run ``s`` (one-to-many samples: the sample is
    prepared into its ``k`` items, kept in ``cached`` for the run's next items), None when
    the sample was dropped."""
    key, _, fields = item
    items: list[Any] | None = None
    if isinstance(fields, SampleError):
        policy.handle(fields)
    else:
        items = prepare(raw_sample(key, url, fields)) if prepare is not None else None
    if i != last:
        cached[s] = (i // k, items)
    return _item(items, i, k)
