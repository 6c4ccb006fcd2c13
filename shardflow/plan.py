"""Splitting and shuffling an epoch: pure functions of (counts, world, seed, epoch).

With per-shard sample counts (from the manifest), an epoch is planned exactly:

1. **Shard order.** Shards are permuted per epoch with a generator seeded by
   ``(seed, epoch)`` (or kept in manifest order without shuffling). Their
   samples, concatenated in that order, form the epoch's *stream*.
2. **Ranks.** Every rank gets the same number of samples: ``ceil(N / W)`` with
   ``partial="pad"`` (positions past the end repeat the stream from its start,
   as ``torch.utils.data.DistributedSampler`` does) or ``floor(N / W)`` with
   ``partial="drop"``. Rank ``r`` takes the contiguous stream positions
   ``[r * n, (r + 1) * n)``, so ranks start and stop inside shards and read
   them by seeking with the offset index. With ``samples_per_epoch`` set, the
   stream is endless (pass ``p`` is the shard order of ``(seed, p)``) and epoch
   ``e`` takes the next ``W * samples_per_epoch`` positions.
3. **Mixing.** A rank reads up to ``interleave`` of its shard segments at once
   (round robin), and passes the samples through a shuffle buffer of
   ``buffer`` samples seeded by ``(seed, epoch, rank)``. The buffer is
   simulated on sample positions, so the yield order is known before any byte
   is read; resumption uses it to seek to the first unconsumed sample.
4. **Batches and workers.** The yield order is cut into ``ceil(n / B)``
   batches (``floor`` with ``drop_last``). Each DataLoader worker takes whole
   batches and reads only the samples they hold (seeking with the offset
   index), so batch contents, per-rank batch counts and ``len()`` do not
   depend on ``num_workers``; a worker may get none. With shuffling, a worker
   takes a contiguous run of batches (its own stretch of the stream); without,
   batches go round robin over the workers, so the DataLoader, which takes one
   batch from each worker in turn, yields them in stored order.

Over an epoch the ranks and workers together see every sample exactly once,
plus the declared padding (``partial="pad"``) or minus the declared drop.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

import numpy as np
import numpy.random  # noqa: F401 - numpy loads it on first use: here, not in each worker's first batch

from .errors import ShardflowError
from .world import World, stable_seed

T = TypeVar("T")

__all__ = [
    "ShuffleConfig",
    "SplitConfig",
    "Segment",
    "RankPlan",
    "shard_order",
    "rank_share",
    "plan_epoch",
    "worker_batches",
    "cost_batches",
    "buffer_shuffle_order",
    "shuffle_buffer",
    "split_unsized",
]


@dataclass(frozen=True)
class ShuffleConfig:
    """Shuffling options.

    Attributes:
        shards: permute shard order per epoch.
        buffer: shuffle buffer size in samples (0 or 1: off).
        interleave: shard segments a worker reads at once, round robin (1: one
            after the other).
        initial: the buffer starts emitting once it holds this many samples
            (at most ``buffer``) and then grows by one per emitted sample up to
            ``buffer`` (as webdataset's ``shuffle(initial=...)``), so the first
            batch does not wait for the whole buffer to fill.
    """

    shards: bool = True
    buffer: int = 1000
    interleave: int = 4
    initial: int = 100

    def __post_init__(self) -> None:
        if self.buffer < 0 or self.interleave < 1 or self.initial < 1:
            raise ValueError(
                "shuffle buffer must be >= 0, interleave >= 1 and initial >= 1, got "
                f"{self.buffer}, {self.interleave}, {self.initial}"
            )

    @classmethod
    def off(cls) -> ShuffleConfig:
        """Stored order: shards as listed, samples in file order."""
        return cls(shards=False, buffer=0, interleave=1)

    @property
    def enabled(self) -> bool:
        return self.shards or self.buffer > 1 or self.interleave > 1


@dataclass(frozen=True)
class SplitConfig:
    """How an epoch is split over ranks, workers and batches.

    Attributes:
        partial: ``"pad"`` repeats samples so every rank gets ``ceil(N/W)``;
            ``"drop"`` leaves out the last ``N mod W`` stream positions.
        batch_size: samples per batch (1 when the dataset yields samples).
        drop_last: drop each rank's last incomplete batch.
        samples_per_epoch: fixed samples per rank per epoch (training by steps,
            shards resampled from an endless stream), or None for one pass.
        max_cost: batch by cost instead of count: consecutive samples join a
            batch while their summed cost (for graphs: nodes or edges) stays
            within ``max_cost`` (a sample costlier than that gets a batch of
            its own), up to ``batch_size`` samples. Every rank still yields the
            same number of batches: ranks with fewer batches split their
            largest ones. Needs per-sample costs from the manifest.
    """

    partial: Literal["pad", "drop"] = "pad"
    batch_size: int = 1
    drop_last: bool = False
    samples_per_epoch: int | None = None
    max_cost: int | None = None

    def __post_init__(self) -> None:
        if self.max_cost is not None and (self.max_cost < 1 or self.drop_last):
            raise ValueError("max_cost must be >= 1 and cannot be combined with drop_last")
        if self.partial not in ("pad", "drop"):
            raise ValueError(f"partial must be 'pad' or 'drop', got {self.partial!r}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.samples_per_epoch is not None and self.samples_per_epoch < 1:
            raise ValueError(f"samples_per_epoch must be >= 1, got {self.samples_per_epoch}")


@dataclass(frozen=True)
class Segment:
    """Samples ``[start, stop)`` of shard number ``shard`` (manifest order)."""

    shard: int
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class RankPlan:
    """One rank's epoch: what it reads and in which order it yields.

    Attributes:
        samples: samples this rank yields (before ``drop_last``).
        padding: padded samples over all ranks this epoch.
        dropped: samples left out over all ranks this epoch (``partial="drop"``
            and ``drop_last``).
        num_batches: batches this rank yields, whatever the worker count.
        batch_size: samples per batch (the last one may be smaller).
        segments: the rank's shard segments in stream order.
        read_segment: int32 array, segment number of each read position.
        read_sample: int64 array, sample index (in its shard) of each read position.
        emit: int64 array, read positions in yield order; batch ``b`` is
            ``emit[b * batch_size : (b + 1) * batch_size]``.
        batch_ends: with cost batching, int64 array: batch ``b`` ends at
            ``emit`` position ``batch_ends[b]`` (exclusive); None otherwise.
    """

    samples: int
    padding: int
    dropped: int
    num_batches: int
    batch_size: int
    segments: tuple[Segment, ...]
    read_segment: np.ndarray
    read_sample: np.ndarray
    emit: np.ndarray
    batch_ends: np.ndarray | None = None

    def batch_positions(self, batches: Sequence[int]) -> tuple[list[int], np.ndarray]:
        """Sizes of the given batches and their :attr:`emit` entries, concatenated in order."""
        ids = np.asarray(batches, dtype=np.int64)
        if self.batch_ends is not None:
            ends = self.batch_ends
        else:
            ends = np.minimum(np.arange(1, self.num_batches + 1, dtype=np.int64) * self.batch_size, len(self.emit))
        starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
        lo, hi = starts[ids], ends[ids]
        sizes = hi - lo
        if ids.size == 0:
            return [], np.zeros(0, np.int64)
        # positions lo[j] .. hi[j]-1 of every batch j, without a Python loop
        offsets = np.repeat(lo - np.concatenate([[0], np.cumsum(sizes)[:-1]]), sizes)
        return sizes.tolist(), self.emit[np.arange(int(sizes.sum()), dtype=np.int64) + offsets]

    def batch_slice(self, batch: int) -> slice:
        """Positions in :attr:`emit` of batch number ``batch``."""
        if self.batch_ends is not None:
            return slice(int(self.batch_ends[batch - 1]) if batch else 0, int(self.batch_ends[batch]))
        return slice(batch * self.batch_size, min((batch + 1) * self.batch_size, len(self.emit)))


def worker_batches(num_batches: int, worker: int, num_workers: int, interleaved: bool = False) -> range:
    """Batch numbers of one DataLoader worker; counts differ by at most one.

    Contiguous (default): a run of consecutive batches, so with shuffling each
    worker reads its own stretch of the stream. Interleaved: batches
    ``worker, worker + num_workers, ...``; the DataLoader takes one batch from
    each worker in turn, so the loader yields batches in plan order (stored
    order when shuffling is off). Readers seek over the other workers'
    batches with the offset index.
    """
    if interleaved:
        return range(worker, num_batches, num_workers)
    return range(worker * num_batches // num_workers, (worker + 1) * num_batches // num_workers)


def shard_order(num_shards: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """Shard order of an epoch: a permutation of ``range(num_shards)``, int64.

    Seeded by ``(seed, epoch)`` with SHA-256 (:func:`shardflow.world.stable_seed`),
    so it is the same on every machine, rank and worker.
    """
    if not shuffle:
        return np.arange(num_shards, dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64(stable_seed("shards", seed, epoch)))
    return rng.permutation(num_shards).astype(np.int64)


def _samples_per_rank(total: int, world_size: int, split: SplitConfig) -> int:
    if split.samples_per_epoch is not None:
        return split.samples_per_epoch
    if split.partial == "pad":
        return -(-total // world_size)
    return total // world_size


def rank_share(total: int, world_size: int, split: SplitConfig) -> tuple[int, int, int, int]:
    """``(samples, num_batches, padding, dropped)`` of each rank.

    A dataset whose shards are all empty gives every rank 0 samples and 0
    batches (as reading its empty tars would), not an error.

    Raises:
        ShardflowError: a rank would get no sample or batch although the dataset has some.
    """
    w = world_size
    if total == 0:  # every shard is empty (a valid empty tar): nothing to split, nothing wrong
        return 0, 0, 0, 0
    n = _samples_per_rank(total, w, split)
    if n == 0:
        raise ShardflowError(
            f"{total} samples cannot be split over {w} ranks with partial='drop': every rank would get 0; "
            "use partial='pad'"
        )
    bs = split.batch_size
    nb = n // bs if split.drop_last else -(-n // bs)
    if nb == 0:
        raise ShardflowError(
            f"each of the {w} ranks gets {n} samples, fewer than batch_size={bs}, and drop_last=True drops them all"
        )
    if split.samples_per_epoch is not None:
        padding, dropped = 0, 0
    else:
        padding = max(n * w - total, 0)
        dropped = max(total - n * w, 0)
    dropped += (n - min(n, nb * bs)) * w
    return n, nb, padding, dropped


def _positions_to_segments(
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
    pass unchanged. Same ``(items, buffer, seed, initial)``, same output.
    """
    if buffer <= 1:
        yield from items
        return
    rand = random.Random(seed).random
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


def _steady_state(buf: list[int], first: int, n: int, picks: list[int], last: int) -> list[int]:
    """Items emitted by the steady state of the buffer, computed with numpy (``buf`` updated).

    Step ``t`` reads item ``first + t`` and picks slot ``picks[t]``: the pick ``last``
    emits the new item itself; another emits what the slot holds (the item put there
    by the slot's previous step, else its content before the steady state) and puts
    the new item there. The same as the step-by-step loop, without a Python step
    per item.
    """
    j = np.asarray(picks, dtype=np.int64)
    new = np.arange(first, n, dtype=np.int64)
    out = new.copy()
    swap = np.flatnonzero(j != last)
    if swap.size:
        slots = j[swap]
        order = np.argsort(slots, kind="stable")  # steps grouped by slot, in time order
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
    return out.tolist()


def buffer_shuffle_order(n: int, buffer: int, seed: int, initial: int = 100) -> np.ndarray:
    """Emission order of :func:`shuffle_buffer` over ``n`` items read in order.

    Returns:
        int64 array, a permutation of ``range(n)``; identity when ``buffer <= 1``.
    """
    if buffer <= 1 or n <= 1:
        return np.arange(n, dtype=np.int64)
    # shuffle_buffer(range(n), ...) written out for ints, 3x faster (it runs in every
    # worker before its first batch): the filling and growing steps, then the steady
    # state where the buffer holds `buffer - 1` items between steps
    rand = random.Random(seed).random
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
    if i < n:  # steady: each new item joins the `buffer - 1` held ones and one of the `buffer` leaves
        out.extend(_steady_state(buf, i, n, [int(rand() * buffer) for _ in range(n - i)], buffer - 1))
    while buf:
        j = int(rand() * len(buf))
        emit(buf[j])
        buf[j] = buf[-1]
        buf.pop()
    return np.asarray(out, dtype=np.int64)


def _interleave(segments: list[Segment], ways: int) -> tuple[np.ndarray, np.ndarray]:
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


def _rank_order(
    counts: np.ndarray, rank: int, world_size: int, seed: int, epoch: int, shuffle: ShuffleConfig, split: SplitConfig
) -> tuple[list[Segment], np.ndarray, np.ndarray, np.ndarray, tuple[int, int, int, int]]:
    """Segments, read order and yield order of one rank's samples."""
    n, nb, padding, dropped = share = rank_share(int(counts.sum()), world_size, split)
    used = n if split.max_cost is not None else min(n, nb * split.batch_size)
    base = rank * n
    endless = split.samples_per_epoch is not None
    if endless:
        base += epoch * world_size * n
    segments = _positions_to_segments(counts, base, base + used, seed, epoch, shuffle.shards, endless)
    read_segment, read_sample = _interleave(segments, shuffle.interleave)
    emit = buffer_shuffle_order(len(read_sample), shuffle.buffer, stable_seed("buffer", seed, epoch, rank), shuffle.initial)
    return segments, read_segment, read_sample, emit, share


def cost_batches(costs: np.ndarray, max_cost: int, max_count: int) -> list[int]:
    """Greedy batch ends over a cost sequence: a batch takes samples while the
    summed cost stays within ``max_cost`` and its size within ``max_count``."""
    ends: list[int] = []
    total = 0
    count = 0
    for i, c in enumerate(costs.tolist()):
        if count and (total + c > max_cost or count >= max_count):
            ends.append(i)
            total = 0
            count = 0
        total += c
        count += 1
    if count:
        ends.append(len(costs))
    return ends


def _split_to(ends: list[int], target: int) -> list[int]:
    """Split the batches with the most samples until there are ``target`` of them."""
    ends = list(ends)
    while len(ends) < target:
        starts = [0, *ends[:-1]]
        sizes = [e - b for b, e in zip(starts, ends)]
        i = max(range(len(sizes)), key=lambda j: (sizes[j], -j))
        if sizes[i] < 2:
            raise ShardflowError(
                f"cannot give every rank {target} cost-bounded batches: a rank has only {ends[-1]} samples"
            )
        ends.insert(i, starts[i] + sizes[i] // 2)
    return ends


def plan_epoch(
    counts: np.ndarray | list[int],
    rank: int,
    world_size: int,
    seed: int,
    epoch: int,
    shuffle: ShuffleConfig,
    split: SplitConfig,
    costs: np.ndarray | None = None,
) -> RankPlan:
    """Plan one rank's epoch.

    Args:
        counts: samples per shard, manifest order.
        rank: this rank, ``0 <= rank < world_size``.
        world_size: number of ranks.
        seed: the dataset seed.
        epoch: the epoch number.
        shuffle: shuffling options.
        split: split options.
        costs: with ``split.max_cost``: int64 cost of every sample, shards
            concatenated in manifest order.

    Returns:
        The rank's plan. It does not depend on the DataLoader worker count:
        workers take whole batches of it (:func:`worker_batches`).

    Raises:
        ShardflowError: see :func:`rank_share`; or cost batching without costs.
    """
    counts = np.asarray(counts, dtype=np.int64)
    segments, read_segment, read_sample, emit, (n, nb, padding, dropped) = _rank_order(
        counts, rank, world_size, seed, epoch, shuffle, split
    )
    batch_ends = None
    if split.max_cost is not None:
        if costs is None or len(costs) != int(counts.sum()):
            raise ShardflowError("batching by cost needs per-sample costs from the manifest (a 'sizes' index per shard)")
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])

        def rank_ends(segs: list[Segment], rseg: np.ndarray, rsmp: np.ndarray, em: np.ndarray) -> list[int]:
            shard_of = np.asarray([sg.shard for sg in segs], dtype=np.int64)
            idx = starts[shard_of[rseg]] + rsmp if len(segs) else np.zeros(0, np.int64)
            return cost_batches(costs[idx[em]], split.max_cost or 0, split.batch_size)

        per_rank = []
        for r in range(world_size):
            if r == rank:
                per_rank.append(rank_ends(segments, read_segment, read_sample, emit))
            else:
                other = _rank_order(counts, r, world_size, seed, epoch, shuffle, split)
                per_rank.append(rank_ends(*other[:4]))
        target = max(len(e) for e in per_rank)
        batch_ends = np.asarray(_split_to(per_rank[rank], target), dtype=np.int64)
        nb = target
    return RankPlan(
        samples=n,
        padding=padding,
        dropped=dropped,
        num_batches=nb,
        batch_size=split.batch_size,
        segments=tuple(segments),
        read_segment=read_segment,
        read_sample=read_sample,
        emit=emit,
        batch_ends=batch_ends,
    )


def split_unsized(num_shards: int, world: World, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """Shards of one (rank, worker) when sample counts are unknown (no manifest).

    Whole shards go round robin over the ``world_size * num_workers`` streams
    (rank-major), after the epoch's shard permutation. Every shard is read
    once per epoch, but streams may get different numbers of samples.

    Raises:
        ShardflowError: this rank would get no shard (fewer shards than ranks).
    """
    if num_shards < world.world_size:
        last = world.world_size - 1
        empty = f"rank {last}" if num_shards == last else f"ranks {num_shards} to {last}"
        raise ShardflowError(
            f"{num_shards} shard(s) cannot be split over {world.world_size} ranks without sample counts: "
            f"{empty} would get no data. Write a manifest with `shardflow index` so that ranks "
            "can split inside shards"
        )
    order = shard_order(num_shards, seed, epoch, shuffle)
    mine = order[world.rank :: world.world_size]
    return [int(s) for s in mine[world.worker :: world.num_workers]]
