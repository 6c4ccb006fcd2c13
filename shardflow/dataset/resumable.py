"""A :class:`~shardflow.dataset.ShardDataset`'s side of a state dict (see :mod:`shardflow.state`
for the format): a state checked against the dataset, and where it resumes.

Functions of the dataset's configuration; the position itself is the run's
(:class:`~shardflow.dataset.epochrun.EpochRun`).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from typing import Any

from ..planning.selection import selection_digest
from ..state import MAX_STREAMS, ResumePoint, check_bounds, check_state, parse_layout

__all__ = ["config", "check", "resume_point"]

log = logging.getLogger(__name__)


def config(ds: Any, num_workers: int) -> dict[str, Any]:
    """The configuration a state of ``ds`` is valid for (its ``config`` entry): the shards and
    their counts (and selection), seed, shuffle, split and batching, world and workers."""
    world = ds.world()
    digest = hashlib.sha256()
    counts = ds.shards.counts if ds.shards.counts is not None else [None] * len(ds.shards.urls)
    for u, c in zip(ds.shards.urls, counts):
        digest.update(f"{u.rsplit('/', 1)[-1]}:{c};".encode())
    if ds.selection is not None:
        digest.update(selection_digest(ds.selection).encode())
    split, b, shuffle = ds.split_config(), ds.batching, ds.shuffle
    return {
        "shards": digest.hexdigest()[:16],
        "seed": ds.seed,
        "shuffle": [shuffle.shards, shuffle.buffer, shuffle.interleave, shuffle.initial]
        + ([shuffle.window] if shuffle.window > 1 else [])
        + (["affinity"] if shuffle.affinity else []),  # (states saved before the window or affinity stay valid)
        "partial": split.partial,
        "samples_per_epoch": split.samples_per_epoch,
        "batch_size": split.batch_size,
        "drop_last": split.drop_last,
        "max_cost": [list(x) for x in zip(*b.budgets)] if b is not None and b.budgets else None,
        "world_size": world.world_size,
        "rank": world.rank,
        "num_workers": num_workers,
        "expand": ds.expand.count if ds.expand is not None else 1,
    }


def check(ds: Any, state: Mapping[str, Any], kind: str, num_workers: int) -> None:
    """Refuse a state ``ds`` cannot resume.

    Args:
        ds: the dataset.
        state: a state dict (:mod:`shardflow.state`).
        kind: ``"ShardDataset"`` or ``"ShardLoader"``.
        num_workers: reading processes per rank of the loading side.

    Raises:
        StateError: another kind or version, or another configuration (the message names
            each difference), or values no run of this dataset could save.
    """
    extra = []
    saved = state.get("config") if isinstance(state, Mapping) else None
    if not ds.sized and isinstance(saved, Mapping) and saved.get("num_workers") != num_workers:
        extra.append(
            f"num_workers: saved {saved.get('num_workers')}, now {num_workers} "
            "(without a manifest the worker count must match)"
        )
    ignored = ("num_workers", "rank", "world_size") if ds.sized else ("num_workers",)
    check_state(state, kind, config(ds, num_workers), ignored=ignored, extra=extra)
    counts = ds.item_counts() if ds.sized else None
    items = None if counts is None else max(int(counts.sum()), ds.samples_per_epoch or 0)
    check_bounds(state, kind, items=items, world_size=ds.world().world_size, max_streams=MAX_STREAMS)


def resume_point(ds: Any, state: Mapping[str, Any], num_workers: int) -> ResumePoint | None:
    """Where a checked state resumes on this world with ``num_workers`` workers per rank
    (None: saved before anything was read, the epoch starts afresh).

    Sized, on the world of the saved layout's last stage, that stage's plan continues at its
    step; on another, what remains is shared out (:mod:`shardflow.planning.elastic`) from step 0.
    """
    epoch = int(state["epoch"])
    remaining = state["remaining"]
    if not remaining:
        return None
    world_size = ds.world().world_size
    if not ds.sized:
        skip = [int(x) for x in remaining]
        j = int(state["next_worker"])
        streams = tuple((i + j) % num_workers for i in range(num_workers))
        return ResumePoint(epoch, skip=tuple(skip[s] for s in streams), streams=streams)
    stages = parse_layout(remaining, str(state.get("kind")))
    if stages[-1][0] == world_size:
        layout, step = tuple(stages[:-1]), stages[-1][1]
    else:
        layout, step = tuple(stages), 0
    if not step and layout:
        log.info("resuming epoch %d on %d ranks after %s (world size, steps)", epoch, world_size, stages)
    return ResumePoint(epoch, layout, step)
