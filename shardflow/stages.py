"""Reader pipeline stages: plain generators over samples.

Each stage takes an iterator and yields an iterator; :class:`ShardDataset`
composes them in one place (``_pipeline``). A sample travels as a dict
``{"__key__": str, "__url__": str, field: bytes | decoded value, ...}``;
``None`` marks a sample that was dropped under ``on_error="skip"`` so that
positions stay aligned until the batching stage.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import islice, repeat
from typing import Any

import numpy as np

from . import storage
from .codecs import DecodeOptions, decode_field, field_alternatives
from .errors import (
    DecodeError,
    ManifestError,
    MissingFieldError,
    SampleError,
    ShardflowError,
    ShardFormatError,
    TruncatedShardError,
)
from .format.tar import iter_samples
from .plan import RankPlan
from .source import ShardSet

__all__ = ["ErrorPolicy", "read_planned", "emit_in_order", "read_shards", "select_fields", "decode", "apply_transform", "batched"]

log = logging.getLogger(__name__)
Sample = dict[str, Any]
_OPENERS = 4  # threads opening the next segments (each open waits on requests: index, first bytes)
ON_ERROR = ("raise", "skip", "warn")


class ErrorPolicy:
    """The dataset's bad-input policy and its counters.

    Args:
        mode: ``"raise"`` raises the error (it names shard, key and reason);
            ``"skip"`` drops the whole sample and counts it; ``"warn"`` does
            the same and logs a warning for the first :attr:`WARN_EACH` of a
            pass, then one total per pass (samples dropped, by reason).
        max_consecutive: under skip/warn, raise after this many bad samples in
            a row with no good one (a pass that can yield nothing fails fast).

    Attributes:
        stats: counters: ``samples`` (yielded), ``skipped`` (samples dropped),
            and one counter per reason (``truncated_shard``, ``missing_field``,
            ``decode``, ``transform``, ``duplicate_field``, ``non_adjacent``,
            ``bad_shard``, ``remote_read``, ...); shard-level reasons count
            shards, ``lost_samples`` counts the samples they took with them.
    """

    WARN_EACH = 10
    """Under ``"warn"``, the bad samples of a pass logged one by one; the rest are counted
    and reported in the total that :meth:`check_end` logs."""

    def __init__(self, mode: str = "raise", max_consecutive: int = 1000) -> None:
        if mode not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {mode!r}")
        self.mode = mode
        self.max_consecutive = max_consecutive
        self.stats: Counter[str] = Counter()
        self.bad_shards: dict[str, set[str]] = {}
        self._run = 0  # bad samples since the last good one (as of ``stats["samples"] == self._good``)
        self._good = 0
        self._warned = 0
        self._last: ShardflowError | None = None

    def handle(self, err: ShardflowError, *, samples: int = 1, shard: str | None = None) -> None:
        """Raise ``err`` or count it (``samples`` dropped with it).

        With ``shard`` (a shard-level problem), the reason counts distinct shards.
        """
        if self.mode == "raise":
            raise err
        if shard is not None:
            urls = self.bad_shards.setdefault(err.reason, set())
            urls.add(shard)
            self.stats[err.reason] = len(urls)
        else:
            self.stats[err.reason] += 1
        self.stats["skipped"] += samples
        good = self.stats["samples"]
        if good != self._good:  # a sample was yielded since the last bad one
            self._run, self._good = 0, good
        self._run += samples
        self._last = err
        if self.mode == "warn":
            self._warned += 1
            if self._warned <= self.WARN_EACH:
                log.warning("skipped %d sample(s): %s", samples, err)
            if self._warned == self.WARN_EACH:
                log.warning("on_error='warn': further bad samples are counted, not logged; "
                            "the total follows at the end of the pass")
        if self._run >= self.max_consecutive:
            raise ShardflowError(
                f"{self._run} bad samples in a row and none good (on_error={self.mode!r}); last error: {err}"
            ) from err

    def snapshot(self) -> dict[str, Any]:
        """The counters plus the bad shards per reason, for merging across workers."""
        out: dict[str, Any] = dict(self.stats)
        if self.bad_shards:
            out["bad_shards"] = {reason: sorted(urls) for reason, urls in self.bad_shards.items()}
        return out

    def good(self) -> None:
        """Record a yielded sample: ``stats["samples"] += 1``, which a hot loop may do itself
        (the run of bad samples in a row restarts whenever that counter moves)."""
        self.stats["samples"] += 1

    def check_end(self) -> None:
        """At the end of a pass: fail if everything was dropped; under ``"warn"``, log
        the total dropped (by reason) when there was any."""
        if self.mode == "warn" and self.stats["skipped"]:
            reasons = {k: v for k, v in self.stats.items() if k not in ("samples", "skipped") and v}
            log.warning("on_error='warn': skipped %d of %d samples in this pass (%s)",
                        self.stats["skipped"], self.stats["skipped"] + self.stats["samples"],
                        ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())))
        if self.stats["samples"] == 0 and self.stats["skipped"] > 0 and self._last is not None:
            raise ShardflowError(
                f"the pass yielded no sample: all {self.stats['skipped']} were dropped "
                f"({dict(self.stats)}); last error: {self._last}"
            ) from self._last


class _Opened:
    """The samples of one shard (or segment) over a byte stream that is already open.

    The stream's read-ahead thread starts when the shard is opened, so a shard
    opened one step before it is needed downloads while the previous one is
    decoded. ``close()`` releases the stream (thread, file handle, connection)
    whether or not a sample was read.
    """

    __slots__ = ("_raw", "_samples")

    def __init__(self, raw: Iterator[bytes], samples: Iterator[Any]) -> None:
        self._raw = raw
        self._samples = samples

    def __iter__(self) -> _Opened:
        return self

    def __next__(self) -> Any:
        return next(self._samples)

    def close(self) -> None:
        try:
            _close(self._samples)
        finally:
            _close(self._raw)


def _from(items: Iterator[Any], start: int) -> Iterator[Any]:
    for n, item in enumerate(items):
        if n >= start:
            yield item


def _size_check(source: ShardSet, shard: int) -> Callable[[int], None] | None:
    """A check of the shard's size against the manifest, made when the shard is
    opened: offsets into a replaced shard would cut samples in the wrong places,
    and a whole read of one would yield samples the manifest does not list."""
    manifest = source.manifest
    if manifest is None or manifest.shards[shard].bytes < 0:
        return None
    url = source.urls[shard]
    listed = manifest.shards[shard].bytes

    def check(size: int) -> None:
        # shorter: cut short after indexing; reading it yields the samples before the
        # cut and then reports the truncation. Longer: the shard was replaced.
        if size > listed:
            raise ManifestError(
                f"{url}: the shard has {size} bytes but the manifest lists {listed}: it changed since the "
                "manifest was written (re-run `shardflow index`, or restore the shard)",
                reason="changed_shard",
            )

    return check


def _open_segment(
    source: ShardSet,
    shard: int,
    start: int,
    stop: int,
    offsets: np.ndarray | None,
    io: storage.IOOptions,
    walk: np.ndarray | None = None,
) -> _Opened:
    """Samples ``[start, stop)`` of one shard, seeking with the offset index if any.

    The shard's bytes start streaming at once (see :func:`storage.open_chunks`);
    its size is checked against the manifest as it opens. ``walk``: without
    ``offsets``, the offset index all the same, to walk the tar headers faster
    (:func:`iter_samples`' ``walk_starts``) and to tell where samples start (its
    ``starts``), as a read that seeks with it does: one sample per indexed
    position, whichever way the shard is read.
    """
    url = source.urls[shard]
    io = source.options_for(shard, io)  # a source's own storage options
    check = _size_check(source, shard)
    if offsets is not None:
        lo, hi = int(offsets[start]), int(offsets[stop])
        raw = storage.open_chunks(url, lo, hi, io, check_size=check)
        return _Opened(raw, _seek_samples(raw, url, lo, hi, io, offsets[start : stop + 1]))
    manifest = source.manifest
    # read to the end: the manifest's digest checks the bytes where the store gives no validator
    # (a local file always has one: its size, mtime and inode, see storage.readers.local)
    sha = manifest.shards[shard].sha256 if manifest is not None and stop >= manifest.shards[shard].samples else None
    if storage.is_local(url):
        sha = None
    raw = storage.open_chunks(url, 0, None, io, check_size=check, sha256=sha)
    chunks: Iterator[bytes] = _Unclosed(raw) if sha else raw  # the tar reader stops at the end-of-archive
    samples = iter_samples(storage.decompressing_chunks(chunks, url), url, 0, limit=stop, sample_errors="yield",
                           limits=io.limits, starts=walk, walk_starts=walk)
    if sha:
        samples = _drained(samples, raw)
    return _Opened(raw, _from(samples, start) if start else samples)


def _drained(samples: Iterator[Any], raw: Iterator[bytes]) -> Iterator[Any]:
    """``samples``, with the rest of ``raw`` read (the end-of-archive padding) before the
    last one is given, so that a whole read reaches its end, where its digest is checked,
    while the reader still listens."""
    held = _NOTHING
    try:
        for item in samples:
            if held is not _NOTHING:
                yield held
            held = item
    except ShardflowError:
        if held is not _NOTHING:  # the error is the stream's, not the held sample's
            yield held
        raise
    for _ in raw:
        pass
    if held is not _NOTHING:
        yield held


_NOTHING = object()


class _Unclosed:
    """An iterator over ``it`` without ``close``: a consumer that stops early leaves ``it`` open."""

    __slots__ = ("_it",)

    def __init__(self, it: Iterator[bytes]) -> None:
        self._it = it

    def __iter__(self) -> _Unclosed:
        return self

    def __next__(self) -> bytes:
        return next(self._it)

def _seek_samples(
    raw: Iterator[bytes], url: str, lo: int, hi: int, io: storage.IOOptions, starts: np.ndarray
) -> Iterator[Any]:
    """Samples of the tar bytes ``[lo, hi)`` (``starts``: their offsets); a compressed shard gets an error that says so."""
    try:
        yield from iter_samples(raw, url, lo, end=hi, sample_errors="yield", limits=io.limits, starts=starts,
                                walk_starts=starts)
    except ShardFormatError as e:
        try:
            compressed = storage.is_compressed(url, io)
        except Exception:  # noqa: BLE001 - the format error is the one to report
            compressed = False
        if not compressed:
            raise
        raise ShardFormatError(
            f"{url}: compressed shard (gzip/zstd), but the manifest gives it an offset index: byte offsets "
            "cannot seek into a compressed stream. Re-index the shards with `shardflow index` (compressed "
            "shards then stream whole), or decompress them",
            reason="compressed_shard",
        ) from e


def _one_sample_lost(err: ShardflowError) -> bool:
    """Whether ``err``, met in a sample reached through the offset index, loses that sample only.

    A damaged header or member does; a shard cut short, compressed, or whose
    index does not match it loses every sample after.
    """
    return (
        isinstance(err, ShardFormatError)
        and not isinstance(err, TruncatedShardError)
        and err.reason not in ("compressed_shard", "stale_index")
    )


def _open_shard(source: ShardSet, shard: int, io: storage.IOOptions) -> _Opened:
    """All samples of one shard (no manifest); streaming starts at once."""
    url = source.urls[shard]
    io = source.options_for(shard, io)
    raw = storage.open_chunks(url, 0, None, io)
    return _Opened(raw, iter_samples(storage.decompressing_chunks(raw, url), url, 0, sample_errors="yield", limits=io.limits))


SEEK_GAP = 16  # unneeded samples read through rather than seeking over them (local files)
# On a remote store a seek is a new request: a round trip (tens of ms on a bucket)
# and several ms of client CPU (botocore). Gaps up to this many bytes (estimated
# from the manifest's mean sample size) are read through instead.
REMOTE_SEEK_BYTES = 4 << 20


def _read_through(source: ShardSet, shard: int) -> int:
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


def _runs(
    plan: RankPlan, positions: np.ndarray, source: ShardSet, expand: int, gaps: dict[int, int] | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs of needed samples: ``(segment, first, last)`` arrays, sorted by (segment, first).

    Within a segment, needed samples further apart than :data:`SEEK_GAP` (on a
    remote store: about :data:`REMOTE_SEEK_BYTES`) form separate runs when the
    shard has an offset index (so the reader can seek); without one a segment is
    a single run (reading restarts at the shard's start). ``gaps`` caches
    :func:`_read_through` per shard (filled here, for the caller to reuse).
    """
    gaps = {} if gaps is None else gaps
    seg = plan.read_segment[positions].astype(np.int64)
    smp = plan.read_sample[positions]
    order = np.lexsort((smp, seg))
    seg, smp = seg[order], smp[order]
    for s in plan.segments:
        if s.shard not in gaps:
            gaps[s.shard] = _read_through(source, s.shard)
    # per segment: the largest gap read through; -1: not seekable (one run)
    through = np.asarray(
        [gaps[s.shard] if source.index_urls[s.shard] is not None else -1 for s in plan.segments], dtype=np.int64
    )
    new = np.ones(len(seg), dtype=bool)
    if len(seg) > 1:
        lim = through[seg[1:]]
        gap = (smp[1:] // expand) - (smp[:-1] // expand) > lim
        new[1:] = (seg[1:] != seg[:-1]) | (gap & (lim >= 0))
    starts = np.flatnonzero(new)
    ends = np.append(starts[1:], len(seg)) - 1
    return seg[starts], smp[starts], smp[ends]


def _blocks(run: np.ndarray, sample: np.ndarray, wanted: np.ndarray) -> np.ndarray:
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


def _run_of(plan: RankPlan, lo: int, hi: int, runs: tuple[np.ndarray, np.ndarray, np.ndarray]) -> np.ndarray:
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


def read_planned(
    plan: RankPlan,
    needed: np.ndarray,
    source: ShardSet,
    io: storage.IOOptions,
    policy: ErrorPolicy,
    offsets: Callable[[int], np.ndarray | None],
    expand: int = 1,
    prepare: Callable[[Sample], list[Any] | None] | None = None,
    *,
    sources: Sequence[int] | None = None,
    positioned: bool = True,
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
        prepare: with ``expand > 1``, turns one raw sample into its
            ``expand`` items (or None when the sample was dropped); each
            sample is read and prepared once.
        sources: with ``expand == 1``, the source index of every shard, set as
            ``__source__`` on each sample as it is made (None: not set).
        positioned: False to yield the items alone (when read order is the
            order wanted, no reordering needs the positions).

    Yields:
        ``(position, item)`` for every needed position, in read order (or the
        ``item`` alone, see ``positioned``); ``item`` is None when it was dropped.
    """
    positions = np.flatnonzero(needed)
    if positions.size == 0:
        return
    lo, hi = int(positions[0]), int(positions[-1]) + 1
    # Reads: runs of needed samples per segment. A gap of more unneeded samples than
    # _read_through allows (SEEK_GAP locally, about REMOTE_SEEK_BYTES remotely)
    # starts a new run, opened by seeking with the offset index, so a worker
    # that owns every k-th batch, or a resumed epoch, reads only what it yields.
    gaps: dict[int, int] = {}  # shard -> the gap its runs read through (see _read_through)
    runs = _runs(plan, positions, source, expand, gaps)
    run_seg, first, last = runs
    # plain lists: indexing numpy arrays element by element is several times slower
    run_all = _run_of(plan, lo, hi, runs)
    read_segment = run_all.tolist()
    read_sample = plan.read_sample[lo:hi].tolist()
    wanted = needed[lo:hi].tolist()
    first_l, last_l = first.tolist(), last.tolist()
    run_seg_l = run_seg.tolist()
    seg_of = run_all[positions - lo]
    iters: dict[int, _Opened] = {}
    dead: set[int] = set()
    urls = source.urls
    k = expand
    cached: dict[int, tuple[int, list[Any] | None]] = {}  # segment -> (sample index, its items)
    # Read-ahead of the next shards: segments in the order they are first read;
    # opening one also starts opening the next ones (as many as are open), so
    # their bytes stream while this one is decoded.
    segs, first_at = np.unique(seg_of, return_index=True)
    opening = segs[np.argsort(first_at, kind="stable")].tolist()
    rank_of = {seg: j for j, seg in enumerate(opening)}
    scheduled = 0  # opening[:scheduled] are open, done, or being opened
    local = all(storage.is_local(urls[plan.segments[run_seg_l[seg]].shard]) for seg in opening)

    counts = source.counts
    # per run: the URL and source of its shard, set on every sample it gives
    run_url = [urls[plan.segments[r].shard] for r in run_seg_l]
    run_source = [int(sources[plan.segments[r].shard]) for r in run_seg_l] if sources is not None else None

    def _ended(shard: int, sample: int) -> TruncatedShardError:
        return TruncatedShardError(
            f"{urls[shard]}: shard ended before sample {sample}; the manifest lists "
            f"{counts[shard] if counts is not None else '?'} samples"
        )

    def open_seg(s: int) -> _Opened:
        seg = plan.segments[run_seg_l[s]]
        shard = seg.shard
        start, stop = first_l[s] // k, last_l[s] // k + 1
        # A run that starts and ends within a read-through gap of the shard's ends
        # streams the shard from its start (skipping to ``start``): no offset index
        # to fetch, one request fewer per shard and worker on a remote store.
        gap = gaps[shard]
        whole = counts is not None and start <= gap and counts[shard] - stop <= gap
        # A local shard read whole still gets its offset index (one small local read), to walk
        # its headers for many samples at once.
        index = offsets(shard) if local or not whole else None
        return _open_segment(source, shard, start, stop, None if whole else index, io, index)

    # segments opened early are opened in a background thread (loading the offset
    # index is a request too); an error is raised when the segment is reached
    opener: ThreadPoolExecutor | None = None
    opened_early: dict[int, Future[_Opened]] = {}
    # runs that go on through the offset index after a format error: the sample the
    # index was entered at (-1: not yet), and the error that sent them there
    reseek: dict[int, int] = {}
    first_error: dict[int, ShardflowError] = {}
    try:
        # (a position outside every run has s == -1: _run_of checks the run's first and last sample)
        # positions yielded in read order: a block of positions that read the next samples of an open
        # run goes in one loop (see _blocks); anything unusual in it goes on position by position
        aheads = _blocks(run_all, plan.read_sample[lo:hi], needed[lo:hi]).tolist() if k == 1 and not positioned else repeat(0)
        steps = zip(range(lo, hi), read_segment, read_sample, wanted, aheads)
        for pos, s, i, want, ahead in steps:
            if s < 0:
                continue
            if k > 1:
                hit = cached.get(s)
                if hit is not None and hit[0] == i // k:
                    if i == last_l[s]:
                        cached.pop(s, None)
                    if want:
                        items = hit[1]
                        got = items[i % k] if items is not None else None
                        yield (pos, got) if positioned else got
                    continue
            item = None
            error: ShardflowError | None = None
            it = iters.get(s)
            if it is not None and ahead > 1:  # the common case: the run is open, its next samples wanted
                url, done = run_url[s], 0
                tag = run_source[s] if run_source is not None else None
                try:
                    for item in islice(it._samples, ahead):
                        fields = item[2]
                        if type(fields) is not dict:  # a bad sample: the general code below drops it
                            break
                        if tag is None:
                            yield {"__key__": item[0], "__url__": url, **fields}
                        else:
                            yield {"__key__": item[0], "__url__": url, **fields, "__source__": tag}
                        done += 1
                    else:
                        item = None
                except ShardflowError as e:
                    item, error = None, e
                if done == ahead:
                    if i + done - 1 == last_l[s]:
                        _close(iters.pop(s, None))
                    if done > 1:
                        next(islice(steps, done - 2, None), None)  # the block's positions are served
                    continue
                if done:  # on at the first position not served, with what it met
                    if done > 1:
                        next(islice(steps, done - 2, None), None)
                    pos, s, i, want, ahead = next(steps)
                if item is None and error is None:
                    error = _ended(plan.segments[run_seg_l[s]].shard, i)
            elif it is not None:  # the run's stream is open
                try:
                    item = next(it._samples, None)  # (the generator itself: no __next__ in Python)
                except ShardflowError as e:
                    error = e
                else:
                    if item is None:
                        error = _ended(plan.segments[run_seg_l[s]].shard, i // k)
            elif s in dead:  # (a dead run has no open stream)
                if want:
                    policy.stats["lost_samples"] += 1
                    policy.stats["skipped"] += 1
                    yield (pos, None) if positioned else None
                continue
            while item is None:  # open the run's stream, or an error: the slow path
                seg = plan.segments[run_seg_l[s]]
                if error is None:
                    if s in reseek and not want:
                        break  # resumed through the index at the next needed sample
                    try:
                        if s in reseek:
                            it = iters[s] = _open_segment(
                                source, seg.shard, i // k, last_l[s] // k + 1, offsets(seg.shard), io
                            )
                            reseek[s] = i // k
                        else:
                            early = opened_early.pop(s, None)
                            scheduled = max(scheduled, rank_of[s] + 1)
                            it = iters[s] = early.result() if early is not None else open_seg(s)
                            # as many segments opening ahead as are open now (the interleave);
                            # not for local files: opening one takes microseconds, and a thread
                            # doing it costs the reader GIL hand-offs (measured: 30% of raw
                            # iteration time on 5 MB shards)
                            while not local and scheduled < len(opening) and len(opened_early) < len(iters):
                                if opener is None:
                                    opener = ThreadPoolExecutor(_OPENERS, thread_name_prefix="shardflow-open")
                                ahead = opening[scheduled]
                                opened_early[ahead] = opener.submit(open_seg, ahead)
                                scheduled += 1
                        item = next(it, None)
                        if item is None:
                            error = _ended(seg.shard, i // k)
                    except ShardflowError as e:
                        error = e
                    if item is not None:
                        break
                _close(iters.pop(s, None))
                e, error = error, None
                if (
                    isinstance(e, ShardFormatError)
                    and reseek.get(s) != i // k
                    and source.index_urls[seg.shard] is not None
                    and e.reason != "compressed_shard"
                ):
                    # A format error met while reading from the shard's start or through a
                    # gap may lie in samples that are not this reader's: go on through the
                    # offset index from this sample on, so that only its own samples decide.
                    # An error in the sample the index led to is this sample's.
                    reseek[s] = -1
                    first_error.setdefault(s, e)
                    continue
                if e.reason == "compressed_shard" and s in first_error:
                    e = first_error[s]  # the index cannot enter it: the first error is the one
                if policy.mode == "raise":
                    raise e
                policy.handle(e, samples=0, shard=source.urls[seg.shard])
                if _one_sample_lost(e) and reseek.get(s) == i // k:
                    # the sample the index led to is damaged, and the index knows where the next
                    # one starts: only this one is lost, the next needed one is sought again
                    if k > 1 and i != last_l[s]:
                        cached[s] = (i // k, None)
                else:
                    dead.add(s)
                if want:
                    policy.stats["lost_samples"] += 1
                    policy.stats["skipped"] += 1
                    yield (pos, None) if positioned else None
                break
            if item is None:
                continue
            if i // k == last_l[s] // k:
                _close(iters.pop(s, None))
            if k > 1:
                key, _, fields = item
                items: list[Any] | None = None
                if isinstance(fields, SampleError):
                    policy.handle(fields)
                else:
                    raw_sample: Sample = {"__key__": key, "__url__": run_url[s]}
                    raw_sample.update(fields)
                    items = prepare(raw_sample) if prepare is not None else None
                if i != last_l[s]:
                    cached[s] = (i // k, items)
                if want:
                    got = items[i % k] if items is not None else None
                    yield (pos, got) if positioned else got
                continue
            if not want:
                continue
            key, _, fields = item
            if type(fields) is not dict:  # a SampleError
                policy.handle(fields)
                yield (pos, None) if positioned else None
                continue
            if run_source is None:
                sample: Sample = {"__key__": key, "__url__": run_url[s], **fields}
            else:
                sample = {"__key__": key, "__url__": run_url[s], **fields, "__source__": run_source[s]}
            yield (pos, sample) if positioned else sample
    finally:
        for it in iters.values():
            _close(it)
        for early in opened_early.values():
            if not early.cancel() and early.exception() is None:
                _close(early.result())
        if opener is not None:
            opener.shutdown(wait=True)


def _close(it: Any) -> None:
    if it is not None and hasattr(it, "close"):
        it.close()


def emit_in_order(items: Iterator[tuple[int, Sample | None]], order: np.ndarray) -> Iterator[Sample | None]:
    """Yield items by ``order`` (positions), buffering those read early.

    The buffer holds at most the shuffle buffer's size plus the interleave
    look-ahead, because the order was made by simulating that buffer.
    """
    stash: dict[int, Sample | None] = {}
    try:
        if order.size < 2 or bool(np.all(order[1:] > order[:-1])):
            # yield order is read order (no shuffle buffer): no reordering to do
            for _, s in items:
                yield s
            return
        for pos in order.tolist():
            while pos not in stash:
                p, s = next(items)
                stash[p] = s
            yield stash.pop(pos)
    finally:
        _close(items)


def read_shards(
    shard_ids: Sequence[int], source: ShardSet, io: storage.IOOptions, policy: ErrorPolicy
) -> Iterator[Sample | None]:
    """Read whole shards in order (no manifest): every sample, errors per policy.

    Each shard is opened when the previous one starts, so it downloads meanwhile.
    """
    ahead = _open_shard(source, shard_ids[0], io) if shard_ids else None
    try:
        for j, shard in enumerate(shard_ids):
            url = source.urls[shard]
            it, ahead = ahead, None
            if j + 1 < len(shard_ids):
                ahead = _open_shard(source, shard_ids[j + 1], io)
            try:
                for key, _, fields in it:
                    if isinstance(fields, SampleError):
                        policy.handle(fields)
                        yield None
                        continue
                    sample: Sample = {"__key__": key, "__url__": url}
                    sample.update(fields)
                    yield sample
            except ShardflowError as e:
                if policy.mode == "raise":
                    raise
                policy.handle(e, samples=0, shard=url)
                if isinstance(e, ShardFormatError) and (e.offset or e.member is not None):
                    # the damaged sample (past the start, or named by a sound header: not a file that
                    # is no tar at all); without a manifest, how many followed it is unknown
                    policy.stats["lost_samples"] += 1
                    policy.stats["skipped"] += 1
            finally:
                it.close()
    finally:
        _close(ahead)


def expand_each(samples: Iterator[Sample | None], prepare: Callable[[Sample], list[Any] | None], k: int) -> Iterator[Any]:
    """Replace each sample by its ``k`` prepared items (``k`` Nones when it was dropped)."""
    for s in samples:
        items = prepare(s) if s is not None else None
        if items is None:
            yield from [None] * k
        else:
            yield from items


def wanted_fields(fields: Sequence[str]) -> list[tuple[str, list[str]]]:
    """``(name, alternatives)`` of each requested field (``"jpg;png"``, ``"image"``), for :func:`select_one`."""
    return [(f.split(";")[0], field_alternatives(f)) for f in fields]


def select_one(s: Sample, wanted: list[tuple[str, list[str]]], policy: ErrorPolicy) -> Sample | None:
    """One sample of :func:`select_fields`."""
    out: Sample = {"__key__": s["__key__"], "__url__": s["__url__"]}
    for name, alternatives in wanted:
        for alt in alternatives:
            if alt in s:
                out[name] = s[alt]
                break
        else:
            present = sorted(k for k in s if not k.startswith("__"))
            policy.handle(
                MissingFieldError(f"{s['__url__']}: sample {s['__key__']!r} has no field {name!r} (fields present: {present})")
            )
            return None
    if "__source__" in s:  # set as the sample was read
        out["__source__"] = s["__source__"]
    return out


def select_fields(samples: Iterator[Sample | None], fields: Sequence[str], policy: ErrorPolicy) -> Iterator[Sample | None]:
    """Keep ``__key__``, ``__url__`` and the requested fields; a missing one is an error.

    A requested name may list alternatives separated by ``;`` (``"jpg;png"``):
    the first present is kept under the first name. ``"image"`` stands for
    whichever image field a sample has (see :func:`shardflow.codecs.field_alternatives`).
    """
    wanted = wanted_fields(fields)
    for s in samples:
        yield None if s is None else select_one(s, wanted, policy)


def decode_one(s: Sample, options: DecodeOptions, policy: ErrorPolicy, graph_records: bool = False) -> Sample | None:
    """One sample of :func:`decode`."""
    try:
        for name, value in s.items():
            if not name.startswith("__"):
                s[name] = decode_field(name, value, options, graph_records=graph_records)
    except DecodeError as e:
        policy.handle(DecodeError(f"{s['__url__']}: sample {s['__key__']!r}: cannot decode {e}", reason=e.reason))
        return None
    return s


def decode(
    samples: Iterator[Sample | None], options: DecodeOptions, policy: ErrorPolicy, graph_records: bool = False
) -> Iterator[Sample | None]:
    """Decode every field by its extension (see :mod:`shardflow.codecs`); ``graph_records``:
    as :func:`~shardflow.codecs.decode_field` (the samples go to the default collate)."""
    for s in samples:
        yield None if s is None else decode_one(s, options, policy, graph_records)


def apply_transform(samples: Iterator[Sample | None], transform: Callable[[Sample], Any], policy: ErrorPolicy) -> Iterator[Any]:
    """Apply the user's per-sample transform; a raised exception follows the policy,
    a returned None drops the sample (counted as ``filtered``)."""
    name = getattr(transform, "__qualname__", repr(transform))
    for s in samples:
        if s is None:
            yield None
            continue
        try:
            out = transform(s)
        except Exception as e:
            err = SampleError(
                f"{s.get('__url__')}: sample {s.get('__key__')!r}: transform {name} raised {type(e).__name__}: {e}",
                reason="transform",
            )
            if policy.mode == "raise":
                raise err from e
            policy.handle(err)
            yield None
            continue
        if out is None:
            policy.stats["filtered"] += 1
        yield out


def batched(items: Iterator[Any], sizes: Sequence[int], collate: Callable[[list[Any]], Any]) -> Iterator[tuple[int, Any]]:
    """Group items into batches of the planned sizes, dropping Nones.

    Yields ``(index, batch)`` for every planned batch, ``index`` its number in
    ``sizes``, so the number of batches never changes; a batch whose samples
    were dropped (``on_error="skip"``) is shorter, and one whose samples were
    *all* dropped is ``(index, None)`` (the loader repeats a neighbouring batch
    in its place, so every DDP rank still takes the same number of steps).
    """
    for index, size in enumerate(sizes):
        group = []
        for _ in range(size):
            item = next(items, _END)
            if item is _END:
                break
            if item is not None:
                group.append(item)
        yield index, (collate(group) if group else None)


_END = object()