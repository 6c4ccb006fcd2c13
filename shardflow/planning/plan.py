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

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from .costs import cost_batches, cost_budgets, split_to
from ..errors import ShardflowError
from .mixing import Mixture, mixture_order
from .affinity import keep_parts
from .window import DEFAULT_WINDOW, window_epoch, window_rank, window_reorder
from .order import Segment, buffer_shuffle_order, interleave, positions_to_segments, shard_order, shuffle_buffer
from ..world import World, stable_seed

__all__ = [
    "ShuffleConfig",
    "SplitConfig",
    "Segment",
    "RankPlan",
    "Mixture",
    "shard_order",
    "rank_share",
    "plan_epoch",
    "worker_batches",
    "cost_batches",
    "cost_budgets",
    "split_to",
    "buffer_shuffle_order",
    "shuffle_buffer",
    "split_unsized",
    "select_plan",
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
        affinity: each rank keeps epoch 0's shard parts in every epoch, reshuffled per epoch, so
            that with a ``cache_dir`` large enough for its share, later epochs fetch nothing
            (docs/remote.md: what it gives up in mixing). Not with ``samples_per_epoch``; it
            turns the window off.
        window: window shuffle, in samples (:mod:`shardflow.planning.window`): each
            sample of the epoch moves by up to this many stream positions, so
            class-sorted shards give mixed batches; the samples are then read
            one by one through the offset index. 0 or 1: off (segments are read
            ``interleave`` at a time, as stored). Used for local shards only.
    """

    shards: bool = True
    buffer: int = 1000
    interleave: int = 4
    initial: int = 100
    affinity: bool = False
    window: int = DEFAULT_WINDOW

    def __post_init__(self) -> None:
        if self.buffer < 0 or self.interleave < 1 or self.initial < 1 or self.window < 0:
            raise ValueError("shuffle buffer must be >= 0, interleave >= 1, initial >= 1 and window >= 0, got "
                             f"{self.buffer}, {self.interleave}, {self.initial}, {self.window}")

    @classmethod
    def off(cls) -> ShuffleConfig:
        """Stored order: shards as listed, samples in file order."""
        return cls(shards=False, buffer=0, interleave=1, window=0)

    @property
    def enabled(self) -> bool:
        return self.shards or self.buffer > 1 or self.interleave > 1 or self.window > 1


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
            its own), up to ``batch_size`` samples. An int (one cost) or a
            tuple of ints, one budget per cost column, each respected. Every rank still yields the
            same number of batches: ranks with fewer batches split their
            largest ones. Needs per-sample costs from the manifest.
    """

    partial: Literal["pad", "drop"] = "pad"
    batch_size: int = 1
    drop_last: bool = False
    samples_per_epoch: int | None = None
    max_cost: int | tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.max_cost is not None:
            budgets = self.max_cost if isinstance(self.max_cost, tuple) else (self.max_cost,)
            if not budgets or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in budgets) or self.drop_last:
                raise ValueError(f"max_cost must be >= 1 (one int per cost) and cannot be combined with drop_last, got {self.max_cost!r}")
        if self.partial not in ("pad", "drop"):
            raise ValueError(f"partial must be 'pad' or 'drop', got {self.partial!r}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.samples_per_epoch is not None and self.samples_per_epoch < 1:
            raise ValueError(f"samples_per_epoch must be >= 1, got {self.samples_per_epoch}")


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
        quotas: in a weighted mixture, the rank's samples of each source this
            epoch (:func:`shardflow.planning.mixing.rank_quotas`); None otherwise.
        contiguous: False when :attr:`read_sample` skips samples of a shard that
            no read position holds (a selection, :func:`select_plan`): a reader
            seeks, through the offset index, at every such gap.
        scattered: True when the read order visits a shard's samples in any
            order (a window shuffle, :mod:`shardflow.planning.window`): a reader reads
            each one on its own, through the offset index.
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
    quotas: tuple[int, ...] | None = None
    contiguous: bool = True
    scattered: bool = False

    def batch_positions(self, batches: Sequence[int]) -> tuple[list[int], np.ndarray]:
        """Sizes of the given batches and their :attr:`emit` entries, concatenated in order."""
        ids = np.arange(batches.start, batches.stop, batches.step) if type(batches) is range else np.asarray(batches)
        ids = ids.astype(np.int64, copy=False)
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


def _rank_order(
    counts: np.ndarray, rank: int, world_size: int, seed: int, epoch: int, shuffle: ShuffleConfig, split: SplitConfig,
    mixture: Mixture | None = None,
) -> tuple[list[Segment], np.ndarray, np.ndarray, np.ndarray, tuple[int, int, int, int], tuple[int, ...] | None]:
    """Segments, read order, yield order, share and (mixtures) per-source quotas of one rank's samples."""
    n, nb, padding, dropped = share = rank_share(int(counts.sum()), world_size, split)
    quotas = None
    if mixture is not None:
        if split.samples_per_epoch is None:
            raise ShardflowError("a weighted mixture needs samples_per_epoch (the samples of each rank per epoch)")
        segments, read_segment, read_sample, quotas = mixture_order(
            counts, mixture, rank, world_size, n, seed, epoch, shuffle.shards, shuffle.interleave
        )
        if shuffle.window > 1:  # each rank's quotas are its own: its read order is shuffled on its own
            read_segment, read_sample = window_reorder(
                read_segment, read_sample, shuffle.window, stable_seed("window", seed, epoch, rank)
            )
    elif shuffle.window > 1:  # the epoch's positions window-shuffled, then strided over the ranks
        used = n if split.max_cost is not None else min(n, nb * split.batch_size)
        endless = split.samples_per_epoch is not None
        first = epoch * world_size * n if endless else 0
        segments, seg, smp = window_epoch(counts, first, world_size * n, seed, epoch, shuffle.shards, endless, shuffle.window)
        read_segment, read_sample = window_rank(seg, smp, rank, world_size, used)
    else:
        used = n if split.max_cost is not None else min(n, nb * split.batch_size)
        base = rank * n
        endless = split.samples_per_epoch is not None
        if endless:
            base += epoch * world_size * n
        if shuffle.affinity and not endless:  # epoch 0's parts, reordered per epoch (shardflow.planning.affinity)
            segments = keep_parts(positions_to_segments(counts, base, base + used, seed, 0, shuffle.shards, False),
                                  seed, epoch, rank)
        else:
            segments = positions_to_segments(counts, base, base + used, seed, epoch, shuffle.shards, endless)
        read_segment, read_sample = interleave(segments, shuffle.interleave)
    emit = buffer_shuffle_order(len(read_sample), shuffle.buffer, stable_seed("buffer", seed, epoch, rank), shuffle.initial)
    return segments, read_segment, read_sample, emit, share, quotas


def plan_epoch(
    counts: np.ndarray | list[int],
    rank: int,
    world_size: int,
    seed: int,
    epoch: int,
    shuffle: ShuffleConfig,
    split: SplitConfig,
    costs: np.ndarray | None = None,
    mixture: Mixture | None = None,
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
            concatenated in manifest order; shape (N,) or (N, C), one column per budget.
        mixture: the sources and weights of a weighted mixture (needs
            ``split.samples_per_epoch``; see :mod:`shardflow.planning.mixing`), or None.

    Returns:
        The rank's plan. It does not depend on the DataLoader worker count:
        workers take whole batches of it (:func:`worker_batches`).

    Raises:
        ShardflowError: see :func:`rank_share`; or cost batching without costs.
    """
    counts = np.asarray(counts, dtype=np.int64)
    segments, read_segment, read_sample, emit, (n, nb, padding, dropped), quotas = _rank_order(
        counts, rank, world_size, seed, epoch, shuffle, split, mixture
    )
    batch_ends = None
    if split.max_cost is not None:
        if costs is None or len(costs) != int(counts.sum()):
            raise ShardflowError("batching by cost needs per-sample costs from the manifest (a 'sizes' index per shard)")
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])

        def rank_ends(segs: list[Segment], rseg: np.ndarray, rsmp: np.ndarray, em: np.ndarray) -> list[int]:
            shard_of = np.asarray([sg.shard for sg in segs], dtype=np.int64)
            idx = starts[shard_of[rseg]] + rsmp if len(segs) else np.zeros(0, np.int64)
            return cost_batches(costs[idx[em]], split.max_cost or 0, split.batch_size)  # type: ignore[arg-type]

        per_rank = []
        for r in range(world_size):
            if r == rank:
                per_rank.append(rank_ends(segments, read_segment, read_sample, emit))
            else:
                other = _rank_order(counts, r, world_size, seed, epoch, shuffle, split, mixture)
                per_rank.append(rank_ends(*other[:4]))
        target = max(len(e) for e in per_rank)
        batch_ends = np.asarray(split_to(per_rank[rank], target), dtype=np.int64)
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
        quotas=quotas,
        scattered=shuffle.window > 1,
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


def select_plan(plan: RankPlan, chosen: Sequence[np.ndarray], expand: int = 1) -> RankPlan:
    """A plan made over selected samples, mapped back to the shards' own sample numbers.

    The plan was made (:func:`plan_epoch`) with ``len(chosen[s]) * expand`` items per
    shard ``s``; item ``i`` of shard ``s`` there is item ``chosen[s][i // expand] *
    expand + i % expand`` of the shard itself. Counts, batches and the yield order stay
    as planned, so every rank still gets the same number of samples and batches, and
    over an epoch the ranks together see every selected sample exactly once (plus the
    declared padding).

    Args:
        plan: one rank's plan over the selection.
        chosen: per shard (manifest order), the selected sample numbers, sorted
            int64 arrays.
        expand: items per stored sample (:mod:`shardflow.expand`).

    Returns:
        The same plan with :attr:`RankPlan.read_sample` and the segments' bounds in
        the shards' own numbering, and ``contiguous=False``.
    """
    sizes = np.asarray([len(c) for c in chosen], dtype=np.int64)
    base = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    flat = np.concatenate([np.asarray(c, dtype=np.int64) for c in chosen]) if len(chosen) else np.zeros(0, np.int64)

    def real(shard: np.ndarray, item: np.ndarray) -> np.ndarray:
        return flat[base[shard] + item // expand] * expand + item % expand

    shard_of = np.asarray([sg.shard for sg in plan.segments], dtype=np.int64)
    if len(plan.read_sample):
        read = real(shard_of[plan.read_segment.astype(np.int64)], plan.read_sample.astype(np.int64))
    else:
        read = plan.read_sample.astype(np.int64)
    segments = tuple(
        Segment(sg.shard, int(real(np.int64(sg.shard), np.int64(sg.start))), int(real(np.int64(sg.shard), np.int64(sg.stop - 1))) + 1)
        if sg.stop > sg.start else sg
        for sg in plan.segments
    )
    return replace(plan, read_sample=read, segments=segments, contiguous=False)
