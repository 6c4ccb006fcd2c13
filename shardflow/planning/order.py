"""Orders of one epoch, pure functions of (counts, seed, epoch): shard permutations,
stream positions to shard segments, interleaved reading, the shuffle buffer."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import numpy.random  # noqa: F401 - numpy loads it on first use: here, not in each worker's first batch

from ..world import stable_seed

T = TypeVar("T")

__all__ = ["Segment", "shard_order", "positions_to_segments", "interleave", "shuffle_buffer", "buffer_shuffle_order", "BufferDraws"]


@dataclass(frozen=True)
class Segment:
    """Samples ``[start, stop)`` of shard number ``shard`` (manifest order)."""

    shard: int
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start


def shard_order(num_shards: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """Shard order of an epoch: a permutation of ``range(num_shards)``, int64.

    Seeded by ``(seed, epoch)`` with SHA-256 (:func:`shardflow.world.stable_seed`),
    so it is the same on every machine, rank and worker.
    """
    if not shuffle:
        return np.arange(num_shards, dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64(stable_seed("shards", seed, epoch)))
    return rng.permutation(num_shards).astype(np.int64)


def positions_to_segments(
    counts: np.ndarray, first: int, stop: int, seed: int, epoch: int, shuffle: bool, endless: bool
) -> list[Segment]:
    """Map stream positions ``[first, stop)`` to shard segments.

    One pass of the stream is every shard once, in the order of ``(seed, pass)``
    (endless) or ``(seed, epoch)`` (one pass per epoch, positions past the end
    wrapping to the start, i.e. padding).
    """
    total = int(counts.sum())
    out: list[Segment] = []
    pos = first
    while pos < stop:
        p, off = divmod(pos, total)
        order = shard_order(len(counts), seed, p if endless else epoch, shuffle)
        ends = np.cumsum(counts[order])
        i = int(np.searchsorted(ends, off, side="right"))
        while pos < stop and i < len(order):
            shard_start = int(ends[i] - counts[order[i]])
            lo = off - shard_start
            take = min(int(counts[order[i]]) - lo, stop - pos)
            if take > 0:
                out.append(Segment(int(order[i]), lo, lo + take))
                pos += take
                off += take
            i += 1
    return out


def shuffle_buffer(items: Iterable[T], buffer: int, seed: int, initial: int = 100) -> Iterator[T]:
    """Pass items through a seeded shuffle buffer (the webdataset ``shuffle`` stage, made exact).

    The buffer fills to ``min(initial, buffer)`` items before the first item
    leaves; while it holds fewer than ``buffer``, each step reads two items and
    emits one (so it grows by one per emitted item); once full, each step reads
    one and emits one. An emitted item is chosen uniformly among the buffered
    ones. At the end the rest leaves in random order. ``buffer <= 1``: items
    pass unchanged. Same ``(items, buffer, seed, initial)``, same output. The picks
    come from :class:`BufferDraws`, as :func:`buffer_shuffle_order`'s do.
    """
    if buffer <= 1:
        yield from items
        return
    rand = BufferDraws(seed).next
    initial = min(initial, buffer)
    it = iter(items)
    buf: list[T] = []
    more = True
    while True:
        if more:
            for _ in range(1 if len(buf) >= buffer - 1 else 2):
                try:
                    buf.append(next(it))
                except StopIteration:
                    more = False
                    break
            if more and len(buf) < initial:
                continue
        if not buf:
            return
        j = int(rand() * len(buf))
        out = buf[j]
        buf[j] = buf[-1]
        buf.pop()
        yield out


def _steady_state(buf: list[int], first: int, n: int, picks: np.ndarray, last: int) -> np.ndarray:
    """Items emitted by the steady state of the buffer, computed with numpy (``buf`` updated).

    Step ``t`` reads item ``first + t`` and picks slot ``picks[t]``: the pick ``last``
    emits the new item itself; another emits what the slot holds (the item put there
    by the slot's previous step, else its content before the steady state) and puts
    the new item there. The same as the step-by-step loop, without a Python step
    per item. ``picks``: int64, shape (n - first,); returns int64, shape (n - first,).
    """
    j = np.asarray(picks, dtype=np.int64)
    new = np.arange(first, n, dtype=np.int64)
    out = new.copy()
    swap = np.flatnonzero(j != last)
    if swap.size:
        slots = j[swap]
        # steps grouped by slot, in time order (a stable sort; a radix sort on 16 bits)
        order = np.argsort(slots.astype(np.uint16) if last < 1 << 16 else slots, kind="stable")
        by_slot, steps = slots[order], swap[order]
        start = np.ones(len(steps), dtype=bool)
        start[1:] = by_slot[1:] != by_slot[:-1]
        held = np.asarray(buf, dtype=np.int64)
        prev = np.empty(len(steps), dtype=np.int64)
        prev[start] = held[by_slot[start]]  # a slot's first pick emits what it held
        prev[~start] = new[steps[np.flatnonzero(~start) - 1]]  # later ones, the previous new item
        out[steps] = prev
        ends = np.append(np.flatnonzero(start)[1:], len(steps)) - 1
        held[by_slot[ends]] = new[steps[ends]]  # what each slot holds at the end
        buf[:] = held.tolist()
    return out


def buffer_shuffle_order(n: int, buffer: int, seed: int, initial: int = 100) -> np.ndarray:
    """Emission order of :func:`shuffle_buffer` over ``n`` items read in order.

    Returns:
        int64 array, a permutation of ``range(n)``; identity when ``buffer <= 1``.
    """
    if buffer <= 1 or n <= 1:
        return np.arange(n, dtype=np.int64)
    # shuffle_buffer(range(n), ...) written out for ints, faster (docs/benchmarks.md; it runs in every worker
    # before its first batch): the filling and growing steps, then the steady state where
    # the buffer holds `buffer - 1` items between steps
    draws = BufferDraws(seed)
    rand = draws.next
    initial = min(initial, buffer)
    buf: list[int] = []
    out: list[int] = []
    emit = out.append
    i = size = 0
    while i < n and size < buffer - 1 or (size < initial and i < n):
        buf.append(i)
        i += 1
        size += 1
        if size < buffer and i < n:
            buf.append(i)
            i += 1
            size += 1
        if size < initial and i < n:
            continue
        j = int(rand() * size)
        emit(buf[j])
        buf[j] = buf[-1]
        buf.pop()
        size -= 1
    steady = np.zeros(0, dtype=np.int64)
    if i < n:  # steady: each new item joins the `buffer - 1` held ones and one of the `buffer` leaves
        # the steady picks, then those of the final drain, drawn at once: the same doubles as rand()
        x = draws.take(n - i + len(buf))
        steady = _steady_state(buf, i, n, (x[: n - i] * buffer).astype(np.int64), buffer - 1)
        drain = (x[n - i :] * np.arange(len(buf), 0, -1, dtype=np.float64)).astype(np.int64).tolist()
    else:
        drain = [int(rand() * size) for size in range(len(buf), 0, -1)]
    last: list[int] = []
    for j in drain:
        last.append(buf[j])
        buf[j] = buf[-1]
        buf.pop()
    return np.concatenate([np.asarray(out, dtype=np.int64), steady, np.asarray(last, dtype=np.int64)])


class BufferDraws:
    """The doubles in ``[0, 1)`` that one shuffle buffer picks its items with.

    numpy's PCG64 seeded with ``seed``, each 64-bit output's top 53 bits scaled by
    ``2**-53`` (the bit generator's stream, unlike a ``Generator`` method's, is the
    same in every numpy version). The same doubles come one by one (:meth:`next`)
    or many at once (:meth:`take`), in any mix, so the planned order and the
    buffer over a stream of items pick alike.
    """

    _BLOCK = 256

    def __init__(self, seed: int) -> None:
        self._bits = np.random.PCG64(seed)
        self._block: list[float] = []
        self._at = 0

    def _draw(self, m: int) -> np.ndarray:
        return (self._bits.random_raw(m) >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)

    def next(self) -> float:
        """The next double."""
        if self._at == len(self._block):
            self._block, self._at = self._draw(self._BLOCK).tolist(), 0
        x = self._block[self._at]
        self._at += 1
        return x

    def take(self, m: int) -> np.ndarray:
        """The next ``m`` doubles, float64 of shape (m,)."""
        held = np.asarray(self._block[self._at : self._at + m], dtype=np.float64)
        self._at += len(held)
        return held if len(held) == m else np.concatenate([held, self._draw(m - len(held))])


def interleave(segments: list[Segment], ways: int) -> tuple[np.ndarray, np.ndarray]:
    """Read order that takes one sample from each of ``ways`` open segments in turn.

    Round robin over the open segments; a segment that ends is replaced, at the
    start of the next round, by the next one in order. Computed a stretch of
    rounds at a time (until the next segment ends) with numpy: this runs in
    every worker before its first batch.
    """
    if not segments:
        return np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int64)
    if ways <= 1:
        lengths = np.asarray([len(seg) for seg in segments], dtype=np.int64)
        seg_ids = np.repeat(np.arange(len(segments), dtype=np.int32), lengths)
        starts = np.asarray([seg.start for seg in segments], dtype=np.int64)
        offsets = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        return seg_ids, np.repeat(starts, lengths) + offsets
    seg_parts: list[np.ndarray] = []
    sample_parts: list[np.ndarray] = []
    pending = 0
    active: list[list[int]] = []  # [segment id, next sample, samples left]
    while pending < len(segments) or active:
        while pending < len(segments) and len(active) < ways:
            seg = segments[pending]
            active.append([pending, seg.start, max(seg.stop - seg.start, 1)])
            pending += 1
        rounds = min(slot[2] for slot in active)
        ids = np.asarray([slot[0] for slot in active], dtype=np.int32)
        nxt = np.asarray([slot[1] for slot in active], dtype=np.int64)
        seg_parts.append(np.tile(ids, rounds))
        sample_parts.append((nxt[None, :] + np.arange(rounds, dtype=np.int64)[:, None]).ravel())
        for slot in active:
            slot[1] += rounds
            slot[2] -= rounds
        active = [slot for slot in active if slot[2] > 0]
    return np.concatenate(seg_parts), np.concatenate(sample_parts)
