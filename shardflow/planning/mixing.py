"""Weighted mixtures of sources: exact per-epoch quotas, and how they fall to ranks.

With weights ``w_s`` and ``samples_per_epoch = n`` (samples per rank), an epoch
of a world of ``W`` ranks holds ``T = W * n`` samples:

1. **Epoch quotas.** Source ``s`` gets ``Q_s`` of them, by largest remainder
   rounding of ``T * w_s / sum(w)`` (exact rational arithmetic): every source
   gets the floor of its share, and the samples left over go one each to the
   sources with the largest fractional parts (ties: the lower source index).
   ``sum(Q) == T`` and ``|Q_s - T * w_s / sum(w)| < 1``.
2. **Rank quotas.** The ``T`` slots are laid out source after source (``Q_0``
   slots of source 0, then ``Q_1`` of source 1, ...) and slot ``j`` falls to
   rank ``j mod W``. So rank ``r`` gets ``q[s][r]``, either ``floor(Q_s / W)``
   or ``ceil(Q_s / W)`` samples of source ``s``, exactly ``n`` in all, and
   ``sum_r q[s][r] == Q_s``: every rank yields the same number of batches.
3. **Draws.** Each source is an endless stream of passes (pass ``p`` is its
   shards in the order of ``(seed, source, p)``), read without repetition:
   epoch ``e`` takes its positions ``[e * Q_s, (e + 1) * Q_s)``, rank ``r``
   the contiguous stretch of ``q[s][r]`` of them after those of the ranks
   before it. A source smaller than its quota wraps into its next pass.
4. **Interleaving.** A rank reads its sources side by side, each spread
   evenly over the rank's read order (the ``k``-th of ``m`` samples of a
   source at time ``(k + 1/2) / m``), then passes them through the shuffle
   buffer: sources are mixed through the epoch, not one after the other.

Everything is a function of ``(weights, counts, world size, seed, epoch)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from ..errors import ShardflowError, SourceError
from .order import Segment, interleave, positions_to_segments
from ..world import stable_seed

__all__ = ["Mixture", "mixture_of", "epoch_quotas", "rank_quotas", "mixture_order"]


@dataclass(frozen=True)
class Mixture:
    """Sources of a weighted mixture in a shard list.

    Attributes:
        parts: ``(start, stop)`` shard numbers of each source, in source order.
        weights: positive relative weight of each source.
    """

    parts: tuple[tuple[int, int], ...]
    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.parts) != len(self.weights) or not self.parts:
            raise ValueError("a mixture needs one weight per source, and at least one source")
        if any(not w > 0 for w in self.weights):
            raise ValueError(f"mixture weights must be > 0, got {list(self.weights)}")


def mixture_of(parts: Sequence[Any], samples_per_epoch: int | None) -> Mixture | None:
    """The weighted mixture of a dataset's sources (:class:`shardflow.sources.source.SourcePart`), or None
    when no source has a weight.

    Raises:
        SourceError: weights on some sources only, no ``samples_per_epoch``, or a
            weighted source without a manifest (each message names the sources).
    """
    weighted = [p.weight is not None for p in parts]
    if not any(weighted):
        return None
    if not all(weighted):
        missing = ", ".join(f"{i} ({p.label})" for i, p in enumerate(parts) if p.weight is None)
        raise SourceError(f"weights are given for some sources only: source {missing} has none; give every source a weight, or none")
    if samples_per_epoch is None:
        raise SourceError("a weighted mixture needs samples_per_epoch: the samples of each rank per epoch, shared out by weight")
    bare = ", ".join(f"{i} ({p.label})" for i, p in enumerate(parts) if not p.sized)
    if bare:
        raise SourceError(f"a weighted mixture needs sample counts, and source {bare} has no shardflow.json; write one with `shardflow index`")
    return Mixture(tuple((p.start, p.stop) for p in parts), tuple(float(p.weight) for p in parts))


def epoch_quotas(weights: Sequence[float], total: int) -> list[int]:
    """Samples of each source in an epoch of ``total`` samples (largest remainder rounding).

    Args:
        weights: positive relative weights, one per source.
        total: samples in the epoch over all ranks.

    Returns:
        One int per source, summing to ``total``.
    """
    fw = [Fraction(w) for w in weights]
    whole = sum(fw)
    shares = [w * total / whole for w in fw]
    out = [int(s) for s in shares]  # floor: shares are >= 0
    left = total - sum(out)
    by_remainder = sorted(range(len(shares)), key=lambda i: (-(shares[i] - out[i]), i))
    for i in by_remainder[:left]:
        out[i] += 1
    return out


def rank_quotas(quotas: Sequence[int], world_size: int) -> list[list[int]]:
    """``q[s][r]``: samples of source ``s`` that rank ``r`` gets (see the module doc, rule 2)."""

    def upto(x: int, r: int) -> int:  # slots t < x with t mod W == r
        return max(0, (x - r + world_size - 1) // world_size)

    out = []
    start = 0
    for q in quotas:
        out.append([upto(start + q, r) - upto(start, r) for r in range(world_size)])
        start += q
    return out


def mixture_order(
    counts: np.ndarray, mixture: Mixture, rank: int, world_size: int, per_rank: int, seed: int, epoch: int,
    shards_shuffled: bool, ways: int,
) -> tuple[list[Segment], np.ndarray, np.ndarray, tuple[int, ...]]:
    """One rank's segments and read order in a mixture epoch.

    Args:
        counts: int64 samples per shard (all sources, shard list order).
        mixture: the sources and weights.
        rank: this rank.
        world_size: number of ranks.
        per_rank: samples per rank per epoch (``samples_per_epoch``).
        seed: the dataset seed.
        epoch: the epoch.
        shards_shuffled: permute each source's shards per pass.
        ways: segments of a source read at once (the interleave).

    Returns:
        ``(segments, read_segment, read_sample, quotas)``: the segments (shard
        numbers of the whole list), int32 segment and int64 sample of every read
        position, and the rank's samples per source.

    Raises:
        ShardflowError: a weighted source holds no sample.
    """
    quotas = epoch_quotas(mixture.weights, world_size * per_rank)
    per = rank_quotas(quotas, world_size)
    segments: list[Segment] = []
    seg_parts, sample_parts, time_parts, source_parts = [], [], [], []
    for s, (start, stop) in enumerate(mixture.parts):
        own = counts[start:stop]
        mine = per[s][rank]
        if int(own.sum()) == 0:
            if quotas[s]:
                raise ShardflowError(f"source {s} of the mixture holds no sample, but its weight gives it {quotas[s]} per epoch")
            continue
        first = epoch * quotas[s] + sum(per[s][:rank])
        local = positions_to_segments(own, first, first + mine, stable_seed("source", seed, s), epoch, shards_shuffled, True)
        segs = [Segment(start + g.shard, g.start, g.stop) for g in local]
        rs, rsmp = interleave(segs, ways)
        seg_parts.append(rs.astype(np.int64) + len(segments))
        sample_parts.append(rsmp)
        time_parts.append((np.arange(len(rs), dtype=np.float64) + 0.5) / max(len(rs), 1))
        source_parts.append(np.full(len(rs), s, dtype=np.int64))
        segments.extend(segs)
    if not seg_parts:
        return [], np.zeros(0, np.int32), np.zeros(0, np.int64), tuple(per[s][rank] for s in range(len(per)))
    order = np.lexsort((np.concatenate(source_parts), np.concatenate(time_parts)))
    read_segment = np.concatenate(seg_parts)[order].astype(np.int32)
    read_sample = np.concatenate(sample_parts)[order]
    return segments, read_segment, read_sample, tuple(per[s][rank] for s in range(len(per)))
