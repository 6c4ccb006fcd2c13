"""A :class:`~shardflow.dataset.ShardDataset` pass: the reader stages composed, per worker.

``__iter__`` detects the world, starts the epoch and composes the stages of
:mod:`shardflow.reader` (read, select, tag, decode, transform, and in loader
workers batch and collate) into the worker's pipeline.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from .. import reader, storage
from ..batching import Batching, Primed, WorkerItem, close_iter, count_good, skip_items, stream_world, take
from ..collation import is_builtin, takes_graph_records
from ..errors import ShardflowError
from ..plan import shuffle_buffer, split_unsized, worker_batches
from ..policy import ErrorPolicy
from ..seeding import Seeder, restoring
from ..state import ResumePoint
from ..world import World, stable_seed

__all__ = ["Iteration"]


class Iteration:
    """The iteration side of :class:`~shardflow.dataset.ShardDataset` (a mixin: the
    attributes it reads are set by the dataset's constructor)."""

    def _offsets(self, shard: int) -> np.ndarray | None:
        """The shard's offset index (None without one), loaded once per process.
        (The shard's size is checked against the manifest when it is opened.)"""
        if shard not in self._offset_cache:
            self._offset_cache[shard] = self.source.load_offsets(shard, self.io)
        return self._offset_cache[shard]

    def __iter__(self) -> Iterator[Any]:
        if self._batching is not None and not self._in_loader:
            # Iterated by itself (or by a plain DataLoader) after a shardflow.loader took it:
            # samples under the dataset's own split, not the loader's batch records.
            view = copy.copy(self)
            view._batching = None
            items = iter(view)
            self.stats = view.stats
            return items
        world = self.world()
        epoch = self._begin(world.worker)
        resume = self._resume if (self._resume is not None and self._resume.epoch == epoch) else None
        if world.num_workers == 1 and not World.in_worker():
            self._resume = None  # consumed by this iteration in the main process
        self._last_epoch = epoch
        policy = ErrorPolicy(self.on_error)
        self.stats = policy.stats
        if self._batching is not None:
            batches = self._iter_batches(world, epoch, resume, policy)
            if World.in_worker():
                return Primed(batches)  # the first batch now, while the DataLoader starts the other workers
            return batches
        return self._iter_samples(world, epoch, resume, policy)

    def _units(self, world: World, epoch: int, resume: ResumePoint | None) -> list[int]:
        """This worker's batch numbers (sized; empty when unsized)."""
        if not self.sized:
            return []
        plan = self.plan(epoch, world.rank)
        step = resume.step if resume is not None else 0
        # whole batches round robin: the DataLoader, taking one from each worker in turn,
        # yields them in plan order, the same sequence for any number of workers
        mine = worker_batches(plan.num_batches - step, world.worker, world.num_workers, True)
        return list(range(step + mine.start, step + mine.stop, mine.step))

    def _pipeline(self, world: World, epoch: int, ids: list[int], skip: int, policy: ErrorPolicy) -> tuple[Iterator[Any], list[int]]:
        """Compose the stages; returns (items, planned batch sizes)."""
        k = self.expand.count if self.expand is not None else 1
        seeder = self._seeder(world, epoch)
        # The default collate batches graph fields from checked records in one step.
        records = (self._batching is not None and self.transform is None and self.expand is None
                   and takes_graph_records(self._batching.collate))
        prepare = reader.Prepare(policy, fields=self.fields, sources=self.source.source_by_url(), decode=self.decode,
                                 graph_records=records, expand=self.expand, seed=self.seed, epoch=epoch,
                                 seeder=seeder)
        # one-to-many samples are prepared as read, before the shuffle buffer; others after it
        expanded = prepare.items if self.expand is not None else None
        io = self.io
        if self.sized:  # batches go round robin, so the rank's DataLoader workers share each fetch (storage.staging)
            job = os.getppid() if World.in_worker() else os.getpid()
            io = storage.staging_for(io, self.source.urls, (job, world.rank, world.world_size, epoch),
                                     world.worker, world.num_workers)
        if self.sized:
            plan = self.plan(epoch, world.rank)
            sizes, order = plan.batch_positions(ids)
            needed = np.zeros(len(plan.read_sample), dtype=bool)  # read positions (a resumed plan reads more than it yields)
            needed[order] = True
            # read order is the yield order unless a shuffle buffer reorders: then no positions to keep
            # (nor a first batch to read first: see phases.first_phase)
            items: Iterator[Any]
            if plan.scattered and expanded is None:  # a window shuffle: each sample through the offset index
                items = reader.emit_in_order(reader.read_scattered(plan, needed, self.source, io, policy, self._offsets), order)
            elif order.size < 2 or bool(np.all(order[1:] > order[:-1])):
                items = reader.read_planned(
                    plan, needed, self.source, io, policy, self._offsets, k, expanded, positioned=False
                )
            else:
                raw = reader.read_planned_in_phases(
                    plan, needed, order, sizes[0] if sizes else 0, self.source, io, policy, self._offsets, k, expanded
                )
                items = reader.emit_in_order(raw, order)
        else:
            shards = split_unsized(len(self.source.urls), world, self.seed, epoch, self.shuffle.shards)
            items = reader.read_shards(shards, self.source, io, policy)
            if expanded is not None:
                items = reader.expand_each(items, prepare, k)
            items = shuffle_buffer(
                items, self.shuffle.buffer, stable_seed("buffer", self.seed, epoch, world.rank, world.worker), self.shuffle.initial
            )
            sizes = []
            if skip:
                items = skip_items(items, skip * (self._batching.batch_size if self._batching else 1))
        items = storage.staged_epoch(items, io)
        if expanded is None:
            items = reader.prepared(items, prepare)
        if self.transform is not None:
            items = reader.apply_transform(items, seeder.wrap(self.transform), policy)
        return items, sizes

    def _seeder(self, world: World, epoch: int, enabled: bool = True) -> Seeder:
        """Seeds the global generators per sample and per batch (see :mod:`shardflow.seeding`);
        with ``enabled`` False, none (a seeder that does nothing)."""
        return Seeder(self.seed, epoch, world.rank, self.sample_seeding if enabled else ())

    def _runs_user_code(self) -> bool:
        """Whether code of the user's runs while a sample is prepared (a transform, ``expand``)."""
        return self.transform is not None or self.expand is not None

    def _iter_samples(self, world: World, epoch: int, resume: ResumePoint | None, policy: ErrorPolicy) -> Iterator[Any]:
        ids = self._units(world, epoch, resume)
        skip = resume.skip[world.worker] if (resume is not None and resume.skip) else 0
        in_main = not World.in_worker()
        layout = resume.layout if resume is not None else ()
        progress = [ids[0] if ids else (resume.step if resume is not None else 0), 0, skip, layout]
        if in_main:  # set at iter(), so a state_dict() before the first next() names this epoch
            self._progress = progress
        return self._yield_samples(stream_world(world, resume), epoch, ids, skip, policy, progress, in_main)

    def _yield_samples(
        self, world: World, epoch: int, ids: list[int], skip: int, policy: ErrorPolicy, progress: list[Any], in_main: bool
    ) -> Iterator[Any]:
        items, _ = self._pipeline(world, epoch, ids, skip, policy)
        if in_main and self.sample_seeding and self._runs_user_code():
            items = restoring(items, self.sample_seeding)  # the training loop's generators stay where it left them
        stats = policy.stats
        try:
            for item in items:
                progress[1] += 1
                if item is None:
                    continue
                stats["samples"] += 1  # policy.good(), without a call per sample
                yield item
            policy.check_end()
        finally:
            close_iter(items)
        if in_main:
            self._progress = None

    def _iter_batches(self, world: World, epoch: int, resume: ResumePoint | None, policy: ErrorPolicy) -> Iterator[WorkerItem]:
        b = self._batching
        if b is None:
            raise ShardflowError("internal: batching requested without a batch configuration")
        ids = self._units(world, epoch, resume)
        skip = resume.skip[world.worker] if (resume is not None and resume.skip) else 0
        items, sizes = self._pipeline(stream_world(world, resume), epoch, ids, skip, policy)
        counted = count_good(items, policy)
        # shardflow's own collate draws nothing: only a user's collate_fn is seeded per batch
        user_collate = not is_builtin(b.collate)
        seeder = self._seeder(world, epoch, enabled=user_collate)
        if self.sized:
            def seed_batch(index: int) -> None:
                seeder.batch(ids[index])

            batches = ((ids[i], batch) for i, batch in reader.batched(counted, sizes, b.collate, seed_batch))
        else:
            batches = unsized_batches(counted, b, skip, stream_world(world, resume), seeder)
        try:
            # in the training process (num_workers=0), its own generators stay where it left them
            # (untouched when no code of the user's runs while a batch is made: nothing is seeded)
            restore = self.sample_seeding and (user_collate or self._runs_user_code()) and not World.in_worker()
            for index, batch in (restoring(batches, self.sample_seeding) if restore else batches):
                yield WorkerItem(world.worker, index, batch, policy.snapshot())
            if world.num_workers == 1 or policy.stats["samples"]:
                policy.check_end()
        finally:
            close_iter(items)
        yield WorkerItem(world.worker, -1, None, policy.snapshot(), final=True)


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
