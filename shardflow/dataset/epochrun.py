"""One loader epoch of a :class:`~shardflow.dataset.ShardDataset`: the whole contract between
the dataset and :class:`~shardflow.loading.shardloader.ShardLoader`.

The dataset hands the loader an :class:`EpochRun` (``dataset.epoch_run(...)``); the run owns
what the epoch's iteration needs and produces: where it resumes, the batches taken per worker,
the workers' stats merged, and its state dict. The loader talks to the run, not to the
dataset's internals.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

from ..loading.batching import WorkerItem
from ..errors import ShardflowError
from ..policy import merge_snapshots
from ..state import ResumePoint, build_state, layout_position

__all__ = ["EpochRun"]

log = logging.getLogger(__name__)


class EpochRun:
    """One epoch of a dataset under a loader, from its start (or resume point) to its end.

    Made by the dataset (:meth:`~shardflow.dataset.ShardDataset.epoch_run`), not by hand.
    Its position is a count of batches, as in Mosaic's ``state_dict(num_samples)``: with a
    manifest the batches every rank has taken (the batch sequence does not depend on the
    worker count); without one, the batches each worker stream has passed.

    Args:
        epoch: the epoch it reads.
        workers: reading processes per rank.
        sized: the dataset has a manifest (sample counts known).
        world_size: ranks of the world the epoch runs on.
        on_error: the dataset's ``on_error`` (named in errors).
        resume: where the epoch resumes, None when it starts afresh.
        loaded: the state ``resume`` came from, verbatim (what :meth:`state_dict` returns until
            the run starts).
        config: returns the dataset's configuration for a state (the ``config`` entry).
        batches: returns this rank's batches in the epoch (sized only).
        begin: the dataset's side of starting the epoch; returns the context to start the
            workers in (see :meth:`start`).

    Attributes:
        stats: the workers' counters, merged as batches arrive (``dataset.stats`` during and
            after the epoch): ``samples``, ``skipped``, one per reason, ``repeated_batches``.
    """

    def __init__(
        self,
        epoch: int,
        workers: int,
        *,
        sized: bool,
        world_size: int,
        on_error: str,
        resume: ResumePoint | None,
        loaded: Mapping[str, Any] | None,
        config: Callable[[], dict[str, Any]],
        batches: Callable[[], int],
        begin: Callable[[EpochRun], AbstractContextManager[None]],
    ) -> None:
        self.epoch = epoch
        self.workers = workers
        self.sized = sized
        self.world_size = world_size
        self.on_error = on_error
        self.resume = resume
        self.stats: Counter[str] = Counter()
        self._loaded = dict(loaded) if loaded is not None else None
        self._config = config
        self._batches = batches
        self._begin = begin
        self._started = False
        self.finished = False
        self._taken = [0] * workers
        self._next_worker = 0
        self._by_worker: dict[int, Mapping[str, Any]] = {}
        self._repeated = 0

    @property
    def resumed(self) -> bool:
        """True when the epoch continues from a saved position."""
        return self.resume is not None

    def num_batches(self) -> int:
        """This rank's batches in the epoch (of the resumed share after a resume).

        Raises:
            TypeError: the dataset has no manifest.
        """
        return self._batches()

    def start(self) -> AbstractContextManager[None]:
        """Start the epoch: the dataset takes its epoch and resume point now (an ``iter()``
        of the loader). Enter the context returned around starting the DataLoader's workers,
        which copy them."""
        self._started = True
        return self._begin(self)

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
        if self._repeated:
            log.warning(
                "epoch %s: %d batch(es) of this rank had every sample dropped (%d filtered by the transform "
                "returning None, %d skipped under on_error=%r) and were replaced by a repeat of a batch: %d "
                "sample(s) seen again this epoch, so that every rank takes len(loader) steps. To select samples "
                "without repeats, plan the selection: ShardDataset(select=...)",
                self.epoch, self._repeated, self.stats.get("filtered", 0), self.stats.get("skipped", 0),
                self.on_error, again,
            )
        if owed:
            raise ShardflowError(
                f"every sample of the epoch's batches was dropped under on_error={self.on_error!r} "
                f"({dict(self.stats)}): there is no batch to yield"
            )
        if self.workers > 1 and self.stats["skipped"] and not self.stats["samples"]:
            # each worker only knows its own share; the pass as a whole yielded nothing
            raise ShardflowError(
                f"the pass yielded no sample: all {self.stats['skipped']} were dropped under "
                f"on_error={self.on_error!r} ({dict(self.stats)}); set on_error='raise' to see the first error"
            )
        self.finished = True

    def state_dict(self) -> dict[str, Any]:
        """The epoch's position as a ``"ShardLoader"`` state (:mod:`shardflow.state`).

        Before the run starts: the state it was loaded from, or the epoch from its start
        (``remaining`` empty). Once started: the batches the loader has taken.
        """
        if not self._started:
            if self._loaded is not None:
                return dict(self._loaded)
            return build_state("ShardLoader", self.epoch, [], 0, self._config())
        resume = self.resume
        if self.sized:  # the layout of the epoch: the same on every rank (see shardflow.planning.elastic)
            step = (resume.step if resume is not None else 0) + sum(self._taken)
            remaining: list[Any] = layout_position(resume.layout if resume is not None else (), self.world_size, step)
            next_worker = 0
        else:  # by stream: worker w may continue another stream after a resume
            skip = resume.skip if resume is not None else (0,) * self.workers
            streams = resume.streams if resume is not None else tuple(range(self.workers))
            remaining = [0] * self.workers
            for w, taken in enumerate(self._taken):
                remaining[streams[w]] = skip[w] + taken
            next_worker = streams[self._next_worker]
        return build_state("ShardLoader", self.epoch, remaining, next_worker, self._config())
