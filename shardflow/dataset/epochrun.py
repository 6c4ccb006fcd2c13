"""One epoch of a :class:`~shardflow.dataset.ShardDataset`: :class:`EpochRun`, for a direct
iteration and for :class:`~shardflow.loading.shardloader.ShardLoader` alike.

The dataset holds configuration; a run holds what one epoch's iteration needs and produces:
its epoch, where it resumes (and the layout of a resumed epoch), its position, its stats and
its state dict. ``iter(dataset)`` starts a direct run (samples); the loader asks the dataset
for a run per epoch (``dataset.epoch_run(...)``) and talks to that run, whose workers yield
batch records. This is torchdata's ``Loader`` -> ``LoaderIterator`` shape: only the run
holds a position.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

from ..errors import ShardflowError
from ..loading.batching import Batching, Primed, WorkerItem, close_iter
from ..policy import ErrorPolicy, merge_snapshots
from ..state import ResumePoint, build_state, layout_position
from ..world import World
from . import iteration
from .resumable import config

__all__ = ["EpochRun"]

log = logging.getLogger(__name__)


class EpochRun:
    """One epoch of a dataset, from its start (or resume point) to its end.

    Made by the dataset (``iter(dataset)``, :meth:`~shardflow.dataset.ShardDataset.epoch_run`),
    not by hand. Its position is a count of steps, as in Mosaic's ``state_dict(num_samples)``:
    with a manifest the steps (batches of the loader, samples of a direct iteration) every
    rank has taken (the sequence does not depend on the worker count); without one, the
    steps each worker stream has passed.

    Args:
        dataset: the dataset (its configuration).
        epoch: the epoch it reads.
        workers: reading processes per rank (1 for a direct iteration).
        resume: where the epoch resumes, None when it starts afresh.
        loaded: the state ``resume`` came from, verbatim (what :meth:`state_dict` returns until
            the run starts; loader runs).
        batching: the loader's batching (a ``"ShardLoader"`` run whose workers yield batch
            records); None: a direct iteration (samples, a ``"ShardDataset"`` state).

    Attributes:
        stats: the counters of the run (``dataset.stats`` during and after it): ``samples``,
            ``skipped``, one per reason, ``repeated_batches``; a loader's merged from its
            workers as batches arrive.
        finished: the run reached the end of its epoch.
    """

    def __init__(
        self,
        dataset: Any,
        epoch: int,
        workers: int = 1,
        *,
        resume: ResumePoint | None = None,
        loaded: Mapping[str, Any] | None = None,
        batching: Batching | None = None,
    ) -> None:
        self.dataset = dataset
        self.epoch = epoch
        self.workers = workers
        self.resume = resume
        self.batching = batching
        self.stats: Counter[str] = Counter()
        self.finished = False
        self._loaded = dict(loaded) if loaded is not None else None
        self._started = False
        self._taken = [0] * workers  # steps taken from each worker (stream)
        self._next_worker = 0
        self._by_worker: dict[int, Mapping[str, Any]] = {}
        self._repeated = 0

    @property
    def resumed(self) -> bool:
        """True when the epoch continues from a saved position."""
        return self.resume is not None

    @property
    def layout(self) -> tuple[tuple[int, int], ...]:
        """The earlier ``(world size, steps)`` stages of a resumed epoch (:mod:`shardflow.planning.elastic`)."""
        return self.resume.layout if self.resume is not None else ()

    def resume_for(self, epoch: int) -> ResumePoint | None:
        """The resume point when ``epoch`` is this run's (a persistent worker's later
        iterations read later epochs afresh), else None."""
        return self.resume if self.resume is not None and self.resume.epoch == epoch else None

    def num_batches(self) -> int:
        """This rank's batches in the epoch (of the resumed share after a resume).

        Raises:
            TypeError: the dataset has no manifest.
        """
        return self.dataset.num_batches(self.workers, self.epoch, layout=self.layout)

    def start(self) -> AbstractContextManager[None]:
        """Start a loader's epoch: the dataset takes its epoch now (an ``iter()`` of the
        loader). Enter the context returned around starting the DataLoader's workers,
        which copy this run with the dataset."""
        self._started = True
        return self.dataset.starting(self)

    # ------------------------------------------------------------ the passes

    def samples(self, world: World) -> Iterator[Any]:
        """A direct pass over ``world``'s share (this process, or a plain DataLoader's worker):
        the samples; in the main process the run counts each step for :meth:`state_dict`."""
        policy = ErrorPolicy(self.dataset.on_error)
        self.stats = policy.stats
        self._started = True
        ids = iteration.units(self.dataset, world, self.epoch, self.resume, batched=False)
        resume = self.resume
        skip = resume.skip[world.worker] if (resume is not None and resume.skip) else 0
        return self._yield_samples(world, ids, skip, policy)

    def _yield_samples(self, world: World, ids: Sequence[int], skip: int, policy: ErrorPolicy) -> Iterator[Any]:
        items = iteration.sample_items(self.dataset, world, self.epoch, self.resume, ids, skip, policy)
        stats, taken = policy.stats, self._taken
        try:
            for item in items:
                taken[0] += 1
                if item is None:
                    continue
                stats["samples"] += 1  # policy.good(), without a call per sample
                yield item
            policy.check_end()
        finally:
            close_iter(items)
        self.finished = True

    def batches(self, world: World, epoch: int) -> Iterator[WorkerItem]:
        """A loader worker's pass (or this process's, without workers) over ``epoch``: batch
        records (:class:`~shardflow.loading.batching.WorkerItem`)."""
        if self.batching is None:
            raise ShardflowError("internal: batches of a run without a batch configuration")
        policy = ErrorPolicy(self.dataset.on_error)
        items = iteration.batch_items(self.dataset, self.batching, world, epoch, self.resume_for(epoch), policy)
        if World.in_worker():
            return Primed(items)  # the first batch now, while the DataLoader starts the other workers
        self.count_here(policy.stats)
        return items

    # ------------------------------------------------------------ the loader's side

    def record(self, item: WorkerItem) -> None:
        """Count a worker's item: its stats (merged into :attr:`stats`), and unless it is the
        worker's final record, one batch taken from that worker."""
        self._by_worker[item.worker] = item.stats
        self._merge()
        if item.final:
            return
        self._taken[item.worker] += 1
        self._next_worker = (item.worker + 1) % self.workers

    def count_here(self, counters: Mapping[str, Any]) -> None:
        """Read worker 0's counters live from ``counters``: a pass in this process (no
        DataLoader workers) counts there, also when it fails before yielding a record."""
        self._by_worker[0] = counters

    def repeated(self) -> None:
        """Count a batch whose samples were all dropped, replaced by a repeat."""
        self._repeated += 1
        self.stats["repeated_batches"] = self._repeated

    def close(self) -> None:
        """The iteration ended (completed, stopped or failed): bring :attr:`stats` up to date."""
        self._merge()

    def _merge(self) -> None:
        merged = merge_snapshots(self._by_worker.values())
        if self._repeated:
            merged["repeated_batches"] = self._repeated
        self.stats.clear()
        self.stats.update(merged)

    def finish(self, owed: int, again: int) -> None:
        """End the epoch: warn about repeated batches, fail when nothing could be yielded.

        Args:
            owed: planned batches left without a batch to repeat (nothing arrived before them).
            again: samples yielded again in repeated batches.

        Raises:
            ShardflowError: every batch of the epoch was dropped, or (several workers) the
                pass as a whole yielded no sample.
        """
        on_error = self.dataset.on_error
        if self._repeated:
            log.warning(
                "epoch %s: %d batch(es) of this rank had every sample dropped (%d filtered by the transform "
                "returning None, %d skipped under on_error=%r) and were replaced by a repeat of a batch: %d "
                "sample(s) seen again this epoch, so that every rank takes len(loader) steps. To select samples "
                "without repeats, plan the selection: ShardDataset(select=...)",
                self.epoch, self._repeated, self.stats.get("filtered", 0), self.stats.get("skipped", 0),
                on_error, again,
            )
        if owed:
            raise ShardflowError(
                f"every sample of the epoch's batches was dropped under on_error={on_error!r} "
                f"({dict(self.stats)}): there is no batch to yield"
            )
        if self.workers > 1 and self.stats["skipped"] and not self.stats["samples"]:
            # each worker only knows its own share; the pass as a whole yielded nothing
            raise ShardflowError(
                f"the pass yielded no sample: all {self.stats['skipped']} were dropped under "
                f"on_error={on_error!r} ({dict(self.stats)}); set on_error='raise' to see the first error"
            )
        self.finished = True

    # ------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """The epoch's position as a state (:mod:`shardflow.state`): ``"ShardLoader"`` for a
        loader's run, ``"ShardDataset"`` for a direct one.

        Before the run starts: the state it was loaded from, or the epoch from its start
        (``remaining`` empty). Once started: the steps taken.
        """
        kind = "ShardDataset" if self.batching is None else "ShardLoader"
        cfg = config(self.dataset, self.workers)
        resume = self.resume
        if not self._started:
            if self._loaded is not None:
                return dict(self._loaded)
            if resume is None:
                return build_state(kind, self.epoch, [], 0, cfg)
        if self.dataset.sized:  # the layout of the epoch: the same on every rank (see shardflow.planning.elastic)
            step = (resume.step if resume is not None else 0) + sum(self._taken)
            remaining: list[Any] = layout_position(self.layout, self.dataset.world().world_size, step)
            next_worker = 0
        else:  # by stream: worker w may continue another stream after a resume
            skip = resume.skip if resume is not None else (0,) * self.workers
            streams = resume.streams if resume is not None else tuple(range(self.workers))
            remaining = [0] * self.workers
            for w, taken in enumerate(self._taken):
                remaining[streams[w]] = skip[w] + taken
            next_worker = streams[self._next_worker]
        return build_state(kind, self.epoch, remaining, next_worker, cfg)
