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
    left = [_left(p, step) for p in old]
    sizes = [len(x) for x in left]
    total = int(sum(sizes))
    m, padding, dropped = remaining_share(total, world_size, split.partial)
    if split.max_cost is None and split.drop_last:
        dropped += (m - m // split.batch_size * split.batch_size) * world_size
    shares = [_rank_items(left, sizes, total, m, r) for r in range(world_size)]
    plan = _build(old, shares[rank], m, padding, dropped, split)
    if split.max_cost is None or costs_of is None:
        return plan
    per_rank = []
    for r in range(world_size):
        p = plan if r == rank else _build(old, shares[r], m, padding, dropped, split)
        costs = _plan_costs(old, shares[r], costs_of)
        per_rank.append(cost_batches(costs, split.max_cost, split.batch_size) if len(p.emit) else [])
    target = max((len(e) for e in per_rank), default=0)
    ends = np.asarray(split_to(per_rank[rank], target), dtype=np.int64) if target else np.zeros(0, np.int64)
    return RankPlan(plan.samples, plan.padding, plan.dropped, target, plan.batch_size, plan.segments,
                    plan.read_segment, plan.read_sample, plan.emit, ends, None, scattered=plan.scattered)


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
        plans = [redistribute(plans, steps, r, nxt, split, costs_of if costs is not None else None) for r in wanted]
    return plans[0]


def _rank_items(left: list[np.ndarray], sizes: list[int], total: int, m: int, rank: int) -> list[tuple[int, int, int]]:
    """The new rank's samples as ``(saved rank, copy, read position)`` in yield order;
    ``copy`` counts the passes over the remaining samples (1 and up: padding)."""
    if total == 0 or m == 0:
        return []
    bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    flat = np.arange(rank * m, (rank + 1) * m, dtype=np.int64)
    copy, idx = np.divmod(flat, total)
    owner = np.searchsorted(bounds, idx, side="right") - 1
    return [(int(o), int(c), int(left[o][i - bounds[o]])) for o, c, i in zip(owner.tolist(), copy.tolist(), idx.tolist())]


def _build(old: Sequence[RankPlan], items: list[tuple[int, int, int]], m: int, padding: int, dropped: int, split: SplitConfig) -> RankPlan:
    """A plan that reads the saved ranks' read arrays (one copy per (rank, pass)) and yields ``items``."""
    segments: list[Segment] = []
    read_segment: list[np.ndarray] = []
    read_sample: list[np.ndarray] = []
    base: dict[tuple[int, int], int] = {}
    offset = 0
    for key in sorted({(o, c) for o, c, _ in items}, key=lambda oc: (oc[1], oc[0])):
        p = old[key[0]]
        base[key] = offset
        read_segment.append(p.read_segment.astype(np.int64) + len(segments))
        read_sample.append(p.read_sample)
        segments.extend(p.segments)
        offset += len(p.read_sample)
    emit = np.asarray([base[(o, c)] + pos for o, c, pos in items], dtype=np.int64)
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
        emit=emit,
        scattered=any(p.scattered for p in old),
    )


def _plan_costs(old: Sequence[RankPlan], items: list[tuple[int, int, int]], costs_of: Callable[[RankPlan, np.ndarray], np.ndarray]) -> np.ndarray:
    """Costs of the items, in order: shape (items,) or (items, columns) as ``costs_of`` gives them."""
    parts: dict[int, tuple[list[int], np.ndarray]] = {}
    by_rank: dict[int, list[int]] = {}
    for j, (o, _, _) in enumerate(items):
        by_rank.setdefault(o, []).append(j)
    for o, js in by_rank.items():
        parts[o] = (js, costs_of(old[o], np.asarray([items[j][2] for j in js], dtype=np.int64)))
    if not parts:
        return np.zeros(0, dtype=np.int64)
    sample = next(iter(parts.values()))[1]
    out = np.zeros((len(items), *sample.shape[1:]), dtype=np.int64)
    for js, c in parts.values():
        out[js] = c
    return out
