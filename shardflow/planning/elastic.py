"""Elastic resumption: the rest of an interrupted epoch, shared out over another world.

Ranks step in lock-step (every rank takes the same number of batches per
step), so a position in an epoch is the same for every rank: ``k`` batches of
each rank's plan taken. A saved position is a *layout*: the world sizes the
epoch ran on and the steps taken on each, ``[(W0, k0), (W1, k1), ...]``.

Resuming at world size ``W``:

- **Same world size as the last entry**: each rank continues its own plan
  (the epoch's plan, or the redistribution below) at step ``k``: exactly the
  batches of the uninterrupted run, in the same order.
- **Another world size**: the *remaining samples* are, for each saved rank
  ``r = 0 .. W0-1`` in order, the samples of its batches ``k0, k0+1, ...`` in
  yield order, concatenated: ``M`` samples, each exactly once (with the
  padding the saved epoch had declared). New rank ``r'`` takes the
  contiguous stretch ``[r' * m, (r' + 1) * m)`` of them, ``m = ceil(M / W)``
  with ``partial="pad"`` (positions past the end repeat the remaining samples
  from their start, as a padded epoch does) or ``floor(M / W)`` with
  ``partial="drop"`` (the last ``M mod W`` are left out). Every new rank
  then yields the same number of batches of its stretch (cut by count, or by
  cost with ``max_cost``), in the saved order, reading the shards as the saved
  ranks would have. The layout gets the entry ``(W, 0)``; a later resume
  repeats the rule from there.

The epochs after the resumed one are plain epochs of the new world.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .order import Segment
from .costs import cost_batches, split_to
from .plan import RankPlan, SplitConfig

__all__ = ["remaining_share", "redistribute", "resumed_plan"]


def remaining_share(remaining: int, world_size: int, partial: str) -> tuple[int, int, int]:
    """``(samples per rank, padding, dropped)`` when ``remaining`` samples go to ``world_size`` ranks."""
    if partial == "pad":
        m = -(-remaining // world_size)
        return m, m * world_size - remaining, 0
    m = remaining // world_size
    return m, 0, remaining - m * world_size


def _left(plan: RankPlan, step: int) -> np.ndarray:
    """Read positions of the samples of batches ``step, step+1, ...`` in yield order."""
    _, positions = plan.batch_positions(range(min(step, plan.num_batches), plan.num_batches))
    return positions


def redistribute(
    old: Sequence[RankPlan],
    step: int,
    rank: int,
    world_size: int,
    split: SplitConfig,
    costs_of: Callable[[RankPlan, np.ndarray], np.ndarray] | None = None,
) -> RankPlan:
    """The plan of new rank ``rank`` for the rest of an epoch (see the module doc).

    Args:
        old: the plans of every saved rank, in rank order.
        step: batches every saved rank had taken.
        rank: the new rank.
        world_size: the new number of ranks.
        split: the split options (``partial``, batch size, ``drop_last``, ``max_cost``).
        costs_of: with ``split.max_cost``: ``costs_of(plan, positions)`` gives the
            int64 cost of the samples at those read positions of ``plan``.

    Returns:
        The new rank's plan. Its read arrays are those of the saved ranks it
        takes samples from (a copy more for each pass into the padding), so
        shards are read and seeked exactly as for a planned epoch.
    """
    return _redistribute(old, step, [rank], world_size, split, costs_of)[0]


def _redistribute(old: Sequence[RankPlan], step: int, ranks: Sequence[int], world_size: int, split: SplitConfig,
                  costs_of: Callable[[RankPlan, np.ndarray], np.ndarray] | None) -> list[RankPlan]:  # fmt: skip
    """:func:`redistribute` for several new ranks, what they share computed once: the saved
    ranks' remaining samples, and (with ``max_cost``) every new rank's cost batches. Time
    O(remaining samples + ranks asked) without ``max_cost``, never O(ranks x samples)."""
    left = [_left(p, step) for p in old]
    sizes = np.asarray([len(x) for x in left], dtype=np.int64)
    total = int(sizes.sum())
    m, padding, dropped = remaining_share(total, world_size, split.partial)
    if split.max_cost is None and split.drop_last:
        dropped += (m - m // split.batch_size * split.batch_size) * world_size
    flat = np.concatenate(left) if left else np.zeros(0, np.int64)
    bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    items = {r: _rank_items(flat, bounds, total, m, r) for r in ranks}
    plans = {r: _build(old, items[r], m, padding, dropped, split) for r in ranks}
    if split.max_cost is None or costs_of is None:
        return [plans[r] for r in ranks]
    per_rank = []
    for r in range(world_size):  # every rank's batch count: the ranks step in lock-step
        its = items[r] if r in items else _rank_items(flat, bounds, total, m, r)
        costs = _plan_costs(old, its, costs_of)
        per_rank.append(cost_batches(costs, split.max_cost, split.batch_size) if m else [])
    target = max((len(e) for e in per_rank), default=0)
    out = []
    for r in ranks:
        plan = plans[r]
        ends = np.asarray(split_to(per_rank[r], target), dtype=np.int64) if target else np.zeros(0, np.int64)
        out.append(RankPlan(plan.samples, plan.padding, plan.dropped, target, plan.batch_size, plan.segments,
                            plan.read_segment, plan.read_sample, plan.emit, ends, None, scattered=plan.scattered))
    return out


def resumed_plan(
    plan_of: Callable[[int, int], RankPlan],
    layout: Sequence[tuple[int, int]],
    rank: int,
    world_size: int,
    split: SplitConfig,
    counts: np.ndarray,
    costs: np.ndarray | None = None,
) -> RankPlan:
    """The plan of ``rank`` of ``world_size`` for the rest of an epoch that ran on ``layout``.

    Args:
        plan_of: ``plan_of(rank, world_size)``, the epoch's own plan of a rank.
        layout: the epoch's earlier ``(world size, steps)`` stages, oldest first.
        rank: the rank to plan.
        world_size: the world it resumes on.
        split: the split options.
        counts: int64 samples per shard (to find each sample's cost).
        costs: with ``split.max_cost``: the per-sample costs, shape (N,) or (N, C).

    Returns:
        Each stage's remaining samples shared out over the next stage's world
        (:func:`redistribute`), ending with this rank's share.
    """
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)

    def costs_of(p: RankPlan, positions: np.ndarray) -> np.ndarray:
        shard = np.asarray([sg.shard for sg in p.segments], dtype=np.int64)[p.read_segment[positions]]
        return costs[starts[shard] + p.read_sample[positions]]  # type: ignore[index]

    plans = [plan_of(r, layout[0][0]) for r in range(layout[0][0])]
    for i, (_, steps) in enumerate(layout):
        last = i + 1 == len(layout)
        nxt = world_size if last else layout[i + 1][0]
        wanted = [rank] if last else list(range(nxt))
        plans = _redistribute(plans, steps, wanted, nxt, split, costs_of if costs is not None else None)
    return plans[0]


Items = tuple[np.ndarray, np.ndarray, np.ndarray]
"""A new rank's samples in yield order: int64 arrays ``(saved rank, copy, read position)``;
``copy`` counts the passes over the remaining samples (0, then 1 and up: padding)."""


def _rank_items(flat: np.ndarray, bounds: np.ndarray, total: int, m: int, rank: int) -> Items:
    """The new rank's stretch ``[rank * m, (rank + 1) * m)`` of the remaining samples
    (``flat``: every saved rank's, concatenated; ``bounds``: where each saved rank's start)."""
    if total == 0 or m == 0:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty
    copy, idx = np.divmod(np.arange(rank * m, (rank + 1) * m, dtype=np.int64), total)
    owner = np.searchsorted(bounds, idx, side="right") - 1
    return owner, copy, flat[idx].astype(np.int64)


def _build(old: Sequence[RankPlan], items: Items, m: int, padding: int, dropped: int, split: SplitConfig) -> RankPlan:
    """A plan that reads the saved ranks' read arrays (one copy per (rank, pass)) and yields ``items``."""
    owner, copy, pos = items
    segments: list[Segment] = []
    read_segment: list[np.ndarray] = []
    read_sample: list[np.ndarray] = []
    # the (pass, saved rank) pairs drawn from, in that order, each read arrays' copy based at its offset
    keys, which = np.unique(np.stack([copy, owner]), axis=1, return_inverse=True) if len(pos) else (
        np.zeros((2, 0), np.int64), np.zeros(0, np.int64))
    base = np.zeros(keys.shape[1], dtype=np.int64)
    offset = 0
    for j, (_, o) in enumerate(keys.T.tolist()):
        p = old[o]
        base[j] = offset
        read_segment.append(p.read_segment.astype(np.int64) + len(segments))
        read_sample.append(p.read_sample)
        segments.extend(p.segments)
        offset += len(p.read_sample)
    emit = base[np.asarray(which, dtype=np.int64).reshape(-1)] + pos
    bs = split.batch_size
    nb = m // bs if split.drop_last else -(-m // bs)
    return RankPlan(
        samples=m,
        padding=padding,
        dropped=dropped,
        num_batches=nb,
        batch_size=bs,
        segments=tuple(segments),
        read_segment=np.concatenate(read_segment).astype(np.int32) if read_segment else np.zeros(0, np.int32),
        read_sample=np.concatenate(read_sample) if read_sample else np.zeros(0, np.int64),
        emit=emit.astype(np.int64),
        scattered=any(p.scattered for p in old),
    )


def _plan_costs(old: Sequence[RankPlan], items: Items, costs_of: Callable[[RankPlan, np.ndarray], np.ndarray]) -> np.ndarray:
    """Costs of the items, in order: shape (items,) or (items, columns) as ``costs_of`` gives them."""
    owner, _, pos = items
    if not len(pos):
        return np.zeros(0, dtype=np.int64)
    out: np.ndarray | None = None
    for o in np.unique(owner).tolist():
        js = np.flatnonzero(owner == o)
        c = costs_of(old[o], pos[js])
        if out is None:
            out = np.zeros((len(pos), *c.shape[1:]), dtype=np.int64)
        out[js] = c
    return out  # type: ignore[return-value]
