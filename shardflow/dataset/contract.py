"""The dataset's side of the loader contract: :class:`~shardflow.loading.ShardLoader` sets the
batching once, then asks for an :class:`~shardflow.dataset.epochrun.EpochRun` per epoch and
talks to that."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from typing import Any

from ..batching import Batching
from .classmix import unmixed_warning
from .epochrun import EpochRun
from .warmstart import prefetch_first

__all__ = ["LoaderContract"]

log = logging.getLogger(__name__)


class LoaderContract:
    """The two methods :class:`~shardflow.loading.ShardLoader` calls (a mixin: the attributes
    it reads are set by the dataset's constructor)."""

    def set_batching(self, batching: Batching | None, num_workers: int = 1, *, forked: bool = False) -> None:
        """Let DataLoader workers batch and collate (:func:`shardflow.loader` calls this);
        None: yield samples.

        Args:
            batching: the loader's batch options, or None.
            num_workers: the loader's DataLoader workers per rank.
            forked: the workers are forked from this process: as they start, this process
                requests the bytes of their first batches (:mod:`.warmstart`).
        """
        self._batching = batching
        self._forked_workers = num_workers if forked and batching is not None else 0
        if not getattr(self, "_mix_warned", False) and (message := unmixed_warning(self, self.world().rank)):
            self._mix_warned = True  # once per dataset
            log.warning("%s", message)
        if batching is not None and batching.drop_last and num_workers > 1 and not self.sized:
            log.warning(
                "without a manifest, drop_last drops each DataLoader worker's last incomplete batch (up to %d "
                "per epoch, or everything when a worker holds less than one batch); write a manifest with "
                "`shardflow index` for one drop per rank",
                num_workers,
            )

    @property
    def batching(self) -> Batching | None:
        """The loader's batching, or None when the dataset yields samples."""
        return self._batching

    def epoch_run(
        self, num_workers: int, *, after: EpochRun | None = None, state: Mapping[str, Any] | None = None
    ) -> EpochRun:
        """The loader epoch that the next loader iteration reads, not started yet.

        Its epoch is that of ``state``, else the one given to :meth:`set_epoch` since the
        last loader epoch began, else the one after ``after``, else :attr:`epoch`.

        Args:
            num_workers: reading processes per rank.
            after: the loader's previous run, if any.
            state: a ``"ShardLoader"`` state to resume (checked here).

        Raises:
            StateError: ``state`` is of another kind, version or configuration (each
                difference named), or holds values no run of this dataset could save.
        """
        resume = None
        if state is not None:
            self._check_state(state, "ShardLoader", num_workers)
            epoch = int(state["epoch"])
            resume = self._resume_of(state, num_workers)
        elif self._user_epoch is not None:
            epoch = self._user_epoch
        else:
            epoch = after.epoch + 1 if after is not None else self.epoch
        layout = resume.layout if resume is not None else ()
        return EpochRun(
            epoch, num_workers, sized=self.sized, world_size=self.world().world_size, on_error=self.on_error,
            resume=resume, loaded=state, config=partial(self._fingerprint, num_workers),
            batches=partial(self.num_batches, num_workers, epoch, layout=layout), begin=self._begin_run,
        )

    def _begin_run(self, run: EpochRun) -> AbstractContextManager[None]:
        """Start ``run`` here: its epoch, resume point and layout (the epoch given to
        :meth:`set_epoch` is used up); returns the context to start the workers in."""
        resume = run.resume
        self._user_epoch = None
        self._layout = (run.epoch, resume.layout) if resume is not None and resume.layout else None
        self._resume = resume
        self._apply_epoch(run.epoch)
        return self._starting_workers(run)

    @contextmanager
    def _starting_workers(self, run: EpochRun) -> Iterator[None]:
        """The DataLoader's workers started inside (forked or pickled) copy the epoch's start
        with the flag that makes them yield batch records; later epochs start afresh."""
        self.stats = run.stats
        self.world()  # detect the ranks here, in the main process: workers get them with the dataset
        if self._forked_workers and run.resume is None:
            prefetch_first(self, run.epoch, self._forked_workers)
        self._in_loader = True
        try:
            yield
        finally:
            self._in_loader = False
            self._resume = None  # the workers hold their copy
            if self.stats is not run.stats:  # a pass started in this process (num_workers=0) counts in its own
                run.count_here(self.stats)
                self.stats = run.stats
