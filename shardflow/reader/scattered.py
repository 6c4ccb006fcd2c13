"""Reading a scattered plan (a window shuffle, :mod:`shardflow.planning.window`): :func:`read_scattered`.

Each needed sample is read on its own through its shard's offset index, with ``os.preadv`` on a
descriptor kept open per shard (the least recently used closed beyond :data:`OPEN_SHARDS`), into one
block buffer that a pass reuses. The tar parse, whose cost is mostly per call, runs over :data:`BLOCK`
samples at once, in that buffer: the samples lie one after another and their starts are known (so
samples with equal keys stay apart), and each field's ``bytes`` is the one copy made of it. When that
parse does not give one clean sample of ``bytes`` fields per position (a damaged sample among them,
members the bulk parse leaves to the general path), the block is parsed again from copies of the reads,
as one ``bytes`` stream and, where that is not clean either, each of those samples on its own, with its
shard's URL and offsets in the errors, under the dataset's ``on_error`` policy. Only local plain ``.tar``
shards get scattered plans (:mod:`shardflow.dataset.classmix`).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .. import storage
from ..errors import ManifestError, ShardflowError, TruncatedShardError
from ..format.tar import iter_samples, raw_sample
from ..planning.plan import RankPlan
from ..policy import ErrorPolicy
from ..sources.source import ShardSet

__all__ = ["read_scattered", "BLOCK", "OPEN_SHARDS"]

BLOCK = 256
"""Samples parsed at once."""

OPEN_SHARDS = 256
"""Shard descriptors a pass keeps open."""

_PREADV = hasattr(os, "preadv")


class _Shards:
    """Open descriptors (least recently used closed first) and offset indexes of a pass's shards."""

    def __init__(self, source: ShardSet, offsets: Callable[[int], np.ndarray | None]) -> None:
        self._source, self._offsets = source, offsets
        self._fds: OrderedDict[int, int] = OrderedDict()

    def index(self, shard: int) -> np.ndarray | None:
        """The shard's offset index (None without one)."""
        return self._offsets(shard)

    def span(self, shard: int, sample: int) -> tuple[int, int]:
        """``[lo, hi)`` of one sample in its shard (its offset index's entries)."""
        index = self._offsets(shard)
        if index is None:  # pragma: no cover - a scattered plan is made only for indexed shards
            url = self._source.urls[shard]
            raise ManifestError(f"{url}: no offset index to read sample {sample} by", reason="missing_index")
        return int(index[sample]), int(index[sample + 1])

    def read_into(self, shard: int, sample: int, lo: int, view: memoryview) -> None:
        """Fill ``view`` with the shard's bytes from ``lo`` on (sample ``sample``'s, for the error)."""
        fd = self._fd(shard)
        if _PREADV:
            got = os.preadv(fd, [view], lo)
        else:  # (a platform without preadv: one copy more)
            data = os.pread(fd, len(view), lo)
            got = len(data)
            view[:got] = data
        if got != len(view):
            raise TruncatedShardError(f"{self._source.urls[shard]}: shard ended before sample {sample} (bytes "
                                      f"[{lo}, {lo + len(view)}))")  # fmt: skip

    def _fd(self, shard: int) -> int:
        fd = self._fds.get(shard)
        if fd is not None:
            self._fds.move_to_end(shard)
            return fd
        url = self._source.urls[shard]
        fd = storage.regular_fd(url[len("file://") :] if url.startswith("file://") else url)
        m = self._source.manifest
        listed = m.shards[shard].bytes if m is not None else -1
        if listed >= 0 and os.fstat(fd).st_size > listed:
            os.close(fd)
            raise ManifestError(f"{url}: the shard has more bytes than the manifest lists ({listed}): it changed since "
                                "the manifest was written (re-run `shardflow index`, or restore the shard)",
                                reason="changed_shard")  # fmt: skip
        self._fds[shard] = fd
        while len(self._fds) > OPEN_SHARDS:
            os.close(self._fds.popitem(last=False)[1])
        return fd

    def close(self) -> None:
        while self._fds:
            os.close(self._fds.popitem()[1])


def _one(data: bytes, lo: int, hi: int, url: str, io: storage.IOOptions, policy: ErrorPolicy) -> dict[str, Any] | None:
    """One sample parsed on its own (None: dropped under the policy)."""
    found = list(iter_samples([data], url, lo, end=hi, sample_errors="yield", limits=io.limits, starts=[lo, hi]))
    if len(found) != 1:
        policy.handle(ManifestError(f"{url}: bytes [{lo}, {hi}) hold {len(found)} samples instead of 1; the offset "
                                    "index does not match the shard (run `shardflow index`)", reason="stale_index"))
        return None
    key, _, fields = found[0]
    if type(fields) is not dict:
        policy.handle(fields)
        return None
    return raw_sample(key, url, fields)


def _block(reads: list[tuple[bytes, int, int]], urls: list[str], io: storage.IOOptions, policy: ErrorPolicy) -> list[Any]:
    """The samples of a block of reads: parsed at once, or one by one when that is not clean."""
    ends = np.cumsum([len(d) for d, _, _ in reads])
    starts = np.concatenate([[0], ends]).astype(np.int64)
    try:
        found = list(iter_samples([b"".join(d for d, _, _ in reads)], "scattered", 0, end=int(ends[-1]),
                                  sample_errors="yield", limits=io.limits, starts=starts, walk_starts=starts))  # fmt: skip
    except ShardflowError:
        found = []
    if len(found) == len(reads) and all(type(f) is dict for _, _, f in found):
        return [raw_sample(k, u, f) for (k, _, f), u in zip(found, urls)]
    return [_one(d, lo, hi, u, io, policy) for (d, lo, hi), u in zip(reads, urls)]


def _read_in_place(block: bytearray, reads: list[tuple[int, int, int]], urls: list[str], io: storage.IOOptions,
                   policy: ErrorPolicy) -> list[Any]:
    """The samples of a block read into ``block`` (``reads``: ``(position in block, lo, hi)``
    each, one after another from 0), parsed where they lie: their fields are the one copy
    made of them (no per-sample ``bytes`` read, no joined copy of the block). Anything but
    the clean case (a sample that is not one whole sample of plain members, the general
    tar path, an error) goes to :func:`_block` on copies of the reads, which decides as
    it always did."""
    end = reads[-1][0] + reads[-1][2] - reads[-1][1]
    starts = np.array([p for p, _, _ in reads] + [end], dtype=np.int64)
    try:
        found = list(iter_samples([block], "scattered", 0, end=end, sample_errors="yield", limits=io.limits,
                                  starts=starts, walk_starts=starts))  # fmt: skip
        if len(found) == len(reads) and all(type(f) is dict and all(type(v) is bytes for v in f.values())
                                            for _, _, f in found):
            return [raw_sample(k, u, f) for (k, _, f), u in zip(found, urls)]
    except Exception:  # noqa: BLE001 - decided below, on bytes, exactly as before
        pass
    view = memoryview(block)
    return _block([(bytes(view[p : p + hi - lo]), lo, hi) for p, lo, hi in reads], urls, io, policy)


def _grown(block: bytearray, used: int, need: int) -> bytearray:
    """``block``, or a larger one holding its first ``used`` bytes, with room for ``need``
    bytes (a quarter more, or twice the old size while a block is filled read by read)."""
    if need <= len(block):
        return block
    bigger = bytearray(max(need + need // 4, 2 * len(block) if used else 0))
    bigger[:used] = memoryview(block)[:used]
    return bigger


_SPAN_SHARDS = 32  # a block reading from more shards than this looks its samples up one by one


def _spans(files: _Shards, shards: list[int], samples: list[int]) -> tuple[list[int], list[int], int] | None:
    """``(lo, hi, total bytes)`` of the samples of a block, from their shards' offset indexes
    at once; None where an index is missing or cannot be loaded, or the block reads from many
    shards (then each sample is looked up on its own, and a failure is reported as it comes)."""
    shard_of = np.asarray(shards, dtype=np.int64)
    sample_of = np.asarray(samples, dtype=np.int64)
    lo = np.empty(len(shards), dtype=np.int64)
    hi = np.empty(len(shards), dtype=np.int64)
    distinct = np.unique(shard_of).tolist()
    if len(distinct) > _SPAN_SHARDS:
        return None
    try:
        for shard in distinct:
            index = files.index(shard)
            if index is None:
                return None
            at = shard_of == shard
            first = sample_of[at]
            lo[at] = index[first]
            hi[at] = index[first + 1]
    except (ShardflowError, OSError, IndexError, ValueError):
        return None
    return lo.tolist(), hi.tolist(), int((hi - lo).sum())


def read_scattered(
    plan: RankPlan,
    needed: np.ndarray,
    source: ShardSet,
    io: storage.IOOptions,
    policy: ErrorPolicy,
    offsets: Callable[[int], np.ndarray | None],
    *,
    positioned: bool = True,
) -> Iterator[Any]:
    """Read the needed positions of a scattered plan, in read order.

    Args:
        plan: the rank's plan (:attr:`~shardflow.planning.plan.RankPlan.scattered`).
        needed: bool array over read positions.
        source: the shards (local plain ``.tar`` files with offset indexes).
        io: storage options (the limits).
        policy: error policy: a sample that cannot be read is dropped under it (yielded as None).
        offsets: ``offsets(shard)``: the shard's offset index.
        positioned: False to yield the samples alone.

    Yields:
        ``(position, sample)`` per needed position (or the sample alone); None for a dropped one.
    """
    positions = np.flatnonzero(needed)
    shard_of = np.asarray([s.shard for s in plan.segments], dtype=np.int64)
    shards = shard_of[plan.read_segment[positions].astype(np.int64)] if len(positions) else positions
    samples = plan.read_sample[positions]
    files = _Shards(source, offsets)
    block = bytearray()  # a block's samples, one after another (reused from block to block)
    try:
        for at in range(0, len(positions), BLOCK):
            reads: list[tuple[int, int, int] | None] = []
            used = 0
            todo_shards, todo_samples = shards[at : at + BLOCK].tolist(), samples[at : at + BLOCK].tolist()
            spans = _spans(files, todo_shards, todo_samples)
            if spans is not None:
                block = _grown(block, 0, spans[2])  # (room for all of them: a failed read leaves none unused)
            view = memoryview(block)
            for k, (shard, sample) in enumerate(zip(todo_shards, todo_samples)):
                try:
                    if spans is None:
                        lo, hi = files.span(shard, sample)
                        if used + hi - lo > len(block):
                            block = _grown(block, used, used + hi - lo)
                            view = memoryview(block)
                    else:
                        lo, hi = spans[0][k], spans[1][k]
                    files.read_into(shard, sample, lo, view[used : used + hi - lo])
                except ShardflowError as e:
                    policy.handle(e, samples=0, shard=source.urls[shard])
                    policy.lost()
                    reads.append(None)
                except OSError as e:
                    url = source.urls[shard]
                    err = (storage.ShardNotFoundError(f"shard not found: {url}") if isinstance(e, FileNotFoundError)
                           else TruncatedShardError(f"{url}: sample {sample} could not be read: {e}"))
                    policy.handle(err, samples=0, shard=url, cause=e)
                    policy.lost()
                    reads.append(None)
                else:
                    reads.append((used, lo, hi))
                    used += hi - lo
            urls = [source.urls[s] for s in shards[at : at + BLOCK].tolist()]
            good = [j for j, r in enumerate(reads) if r is not None]
            parsed = (_read_in_place(block, [reads[j] for j in good], [urls[j] for j in good], io, policy)  # type: ignore[misc]
                      if good else [])
            out: list[Any] = [None] * len(reads)
            for j, s in zip(good, parsed):
                out[j] = s
            for pos, s in zip(positions[at : at + BLOCK].tolist(), out):
                yield (pos, s) if positioned else s
    finally:
        files.close()
