"""A pass of one worker over an epoch of a :class:`~shardflow.dataset.ShardDataset`: the
stages of :mod:`shardflow.reader` (read, select, tag, decode, transform, and in loader
workers batch and collate) composed into the worker's pipeline.

Functions of the dataset (its configuration, read here) and of the run's epoch and resume
point (:class:`~shardflow.dataset.epochrun.EpochRun` calls them); they keep no state.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from .. import accounting, reader, storage
from ..accounting import Account
from ..loading.batching import Batching, WorkerItem, close_iter, count_good, skip_items, stream_world, take
from ..loading.collation import is_builtin, takes_graph_records
from ..planning.plan import shuffle_buffer, split_unsized, worker_batches
from ..policy import ErrorPolicy
from ..seeding import Seeder, restoring
from ..state import ResumePoint
from ..world import World, stable_seed
from .warmstart import staged_io

__all__ = ["units", "pipeline", "seeder_of", "runs_user_code", "sample_items", "batch_items", "unsized_batches"]


def units(ds: Any, world: World, epoch: int, resume: ResumePoint | None, *, batched: bool) -> list[int]:
    """This worker's step numbers in ``ds``'s plan for ``epoch`` (sized; empty when unsized):
    batches of the loader's plan (``batched``), or samples of a direct iteration."""
    if not ds.sized:
        return []
    plan = ds.plan(epoch, world.rank, layout=resume.layout if resume is not None else (), batched=batched)
    step = resume.step if resume is not None else 0
    # whole batches round robin: the DataLoader, taking one from each worker in turn,
    # yields them in plan order, the same sequence for any number of workers
    mine = worker_batches(plan.num_batches - step, world.worker, world.num_workers, True)
    return list(range(step + mine.start, step + mine.stop, mine.step))


def pipeline(
    ds: Any, batching: Batching | None, world: World, epoch: int, resume: ResumePoint | None, ids: list[int], skip: int,
    policy: ErrorPolicy,
) -> tuple[Iterator[Any], list[int]]:
    """Compose the stages of ``ds`` for ``world`` (the stream it reads); returns (items, planned
    batch sizes). ``batching``: the loader's (its plan and collate), None for a direct pass."""
    k = ds.expand.count if ds.expand is not None else 1
    seeder = seeder_of(ds, world, epoch)
    # The default collate batches graph fields from checked records in one step.
    records = (batching is not None and ds.transform is None and ds.expand is None
               and takes_graph_records(batching.collate))
    prepare = reader.Prepare(policy, fields=ds.fields, sources=ds.shards.source_by_url(), decode=ds.decode,
                             graph_records=records, expand=ds.expand, seed=ds.seed, epoch=epoch,
                             seeder=seeder)
    # one-to-many samples are prepared as read, before the shuffle buffer; others after it
    expanded = prepare.items if ds.expand is not None else None
    io = ds.io
    if ds.sized:  # batches go round robin, so the rank's DataLoader workers share each fetch (storage.staging)
        io = staged_io(ds, world, epoch, world.worker, world.num_workers, in_worker=World.in_worker())
    if ds.sized:
        plan = ds.plan(epoch, world.rank, layout=resume.layout if resume is not None else (), batched=batching is not None)
        sizes, order = plan.batch_positions(ids)
        needed = np.zeros(len(plan.read_sample), dtype=bool)  # read positions (a resumed plan reads more than it yields)
        needed[order] = True
        # read order is the yield order unless a shuffle buffer reorders: then no positions to keep
        # (nor a first batch to read first: see phases.first_phase)
        items: Iterator[Any]
        if plan.scattered and expanded is None:  # a window shuffle: each sample through the offset index
            items = reader.emit_in_order(reader.read_scattered(plan, needed, ds.shards, io, policy, ds.shard_offsets), order)
        elif order.size < 2 or bool(np.all(order[1:] > order[:-1])):
            items = reader.read_planned(
                plan, needed, ds.shards, io, policy, ds.shard_offsets, k, expanded, positioned=False
            )
        else:
            raw = reader.read_planned_in_phases(
                plan, needed, order, sizes[0] if sizes else 0, ds.shards, io, policy, ds.shard_offsets, k, expanded
            )
            items = reader.emit_in_order(raw, order)
    else:
        shards = split_unsized(len(ds.shards.urls), world, ds.seed, epoch, ds.shuffle.shards)
        items = reader.read_shards(shards, ds.shards, io, policy)
        if expanded is not None:
            items = reader.expand_each(items, prepare, k)
        items = shuffle_buffer(
            items, ds.shuffle.buffer, stable_seed("buffer", ds.seed, epoch, world.rank, world.worker), ds.shuffle.initial
        )
        sizes = []
        if skip:
            items = skip_items(items, skip * (batching.batch_size if batching else 1))
    items = storage.staged_epoch(items, io)
    timed = batching is not None and batching.account  # stage timers (shardflow.accounting)
    items = accounting.timed(items, "read") if timed else items
    if expanded is None:
        items = reader.prepared(items, prepare)
        items = accounting.timed(items, "decode") if timed else items
    if ds.transform is not None:
        items = reader.apply_transform(items, seeder.wrap(ds.transform), policy)
        items = accounting.timed(items, "transform") if timed else items
    return items, sizes


def seeder_of(ds: Any, world: World, epoch: int, enabled: bool = True) -> Seeder:
    """Seeds the global generators per sample and per batch (see :mod:`shardflow.seeding`);
    with ``enabled`` False, none (a seeder that does nothing)."""
    return Seeder(ds.seed, epoch, world.rank, ds.sample_seeding if enabled else ())


def runs_user_code(ds: Any) -> bool:
    """Whether code of the user's runs while a sample is prepared (a transform, ``expand``)."""
    return ds.transform is not None or ds.expand is not None


def sample_items(
    ds: Any, world: World, epoch: int, resume: ResumePoint | None, ids: list[int], skip: int, policy: ErrorPolicy
) -> Iterator[Any]:
    """The items of a direct pass (None where a sample was dropped); in the training process,
    its global generators are restored around the user's code."""
    items, _ = pipeline(ds, None, stream_world(world, resume), epoch, resume, ids, skip, policy)
    if not World.in_worker() and ds.sample_seeding and runs_user_code(ds):
        items = restoring(items, ds.sample_seeding)  # the training loop's generators stay where it left them
    return items


def batch_items(
    ds: Any, b: Batching, world: World, epoch: int, resume: ResumePoint | None, policy: ErrorPolicy
) -> Iterator[WorkerItem]:
    """A loader worker's batch records for ``epoch``, then its final record (its stats)."""
    ids = units(ds, world, epoch, resume, batched=True)
    skip = resume.skip[world.worker] if (resume is not None and resume.skip) else 0
    account = Account(b.account)  # this worker's epoch: its stage times and counters since now
    items, sizes = pipeline(ds, b, stream_world(world, resume), epoch, resume, ids, skip, policy)
    counted = count_good(items, policy)
    # shardflow's own collate draws nothing: only a user's collate_fn is seeded per batch
    user_collate = not is_builtin(b.collate)
    seeder = seeder_of(ds, world, epoch, enabled=user_collate)
    if ds.sized:
        def seed_batch(index: int) -> None:
            seeder.batch(ids[index])

        batches = ((ids[i], batch) for i, batch in reader.batched(counted, sizes, b.collate, seed_batch))
    else:
        batches = unsized_batches(counted, b, skip, stream_world(world, resume), seeder)
    batches = accounting.timed_batches(batches) if b.account else batches
    try:
        # in the training process (num_workers=0), its own generators stay where it left them
        # (untouched when no code of the user's runs while a batch is made: nothing is seeded)
        restore = ds.sample_seeding and (user_collate or runs_user_code(ds)) and not World.in_worker()
        for index, batch in (restoring(batches, ds.sample_seeding) if restore else batches):
            yield WorkerItem(world.worker, index, batch, policy.snapshot(), acct=account.now())
        if world.num_workers == 1 or policy.stats["samples"]:
            policy.check_end()
    finally:
        close_iter(items)
    yield WorkerItem(world.worker, -1, None, policy.snapshot(), final=True, acct=account.now())


def unsized_batches(items: Iterator[Any], b: Batching, skip: int, stream: World, seeder: Seeder) -> Iterator[tuple[int, Any]]:
    """Batches of one worker stream without a manifest: ``(n, batch)``, ``n`` the stream's batch
    number from ``skip`` (where a resume left it), the last batch short unless ``drop_last``.

    Each batch is seeded as the ``n * workers + stream``-th batch of the rank, the position at
    which the DataLoader's round robin yields it: the streams' batches ``n`` differ.
    """
    n = skip
    while True:
        group = take(items, b.batch_size)
        full = len(group) == b.batch_size
        group = [x for x in group if x is not None]
        if group and (full or not b.drop_last):
            seeder.batch(n * stream.num_workers + stream.worker)
            yield n, b.collate(group)
        n += 1
        if not full:
            return
