"""Where a loader epoch's time and bytes go: counters and stage timers, one tally per process.

Counters are exact: the storage layer counts every request, byte and retry where it happens
(:func:`count`), in whichever thread. Stage times are ``time.perf_counter_ns`` totals: exact per
batch (a worker's whole time per batch, collate, hand-over) and per chunk of shard bytes
(fetch); the per-sample stages (decode, transform) are timed on one sample in
:data:`SAMPLE_EVERY` and scaled (:func:`timed`), and the tar walk is what is left
(:func:`stage_seconds`). A worker sends :func:`since` its epoch's start with every batch it
yields (see :class:`shardflow.loading.batching.WorkerItem`), and the loader sums the workers' last ones
(:mod:`shardflow.loading.report`).

The stages, innermost first (docs/insight.md):

* ``fetch``: waiting for a shard's bytes: the network, the staging area, the cache, a local read;
* ``read``: walking the tar (headers, members, samples);
* ``decode``: selecting, tagging and decoding fields;
* ``transform``: the user's transform (and its seeding);
* ``collate``: grouping samples into a batch and collating it;
* ``handover``: sending the batch to the main process and copying it out there.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from itertools import islice
from typing import Any

__all__ = [
    "STAGES",
    "COUNTERS",
    "clock",
    "count",
    "add_ns",
    "snapshot",
    "since",
    "timed",
    "timed_batches",
    "SAMPLE_EVERY",
    "timed_chunks",
    "stage_seconds",
    "is_shard_data",
    "Account",
]

clock = time.perf_counter_ns
"""The one clock of accounting and tracing: monotonic, nanoseconds, shared by the processes of
one machine (CLOCK_MONOTONIC on Linux), so that worker and loop events line up in a trace."""

STAGES: tuple[str, ...] = ("fetch", "read", "decode", "transform", "collate", "handover")
"""Stage names, innermost first."""

COUNTERS: tuple[str, ...] = (
    "bytes_network",  # shard bytes received from a remote store
    "bytes_local",  # shard bytes read from local disk: local shards, the cache, the staging area
    "requests",  # GETs of shard data (a streaming GET per part, or a ranged read)
    "retries",  # reads of shard data retried after a transient failure
    "cache_hits",  # shard opens served by cache_dir without a download
    "cache_fills",  # shards downloaded into cache_dir
    "staged_reads",  # shard parts read through the rank's staging area
    "meta_requests",  # GETs of manifests and offset indexes (not shard data)
    "meta_bytes",
)
"""Counter names (each an exact integer)."""

# Inclusive stage timers ("in.<stage>") and exclusive ones (fetch, handover), in ns.
_TIMERS = ("fetch", "in.read", "in.decode", "in.transform", "in.collate", "collate", "handover")

SAMPLE_EVERY: int = 8
"""Per-sample stages time one item in this many (:func:`timed`); batches are all timed."""

_META_SUFFIXES = (".json", ".npy", ".jsonl", ".idx")


class _Tally:
    """The process's counters and timers; ``lock`` guards counters bumped by fetch threads."""

    def __init__(self) -> None:
        self.values: dict[str, int] = dict.fromkeys(COUNTERS + _TIMERS, 0)
        self.lock = threading.Lock()


_tally = _Tally()


def _after_fork() -> None:
    # a lock held by a parent's thread at fork time would stay held in the child
    _tally.lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


def is_shard_data(url: str) -> bool:
    """Whether ``url`` names shard data (not a manifest, journal or offset index)."""
    return not url.endswith(_META_SUFFIXES)


def count(name: str, n: int = 1) -> None:
    """Add ``n`` to counter ``name`` of this process (thread-safe)."""
    with _tally.lock:
        _tally.values[name] += n


def add_ns(timer: str, ns: int) -> None:
    """Add ``ns`` nanoseconds to timer ``timer`` (``"fetch"``, ``"handover"``, ``"in.<stage>"``)."""
    _tally.values[timer] += ns


def snapshot() -> dict[str, int]:
    """This process's counters and timers now (a copy)."""
    with _tally.lock:
        return dict(_tally.values)


def since(base: Mapping[str, int]) -> dict[str, int]:
    """Counters and timers of this process since ``base`` (a :func:`snapshot`)."""
    now = snapshot()
    return {k: v - base.get(k, 0) for k, v in now.items()}


def timed(items: Iterable[Any], stage: str, every: int = SAMPLE_EVERY) -> Iterator[Any]:
    """``items`` of a one-to-one sample stage, with every ``every``-th ``next()`` timed (from
    the first), its time times ``every`` added to stage ``stage``'s inclusive timer.

    The stages of a worker sample the same items (they pass each item on, a dropped one as
    None), so the difference of two neighbours' timers is the outer stage's own time on those
    items, whatever the inner one waited for. The items in between pass through
    ``yield from``, untimed (a clock read costs a system call on some virtual machines).
    Closing it closes ``items``.
    """
    values = _tally.values
    key = "in." + stage
    it = iter(items)
    step = it.__next__
    rest = every - 1
    try:
        while True:
            t = clock()
            try:
                x = step()
            except StopIteration:
                values[key] += clock() - t  # the last, empty step: its own time, unscaled
                return
            values[key] += (clock() - t) * every
            yield x
            yield from islice(it, rest)
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()


def timed_batches(batches: Iterable[Any]) -> Iterator[Any]:
    """``batches``, with the time of every ``next()`` added to the ``in.collate`` timer: all a
    worker's work for the batch (exact, two clock reads per batch: :func:`timed` with every
    batch timed). Closing it closes ``batches``."""
    return timed(batches, "collate", every=1)


def timed_chunks(chunks: Iterator[bytes], local: bool) -> Iterator[bytes]:
    """A shard's byte stream, with the wait for each chunk added to ``fetch`` and, for bytes
    from local disk (``local``: a local shard, the cache or the staging area), their count to
    ``bytes_local``. Closing it closes ``chunks``."""
    values = _tally.values
    try:
        while True:
            t = clock()
            try:
                chunk = next(chunks)
            except StopIteration:
                values["fetch"] += clock() - t
                return
            values["fetch"] += clock() - t
            if local:
                count("bytes_local", len(chunk))
            yield chunk
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()


def stage_seconds(values: Mapping[str, int]) -> dict[str, float]:
    """Exclusive seconds per stage (:data:`STAGES`) from counters and timers (summed over
    processes), never below 0: ``fetch``, ``collate`` and ``handover`` as timed; the
    per-sample stages (decode, transform) each as its sampled inclusive time less that of the
    nearest inner one that ran; ``read`` as what is left of the batches' whole time
    (``in.collate``) after the others: the tar walk, and whatever else ran between them."""
    out = dict.fromkeys(STAGES, 0.0)
    inner = values.get("in.read", 0)
    for stage in ("decode", "transform"):
        incl = values.get("in." + stage, 0)
        if incl:
            out[stage] = max(incl - inner, 0) / 1e9
            inner = incl
    out["fetch"] = values.get("fetch", 0) / 1e9
    out["collate"] = values.get("collate", 0) / 1e9
    out["handover"] = values.get("handover", 0) / 1e9
    rest = values.get("in.collate", 0) / 1e9 - out["collate"] - out["decode"] - out["transform"] - out["fetch"]
    out["read"] = max(rest, 0.0)
    return out


class Account:
    """One worker's epoch: its process's counters and timers since the epoch began.

    Args:
        on: accounting is on (off: :meth:`now` returns None and nothing is sent).
    """

    __slots__ = ("on", "base", "began")

    def __init__(self, on: bool) -> None:
        self.on = on
        self.base = snapshot() if on else {}
        self.began = clock()

    def now(self) -> dict[str, int] | None:
        """Counters and timers since the epoch began, with ``began`` and ``at`` (clock, ns):
        what a worker sends with each batch (None when off)."""
        if not self.on:
            return None
        out = since(self.base)
        out["began"] = self.began
        out["at"] = clock()
        return out
